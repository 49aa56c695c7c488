//! The AVX2+FMA micro-kernels: the attention tiles' two products over the
//! packed keys and values (`panel.rs`), 6 query rows by a panel of 16 in
//! 12 `ymm` accumulators, 12 FMAs per 8 loads; the linear layers' tile
//! over panels of 16 (the same `Q·Kᵀ` kernel); and the 8 × 8 transposes
//! that pack keys and queries. The tile driver is `tile.rs`; the softmax
//! between the products is `softmax.rs` on `ymm` lanes.

use std::arch::x86_64::*;

use crate::elem::PanelElem;
use crate::panel::{NR, STRIP_RS};

/// Query rows per micro-kernel.
pub(crate) const MR: usize = 6;

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
/// Picks the micro-kernel instance for a group of `rows` (1..=MR).
macro_rules! by_rows {
    ($rows:expr, $f:ident$(::<_, $($p:tt),+>)?($($arg:expr),*)) => {
        match $rows {
            1 => $f::<1 $($(, $p)+)?>($($arg),*),
            2 => $f::<2 $($(, $p)+)?>($($arg),*),
            3 => $f::<3 $($(, $p)+)?>($($arg),*),
            4 => $f::<4 $($(, $p)+)?>($($arg),*),
            5 => $f::<5 $($(, $p)+)?>($($arg),*),
            _ => $f::<MR $($(, $p)+)?>($($arg),*),
        }
    };
}

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
pub(crate) unsafe fn scores<const ACC: bool, E: PanelElem>(
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
            scores_rows::<_, ACC, E>(q, q_rs, d, kt, panels, out, out_rs, maxes)
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_rows<const R: usize, const ACC: bool, E: PanelElem>(
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
    unsafe { by_rows!(rows, weighted_values_rows(strip, v, panel, dvp, cols, acc)) }
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
