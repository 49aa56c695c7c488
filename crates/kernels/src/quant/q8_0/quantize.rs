//! Q8_0's quantization rule: a block of [`QK`] values as llama.cpp's
//! reference quantizes it, which every instruction set's code gives bit
//! for bit (`mod.rs` picks the code that quantizes a weight's rows and a
//! call's inputs), and the quantized inputs' layout.

use crate::quant::round_to_i8;

/// Inputs per block (Q8_0's `QK8_0`), each block with its own scale.
pub(super) const QK: usize = 32;

/// One block of 32 values quantized as llama.cpp's `quantize_row_q8_0_ref`
/// does: the scale `max|x| / 127` (f32; the caller rounds it to f16), the
/// values `round(x · (1 / d))` (ties away from zero) into `q`, and their
/// sum. A NaN sticks to the largest magnitude, so a block holding one gets
/// a NaN scale. A block whose scale or its inverse is not finite (an
/// infinite or NaN value; magnitudes all below 4e-37, whose scale is 0 in
/// f16) gets zeros: C leaves the conversion of those `x · id` to `int8_t`
/// undefined, and llama.cpp's x86 builds give 0.
pub(super) fn quantize_block(x: &[f32; QK], q: &mut [i8; QK]) -> (f32, i32) {
    // The magnitudes' bits: ordered as the magnitudes, a NaN's above
    // infinity's. Integer lanes, so that the loop vectorises.
    let top = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    // One NaN whatever the block's, as the vector kernels give.
    let amax = if top > f32::INFINITY.to_bits() {
        f32::NAN
    } else {
        f32::from_bits(top)
    };
    let d = amax / 127.;
    let id = if d != 0. { 1. / d } else { 0. };
    if !(d.is_finite() && id.is_finite()) {
        q.fill(0);
        return (d, 0);
    }
    let mut sum = 0;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v · id| <= 127 (up to rounding).
        *q = round_to_i8(v * id);
        sum += i32::from(*q);
    }
    (d, sum)
}

/// Rows of inputs quantized for the kernels: `q` `m` rows of `k` values,
/// and per row and block (`m` rows of `nb`) the scale, rounded to f16 and
/// widened, and `-128 · Σ q` (the start of `vnni.rs`'s block sums).
pub(super) struct Quantized {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) off: Vec<i32>,
}
