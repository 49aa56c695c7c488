//! Linear weights in quantized block formats, multiplied by inputs
//! quantized per block at each call, in integers, as ggml's `vec_dot`s do.
//! A folder per kernel family:
//! - `q8_0/`: llama.cpp's Q8_0 on kernels of its own (a format with its
//!   own kernels): f32, bf16 and f16 weights quantized as a layer packs
//!   them ([`PackFormat::Q8_0`](crate::PackFormat::Q8_0)), or a GGUF
//!   file's Q8_0 blocks taken as they are, laid out in panels of 16
//!   features for `vpdpbusd`; every kernel gives llama.cpp's bits;
//! - `blocks/`: every other ggml block format (Q4_0 … Q6_K) as a GGUF
//!   file stores it, through one driver whose kernel bodies several
//!   formats share: the formats of 32 (Q4_0, Q4_1, Q5_0, Q5_1) one, the
//!   k-quants others (Q4_K and Q5_K one, Q6_K its own, Q2_K and Q3_K
//!   one); see its module doc.
//!
//! In each, one file per instruction set: `avx2.rs`, `vnni.rs`
//! (AVX512-VNNI), `portable.rs`.

pub(crate) mod blocks;
pub(crate) mod q8_0;

pub use blocks::{dequantize_row, BlockFormat};

/// `y` rounded half away from zero (C's `roundf`) into an `i8`, for `|y|
/// <= 127` up to rounding: `trunc(y + copysign(0.5 - 2⁻²⁵, y))`, exact
/// for every float, the truncation in the conversion. No call to
/// `roundf`, which the baseline target does not inline (nor vectorise).
#[inline(always)]
pub(crate) fn round_to_i8(y: f32) -> i8 {
    /// The largest float below 0.5.
    const ROUND_HALF: f32 = 0.5 - f32::EPSILON / 4.;
    (y + ROUND_HALF.copysign(y)) as i32 as i8
}
