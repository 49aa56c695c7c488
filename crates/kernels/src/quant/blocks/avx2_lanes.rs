//! The panels' products with rows in lanes (`lanes.rs`) on AVX2: 8 rows'
//! 4 values in a 256-bit vector, each feature's broadcast codes multiplied
//! with `vpmaddubsw` (`u8 · i8` pairs into `i16`), a run of steps summed in
//! `i16` (as many as the codes' size keeps below `2¹⁵`: 8 of 4 bits, 4 of
//! 5, 2 of 6; a scale's 4 of 2 or 3 bits), then `vpmaddwd` by the scale
//! (by 1 for the formats of 32) into `i32`, the mins from the inputs' sums
//! by pairs (`vpmaddwd`): the integers of the panels' AVX2 kernels
//! (`avx2.rs`, `avx2_k.rs`, `avx2_k23.rs`), floated in their operations,
//! so their bits.

use std::arch::x86_64::*;

use super::format::BlockFormat;
use super::lanes::{LaneInputs, Unpacked32, UnpackedBlock, UnpackedPanel, STEPS};
use super::repack::PANEL;

/// Rows in a vector's lanes.
pub(crate) const LANES: usize = 8;

/// A panel's unpacked blocks times the 8 rows of group `g` of `x`, into
/// `out` (feature by feature, 8 rows each: 64 floats).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn rows_in_lanes(
    format: BlockFormat,
    panel: &UnpackedPanel,
    x: &LaneInputs,
    g: usize,
    out: &mut [f32],
) {
    assert!(x.lanes == LANES && out.len() == PANEL * LANES);
    match (panel, format) {
        (UnpackedPanel::K(blocks), BlockFormat::Q6_K) => lanes_k::<16, true, 2>(blocks, x, g, out),
        (UnpackedPanel::K(blocks), BlockFormat::Q3_K) => lanes_k::<16, true, 4>(blocks, x, g, out),
        (UnpackedPanel::K(blocks), BlockFormat::Q2_K) => lanes_k::<16, false, 4>(blocks, x, g, out),
        (UnpackedPanel::K(blocks), BlockFormat::Q5_K) => lanes_k::<32, false, 4>(blocks, x, g, out),
        (UnpackedPanel::K(blocks), _) => lanes_k::<32, false, 8>(blocks, x, g, out),
        (UnpackedPanel::Of32(blocks), BlockFormat::Q5_0 | BlockFormat::Q5_1) => {
            lanes_32::<4>(blocks, x, g, out)
        }
        (UnpackedPanel::Of32(blocks), _) => lanes_32::<8>(blocks, x, g, out),
    }
}

/// `RUN` steps of a feature's codes times the rows' values, summed in
/// `i16` pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_products<const RUN: usize>(codes: &[u32], values: &[__m256i; RUN], f: usize) -> __m256i {
    let mut p = _mm256_setzero_si256();
    for (i, v) in values.iter().enumerate() {
        let c = _mm256_set1_epi32(codes[PANEL * i + f] as i32);
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(c, *v));
    }
    p
}

/// The values of steps `at..at + RUN` of a block's `q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_values<const RUN: usize>(q: &[i8], at: usize) -> [__m256i; RUN] {
    let q = &q[32 * at..32 * (at + RUN)];
    // SAFETY: `q` holds 32 bytes a step.
    std::array::from_fn(|i| unsafe { _mm256_loadu_si256(q[32 * i..].as_ptr().cast()) })
}

/// The formats of 32: per block, `acc += d·dx·Σ u·q − dmin·(dx·Σ q)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_32<const RUN: usize>(blocks: &[Unpacked32], x: &LaneInputs, g: usize, out: &mut [f32]) {
    assert!(blocks.len() == x.nb && g < x.groups() && x.pairs == 0);
    let group = &x.groups[g];
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); PANEL];
    for (b, w) in blocks.iter().enumerate() {
        let q = &group.q[b * 8 * LANES * 4..][..8 * LANES * 4];
        // SAFETY: the group's `d` and `dsums` hold 8 floats from `b · 8`.
        let (dx, dsums) = unsafe {
            (
                _mm256_loadu_ps(group.d[b * LANES..][..LANES].as_ptr()),
                _mm256_loadu_ps(group.dsums[b * LANES..][..LANES].as_ptr()),
            )
        };
        let mut isum = [_mm256_setzero_si256(); PANEL];
        for at in (0..8).step_by(RUN) {
            let values = run_values::<RUN>(q, at);
            for (f, isum) in isum.iter_mut().enumerate() {
                let p = run_products::<RUN>(&w.codes[PANEL * at..], &values, f);
                *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, ones));
            }
        }
        for f in 0..PANEL {
            let scale = _mm256_mul_ps(_mm256_set1_ps(w.d[f]), dx);
            acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[f]), scale, acc[f]);
            acc[f] = _mm256_fnmadd_ps(_mm256_set1_ps(w.dmin[f]), dsums, acc[f]);
        }
    }
    for (acc, out) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}

/// The k-quants, scales of `SUB` values, Q6_K's or Q3_K's offset (`OFFSET`) or
/// mins, `RUN` steps summed in `i16`: per block, the mins' part, then
/// `d·dx·Σ sc·Σ u·q`.
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_k<const SUB: usize, const OFFSET: bool, const RUN: usize>(
    blocks: &[UnpackedBlock],
    x: &LaneInputs,
    g: usize,
    out: &mut [f32],
) {
    let (nb, pairs) = (x.nb, x.pairs);
    assert!(blocks.len() == nb && g < x.groups() && pairs == 256 / SUB / 2 && SUB.is_multiple_of(4 * RUN));
    let group = &x.groups[g];
    let mut acc = [_mm256_setzero_ps(); PANEL];
    for (b, w) in blocks.iter().enumerate() {
        let q = &group.q[b * STEPS * LANES * 4..][..STEPS * LANES * 4];
        // SAFETY: the group's `d` holds 8 scales from `b · 8`.
        let dx = unsafe { _mm256_loadu_ps(group.d[b * LANES..][..LANES].as_ptr()) };
        let mut isum = [_mm256_setzero_si256(); PANEL];
        for s in 0..256 / SUB {
            for at in (s * SUB / 4..(s + 1) * SUB / 4).step_by(RUN) {
                let values = run_values::<RUN>(q, at);
                for (f, isum) in isum.iter_mut().enumerate() {
                    let p = run_products::<RUN>(&w.codes[PANEL * at..], &values, f);
                    let scale = _mm256_set1_epi16(w.sc[PANEL * s + f] as i16);
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, scale));
                }
            }
        }
        // SAFETY: the group's `sums` holds 8 pairs from `(b · pairs + p) · 8`.
        let sums: [__m256i; 8] = std::array::from_fn(|p| match p < pairs {
            true => unsafe {
                _mm256_loadu_si256(group.sums[(b * pairs + p) * LANES..][..LANES].as_ptr().cast())
            },
            false => _mm256_setzero_si256(),
        });
        for f in 0..PANEL {
            let mut msum = _mm256_setzero_si256();
            for (p, s) in sums.iter().enumerate().take(pairs) {
                let mins = _mm256_set1_epi32(w.mins[PANEL * p + f]);
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(*s, mins));
            }
            let (d, dmin) = (_mm256_set1_ps(w.d[f]), _mm256_set1_ps(w.dmin[f]));
            if OFFSET {
                let total = _mm256_sub_epi32(isum[f], msum);
                acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[f]);
            } else {
                acc[f] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[f]);
                acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[f]), _mm256_mul_ps(d, dx), acc[f]);
            }
        }
    }
    for (acc, out) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}
