//! Q8_0's quantization rules: a block of 32 values as llama.cpp's
//! reference quantizes it, and the rows of inputs and of weights
//! quantized by each instruction set's code, the same blocks whichever.

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::{avx2, vnni};
use super::{portable, Kernel, BLOCK_BYTES, NR, QK};
use crate::elem::PanelElem;

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
        // |v · id| <= 127 (up to rounding). Half away from zero (C's
        // `roundf`) as `trunc(y + copysign(0.5 - 2⁻²⁵, y))`, exact for
        // every float, with the truncation in the conversion: no call to
        // `roundf`, which the baseline target does not inline.
        let y = v * id;
        *q = (y + ROUND_HALF.copysign(y)) as i32 as i8;
        sum += i32::from(*q);
    }
    (d, sum)
}

/// The largest float below 0.5: added before a truncation, it rounds half
/// away from zero ([`quantize_block`]).
const ROUND_HALF: f32 = 0.5 - f32::EPSILON / 4.;

/// Rows of inputs quantized for the kernels: `q` `m` rows of `k` values,
/// and per row and block (`m` rows of `nb`) the scale, rounded to f16 and
/// widened, and `-128 · Σ q` (the start of `vnni.rs`'s block sums).
pub(super) struct Quantized {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) off: Vec<i32>,
}

/// Quantizes `x` (rows of `q.len()` values, `d.len()` blocks a row) into
/// `q`, `d` and `off` ([`Quantized`]) with `kernel`'s instruction set:
/// the same values whichever it is.
pub(super) fn quantize_rows(kernel: Kernel, x: &[f32], q: &mut [i8], d: &mut [f32], off: &mut [i32]) {
    assert!(x.len() == q.len() && q.len() == d.len() * QK && d.len() == off.len());
    match kernel {
        // SAFETY: the slices hold the extents (asserted above); the kernel
        // was picked for an instruction set the processor has.
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => unsafe {
            vnni::quantize_row(
                x.as_ptr(),
                d.len(),
                q.as_mut_ptr(),
                d.as_mut_ptr(),
                off.as_mut_ptr(),
            )
        },
        // SAFETY: as above; the AVX2 kernel reads no offsets.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::quantize_row(x.as_ptr(), d.len(), q.as_mut_ptr(), d.as_mut_ptr()) },
        Kernel::Portable => {
            let blocks = x.as_chunks::<QK>().0.iter().zip(q.as_chunks_mut::<QK>().0);
            for ((xb, qb), (d, off)) in blocks.zip(d.iter_mut().zip(off)) {
                let (scale, sum) = quantize_block(xb, qb);
                *d = f16::from_f32(scale).to_f32();
                *off = -128 * sum;
            }
        }
    }
}

/// Feature `c`'s row `w` of weights (`nb` blocks) quantized into its
/// panel's values `qs` (`nb` blocks of [`BLOCK_BYTES`]) and scales `d`
/// (`nb` blocks of [`NR`]), laid out for `kernel`, by its instruction set:
/// the same blocks whichever it is, each as [`quantize_block`] gives it.
pub(super) fn quantize_weight_row<S: PanelElem>(
    kernel: Kernel,
    w: &[S],
    c: usize,
    qs: &mut [u8],
    d: &mut [f16],
) {
    let nb = w.len() / QK;
    assert!(w.len() == nb * QK && qs.len() == nb * BLOCK_BYTES && d.len() == nb * NR && c < NR);
    match kernel {
        // SAFETY: the slices hold the extents (asserted above); the kernel
        // was picked for an instruction set the processor has.
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => unsafe {
            vnni::quantize_weight_row(w.as_ptr(), nb, c, qs.as_mut_ptr(), d.as_mut_ptr().cast())
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe {
            avx2::quantize_weight_row(w.as_ptr(), nb, c, qs.as_mut_ptr(), d.as_mut_ptr().cast())
        },
        Kernel::Portable => portable::quantize_weight_row(w, c, qs, d),
    }
}
