//! The AVX-512F micro-kernels of the attention tiles (`tiles.rs`): their
//! two products, over the packed keys and values of `panel/` (panels of
//! 16):
//! a group of [`MR`] query rows against two panels at a time, 24 `zmm`
//! accumulators, 24 FMAs per 2 panel loads and 12 broadcasts, each
//! broadcast at a fixed offset from one pointer (the group's queries
//! interleaved, the score strip's row stride a constant); the `Q·Kᵀ` kernel
//! keeps each row's max as it stores the scores (the softmax between the
//! two is `rows/softmax.rs` on `zmm` lanes).

use std::arch::x86_64::*;

use crate::panel::{NR, STRIP_RS};
use crate::rows::lanes::zmm_mask;

/// Query rows per micro-kernel.
pub(crate) const MR: usize = 12;

/// `out[r·out_rs + c] = Σₑ q[e·MR + r] · Kᵀ[e, c]` for `rows` rows, `d`
/// dims and the `ceil(cols / NR)` panels holding `cols` keys, the rows'
/// queries interleaved (dim `e` of the group's rows at `e·MR`), so that a
/// step's broadcasts read fixed offsets from one pointer instead of
/// computing a row address each. The softmax's row max comes with it:
/// lane `c` of `maxes[r·16..]` becomes the largest of itself and row `r`'s
/// scores of keys `c`, `c + 16`, … below `cols` (a NaN score may be
/// skipped, as by `row_max`).
///
/// # Safety
/// AVX-512F; the pointers cover those extents (`maxes` `rows · 16`
/// floats).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scores(
    rows: usize,
    q: *const f32,
    d: usize,
    kt: *const f32,
    cols: usize,
    out: *mut f32,
    out_rs: usize,
    maxes: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe {
        by_rows!(rows, [1 2 3 4 5 6 7 8 9 10 11] else MR, scores_rows(q, d, kt, cols, out, out_rs, maxes))
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn scores_rows<const R: usize>(
    q: *const f32,
    d: usize,
    kt: *const f32,
    cols: usize,
    out: *mut f32,
    out_rs: usize,
    maxes: *mut f32,
) {
    let panels = cols.div_ceil(NR);
    // Row r's running maxima take panel pi's scores `c` of keys below
    // `cols`; they stay in memory, the accumulators take the registers.
    macro_rules! keep_max {
        ($r:expr, $pi:expr, $c:expr) => {{
            let m = maxes.add($r * 16);
            let old = _mm512_loadu_ps(m);
            _mm512_storeu_ps(m, _mm512_mask_max_ps(old, zmm_mask(cols - $pi * NR), old, $c));
        }};
    }
    let mut pi = 0;
    // SAFETY: (here and below) inside the extents the caller vouched for.
    unsafe {
        while pi + 2 <= panels {
            let (k0, k1) = (kt.add(pi * d * NR), kt.add((pi + 1) * d * NR));
            let mut c = [[_mm512_setzero_ps(); 2]; R];
            // Two steps a loop: the loop's counter and pointers come once
            // per two; more do not help, as the broadcasts read fixed
            // offsets from one pointer.
            macro_rules! step {
                ($e:expr) => {{
                    let e = $e;
                    let w0 = _mm512_loadu_ps(k0.add(e * NR));
                    let w1 = _mm512_loadu_ps(k1.add(e * NR));
                    for (r, c) in c.iter_mut().enumerate() {
                        let a = _mm512_set1_ps(*q.add(e * MR + r));
                        c[0] = _mm512_fmadd_ps(a, w0, c[0]);
                        c[1] = _mm512_fmadd_ps(a, w1, c[1]);
                    }
                }};
            }
            unrolled!(d, [0, 1], step);
            for (r, c) in c.iter().enumerate() {
                let dst = out.add(r * out_rs + pi * NR);
                _mm512_storeu_ps(dst, c[0]);
                _mm512_storeu_ps(dst.add(NR), c[1]);
                keep_max!(r, pi, c[0]);
                keep_max!(r, pi + 1, c[1]);
            }
            pi += 2;
        }
        if pi < panels {
            let k0 = kt.add(pi * d * NR);
            let mut c = [_mm512_setzero_ps(); R];
            for e in 0..d {
                let w0 = _mm512_loadu_ps(k0.add(e * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    *c = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(e * MR + r)), w0, *c);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * out_rs + pi * NR), *c);
                keep_max!(r, pi, *c);
            }
        }
    }
}

/// `acc[r·dvp + p·NR + c] += Σⱼ strip[r·STRIP_RS + j] ·
/// v[p·panel + j·NR + c]` for `rows` rows, `cols` keys and all `dvp / NR`
/// panels. The strip's row stride is a constant, so that a step's
/// broadcasts read fixed offsets from one pointer.
///
/// # Safety
/// AVX-512F; the pointers cover those extents.
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
    unsafe {
        by_rows!(rows, [1 2 3 4 5 6 7 8 9 10 11] else MR, weighted_values_rows(strip, v, panel, dvp, cols, acc))
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn weighted_values_rows<const R: usize>(
    strip: *const f32,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    let panels = dvp / NR;
    let mut pi = 0;
    // SAFETY: (here and below) inside the extents the caller vouched for.
    unsafe {
        while pi + 2 <= panels {
            let (v0p, v1p) = (v.add(pi * panel), v.add((pi + 1) * panel));
            let mut c = [[_mm512_setzero_ps(); 2]; R];
            for (r, c) in c.iter_mut().enumerate() {
                let src = acc.add(r * dvp + pi * NR);
                *c = [_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(NR))];
            }
            // Two steps a loop, as in `scores_rows`.
            macro_rules! step {
                ($j:expr) => {{
                    let j = $j;
                    let v0 = _mm512_loadu_ps(v0p.add(j * NR));
                    let v1 = _mm512_loadu_ps(v1p.add(j * NR));
                    for (r, c) in c.iter_mut().enumerate() {
                        let a = _mm512_set1_ps(*strip.add(r * STRIP_RS + j));
                        c[0] = _mm512_fmadd_ps(a, v0, c[0]);
                        c[1] = _mm512_fmadd_ps(a, v1, c[1]);
                    }
                }};
            }
            unrolled!(cols, [0, 1], step);
            for (r, c) in c.iter().enumerate() {
                let dst = acc.add(r * dvp + pi * NR);
                _mm512_storeu_ps(dst, c[0]);
                _mm512_storeu_ps(dst.add(NR), c[1]);
            }
            pi += 2;
        }
        if pi < panels {
            let v0p = v.add(pi * panel);
            let mut c = [_mm512_setzero_ps(); R];
            for (r, c) in c.iter_mut().enumerate() {
                *c = _mm512_loadu_ps(acc.add(r * dvp + pi * NR));
            }
            for j in 0..cols {
                let v0 = _mm512_loadu_ps(v0p.add(j * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    *c = _mm512_fmadd_ps(_mm512_set1_ps(*strip.add(r * STRIP_RS + j)), v0, *c);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm512_storeu_ps(acc.add(r * dvp + pi * NR), *c);
            }
        }
    }
}
