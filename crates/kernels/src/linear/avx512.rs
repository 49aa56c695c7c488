//! AVX-512's linear micro-kernels over packed panels (`weight.rs`): the
//! tiles and the one-row kernel, written once over [`Dot`], the step that
//! multiplies (f32 FMAs over widened panels here, `vdpbf16ps` over bf16
//! pairs in `avx512bf16.rs`).

use std::arch::x86_64::*;

use crate::elem::PanelElem;
use crate::rows::lanes::zmm_mask;

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

/// How a linear micro-kernel's step multiplies: the inputs it reads, the
/// panel rows it loads and the multiply-add. [`Widen`] is the f32 FMA over
/// panels of any [`PanelElem`], an input a step; `avx512bf16.rs`'s pairs
/// are `vdpbf16ps` over bf16 inputs and panels, two inputs a step. The
/// kernels' bodies are written once over it and compiled into each
/// instruction set's entry points ([`Dot::tile_rows`], [`Dot::one_row`]),
/// which enable the target features its instructions need.
pub(crate) trait Dot: Sized {
    /// An input element.
    type X: Copy;
    /// A panel element.
    type W: Copy;
    /// A step's inputs of one row, broadcast to every lane.
    type A: Copy;
    /// 16 lanes of a panel row.
    type Wv: Copy;
    /// Inputs a step.
    const STEP: usize;
    /// Elements from a panel row's first 16 features to its next 16.
    const HALF: usize;
    /// How far ahead of its loads [`one_row_body`] prefetches its panels,
    /// in bytes. The stream is read once and at a rate the hardware
    /// prefetcher, which stops at every 4 KiB page, does not keep ahead of;
    /// the distance that keeps the loads from waiting on memory differs by
    /// how much work each byte brings.
    const PREFETCH: usize;
    /// The step's inputs from `x` on, broadcast.
    /// # Safety
    /// The entry point's features are enabled; `x` holds `STEP` inputs.
    unsafe fn broadcast(x: *const Self::X) -> Self::A;
    /// 16 lanes of a panel row, from `w` on.
    /// # Safety
    /// As for `broadcast`; `w` holds them and is aligned to their size.
    unsafe fn load(w: *const Self::W) -> Self::Wv;
    /// `c + a · w` lane by lane, summed over the step's inputs.
    /// # Safety
    /// The entry point's features are enabled.
    unsafe fn madd(a: Self::A, w: Self::Wv, c: __m512) -> __m512;
    /// [`tile_rows`] for this dot, `R` rows and `V` vectors.
    /// # Safety
    /// As [`linear_tile`].
    unsafe fn tile_rows<const R: usize, const V: usize>(t: &Tile<Self>);
    /// [`one_row_body`] for this dot.
    /// # Safety
    /// As [`one_row_body`].
    unsafe fn one_row(r: &Row<Self>);
}

/// The f32 FMA over panels of `E`, widened as they are loaded.
pub(crate) struct Widen<E>(std::marker::PhantomData<E>);

impl<E: PanelElem> Dot for Widen<E> {
    type X = f32;
    type W = E;
    type A = __m512;
    type Wv = __m512;
    const STEP: usize = 1;
    const HALF: usize = 16;
    /// f32 panels 1 KiB; bf16 and f16 panels, widened in registers (more
    /// work a byte), 2 KiB: the distances that streamed a decoder step's
    /// linears fastest.
    const PREFETCH: usize = if size_of::<E>() == 4 { 1024 } else { 2048 };
    #[inline(always)]
    unsafe fn broadcast(x: *const f32) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_set1_ps(*x) }
    }
    #[inline(always)]
    unsafe fn load(w: *const E) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { E::load_zmm(w) }
    }
    #[inline(always)]
    unsafe fn madd(a: __m512, w: __m512, c: __m512) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_fmadd_ps(a, w, c) }
    }
    unsafe fn tile_rows<const R: usize, const V: usize>(t: &Tile<Self>) {
        #[target_feature(enable = "avx512f")]
        unsafe fn entry<const R: usize, const V: usize, E: PanelElem>(t: &Tile<Widen<E>>) {
            // SAFETY: forwarded, with the features it needs.
            unsafe { tile_rows::<R, V, Widen<E>>(t) }
        }
        // SAFETY: forwarded; the caller vouched for AVX-512F.
        unsafe { entry::<R, V, E>(t) }
    }
    unsafe fn one_row(r: &Row<Self>) {
        #[target_feature(enable = "avx512f")]
        unsafe fn entry<E: PanelElem>(r: &Row<Widen<E>>) {
            // SAFETY: forwarded, with the features it needs.
            unsafe { one_row_body(r) }
        }
        // SAFETY: forwarded; the caller vouched for AVX-512F.
        unsafe { entry(r) }
    }
}

