//! The AVX-512F micro-kernels. The attention tiles' two products, over the
//! packed keys and values of `panel.rs` (panels of 16):
//! a group of [`MR`] query rows against two panels at a time, 24 `zmm`
//! accumulators, 24 FMAs per 2 panel loads and 12 broadcasts, each
//! broadcast at a fixed offset from one pointer (the group's queries
//! interleaved, the score strip's row stride a constant); the `Q·Kᵀ` kernel
//! keeps each row's max as it stores the scores (the softmax between the
//! two is `softmax.rs` on `zmm` lanes).

use std::arch::x86_64::*;

use crate::elem::PanelElem;
use crate::panel::{NR, STRIP_RS};

/// Query rows per micro-kernel.
pub(crate) const MR: usize = 12;

/// Picks the micro-kernel instance for a group of `rows` (1..=MR).
macro_rules! by_rows {
    ($rows:expr, $f:ident$(::<_, $acc:tt>)?($($arg:expr),*)) => {
        match $rows {
            1 => $f::<1 $(, $acc)?>($($arg),*),
            2 => $f::<2 $(, $acc)?>($($arg),*),
            3 => $f::<3 $(, $acc)?>($($arg),*),
            4 => $f::<4 $(, $acc)?>($($arg),*),
            5 => $f::<5 $(, $acc)?>($($arg),*),
            6 => $f::<6 $(, $acc)?>($($arg),*),
            7 => $f::<7 $(, $acc)?>($($arg),*),
            8 => $f::<8 $(, $acc)?>($($arg),*),
            9 => $f::<9 $(, $acc)?>($($arg),*),
            10 => $f::<10 $(, $acc)?>($($arg),*),
            11 => $f::<11 $(, $acc)?>($($arg),*),
            _ => $f::<MR $(, $acc)?>($($arg),*),
        }
    };
}

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
    unsafe { by_rows!(rows, scores_rows(q, d, kt, cols, out, out_rs, maxes)) }
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
            _mm512_storeu_ps(m, _mm512_mask_max_ps(old, lanes(cols - $pi * NR), old, $c));
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
    unsafe { by_rows!(rows, weighted_values_rows(strip, v, panel, dvp, cols, acc)) }
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

/// Output features per panel of the linear layers' AVX-512 layout: two
/// `zmm` registers.
pub(crate) const LINEAR_NR: usize = 32;

/// The two linear micro-kernels, each 24 accumulators: tall (12 rows by
/// a panel, 2 panel loads and 12 broadcasts per 24 FMAs) and wide (6 rows
/// by two panels, 4 loads and 6 broadcasts). Wide takes every call of more
/// than 12 rows, its rows' inputs in L1 and the panels streaming from L2;
/// tall takes calls of one row group, which then read each panel once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinearTile {
    Tall,
    Wide,
}

impl LinearTile {
    /// The kernel for a call of `m` rows.
    pub(crate) fn for_rows(m: usize) -> LinearTile {
        if m > 12 {
            LinearTile::Wide
        } else {
            LinearTile::Tall
        }
    }

    /// `(rows, panels)` of a tile: the rows of `x` go in groups of `rows`.
    pub(crate) fn shape(self) -> (usize, usize) {
        match self {
            LinearTile::Tall => (12, 1),
            LinearTile::Wide => (6, 2),
        }
    }
}

