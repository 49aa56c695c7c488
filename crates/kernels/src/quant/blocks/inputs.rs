//! The inputs of a block-quantized product, quantized once per call in
//! the manner of ggml's `block_q8_K` (the k-quants) and `block_q8_0`/`q8_1`
//! (the others): per block of the weight's size, a scale
//! `dx = max|x| / 127` and the values `q = round(x / dx)` (ties away from
//! zero, `i8`), and the sum of every 16 values (ggml's `bsums`), which the
//! formats' mins multiply. Not to ggml's bits: ggml rounds `q8_0`'s scale
//! to f16 and takes `q8_K`'s from the signed largest value, where this
//! keeps the f32 scale of the largest magnitude; the products then differ
//! from llama.cpp's within the inputs' rounding.

use crate::quant::round_to_i8;
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_each, PARALLEL_FROM};

/// `(first, count)` of the groups a kernel takes `rows` input rows in:
/// `most` at a time while they last, then 4, 2 and 1 (each count a
/// kernel holding that many rows' sums in registers).
pub(crate) fn row_groups(rows: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let n = match (rows - at).min(most) {
            0 => return None,
            8.. => 8,
            4..=7 => 4,
            2..=3 => 2,
            _ => 1,
        };
        at += n;
        Some((at - n, n))
    })
}

/// `m` rows of `k` inputs quantized in blocks of `block` (32 or 256).
#[derive(Debug)]
pub(crate) struct QuantizedInputs {
    pub(crate) q: Vec<i8>,
    /// Per row and block.
    pub(crate) d: Vec<f32>,
    /// Per row and 16 values.
    pub(crate) sums: Vec<i16>,
    /// Per row and block, `dx · Σ q`: what a block's min multiplies in
    /// the formats with one scale per 32 (`format.rs`).
    pub(crate) dsums: Vec<f32>,
    pub(crate) k: usize,
    pub(crate) block: usize,
}

impl QuantizedInputs {
    /// Every row's slices.
    pub(crate) fn rows(&self) -> Vec<InputRow<'_>> {
        let (k, nb) = (self.k, self.k / self.block);
        (0..self.q.len() / k.max(1))
            .map(|r| InputRow {
                q: &self.q[r * k..][..k],
                d: &self.d[r * nb..][..nb],
                sums: &self.sums[r * k / 16..][..k / 16],
                dsums: &self.dsums[r * nb..][..nb],
            })
            .collect()
    }
}

/// One row of quantized inputs: its values, per block its scale and
/// `dx · Σ q`, per 16 values their sum.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InputRow<'a> {
    pub(crate) q: &'a [i8],
    pub(crate) d: &'a [f32],
    pub(crate) sums: &'a [i16],
    pub(crate) dsums: &'a [f32],
}

/// One block of `x` into `q` and `sums`; returns its scale. A block
/// holding NaN or infinity gets that scale (NaN) and zeros, so the
/// outputs it reaches are NaN, as in ggml; an all-zero block scale 0.
fn quantize_block(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
    // The largest magnitude by its bits, in one pass: above infinity's
    // bits, a NaN; infinity itself gives an infinite scale, made NaN below.
    let top = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    let amax = if top > f32::INFINITY.to_bits() {
        f32::NAN
    } else {
        f32::from_bits(top)
    };
    let d = amax / 127.;
    let id = if d != 0. { 1. / d } else { 0. };
    if !(d.is_finite() && id.is_finite()) {
        q.fill(0);
        sums.fill(0);
        return if d.is_finite() { 0. } else { f32::NAN };
    }
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_to_i8(v * id);
    }
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| i16::from(v)).sum();
    }
    d
}