/// One tile of a packed linear layer: for `rows` rows (1..= the tile's)
/// and the first `cols` (1..= `LINEAR_NR` times the tile's panels)
/// features of the panel slice at `w` and, past `LINEAR_NR`, of the one at
/// `w + w_next`, `out[r·out_rs + c] = init[c] + Σₑ x[r·x_rs + e·x_cs] ·
/// w[e·LINEAR_NR + c]` over `kc` inputs (`x_cs` 1 but for a transposed
/// input, which only `D::STEP` = 1 reads) (a multiple of `D::STEP`; the
/// panel rows in `D`'s layout); `init` is the bias, or, when null, the
/// output itself (a later slice of the reduction adds to it).
/// With a bias, a non-null `res` adds a residual to it, `res[r·res_rs +
/// c]`, as the tile starts (the same sum, rounded alike, as a pass that
/// writes `residual + bias` into the output first, without that pass).
/// The panel rows of inputs `0..pf_steps` from each non-null pointer of
/// `pf` on (`LINEAR_NR` elements an input) are prefetched into L2, one
/// step's a step.
pub(crate) struct Tile<D: Dot> {
    pub(crate) cols: usize,
    pub(crate) kc: usize,
    pub(crate) x: *const D::X,
    pub(crate) x_rs: usize,
    pub(crate) x_cs: usize,
    pub(crate) w: *const D::W,
    pub(crate) w_next: usize,
    pub(crate) init: *const f32,
    pub(crate) res: *const f32,
    pub(crate) res_rs: usize,
    pub(crate) out: *mut f32,
    pub(crate) out_rs: usize,
    pub(crate) pf: [*const D::W; 2],
    pub(crate) pf_steps: usize,
}

/// Runs `t` for `rows` rows with `tile`'s kernel.
///
/// # Safety
/// `D`'s entry point's features (AVX-512F, and what `D` adds); the
/// pointers cover [`Tile`]'s extents (`x` `rows` rows of `kc` inputs,
/// `x_rs` apart, each panel slice `LINEAR_NR` elements per input, `init`
/// `cols` floats, a non-null `res` `rows` rows of `cols` floats `res_rs`
/// apart); `w + w_next` is only read where `cols > LINEAR_NR`.
pub(crate) unsafe fn linear_tile<D: Dot>(tile: LinearTile, rows: usize, t: &Tile<D>) {
    macro_rules! go {
        ($mr:literal, $v:literal, $($r:literal)*) => {
            match rows {
                $($r => D::tile_rows::<$r, $v>(t),)*
                _ => D::tile_rows::<$mr, $v>(t),
            }
        };
    }
    // SAFETY: forwarded.
    unsafe {
        match tile {
            LinearTile::Tall => go!(12, 2, 1 2 3 4 5 6 7 8 9 10 11),
            LinearTile::Wide if t.cols > LINEAR_NR => go!(6, 4, 1 2 3 4 5),
            // A last panel without its pair.
            LinearTile::Wide => go!(6, 2, 1 2 3 4 5),
        }
    }
}

