//! The panels' products with rows in lanes (`lanes.rs`) on AVX512-VNNI:
//! 16 rows' 4 values in a 512-bit vector, one `vpdpbusd` a step for each
//! feature's broadcast codes, a scale's steps summed in `i32` and then
//! multiplied by it (`vpmulld`), the mins from the inputs' sums by pairs
//! (`vpdpwssd`): the integers of the panels' VNNI kernels (`avx2.rs`,
//! `avx2_k.rs`, `avx2_k23.rs`), floated in their operations, so their
//! bits.

use std::arch::x86_64::*;

use super::format::BlockFormat;
use super::lanes::{LaneInputs, Unpacked32, UnpackedBlock, UnpackedPanel, STEPS};
use super::repack::PANEL;

/// Rows in a vector's lanes.
pub(crate) const LANES: usize = 16;

/// A panel's unpacked blocks times the 16 rows of group `g` of `x`, into
/// `out` (feature by feature, 16 rows each: 128 floats).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn rows_in_lanes(
    format: BlockFormat,
    panel: &UnpackedPanel,
    x: &LaneInputs,
    g: usize,
    out: &mut [f32],
) {
    assert!(x.lanes == LANES && out.len() == PANEL * LANES);
    match (panel, format) {
        (UnpackedPanel::K(blocks), BlockFormat::Q6_K | BlockFormat::Q3_K) => {
            lanes_k::<16, true>(blocks, x, g, out)
        }
        (UnpackedPanel::K(blocks), BlockFormat::Q2_K) => lanes_k::<16, false>(blocks, x, g, out),
        (UnpackedPanel::K(blocks), _) => lanes_k::<32, false>(blocks, x, g, out),
        (UnpackedPanel::Of32(blocks), _) => lanes_32(blocks, x, g, out),
    }
}

/// The formats of 32: per block, `acc += d·dx·Σ u·q − dmin·(dx·Σ q)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn lanes_32(blocks: &[Unpacked32], x: &LaneInputs, g: usize, out: &mut [f32]) {
    assert!(blocks.len() == x.nb && g < x.groups() && x.pairs == 0);
    let group = &x.groups[g];
    let mut acc = [_mm512_setzero_ps(); PANEL];
    for (b, w) in blocks.iter().enumerate() {
        let q: &[i8; 8 * LANES * 4] = group.q[b * 8 * LANES * 4..][..8 * LANES * 4]
            .try_into()
            .expect("a block's steps");
        // SAFETY: the group's `d` and `dsums` hold 16 floats from `b · 16`.
        let (dx, dsums) = unsafe {
            (
                _mm512_loadu_ps(group.d[b * LANES..][..LANES].as_ptr()),
                _mm512_loadu_ps(group.dsums[b * LANES..][..LANES].as_ptr()),
            )
        };
        let mut isum = [_mm512_setzero_si512(); PANEL];
        for step in 0..8 {
            // SAFETY: `q` holds 64 bytes at each step's `64·step`.
            let values = unsafe { _mm512_loadu_si512(q[64 * step..].as_ptr().cast()) };
            for (isum, &codes) in isum.iter_mut().zip(&w.codes[PANEL * step..][..PANEL]) {
                *isum = _mm512_dpbusd_epi32(*isum, _mm512_set1_epi32(codes as i32), values);
            }
        }
        for f in 0..PANEL {
            let scale = _mm512_mul_ps(_mm512_set1_ps(w.d[f]), dx);
            acc[f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[f]), scale, acc[f]);
            acc[f] = _mm512_fnmadd_ps(_mm512_set1_ps(w.dmin[f]), dsums, acc[f]);
        }
    }
    for (acc, out) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: `out` holds 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}

/// The k-quants, scales of `SUB` values, Q6_K's or Q3_K's offset (`OFFSET`) or
/// mins: per block, the mins' part, then `d·dx·Σ sc·Σ u·q`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn lanes_k<const SUB: usize, const OFFSET: bool>(
    blocks: &[UnpackedBlock],
    x: &LaneInputs,
    g: usize,
    out: &mut [f32],
) {
    let (nb, pairs) = (x.nb, x.pairs);
    assert!(blocks.len() == nb && g < x.groups() && pairs == 256 / SUB / 2);
    let mut acc = [_mm512_setzero_ps(); PANEL];
    let group = &x.groups[g];
    for (b, w) in blocks.iter().enumerate() {
        let q: &[i8; STEPS * LANES * 4] = group.q[b * STEPS * LANES * 4..][..STEPS * LANES * 4]
            .try_into()
            .expect("a block's steps");
        // SAFETY: the group's `d` holds 16 scales from `b · 16`.
        let dx = unsafe { _mm512_loadu_ps(group.d[b * LANES..][..LANES].as_ptr()) };
        let mut isum = [_mm512_setzero_si512(); PANEL];
        for s in 0..256 / SUB {
            let mut part = [_mm512_setzero_si512(); PANEL];
            for step in s * SUB / 4..(s + 1) * SUB / 4 {
                // SAFETY: `q` holds 64 bytes at each step's `64·step`.
                let values = unsafe { _mm512_loadu_si512(q[64 * step..].as_ptr().cast()) };
                for (part, &codes) in part.iter_mut().zip(&w.codes[PANEL * step..][..PANEL]) {
                    *part = _mm512_dpbusd_epi32(*part, _mm512_set1_epi32(codes as i32), values);
                }
            }
            for f in 0..PANEL {
                let scaled = _mm512_mullo_epi32(part[f], _mm512_set1_epi32(w.sc[PANEL * s + f]));
                isum[f] = _mm512_add_epi32(isum[f], scaled);
            }
        }
        let sums: [__m512i; 8] = std::array::from_fn(|p| match p < pairs {
            // SAFETY: the group's `sums` holds 16 pairs from `(b · pairs + p) · 16`.
            true => unsafe {
                _mm512_loadu_si512(group.sums[(b * pairs + p) * LANES..][..LANES].as_ptr().cast())
            },
            false => _mm512_setzero_si512(),
        });
        for f in 0..PANEL {
            let mut msum = _mm512_setzero_si512();
            for (p, s) in sums.iter().enumerate().take(pairs) {
                msum = _mm512_dpwssd_epi32(msum, *s, _mm512_set1_epi32(w.mins[PANEL * p + f]));
            }
            let (d, dmin) = (_mm512_set1_ps(w.d[f]), _mm512_set1_ps(w.dmin[f]));
            if OFFSET {
                let total = _mm512_sub_epi32(isum[f], msum);
                acc[f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), acc[f]);
            } else {
                acc[f] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), acc[f]);
                acc[f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[f]), _mm512_mul_ps(d, dx), acc[f]);
            }
        }
    }
    for (acc, out) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: `out` holds 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}
