//! A call of a packed weight: the inputs rounded to bf16 where the panels
//! pair them, a single row (a decoder's step) to `one_row.rs`, and a call
//! of several rows in tiles. A work unit is a block of panels
//! (`UNIT_FEATURES` features at most) by a block of row groups
//! (`units.rs`): with more than one thread, at most `CHUNK_GROUPS` of them
//! where the reduction is one slice, so that a thread that finishes first
//! takes over the rest of the other's share; inside it, as in BLIS and
//! `gemm`, one row group's slice of the inputs stays in L1 while the unit's
//! panel slices stream past it from L2, where they stay across the row
//! groups. On AVX-512 the tiles prefetch weights into L2 as they run: in a
//! unit of one row group (a decoder's step at batch ≤ 12) the next tile's,
//! in the first row group of a unit of more their own, `AHEAD` steps on.
//! Units run on the threads of `runtime::pool`. The bias (or the
//! residual) starts the accumulators, and the epilogue (GELU or ReLU) runs
//! on each tile as its last slice is written, while it is in L1.

use half::bf16;

use super::units::{slice_len, unit_shape};
use super::weight::{on_panels, Epilogue, PackedWeight, PanelData};
use crate::elem::PanelElem;
#[cfg(target_arch = "x86_64")]
use crate::panel::avx2::transpose_into;
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_chunks_mut, par_for, piece, threads, SyncPtr, PARALLEL_FROM};

