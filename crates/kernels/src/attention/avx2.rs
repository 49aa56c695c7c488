//! The AVX2+FMA micro-kernels of the attention tiles (`tiles.rs`): `P·V`
//! over the packed values (panels of 16, `panel/`), [`MR`] rows by a
//! panel in 12 `ymm` accumulators, and the 8 × 8 transposes that pack
//! keys and queries. `Q·Kᵀ` is the panel product both operations share
//! (`panel/avx2.rs`); the softmax between the two is `rows/softmax.rs` on
//! `ymm` lanes.

use std::arch::x86_64::*;

use crate::panel::{MR, NR, STRIP_RS};

/// `dst[e·ds + c] = rows[c][e] · scale` for the `d` dims `e` and the
/// `lanes` (4 or 8) columns `c`, zero for `c >= rows.len()`: an 8 × 8
/// register transpose per 8 dims.
///
/// # Safety
/// The CPU must have AVX2; every row holds `d` floats, `rows.len() <=
/// lanes`, and `dst` has room for `d` rows of stride `ds` of `lanes`
/// floats.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose_into(
    rows: &[&[f32]],
    d: usize,
    scale: f32,
    dst: *mut f32,
    ds: usize,
    lanes: usize,
) {
    debug_assert!(rows.len() <= lanes && (lanes == 4 || lanes == 8));
    debug_assert!(rows.iter().all(|r| r.len() >= d));
    let n = rows.len();
    let sc = _mm256_set1_ps(scale);
    let mut e = 0;
    while e + 8 <= d {
        let mut r = [_mm256_setzero_ps(); 8];
        for (c, r) in r.iter_mut().enumerate() {
            if c < n {
                // SAFETY: dims e..e+8 of a row of `d`.
                *r = _mm256_mul_ps(unsafe { _mm256_loadu_ps(rows[c].as_ptr().add(e)) }, sc);
            }
        }
        for (k, t) in transpose8(r).into_iter().enumerate() {
            // SAFETY: row `e + k < d` of `dst`, `lanes` floats.
            unsafe {
                let at = dst.add((e + k) * ds);
                if lanes == 8 {
                    _mm256_storeu_ps(at, t);
                } else {
                    _mm_storeu_ps(at, _mm256_castps256_ps128(t));
                }
            }
        }
        e += 8;
    }
    for e in e..d {
        for c in 0..lanes {
            // SAFETY: as above.
            unsafe { *dst.add(e * ds + c) = rows.get(c).map_or(0., |r| r[e] * scale) };
        }
    }
}

/// The transpose of the 8 × 8 block whose rows are `r`.
#[inline(always)]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register shuffles; callers are compiled with AVX2.
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}
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
