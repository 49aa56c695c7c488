//! CPU kernels for candle models: the building blocks under
//! `multihead-attention` and `multihead-models`.
//!
//! - [`PackedLinear`]: `torch.nn.Linear` with its weight packed once into
//!   the micro-kernels' panels, fused bias, GELU, ReLU or residual;
//! - [`LayerNorm`] (fused with a residual add), [`relu`] and
//!   [`silu_and_mul`] as PyTorch computes them;
//! - [`attention::sdpa`]: a memory-efficient (FlashAttention-style)
//!   attention kernel over strided inputs, masks read in their own shapes;
//! - [`isa`]: the one place that picks the instruction set.
//!
//! The layout, after BLIS and the `gemm` crate: packing, a driver that
//! walks blocks sized for L1 and L2, and register-blocked micro-kernels.
//! - `packed.rs`: linear weights packed into panels; `packed/tiles.rs`
//!   the loop over row groups and panel blocks that runs the linear
//!   micro-kernels, `packed/one_row.rs` a single row's;
//! - `tile.rs`: the attention tiles' packing and work unit (`panel.rs`
//!   holds the layout it shares with the micro-kernels);
//! - `avx2.rs`, `avx512.rs`: the micro-kernels of one instruction set
//!   each, importing nothing from one another; `avx512bf16.rs`: AVX-512's
//!   linear kernels with `vdpbf16ps` for their step (bf16 weights times
//!   inputs rounded to bf16);
//! - `lanes.rs`: a vector type per instruction set (`ymm`, `zmm`, and
//!   portable lanes the compiler vectorises), so that kernels are written
//!   once over the vector width: `softmax.rs` (the online softmax, its
//!   `exp`, and the `tanh` of logit soft-capping) and `direct.rs`
//!   (decode-sized attention products read in place);
//! - `simd.rs`: row operations (masks, GELU, SiLU, LayerNorm rows) written
//!   once as plain Rust and compiled for each instruction set;
//! - `attention.rs`: the attention kernel's problem, masks and dispatch;
//! - `elem.rs`: the element types of weight panels (f32, bf16, f16), which
//!   the linear micro-kernels widen to f32 lanes as they load them;
//! - `q8.rs`: linear weights in llama.cpp's 8-bit Q8_0 blocks, with a
//!   kernel per instruction set in `q8/` (AVX512-VNNI, AVX2, portable);
//! - `quant/`: linear weights in ggml's block formats (Q4_0 … Q6_K) as a
//!   GGUF file stores them (most reordered into panels of 8 features at
//!   load, never widened), their reference dequantization and integer
//!   products per instruction set (AVX512-VNNI, AVX2, portable);
//! - `pool.rs`: work spread over the caller and polling helper threads (or
//!   rayon's pool from inside it), buffers kept between calls.
//!
//! Every kernel variant can be forced ([`isa::force`], or
//! `MULTIHEAD_CPU_ISA=avx512bf16|avx512|avx2|portable` for a whole
//! process), and the
//! tests compare each one the processor runs with the reference path.

#![warn(missing_docs)]

/// `$step!(i)` for `i` in `0..$n`: a step for each offset of the list
/// (`[0, 1]`, `[0, 1, 2, 3]`) an iteration of the loop, then the rest one
/// at a time: the micro-kernels' reduction loops, whose counter and
/// pointers then come once per iteration.
#[cfg(target_arch = "x86_64")]
macro_rules! unrolled {
    ($n:expr, [$($k:literal),+], $step:ident) => {{
        let (n, by) = ($n, [$($k),+].len());
        let mut i = 0;
        while i + by <= n {
            $($step!(i + $k);)+
            i += by;
        }
        while i < n {
            $step!(i);
            i += 1;
        }
    }};
}

mod activation;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
#[cfg(target_arch = "x86_64")]
mod direct;
mod elem;
pub mod isa;
mod lanes;
mod linear;
mod norm;
mod packed;
mod pages;
#[cfg(target_arch = "x86_64")]
mod panel;
mod pool;
mod q8;
mod quant;
mod simd;
mod softmax;
#[cfg(target_arch = "x86_64")]
mod tile;

pub use activation::{gelu_tanh_and_mul, relu, silu_and_mul};
pub use linear::{
    is_broadcast, is_lent, lend_blocks, lending, packing_as, packing_format, PackFormat, PackedLinear,
};
pub use norm::LayerNorm;
pub use quant::{dequantize_row, BlockFormat};

/// The instruction set the CPU kernels run with now: `"avx512bf16"`
/// (AVX-512F with AVX512-BF16: bf16 weights multiply inputs rounded to
/// bf16), `"avx512"` (AVX-512F), `"avx2"` (AVX2 and FMA) or `"portable"`;
/// the best the processor has, unless `MULTIHEAD_CPU_ISA` (one of those
/// names, read once) or [`isa::force`] asks for less. Benchmarks print it beside their
/// figures.
pub fn cpu_isa() -> &'static str {
    isa::current().name()
}

/// Helpers of the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use candle::{Device, Result, Tensor};

    pub(crate) fn randn(shape: &[usize]) -> Result<Tensor> {
        Tensor::randn(0f32, 1., shape, &Device::Cpu)
    }

    /// Largest difference over the expected tensor's largest magnitude.
    pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
        let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-30);
        Ok(diff / scale)
    }
}

/// The crate README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