/// Lanes `0..n` of a 16-lane mask (`n` may exceed 16).
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// One tile of a packed linear layer: for `rows` rows (1..= the tile's)
/// and the first `cols` (1..= `LINEAR_NR` times the tile's panels)
/// features of the panel slice at `w` and, past `LINEAR_NR`, of the one at
/// `w + w_next`, `out[r·out_rs + c] = init[c] + Σₑ x[r·x_rs + e] ·
/// w[e·LINEAR_NR + c]` over `kc` inputs; `init` is the bias, or, when
/// null, the output itself (a later slice of the reduction adds to it).
/// With a bias, a non-null `res.0` adds a residual to it, `res.0[r·res.1 +
/// c]`, as the tile starts (the same sum, rounded alike, as a pass that
/// writes `residual + bias` into the output first, without that pass).
/// The panel rows
/// of steps `0..prefetch.1` from each non-null pointer of `prefetch.0` on
/// (`LINEAR_NR` elements a step) are prefetched into L2, one step's a step.
/// The weights are `f32`, `bf16` or `f16` ([`PanelElem`]), widened to f32
/// as they are loaded.
///
/// # Safety
/// AVX-512F; the pointers cover those extents (`x` `rows` rows of `kc`
/// inputs, `x_rs` apart, each panel slice `LINEAR_NR` elements per input,
/// `init` `cols` floats, a non-null `res.0` `rows` rows of `cols` floats
/// `res.1` apart); `w + w_next` is only read where `cols > LINEAR_NR`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn linear_tile<E: PanelElem>(
    tile: LinearTile,
    rows: usize,
    cols: usize,
    kc: usize,
    x: (*const f32, usize),
    (w, w_next): (*const E, usize),
    init: *const f32,
    res: (*const f32, usize),
    out: *mut f32,
    out_rs: usize,
    prefetch: ([*const E; 2], usize),
) {
    macro_rules! go {
        ($mr:literal, $v:literal, $($r:literal)*) => {
            match rows {
                $($r => linear_tile_rows::<$r, $v, E>(cols, kc, x, (w, w_next), init, res, out, out_rs, prefetch),)*
                _ => linear_tile_rows::<$mr, $v, E>(cols, kc, x, (w, w_next), init, res, out, out_rs, prefetch),
            }
        };
    }
    // SAFETY: forwarded.
    unsafe {
        match tile {
            LinearTile::Tall => go!(12, 2, 1 2 3 4 5 6 7 8 9 10 11),
            LinearTile::Wide if cols > LINEAR_NR => go!(6, 4, 1 2 3 4 5),
            // A last panel without its pair.
            LinearTile::Wide => go!(6, 2, 1 2 3 4 5),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn linear_tile_rows<const R: usize, const V: usize, E: PanelElem>(
    cols: usize,
    kc: usize,
    (x, x_rs): (*const f32, usize),
    (w, w_next): (*const E, usize),
    init: *const f32,
    (res, res_rs): (*const f32, usize),
    out: *mut f32,
    out_rs: usize,
    (pf, pf_steps): ([*const E; 2], usize),
) {
    let masks: [__mmask16; V] = std::array::from_fn(|v| lanes(cols.saturating_sub(16 * v)));
    // SAFETY: (the block) inside the extents the caller vouched for; lanes
    // past `cols` are masked off.
    unsafe {
        let mut c = [[_mm512_setzero_ps(); V]; R];
        if init.is_null() {
            for (r, c) in c.iter_mut().enumerate() {
                for (v, c) in c.iter_mut().enumerate() {
                    *c = _mm512_maskz_loadu_ps(masks[v], out.add(r * out_rs + 16 * v));
                }
            }
        } else {
            let b: [__m512; V] = std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], init.add(16 * v)));
            for (r, c) in c.iter_mut().enumerate() {
                *c = b;
                if !res.is_null() {
                    for (v, c) in c.iter_mut().enumerate() {
                        let y = _mm512_maskz_loadu_ps(masks[v], res.add(r * res_rs + 16 * v));
                        *c = _mm512_add_ps(y, *c);
                    }
                }
            }
        }
        // Vector v of a step: panel v / 2, lanes (v % 2) · 16.
        let wp: [*const E; V] = std::array::from_fn(|v| w.wrapping_add((v / 2) * w_next + (v % 2) * 16));
        // Step `e`: the panel rows' loads, a broadcast and V FMAs a row.
        macro_rules! step {
            ($e:expr) => {{
                let e = $e;
                let wv: [__m512; V] = std::array::from_fn(|v| E::load_zmm(wp[v].add(e * LINEAR_NR)));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*x.add(r * x_rs + e));
                    for (c, &wv) in c.iter_mut().zip(&wv) {
                        *c = _mm512_fmadd_ps(a, wv, *c);
                    }
                }
            }};
        }
        // Step e's panel row from each pointer to prefetch: two lines of
        // f32, one of bf16 or f16.
        macro_rules! prefetch {
            ($e:expr) => {{
                for pf in pf.iter().filter(|pf| !pf.is_null()) {
                    let line = pf.wrapping_add($e * LINEAR_NR) as *const i8;
                    _mm_prefetch::<_MM_HINT_T1>(line);
                    if size_of::<E>() * LINEAR_NR > 64 {
                        _mm_prefetch::<_MM_HINT_T1>(line.wrapping_add(64));
                    }
                }
            }};
        }
        // Steps `e..end`, with or without the prefetches, four at a time:
        // the loop's own instructions (pointers, counter, the prefetch's
        // test, about 10 µops beside a step's 24 FMAs and 10 loads) then
        // come once per four steps. The tall tile steps one at a time:
        // unrolled, even by two, LLVM hoists its 12 broadcasts a step and
        // spills them.
        let mut e = 0;
        macro_rules! steps {
            ($end:expr, $pf:expr) => {{
                let end = $end;
                if R <= 6 {
                    while e + 4 <= end {
                        if $pf {
                            prefetch!(e);
                            prefetch!(e + 1);
                            prefetch!(e + 2);
                            prefetch!(e + 3);
                        }
                        step!(e);
                        step!(e + 1);
                        step!(e + 2);
                        step!(e + 3);
                        e += 4;
                    }
                }
                while e < end {
                    if $pf {
                        prefetch!(e);
                    }
                    step!(e);
                    e += 1;
                }
            }};
        }
        let prefetching = pf.iter().any(|pf| !pf.is_null());
        steps!(if prefetching { pf_steps.min(kc) } else { 0 }, true);
        steps!(kc, false);
        for (r, c) in c.iter().enumerate() {
            for (v, c) in c.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(r * out_rs + 16 * v), masks[v], *c);
            }
        }
    }
}