/// The body of every [`Dot::tile_rows`], inlined into each entry point.
///
/// # Safety
/// As [`linear_tile`].
#[inline(always)]
pub(crate) unsafe fn tile_rows<const R: usize, const V: usize, D: Dot>(t: &Tile<D>) {
    let &Tile {
        cols,
        kc,
        x,
        x_rs,
        x_cs,
        w,
        w_next,
        init,
        res,
        res_rs,
        out,
        out_rs,
        pf,
        pf_steps,
    } = t;
    let masks: [__mmask16; V] = std::array::from_fn(|v| zmm_mask(cols.saturating_sub(16 * v)));
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
        let wp: [*const D::W; V] =
            std::array::from_fn(|v| w.wrapping_add((v / 2) * w_next + (v % 2) * D::HALF));
        // The step at input `e`: the panel rows' loads, a broadcast and V
        // multiply-adds a row.
        macro_rules! step {
            ($e:expr) => {{
                let e = $e;
                let wv: [D::Wv; V] = std::array::from_fn(|v| D::load(wp[v].add(e * LINEAR_NR)));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = D::broadcast(x.add(r * x_rs + e * x_cs));
                    for (c, &wv) in c.iter_mut().zip(&wv) {
                        *c = D::madd(a, wv, *c);
                    }
                }
            }};
        }
        // The step at input e's panel rows from each pointer to prefetch,
        // a line at a time.
        macro_rules! prefetch {
            ($e:expr) => {{
                for pf in pf.iter().filter(|pf| !pf.is_null()) {
                    let line = pf.wrapping_add($e * LINEAR_NR) as *const i8;
                    for l in (0..D::STEP * LINEAR_NR * size_of::<D::W>()).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(line.wrapping_add(l));
                    }
                }
            }};
        }
        // Steps from `e` to `end`, with or without the prefetches, four at
        // a time: the loop's own instructions (pointers, counter, the
        // prefetch's test, about 10 µops beside a step's 24 FMAs and 10
        // loads) then come once per four steps. The tall tile steps one at
        // a time: unrolled, even by two, LLVM hoists its 12 broadcasts a
        // step and spills them.
        let mut e = 0;
        let s = D::STEP;
        macro_rules! steps {
            ($end:expr, $pf:expr) => {{
                let end = $end;
                if R <= 6 {
                    while e + 4 * s <= end {
                        if $pf {
                            prefetch!(e);
                            prefetch!(e + s);
                            prefetch!(e + 2 * s);
                            prefetch!(e + 3 * s);
                        }
                        step!(e);
                        step!(e + s);
                        step!(e + 2 * s);
                        step!(e + 3 * s);
                        e += 4 * s;
                    }
                }
                while e + s <= end {
                    if $pf {
                        prefetch!(e);
                    }
                    step!(e);
                    e += s;
                }
            }};
        }
        let prefetching = pf.iter().any(|pf| !pf.is_null());
        steps!(if prefetching { pf_steps.min(kc) } else { 0 }, true);
        steps!(kc, false);
        debug_assert_eq!(e, kc);
        for (r, c) in c.iter().enumerate() {
            for (v, c) in c.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(r * out_rs + 16 * v), masks[v], *c);
            }
        }
    }
}

/// One row (a decoder's step) through `ceil(cols / 32)` packed panels of
/// `k` inputs from `w` on ([`one_row_body`]).
pub(crate) struct Row<D: Dot> {
    pub(crate) x: *const D::X,
    pub(crate) k: usize,
    pub(crate) w: *const D::W,
    pub(crate) cols: usize,
    pub(crate) init: *const f32,
    pub(crate) out: *mut f32,
}

/// The body of every [`Dot::one_row`], inlined into each entry point:
/// `out[c] = init[c] + Σₑ x[e] · w[p·k·LINEAR_NR + e·LINEAR_NR + c % 32]`
/// (`p = c / 32`) for `cols` columns: one row (a decoder's step) through
/// the packed panels (in `D`'s layout), each streamed once, four steps at
/// a time into 8 accumulators, prefetching [`Dot::PREFETCH`] bytes ahead.
///
/// # Safety
/// `D`'s entry point's features (AVX-512F, and what `D` adds); `k` is a
/// multiple of `D::STEP`; `w` starts at a panel (64-byte aligned) and
/// covers `ceil(cols / 32)` panels of `k` inputs, `x` holds `k` inputs,
/// `init` and `out` `cols` floats.
#[inline(always)]
pub(crate) unsafe fn one_row_body<D: Dot>(r: &Row<D>) {
    let &Row {
        x,
        k,
        w,
        cols,
        init,
        out,
    } = r;
    const V: usize = LINEAR_NR / 16;
    const U: usize = 8 / V;
    let s = D::STEP;
    for (p, c0) in (0..cols).step_by(LINEAR_NR).enumerate() {
        let masks: [__mmask16; V] = std::array::from_fn(|v| zmm_mask((cols - c0).saturating_sub(16 * v)));
        // SAFETY: (the block) panel p's k inputs, lanes within `cols`.
        unsafe {
            let mut w = w.add(p * k * LINEAR_NR);
            // U steps at a time into U sets of accumulators (8 in all).
            let mut acc = [[_mm512_setzero_ps(); V]; U];
            let mut e = 0;
            while e + U * s <= k {
                // The lines this loop reads `D::PREFETCH` bytes on:
                // a prefetch never faults, so past the weight's end it is
                // only wasted.
                let ahead = w.cast::<i8>().wrapping_add(D::PREFETCH);
                for line in (0..U * s * LINEAR_NR * size_of::<D::W>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                }
                for (u, acc) in acc.iter_mut().enumerate() {
                    let a = D::broadcast(x.add(e + u * s));
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = D::madd(a, D::load(w.add(u * s * LINEAR_NR + D::HALF * v)), *acc);
                    }
                }
                w = w.add(U * s * LINEAR_NR);
                e += U * s;
            }
            while e + s <= k {
                let a = D::broadcast(x.add(e));
                for (v, acc) in acc[0].iter_mut().enumerate() {
                    *acc = D::madd(a, D::load(w.add(D::HALF * v)), *acc);
                }
                w = w.add(s * LINEAR_NR);
                e += s;
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