/// One row of `x` quantized block by block into `q`, `d`, `sums` and
/// `dsums` ([`quantize_block`]), with AVX-512 or AVX2 where `isa` has it.
fn quantize_row(isa: Isa, x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [i16], dsums: &mut [f32]) {
    let block = x.len() / d.len();
    assert!(
        q.len() == x.len()
            && sums.len() * 16 == x.len()
            && dsums.len() == d.len()
            && block.is_multiple_of(16)
    );
    #[cfg(target_arch = "x86_64")]
    if crate::runtime::isa::runnable(isa) >= Isa::Avx512 {
        // SAFETY: the processor runs AVX-512F (`runnable` caps `isa` at
        // what it detected), and the slices hold one row's extents
        // (asserted above).
        unsafe { avx512::quantize_row((x, q, d, sums, dsums)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::runtime::isa::runnable(isa) >= Isa::Avx2 {
        // SAFETY: the processor runs AVX2 (`runnable` caps `isa` at what
        // it detected), and the slices hold one row's extents (asserted
        // above).
        unsafe { avx2::quantize_row((x, q, d, sums, dsums)) };
        return;
    }
    let _ = isa;
    for ((((q, d), dsum), sums), x) in q
        .chunks_exact_mut(block)
        .zip(d.iter_mut())
        .zip(dsums.iter_mut())
        .zip(sums.chunks_exact_mut(block / 16))
        .zip(x.chunks_exact(block))
    {
        *d = quantize_block(x, q, sums);
        *dsum = block_dsum(*d, sums);
    }
}

/// `d · Σ sums`, a block's `dx · Σ q`.
fn block_dsum(d: f32, sums: &[i16]) -> f32 {
    d * sums.iter().map(|&s| f32::from(s)).sum::<f32>()
}

/// One row's inputs, then its values, scales, sums of 16 and `dx · Σ q`
/// (`quantize_row`'s slices).
#[cfg(target_arch = "x86_64")]
type RowSlices<'a> = (
    &'a [f32],
    &'a mut [i8],
    &'a mut [f32],
    &'a mut [i16],
    &'a mut [f32],
);

/// [`quantize_block`] of every block of a row as the vector paths take
/// it: the block's largest magnitude by its bits from `top_bits`, then,
/// where its scale and that scale's inverse are finite, each 16 values'
/// `i8`s from `step(values, 1 / d)`, their sum from those; a block whose
/// scale or inverse is not finite (NaN, infinity, magnitudes too small to
/// invert) through [`quantize_block`] itself. The slices hold one row
/// (`quantize_row`'s extents).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn by_blocks(
    (x, q, d, sums, dsums): RowSlices,
    top_bits: impl Fn(&[f32]) -> u32,
    step: impl Fn(&[f32], f32) -> std::arch::x86_64::__m128i,
) {
    let block = x.len() / d.len();
    let steps = block / 16;
    for b in 0..d.len() {
        let (xb, qb) = (&x[b * block..][..block], &mut q[b * block..][..block]);
        let sb = &mut sums[b * steps..][..steps];
        let db = f32::from_bits(top_bits(xb)) / 127.;
        let id = if db != 0. { 1. / db } else { 0. };
        if !(db.is_finite() && id.is_finite()) {
            d[b] = quantize_block(xb, qb, sb);
            dsums[b] = block_dsum(d[b], sb);
            continue;
        }
        for (s, sum) in sb.iter_mut().enumerate() {
            let q16 = step(&xb[16 * s..][..16], id);
            let out: &mut [i8; 16] = (&mut qb[16 * s..][..16]).try_into().expect("16 values");
            // SAFETY: `out` holds 16 bytes.
            unsafe { std::arch::x86_64::_mm_storeu_si128(out.as_mut_ptr().cast(), q16) };
            *sum = sum16(q16);
        }
        d[b] = db;
        dsums[b] = block_dsum(db, sb);
    }
}

/// The sum of 16 `i8`: `vpsadbw` of the values offset by 128 (each half's
/// 8 bytes summed as `u64`), less the offsets.
#[cfg(target_arch = "x86_64")]
#[inline]
fn sum16(q: std::arch::x86_64::__m128i) -> i16 {
    use std::arch::x86_64::*;
    // SAFETY: SSE2, in every x86_64 processor's baseline.
    unsafe {
        let sad = _mm_sad_epu8(_mm_xor_si128(q, _mm_set1_epi8(i8::MIN)), _mm_setzero_si128());
        (_mm_cvtsi128_si32(_mm_add_epi32(sad, _mm_unpackhi_epi64(sad, sad))) - 16 * 128) as i16
    }
}

/// The largest float below 0.5, which a value's sign and magnitude take
/// before truncation to round half away from zero (`round_to_i8`).
#[cfg(target_arch = "x86_64")]
const ROUND_HALF: f32 = 0.5 - f32::EPSILON / 4.;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{by_blocks, RowSlices, ROUND_HALF};

    /// [`super::quantize_block`] of every block of a row ([`by_blocks`]),
    /// 16 values a step: the same operations lane by lane (the largest
    /// magnitude by its bits, `v · (1 / d)`, ROUND_HALF with the value's
    /// sign added, truncated), so the same values.
    ///
    /// # Safety
    /// AVX-512F; the slices hold one row (`super::quantize_row`'s).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_row(row: RowSlices) {
        let top_bits = |xb: &[f32]| {
            let mut top = _mm512_setzero_si512();
            for v in xb.chunks_exact(16) {
                // SAFETY: `v` holds 16 floats.
                let v = unsafe { _mm512_loadu_si512(v.as_ptr().cast()) };
                top = _mm512_max_epu32(top, _mm512_and_si512(v, _mm512_set1_epi32(0x7fff_ffff)));
            }
            _mm512_reduce_max_epu32(top)
        };
        let step = |v: &[f32], id: f32| {
            // SAFETY: `v` holds 16 floats (`by_blocks`).
            let y = _mm512_mul_ps(unsafe { _mm512_loadu_ps(v.as_ptr()) }, _mm512_set1_ps(id));
            let signed_half = _mm512_or_si512(
                _mm512_castps_si512(_mm512_set1_ps(ROUND_HALF)),
                _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(i32::MIN)),
            );
            _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_add_ps(
                y,
                _mm512_castsi512_ps(signed_half),
            )))
        };
        by_blocks(row, top_bits, step);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{by_blocks, RowSlices, ROUND_HALF};

    /// [`super::quantize_block`] of every block of a row ([`by_blocks`])
    /// as `avx512::quantize_row` does it, 8 values a vector (the same
    /// operations lane by lane, so the same values): a step's 16 `i32`s
    /// narrowed by two saturating packs, which leave them as they are
    /// (each within ±127).
    ///
    /// # Safety
    /// AVX2; the slices hold one row (`super::quantize_row`'s).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row(row: RowSlices) {
        let top_bits = |xb: &[f32]| {
            let mut top = _mm256_setzero_si256();
            for v in xb.chunks_exact(8) {
                // SAFETY: `v` holds 8 floats.
                let v = unsafe { _mm256_loadu_si256(v.as_ptr().cast()) };
                top = _mm256_max_epu32(top, _mm256_and_si256(v, _mm256_set1_epi32(0x7fff_ffff)));
            }
            let top = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256::<1>(top));
            let top = _mm_max_epu32(top, _mm_shuffle_epi32::<0b01_00_11_10>(top));
            let top = _mm_max_epu32(top, _mm_shuffle_epi32::<0b10_11_00_01>(top));
            _mm_cvtsi128_si32(top) as u32
        };
        let round = |v: &[f32], id: f32| {
            // SAFETY: `v` holds 8 floats (a half of `by_blocks`' 16).
            let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, _mm256_set1_ps(id));
            let signed_half = _mm256_or_si256(
                _mm256_castps_si256(_mm256_set1_ps(ROUND_HALF)),
                _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(i32::MIN)),
            );
            _mm256_cvttps_epi32(_mm256_add_ps(y, _mm256_castsi256_ps(signed_half)))
        };
        let step = |v: &[f32], id: f32| {
            // i16s [0..4, 8..12 | 4..8, 12..16], put in order.
            let pairs = _mm256_packs_epi32(round(&v[..8], id), round(&v[8..16], id));
            let pairs = _mm256_permute4x64_epi64::<0b11_01_10_00>(pairs);
            _mm_packs_epi16(
                _mm256_castsi256_si128(pairs),
                _mm256_extracti128_si256::<1>(pairs),
            )
        };
        by_blocks(row, top_bits, step);
    }
}