thread_local! {
    /// A thread's f32 copy of a unit's half-precision panel slices
    /// ([`PackedWeight::tiles`]), kept between units and calls.
    static WIDENED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Steps (inputs) ahead of itself that a tile of a unit's first row group
/// prefetches its panels: 4 KiB a panel on AVX-512, into the next page,
/// where the hardware's stream prefetch stops (weights cold in memory, as
/// a model's layers are one after another).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 32;

impl PackedWeight {
    /// `epilogue(x · wᵀ + b)` for output features `lo..hi` (see
    /// [`PackedWeight::serves_range`]), plus `residual` where given (with
    /// [`Epilogue::Identity`] only): `x` is `m` rows of `k` floats,
    /// `residual` `m` rows of `hi - lo`; returns `m` rows of `hi - lo`
    /// floats. A residual is where the tiles start from (with the bias),
    /// so that adding it back costs no pass of its own.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        m: usize,
        range: (usize, usize),
        epilogue: Epilogue,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        on_panels!(&self.panels, p => self.forward_with(p.get(), x, m, range, epilogue, residual))
    }

    /// [`PackedWeight::forward`] over the panels in their dtype.
    fn forward_with<E: PanelElem>(
        &self,
        panels: &[E],
        x: &[f32],
        m: usize,
        (lo, hi): (usize, usize),
        epilogue: Epilogue,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        debug_assert!(self.serves_range(lo, hi) && x.len() >= m * self.k);
        debug_assert!(residual.is_none_or(|r| r.len() == m * (hi - lo) && epilogue == Epilogue::Identity));
        if m == 0 {
            return Vec::new();
        }
        let xb = self.paired_inputs(&x[..m * self.k]);
        #[cfg(target_arch = "x86_64")]
        if self.isa >= Isa::Avx2 && m == 1 {
            let mut out = self.one_row(panels, x, xb.as_deref(), (lo, hi));
            epilogue.apply(self.isa, &mut out);
            if let Some(residual) = residual {
                for (y, r) in out.iter_mut().zip(residual) {
                    *y += r;
                }
            }
            return out;
        }
        self.tiles(
            panels,
            (x, (self.k, 1)),
            xb.as_deref(),
            m,
            (lo, hi),
            epilogue,
            residual,
        )
    }

    /// `xᵀ · wᵀ` over f32 panels: the call's `m` rows are the columns of
    /// `x`, `k` rows of `m` floats, read in place on AVX-512 (or
    /// AVX512-BF16), through a transposed copy on AVX2 (whose tiles read
    /// rows only). `None` where the panels or the instruction set do not
    /// serve it.
    pub(crate) fn forward_transposed(&self, x: &[f32], m: usize) -> Option<Vec<f32>> {
        let PanelData::F32(panels) = &self.panels else {
            return None;
        };
        #[cfg(target_arch = "x86_64")]
        if m > 0 && x.len() >= m * self.k && self.isa == Isa::Avx2 {
            let k = self.k;
            let mut xt = vec![0f32; m * k];
            // Columns e..e + 8 of the copy (rows e.. of `x`) a transpose,
            // 64 of them an item.
            const ITEM: usize = 64;
            let at = SyncPtr(xt.as_mut_ptr());
            par_for(k.div_ceil(ITEM), m * k, |i| {
                for e in (i * ITEM..((i + 1) * ITEM).min(k)).step_by(8) {
                    let lanes = (k - e).min(8);
                    let mut rows: [&[f32]; 8] = [&[]; 8];
                    for (r, row) in (e..e + lanes).zip(&mut rows) {
                        *row = &x[r * m..][..m];
                    }
                    let rows = &rows[..lanes];
                    // SAFETY: the layer was packed for AVX2, which the CPU
                    // runs; rows of `m` floats; the copy holds `m` rows of
                    // `k`, and this item alone writes its columns `e..e +
                    // lanes` (8 at once, fewer at the end value by value).
                    unsafe {
                        match lanes {
                            8 => transpose_into(rows, m, 1., at.get().add(e), k, 8),
                            _ => {
                                for (c, row) in rows.iter().enumerate() {
                                    for (r, &v) in row.iter().enumerate() {
                                        *at.get().add(r * k + e + c) = v;
                                    }
                                }
                            }
                        }
                    }
                }
            });
            let out = self.tiles(
                panels.get(),
                (&xt, (k, 1)),
                None,
                m,
                (0, self.dims().0),
                Epilogue::Identity,
                None,
            );
            return Some(out);
        }
        #[cfg(target_arch = "x86_64")]
        if m > 0 && x.len() >= m * self.k && matches!(self.isa, Isa::Avx512 | Isa::Avx512Bf16) {
            let out = self.tiles(
                panels.get(),
                (x, (1, m)),
                None,
                m,
                (0, self.dims().0),
                Epilogue::Identity,
                None,
            );
            return Some(out);
        }
        let _ = (panels, x, m);
        None
    }

    /// `x` rounded to bf16 where the panels are bf16 in input pairs, for
    /// `vdpbf16ps` (`avx512bf16.rs`); else `None`, the kernels reading `x`
    /// as it is.
    fn paired_inputs(&self, x: &[f32]) -> Option<Vec<bf16>> {
        if !self.rounds_inputs() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // Chunks of whole vectors, over the pool where the input is
            // large: one thread's pass over a call of many rows would
            // take a sizeable share of the layer's time.
            const CHUNK: usize = 1 << 14;
            let mut xb = vec![bf16::ZERO; x.len()];
            par_chunks_mut(&mut xb, CHUNK, x.len(), |i, xb| {
                // SAFETY: the panels are paired only for `Isa::Avx512Bf16`,
                // which was current, so detected, when they were packed.
                unsafe { super::avx512bf16::round(piece(x, CHUNK, i), xb) }
            });
            Some(xb)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("panels are paired only for AVX512-BF16")
    }

    /// [`PackedWeight::forward`] of `m` rows (`m > 0`) over `panels`, the
    /// tiles reading `xb`, `x` rounded to bf16, where the panels are paired;
    /// row `r`'s input `e` at `x[r·x_rs + e·x_cs]` (`x_cs` 1 but for
    /// [`PackedWeight::forward_transposed`], on AVX-512 only).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tiles<E: PanelElem>(
        &self,
        panels: &[E],
        (x, (x_rs, x_cs)): (&[f32], (usize, usize)),
        xb: Option<&[bf16]>,
        m: usize,
        (lo, hi): (usize, usize),
        epilogue: Epilogue,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let (nr, k, width) = (self.nr(), self.k, hi - lo);
        let mut out: Vec<f32> = Vec::with_capacity(m * width);
        // Both read the rows of x in place, in groups of `mr`. A tile
        // covers `tp` panels.
        #[cfg(target_arch = "x86_64")]
        let tile = super::avx512::LinearTile::for_rows(m);
        let (mr, tp) = match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 => tile.shape(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => (crate::panel::MR, 1),
            _ => unreachable!("weights are only packed for a SIMD instruction set"),
        };
        // Half-precision panels that the tiles would widen as they load
        // them are widened once a slice into f32 panels where a unit has
        // several row groups, which then all run f32 tiles over them, on
        // processors where that measures faster (`calibrate.rs`): a tile
        // widening its panels does so again for every row group, which
        // costs more than one pass where FMAs are the limit, and less
        // where the panels' half size in the caches counts for more. A
        // call of one row group (a decode step) widens as it loads: its
        // weights are read once, and their bytes are its limit.
        let widens = std::mem::size_of::<E>() < 4
            && xb.is_none()
            && m > mr
            && self
                .widen_once
                .unwrap_or_else(|| super::calibrate::widening_once_pays(self.isa));
        // Slices of the reduction of at most `slice_len` inputs (of the
        // element the tiles read), of equal length, even where the inputs
        // go in pairs.
        let elem_bytes = if widens { 4 } else { std::mem::size_of::<E>() };
        let kc_max = k.div_ceil(k.div_ceil(slice_len(self.isa, elem_bytes)));
        let kc_max = if xb.is_some() {
            kc_max.next_multiple_of(2)
        } else {
            kc_max
        };
        let groups = m.div_ceil(mr);
        let (p_lo, p_hi) = (lo / nr, hi.div_ceil(nr));
        let threads = if m * width * k > PARALLEL_FROM {
            threads()
        } else {
            1
        };
        let (ppu, gpu) = unit_shape(p_hi - p_lo, groups, nr, tp, threads, kc_max < k);
        let units: Vec<(usize, usize)> = (p_lo..p_hi)
            .step_by(ppu)
            .flat_map(|p0| (0..groups).step_by(gpu).map(move |g0| (p0, g0)))
            .collect();
        let out_ptr = SyncPtr(out.as_mut_ptr());
        // The pair of panel slices a tile spanning panels `q..q + tp`
        // reads from input `e` on, a panel at or past `end` left out.
        #[cfg(target_arch = "x86_64")]
        let panel_pair = |q: usize, end: usize, e: usize| -> [*const E; 2] {
            let at = |q: usize| match q < end {
                true => panels[q * k * nr + e * nr..].as_ptr(),
                false => std::ptr::null(),
            };
            [at(q), if tp > 1 { at(q + 1) } else { std::ptr::null() }]
        };
        let run = |u: usize| {
            let (p0, g0) = units[u];
            let out = out_ptr.get();
            let g1 = (g0 + gpu).min(groups);
            let p1 = (p0 + ppu).min(p_hi);
            // What an AVX-512 tile at slice `k0` of row group `g` and panel
            // `p` prefetches into L2 as it runs, a panel row a step. In a unit
            // of one row group, which reads each panel slice once and is
            // bound by fetching them: the unit's next tile, else the next
            // slice's first, else the next unit's (the next a thread runs,
            // but at the end of its share). In a unit of more: the first
            // row group, which reads the slice from memory, its own panels
            // `AHEAD` steps on; the later ones reuse the slice from L2,
            // where the hardware's prefetch serves them.
            #[cfg(target_arch = "x86_64")]
            let prefetch = |k0: usize, kc: usize, g: usize, p: usize| {
                let next = if g1 - g0 > 1 {
                    None
                } else if p + tp < p1 {
                    Some((p + tp, p1, k0))
                } else if k0 + kc < k {
                    Some((p0, p1, k0 + kc))
                } else {
                    units.get(u + 1).map(|&(q0, _)| (q0, (q0 + ppu).min(p_hi), 0))
                };
                match next {
                    Some((q, end, k1)) => (panel_pair(q, end, k1), kc_max.min(k - k1).min(kc)),
                    None if g == g0 => (panel_pair(p, p1, k0 + AHEAD.min(kc)), kc.saturating_sub(AHEAD)),
                    None => ([std::ptr::null(); 2], 0),
                }
            };
            // The unit's panel slices widened to f32, 64-byte aligned, where
            // it widens them.
            let mut widened = WIDENED.take();
            let widen_unit = widens && g1 - g0 > 1;
            if widen_unit {
                widened.resize((p1 - p0) * kc_max * nr + 16, 0.);
            }
            let w_at = widened.as_ptr().align_offset(64).min(16);
            // Slice-major, then row groups, then tiles: a row group's slice
            // of inputs stays in L1 while the unit's panel slices (at most
            // `slice_len · UNIT_FEATURES` elements) stream past it from L2.
            for k0 in (0..k).step_by(kc_max) {
                let kc = kc_max.min(k - k0);
                if widen_unit {
                    for p in p0..p1 {
                        E::widen(
                            &panels[p * k * nr + k0 * nr..][..kc * nr],
                            &mut widened[w_at + (p - p0) * kc * nr..][..kc * nr],
                        );
                    }
                }
                // Panel p's slice in f32, where the unit widened them.
                let wide = |p: usize| widen_unit.then(|| widened[w_at + (p - p0) * kc * nr..].as_ptr());
                for g in g0..g1 {
                    let rows = mr.min(m - g * mr);
                    for p in (p0..p1).step_by(tp) {
                        let (c0, cols) = ((p - p_lo) * nr, (tp * nr).min(hi - p * nr));
                        let w = panels[p * k * nr + k0 * nr..].as_ptr();
                        let xg = x[g * mr * x_rs + k0 * x_cs..].as_ptr();
                        // SAFETY: rows g·mr.. (`rows` of them) and columns
                        // c0..c0 + cols of the m × width output are this
                        // unit's alone and in bounds; the first slice
                        // writes them before later ones read them; the
                        // kernels read in-bounds inputs, panel p's slice
                        // and the residual's block of the same rows and
                        // columns (`m × width`); `self.isa` was current, so
                        // detected, when packing.
                        unsafe {
                            let dst = out.add(g * mr * width + c0);
                            // The first slice starts from the bias, and
                            // from the residual's rows where there is one;
                            // later ones from the output itself.
                            let (bias, res) = if k0 == 0 {
                                let res =
                                    residual.map_or(std::ptr::null(), |r| r[g * mr * width + c0..].as_ptr());
                                (self.bias[p * nr..].as_ptr(), (res, width))
                            } else {
                                (std::ptr::null(), (std::ptr::null(), width))
                            };
                            match self.isa {
                                #[cfg(target_arch = "x86_64")]
                                Isa::Avx512 | Isa::Avx512Bf16 => {
                                    use super::avx512::{linear_tile, Tile, Widen};
                                    let (pf, pf_steps) = prefetch(k0, kc, g, p);
                                    macro_rules! tile {
                                        ($x:expr, $w:expr, $w_next:expr, $pf:expr) => {
                                            Tile {
                                                cols,
                                                kc,
                                                x: $x,
                                                x_rs,
                                                x_cs,
                                                w: $w.cast(),
                                                w_next: $w_next,
                                                init: bias,
                                                res: res.0,
                                                res_rs: res.1,
                                                out: dst,
                                                out_rs: width,
                                                pf: $pf.map(|pf| pf.cast()),
                                                pf_steps,
                                            }
                                        };
                                    }
                                    match (&xb, wide(p)) {
                                        // Paired panels are bf16.
                                        (Some(xb), _) => linear_tile::<super::avx512bf16::Pairs>(
                                            tile,
                                            rows,
                                            &tile!(xb[g * mr * k + k0..].as_ptr(), w, k * nr, pf),
                                        ),
                                        // The unit's slices are in L2: nothing
                                        // to prefetch.
                                        (None, Some(wf)) => linear_tile::<Widen<f32>>(
                                            tile,
                                            rows,
                                            &tile!(xg, wf, kc * nr, [std::ptr::null::<f32>(); 2]),
                                        ),
                                        (None, None) => {
                                            linear_tile::<Widen<E>>(tile, rows, &tile!(xg, w, k * nr, pf))
                                        }
                                    }
                                }
                                _ => {
                                    debug_assert_eq!(x_cs, 1, "a transposed input runs on AVX-512");
                                    match wide(p) {
                                        Some(wf) => {
                                            self.avx2_tile(rows, cols, xg, kc, wf, (bias, res), dst, width)
                                        }
                                        None => {
                                            self.avx2_tile(rows, cols, xg, kc, w, (bias, res), dst, width)
                                        }
                                    }
                                }
                            }
                            if k0 + kc == k && epilogue != Epilogue::Identity {
                                for r in 0..rows {
                                    epilogue.apply(
                                        self.isa,
                                        std::slice::from_raw_parts_mut(dst.add(r * width), cols),
                                    );
                                }
                            }
                        }
                    }
                }
            }
            WIDENED.set(widened);
        };
        if threads > 1 {
            par_for(units.len(), m * width * k, run);
        } else {
            (0..units.len()).for_each(run);
        }
        // SAFETY: the units cover every (row, panel) block of the output.
        unsafe { out.set_len(m * width) };
        out
    }

    /// One AVX2 micro-kernel call: `rows` rows of outputs = `bias` plus,
    /// where `res` is not null, the residual's rows `res.1` apart (or, with
    /// a null bias, the outputs themselves) + their `kc` inputs times one
    /// panel slice; the AVX2 kernel accumulates onto its output, so the
    /// start is written there first, and a panel cut short by the output's
    /// end goes through a buffer.
    ///
    /// # Safety
    /// The extents are in bounds, and `self.isa` runs on this processor.
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx2_tile<E: PanelElem>(
        &self,
        rows: usize,
        cols: usize,
        x: *const f32,
        kc: usize,
        w: *const E,
        (bias, res): (*const f32, (*const f32, usize)),
        out: *mut f32,
        out_rs: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::panel::avx2::product;
            use crate::panel::{MR, NR};
            debug_assert!(self.isa == Isa::Avx2 && rows <= MR);
            // SAFETY: rows × cols of `out` and of a non-null residual, and
            // `cols` of `bias`, are in bounds; the tile holds MR × NR.
            unsafe {
                // Row r's start, `cols` floats, written at `dst`.
                let start = |r: usize, dst: *mut f32| {
                    if bias.is_null() {
                        std::ptr::copy(out.add(r * out_rs), dst, cols);
                    } else if res.0.is_null() {
                        std::ptr::copy_nonoverlapping(bias, dst, cols);
                    } else {
                        for c in 0..cols {
                            dst.add(c).write(*res.0.add(r * res.1 + c) + *bias.add(c));
                        }
                    }
                };
                if cols == NR {
                    if !bias.is_null() {
                        for r in 0..rows {
                            start(r, out.add(r * out_rs));
                        }
                    }
                    product::<true, E>(rows, x, self.k, kc, w, 1, out, out_rs, None);
                    return;
                }
                let mut tile = [0f32; MR * NR];
                for r in 0..rows {
                    start(r, tile.as_mut_ptr().add(r * NR));
                }
                product::<true, E>(rows, x, self.k, kc, w, 1, tile.as_mut_ptr(), NR, None);
                for r in 0..rows {
                    std::ptr::copy_nonoverlapping(tile.as_ptr().add(r * NR), out.add(r * out_rs), cols);
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (rows, cols, x, kc, w, bias, out, out_rs);
            unreachable!("weights are only packed for a SIMD instruction set")
        }
    }
}
