//! The AVX2+FMA micro-kernel both operations run over panels of [`NR`]:
//! [`MR`] rows of inputs by a panel of 16 in 12 `ymm` accumulators, 12
//! FMAs per 8 loads, the panel rows in f32, bf16 or f16 ([`PanelElem`])
//! widened as they load. The attention tiles' `Q·Kᵀ` (`attention/tiles.rs`,
//! with the softmax's running row max) and the AVX2 linear layers' tiles
//! (`linear/tiles.rs`, accumulating onto their output) call it.

use std::arch::x86_64::*;

use super::{MR, NR};
use crate::elem::PanelElem;

/// `out[r·out_rs + c] = Σₑ q[r·q_rs + e] · Kᵀ[e, c]` for `rows` rows, `d`
/// dims and `panels · NR` keys (or output features), `+=` with `ACC`; the
/// panels hold f32, or a linear layer's bf16 or f16 weights
/// ([`PanelElem`]), widened as they are loaded. With
/// `maxes` `Some((m, cols))`, the softmax's row max comes with it: lane `c`
/// of `m[r·16..]` becomes the largest of itself and row `r`'s scores of
/// keys `c`, `c + 8`, … below `cols` (a NaN score may be skipped, as by
/// `row_max`).
///
/// # Safety
/// AVX2, FMA and F16C; the pointers cover those extents (`m` `rows · 16`
/// floats).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product<const ACC: bool, E: PanelElem>(
    rows: usize,
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const E,
    panels: usize,
    out: *mut f32,
    out_rs: usize,
    maxes: Option<(*mut f32, usize)>,
) {
    // SAFETY: forwarded.
    unsafe {
        by_rows!(
            rows,
            [1 2 3 4 5] else MR,
            product_rows::<_, ACC, E>(q, q_rs, d, kt, panels, out, out_rs, maxes)
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn product_rows<const R: usize, const ACC: bool, E: PanelElem>(
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const E,
    panels: usize,
    strip: *mut f32,
    out_rs: usize,
    maxes: Option<(*mut f32, usize)>,
) {
    // Each row's own pointer, a step's broadcasts indexed by the dim from
    // them. Seeing the rows a stride apart, LLVM rebuilds their addresses
    // from the stride every step (27 µops a step where 23 do, for 12 FMAs
    // that take 6 cycles on two ports); `black_box` hides the stride.
    // SAFETY: the group's rows lie in the caller's allocation.
    let rows_at: [*const f32; R] = std::hint::black_box(std::array::from_fn(|r| unsafe { q.add(r * q_rs) }));
    for pi in 0..panels {
        // SAFETY: (here and below) inside the extents the caller vouched for.
        unsafe {
            let kt = kt.add(pi * d * NR);
            let mut c = [[_mm256_setzero_ps(); 2]; R];
            if ACC {
                for (r, c) in c.iter_mut().enumerate() {
                    let src = strip.add(r * out_rs + pi * NR);
                    *c = [_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))];
                }
            }
            macro_rules! step {
                ($e:expr) => {{
                    let e = $e;
                    let k0 = E::load_ymm(kt.add(e * NR));
                    let k1 = E::load_ymm(kt.add(e * NR + 8));
                    for (c, row) in c.iter_mut().zip(rows_at) {
                        let a = _mm256_broadcast_ss(&*row.add(e));
                        c[0] = _mm256_fmadd_ps(a, k0, c[0]);
                        c[1] = _mm256_fmadd_ps(a, k1, c[1]);
                    }
                }};
            }
            // Four steps a loop, so that its counter and pointer come once
            // per four.
            unrolled!(d, [0, 1, 2, 3], step);
            for (r, c) in c.iter().enumerate() {
                let dst = strip.add(r * out_rs + pi * NR);
                _mm256_storeu_ps(dst, c[0]);
                _mm256_storeu_ps(dst.add(8), c[1]);
            }
            if let Some((m, cols)) = maxes {
                // Lanes of keys below `cols`, for each half of the panel.
                let lane = _mm256_setr_ps(0., 1., 2., 3., 4., 5., 6., 7.);
                let valid: [__m256; 2] = std::array::from_fn(|h| {
                    let n = cols.saturating_sub(pi * NR + h * 8).min(8) as f32;
                    _mm256_cmp_ps::<_CMP_LT_OQ>(lane, _mm256_set1_ps(n))
                });
                for (r, c) in c.iter().enumerate() {
                    let m = m.add(r * 16);
                    let mut mx = _mm256_loadu_ps(m);
                    for (c, valid) in c.iter().zip(valid) {
                        mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, *c), valid);
                    }
                    _mm256_storeu_ps(m, mx);
                }
            }
        }
    }
}

/// `dst[e·ds + c] = rows[c][e] · scale` for the `d` dims `e` and the
/// `lanes` (4 or 8) columns `c`, zero for `c >= rows.len()`: an 8 × 8
/// register transpose per 8 dims (a scale of 1 multiplies nothing, so the
/// values keep their bits). Packs the attention's keys and queries and a
/// linear layer's f32 weight rows into panels.
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
                let x = unsafe { _mm256_loadu_ps(rows[c].as_ptr().add(e)) };
                *r = if scale == 1. { x } else { _mm256_mul_ps(x, sc) };
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
            let x = rows
                .get(c)
                .map_or(0., |r| if scale == 1. { r[e] } else { r[e] * scale });
            unsafe { *dst.add(e * ds + c) = x };
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
