//! The AVX2+FMA micro-kernels of the attention tiles (`tiles.rs`): `P·V`
//! over the packed values (panels of 16, `panel/`), [`MR`] rows by a
//! panel in 12 `ymm` accumulators. `Q·Kᵀ` is the panel product both
//! operations share, and the 8 × 8 transposes that pack keys and queries
//! theirs (`panel/avx2.rs`); the softmax between the two is
//! `rows/softmax.rs` on `ymm` lanes.

use std::arch::x86_64::*;

use crate::panel::{MR, NR, STRIP_RS};

/// `acc[r·dvp + p·NR + c] += Σⱼ strip[r·STRIP_RS + j] · v[p·panel + j·NR +
/// c]` for `rows` rows, `cols` keys and all `dvp / NR` panels.
///
/// # Safety
/// AVX2+FMA; the pointers cover those extents.
pub(crate) unsafe fn weighted_values(
    rows: usize,
    strip: *const f32,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { by_rows!(rows, [1 2 3 4 5] else MR, weighted_values_rows(strip, v, panel, dvp, cols, acc)) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_values_rows<const R: usize>(
    strip: *const f32,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    for c0 in (0..dvp).step_by(NR) {
        // SAFETY: (here and below) inside the extents the caller vouched for.
        unsafe {
            let mut c: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
            for (r, c) in c.iter_mut().enumerate() {
                c[0] = _mm256_loadu_ps(acc.add(r * dvp + c0));
                c[1] = _mm256_loadu_ps(acc.add(r * dvp + c0 + 8));
            }
            let v = v.add(c0 / NR * panel);
            for j in 0..cols {
                let v0 = _mm256_loadu_ps(v.add(j * NR));
                let v1 = _mm256_loadu_ps(v.add(j * NR + 8));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = _mm256_broadcast_ss(&*strip.add(r * STRIP_RS + j));
                    c[0] = _mm256_fmadd_ps(a, v0, c[0]);
                    c[1] = _mm256_fmadd_ps(a, v1, c[1]);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm256_storeu_ps(acc.add(r * dvp + c0), c[0]);
                _mm256_storeu_ps(acc.add(r * dvp + c0 + 8), c[1]);
            }
        }
    }
}