/// How far ahead of its loads [`one_row`] prefetches its panels, in bytes.
/// The stream is read once and at a rate the hardware prefetcher, which
/// stops at every 4 KiB page, does not keep ahead of: half a page of
/// software prefetch is what keeps a half-precision panel's loads from
/// waiting on memory (f32 reads fast enough without it, and takes no harm).
const ONE_ROW_PREFETCH: usize = 2048;

/// `out[c] = init[c] + Σₑ x[e] · w[p·k·LINEAR_NR + e·LINEAR_NR + c % 32]`
/// (`p = c / 32`) for `cols` columns: one row (a decoder's step) through
/// the packed panels (f32, bf16 or f16), each streamed once, four inputs at
/// a time into 8 accumulators, prefetching `ONE_ROW_PREFETCH` bytes ahead.
///
/// # Safety
/// AVX-512F; `w` starts at a panel (64-byte aligned) and covers
/// `ceil(cols / 32)` panels of `k` inputs, `x` holds `k` floats, `init`
/// and `out` `cols`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn one_row<E: PanelElem>(
    x: *const f32,
    k: usize,
    w: *const E,
    cols: usize,
    init: *const f32,
    out: *mut f32,
) {
    const V: usize = LINEAR_NR / 16;
    const U: usize = 8 / V;
    for (p, c0) in (0..cols).step_by(LINEAR_NR).enumerate() {
        let masks: [__mmask16; V] = std::array::from_fn(|v| lanes((cols - c0).saturating_sub(16 * v)));
        // SAFETY: (the block) panel p's k inputs, lanes within `cols`.
        unsafe {
            let mut w = w.add(p * k * LINEAR_NR);
            // U inputs at a time into U sets of accumulators (8 in all).
            let mut acc = [[_mm512_setzero_ps(); V]; U];
            let mut e = 0;
            while e + U <= k {
                // The lines this loop reads `ONE_ROW_PREFETCH` bytes on:
                // a prefetch never faults, so past the weight's end it is
                // only wasted.
                let ahead = w.cast::<i8>().wrapping_add(ONE_ROW_PREFETCH);
                for line in (0..U * LINEAR_NR * size_of::<E>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                }
                for (u, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*x.add(e + u));
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_fmadd_ps(a, E::load_zmm(w.add(u * LINEAR_NR + 16 * v)), *acc);
                    }
                }
                w = w.add(U * LINEAR_NR);
                e += U;
            }
            for e in e..k {
                let a = _mm512_set1_ps(*x.add(e));
                for (v, acc) in acc[0].iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(a, E::load_zmm(w.add(16 * v)), *acc);
                }
                w = w.add(LINEAR_NR);
            }
            for v in 0..V {
                let sum = acc
                    .iter()
                    .fold(_mm512_maskz_loadu_ps(masks[v], init.add(c0 + 16 * v)), |s, a| {
                        _mm512_add_ps(s, a[v])
                    });
                _mm512_mask_storeu_ps(out.add(c0 + 16 * v), masks[v], sum);
            }
        }
    }
}
