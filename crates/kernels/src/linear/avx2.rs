//! The AVX2+FMA linear micro-kernel of one row (a decoder's step) over
//! the panels of 16 (`panel/`); a call of several rows runs the shared
//! panel product (`panel/avx2.rs`) tile by tile.

use std::arch::x86_64::*;

use crate::elem::PanelElem;
use crate::panel::NR;

/// How far ahead of its loads [`one_row`] prefetches half-precision
/// panels, in bytes: as AVX-512's `one_row_body`, whose stream the hardware
/// prefetcher does not keep ahead of. f32 panels, twice the bytes per
/// multiply-add, stream at the hardware prefetcher's pace, and the extra
/// prefetch instructions only slow them.
const ONE_ROW_PREFETCH: usize = 2048;

/// `out[c] = init[c] + Σₑ x[e] · w[p·k·NR + e·NR + c % NR]` (`p = c / NR`)
/// for `cols` columns: one row (a decoder's step) through the packed
/// panels of 16 (f32, bf16 or f16), each streamed once, four inputs at a
/// time into 8 accumulators, prefetching `ONE_ROW_PREFETCH` bytes ahead
/// of half-precision panels.
///
/// # Safety
/// AVX2, FMA and F16C; `w` covers `ceil(cols / NR)` panels of `k` inputs,
/// `x` holds `k` floats, `init` holds `ceil(cols / NR) · NR` floats and
/// `out` `cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn one_row<E: PanelElem>(
    x: *const f32,
    k: usize,
    w: *const E,
    cols: usize,
    init: *const f32,
    out: *mut f32,
) {
    const V: usize = NR / 8;
    const U: usize = 4;
    for (p, c0) in (0..cols).step_by(NR).enumerate() {
        // SAFETY: (the block) panel p's k inputs; init holds the panel's
        // NR floats; out is written for the columns below `cols` only.
        unsafe {
            let mut w = w.add(p * k * NR);
            let mut acc = [[_mm256_setzero_ps(); V]; U];
            let mut e = 0;
            while e + U <= k {
                if size_of::<E>() < size_of::<f32>() {
                    let ahead = w.cast::<i8>().wrapping_add(ONE_ROW_PREFETCH);
                    for line in (0..U * NR * size_of::<E>()).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                    }
                }
                for (u, acc) in acc.iter_mut().enumerate() {
                    let a = _mm256_set1_ps(*x.add(e + u));
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(a, E::load_ymm(w.add(u * NR + 8 * v)), *acc);
                    }
                }
                w = w.add(U * NR);
                e += U;
            }
            for e in e..k {
                let a = _mm256_set1_ps(*x.add(e));
                for (v, acc) in acc[0].iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(a, E::load_ymm(w.add(8 * v)), *acc);
                }
                w = w.add(NR);
            }
            let mut sums = [0f32; NR];
            for (v, sum) in sums.chunks_exact_mut(8).enumerate() {
                let total = acc.iter().fold(_mm256_loadu_ps(init.add(c0 + 8 * v)), |s, a| {
                    _mm256_add_ps(s, a[v])
                });
                _mm256_storeu_ps(sum.as_mut_ptr(), total);
            }
            let n = (cols - c0).min(NR);
            std::ptr::copy_nonoverlapping(sums.as_ptr(), out.add(c0), n);
        }
    }
}