/// `x`'s `m` rows of `k` values (`k` a multiple of `block`, itself of 16)
/// quantized, in parallel over rows where they are many, with the
/// instruction set `isa` (capped at what the processor runs).
pub(crate) fn quantize_inputs(isa: Isa, x: &[f32], m: usize, k: usize, block: usize) -> QuantizedInputs {
    let nb = k / block;
    let mut out = QuantizedInputs {
        q: vec![0; m * k],
        d: vec![0.; m * nb],
        sums: vec![0; m * k / 16],
        dsums: vec![0.; m * nb],
        k,
        block,
    };
    type Row<'a> = (
        ((&'a mut [i8], &'a mut [f32]), &'a mut [f32]),
        (&'a mut [i16], &'a [f32]),
    );
    let one_row = |(((q, d), dsums), (sums, x)): Row| quantize_row(isa, x, q, d, sums, dsums);
    let rows = out
        .q
        .chunks_exact_mut(k)
        .zip(out.d.chunks_exact_mut(nb))
        .zip(out.dsums.chunks_exact_mut(nb))
        .zip(out.sums.chunks_exact_mut(k / 16).zip(x.chunks_exact(k)));
    if m * k >= 1 << 15 {
        par_each(rows.collect(), PARALLEL_FROM.max(m * k), one_row);
    } else {
        rows.for_each(one_row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::quantize_inputs;
    use crate::runtime::isa::{supported, Isa};

    /// Each block's scale is its largest magnitude over 127 and its values
    /// `round(x / d)` with ties away from zero (C's `roundf`, as ggml
    /// quantizes), ties included; a block holding infinity or NaN gets a
    /// NaN scale and zeros, an all-zero block scale 0.
    #[test]
    fn blocks_quantize_as_roundf_and_mark_non_finite_blocks() {
        let k = 64;
        let mut x: Vec<f32> = (0..4 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.) * 0.173)
            .collect();
        // Block 0: ties at ±0.5, ±1.5 and ±126.5 steps of a scale of 1.
        x[..8].copy_from_slice(&[127., 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 2.5]);
        x[2 * k + 3] = f32::INFINITY;
        x[3 * k + 9] = f32::NAN;
        x[k..2 * k].fill(0.);
        let qi = quantize_inputs(Isa::Portable, &x, 4, k, 32);
        for (b, block) in x.chunks_exact(32).enumerate() {
            let (d, q) = (qi.d[b], &qi.q[b * 32..][..32]);
            if block.iter().any(|v| !v.is_finite()) {
                assert!(d.is_nan(), "block {b}: scale {d}");
                assert!(q.iter().all(|&v| v == 0), "block {b}: {q:?}");
                continue;
            }
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d, amax / 127., "block {b}");
            let id = if d != 0. { 1. / d } else { 0. };
            let want: Vec<i8> = block.iter().map(|&v| (v * id).round() as i8).collect();
            assert_eq!(q, &want[..], "block {b}");
        }
        assert_eq!(&qi.q[..8], &[127, 1, -1, 2, -2, 127, -127, 3]);
    }

    /// Every instruction set quantizes as the portable code does, bit for
    /// bit: values, scales, sums of 16 and `dx · Σ q`, in blocks of 32 and
    /// 256, over ties, zeros, infinities, NaN and magnitudes whose scale
    /// cannot be inverted (fails where a vector path rounds ties to even,
    /// or takes a subnormal block's scale).
    #[test]
    fn every_isa_quantizes_as_the_portable_code() {
        for block in [32, 256] {
            let (m, k) = (5, 2 * 256);
            let mut x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.) * 0.0137)
                .collect();
            x[..6].copy_from_slice(&[127., 0.5, -0.5, 1.5, -126.5, 2.5]);
            x[k..k + block].fill(0.);
            x[2 * k + 3] = f32::INFINITY;
            x[2 * k + block + 1] = f32::NEG_INFINITY;
            x[3 * k + 9] = f32::NAN;
            x[4 * k..4 * k + block].fill(1e-38);
            x[4 * k + block..4 * k + 2 * block].fill(-0.);
            let want = quantize_inputs(Isa::Portable, &x, m, k, block);
            for isa in supported() {
                let got = quantize_inputs(isa, &x, m, k, block);
                assert_eq!(got.q, want.q, "{isa:?} block {block}");
                assert_eq!(got.sums, want.sums, "{isa:?} block {block}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.d), bits(&want.d), "{isa:?} block {block}");
                assert_eq!(bits(&got.dsums), bits(&want.dsums), "{isa:?} block {block}");
            }
        }
    }
}
