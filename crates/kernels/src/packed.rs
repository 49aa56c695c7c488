//! Linear layers whose weight is packed once, when the layer is built, into
//! the micro-kernels' panel layout: `x · wᵀ + b` without the per-call
//! packing a general GEMM does, with the bias and optionally the exact GELU
//! or ReLU applied while the output block is still in cache.
//!
//! The weight `(n, k)` (PyTorch's `(out, in)`) becomes `ceil(n / nr)`
//! panels of `k × nr` elements, output feature `p·nr + c`'s input `e` at
//! `p·k·nr + e·nr + c`, zero past `n`, 64-byte aligned, in f32, bf16 or
//! f16 (`elem.rs`: the micro-kernels widen half-precision panels to f32 as
//! they load them and accumulate in f32, so they read half the bytes),
//! where `nr` is the width of the instruction set's micro-kernel:
//! - **AVX2**: panels of 16 for the attention's 6 × 16 micro-kernel
//!   (`avx2.rs`), which reads the rows of `x` in place;
//! - **AVX-512**: panels of 32 for two `zmm` micro-kernels (`avx512.rs`):
//!   12 rows by one panel for calls of up to 12 rows, 6 rows by two
//!   panels for more ([`crate::avx512::LinearTile`]), which read the rows
//!   of `x` in place too, in groups of 12 or 6 (no per-call packing of the
//!   inputs);
//! - **AVX512-BF16**: AVX-512's panels, but bf16 weights over an even
//!   number of inputs interleave their inputs in pairs for `vdpbf16ps`
//!   (`avx512bf16.rs`), and a call rounds its inputs to bf16 once.
//!
//! A single row (a decoder's step) takes each set's `one_row`, which
//! streams each panel once with 8 accumulators and a software prefetch
//! (on AVX2 of half-precision panels only: f32 ones are left to the
//! hardware prefetcher).
//!
//! A work unit is a block of panels (`UNIT_FEATURES` features at most)
//! by a block of row groups (`units.rs`): with more than one thread, at
//! most `CHUNK_GROUPS` of them where the reduction is one slice, so that a
//! thread that finishes first takes over the rest of the other's share;
//! inside it, as in BLIS and `gemm`, one row group's slice of the
//! inputs stays in L1 while the unit's panel slices stream past it from
//! L2, where they stay across the row groups. On AVX-512 the tiles
//! prefetch weights into L2 as they run: in a unit of one row group (a
//! decoder's step at batch ≤ 12) the next tile's, in the first row group
//! of a unit of more their own, `AHEAD` steps on. Units run on the
//! threads of [`crate::pool::par_for`]. The bias (or the residual) starts the accumulators, and the
//! epilogue (GELU or ReLU) runs on each tile as its last slice is written,
//! while it is in L1.

mod panels;
mod units;

use candle::{DType, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::elem::PanelElem;
use crate::isa::Isa;
use crate::pool::{par_for, SyncPtr};
use crate::simd;
use panels::Panels;
use units::{slice_len, unit_shape};

/// Multiply-adds (or floats packed) from which a call's work is spread
/// over the threads ([`crate::pool::par_for`]).
pub(crate) const PARALLEL_FROM: usize = 1 << 16;

/// Steps (inputs) ahead of itself that a tile of a unit's first row group
/// prefetches its panels: 4 KiB a panel on AVX-512, into the next page,
/// where the hardware's stream prefetch stops (weights cold in memory, as
/// a model's layers are one after another).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 32;

/// Output features per panel for `isa`.
fn panel_width(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => crate::avx512::LINEAR_NR,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::panel::NR,
        _ => 16,
    }
}

/// Whether weights packed for `isa` in `dtype` over `k` inputs go in input
/// pairs (`avx512bf16.rs`), their layers rounding their inputs to bf16:
/// AVX512-BF16 multiplies bf16 weights in pairs, where the inputs pair up.
fn pairs_inputs(isa: Isa, dtype: DType, k: usize) -> bool {
    isa == Isa::Avx512Bf16 && dtype == DType::BF16 && k.is_multiple_of(2)
}

/// What the write-out applies after the bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// Nothing.
    Identity,
    /// `x · Φ(x)`, the exact GELU (PyTorch's `approximate='none'`).
    GeluErf,
    /// The tanh GELU (PyTorch's `approximate='tanh'`, HF's `gelu_new`).
    GeluTanh,
    /// `max(x, 0)`, NaN kept (PyTorch's `relu`).
    Relu,
}

impl Epilogue {
    /// Applies the epilogue to `xs` in place.
    pub(crate) fn apply(self, xs: &mut [f32]) {
        match self {
            Epilogue::Identity => {}
            Epilogue::GeluErf => simd::gelu_erf(xs),
            Epilogue::GeluTanh => simd::gelu_tanh(xs),
            Epilogue::Relu => simd::relu(xs),
        }
    }
}

/// The panels in the dtype they were packed in.
enum PanelData {
    F32(Panels<f32>),
    Bf16(Panels<bf16>),
    F16(Panels<f16>),
}

/// `$body` with `$p` bound to the [`Panels`] of whichever dtype `$data`
/// holds: code written once over [`PanelElem`], instantiated per dtype.
macro_rules! on_panels {
    ($data:expr, $p:ident => $body:expr) => {
        match $data {
            PanelData::F32($p) => $body,
            PanelData::Bf16($p) => $body,
            PanelData::F16($p) => $body,
        }
    };
}

/// A weight and bias in panel layout, for the instruction set it was
/// packed for: the weight in f32, bf16 or f16, the bias in f32.
pub(crate) struct PackedWeight {
    panels: PanelData,
    /// `np` floats, zero past `n` (all zero without a bias).
    bias: Vec<f32>,
    has_bias: bool,
    n: usize,
    k: usize,
    isa: Isa,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("out", &self.n)
            .field("in", &self.k)
            .field("dtype", &self.dtype())
            .field("bias", &self.has_bias)
            .field("isa", &self.isa)
            .finish()
    }
}

impl PackedWeight {
    /// The instruction set a weight packed now would run with, if any
    /// kernel serves this processor.
    pub(crate) fn isa() -> Option<Isa> {
        match crate::isa::current() {
            Isa::Portable => None,
            isa => Some(isa),
        }
    }

    /// Output features per panel.
    fn nr(&self) -> usize {
        panel_width(self.isa)
    }

    /// Packs `w`, `n` rows of `k` elements, into panels of `dtype` (F32,
    /// BF16 or F16; each element rounded to it), and `bias` (`n` floats),
    /// for `isa` (from [`PackedWeight::isa`]); `n, k > 0`.
    pub(crate) fn new<S: PanelElem>(
        w: &[S],
        n: usize,
        k: usize,
        bias: Option<&[f32]>,
        isa: Isa,
        dtype: DType,
    ) -> Result<Self> {
        let nr = panel_width(isa);
        let np = n.div_ceil(nr) * nr;
        let mut b = vec![0f32; np];
        if let Some(bias) = bias {
            b[..n].copy_from_slice(bias);
        }
        let paired = pairs_inputs(isa, dtype, k);
        let panels = match dtype {
            DType::F32 => PanelData::F32(Panels::pack(w, n, k, nr, false)),
            DType::BF16 => PanelData::Bf16(Panels::pack(w, n, k, nr, paired)),
            DType::F16 => PanelData::F16(Panels::pack(w, n, k, nr, false)),
            other => candle::bail!("PackedLinear: weights cannot be packed as {other:?} (f32, bf16 or f16)"),
        };
        Ok(PackedWeight {
            panels,
            bias: b,
            has_bias: bias.is_some(),
            n,
            k,
            isa,
        })
    }

    /// Its output features, then `other`'s, `other`'s panels copied after
    /// its own as they are (a missing bias as zeros); given back unchanged
    /// unless both are packed for the same instruction set, in the same
    /// dtype, over the same inputs, and its features fill whole panels.
    pub(crate) fn join(self, other: &Self) -> std::result::Result<Self, Self> {
        let (nr, k) = (self.nr(), self.k);
        if self.isa != other.isa || other.k != k || !self.n.is_multiple_of(nr) {
            return Err(self);
        }
        let (la, lb) = (self.n * k, other.n.div_ceil(nr) * nr * k);
        let panels = match (self.panels, &other.panels) {
            (PanelData::F32(a), PanelData::F32(b)) => PanelData::F32(a.extend(la, b, lb)),
            (PanelData::Bf16(a), PanelData::Bf16(b)) => PanelData::Bf16(a.extend(la, b, lb)),
            (PanelData::F16(a), PanelData::F16(b)) => PanelData::F16(a.extend(la, b, lb)),
            (panels, _) => return Err(PackedWeight { panels, ..self }),
        };
        let mut bias = self.bias;
        bias.truncate(self.n);
        bias.extend_from_slice(&other.bias);
        Ok(PackedWeight {
            panels,
            bias,
            has_bias: self.has_bias || other.has_bias,
            n: self.n + other.n,
            k,
            isa: self.isa,
        })
    }

    /// Whether [`PackedWeight::forward`] rounds its inputs to bf16: the
    /// panels are bf16 in input pairs, for `vdpbf16ps`.
    pub(crate) fn rounds_inputs(&self) -> bool {
        pairs_inputs(self.isa, self.dtype(), self.k)
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
            let mut xb = vec![bf16::ZERO; x.len()];
            // SAFETY: the panels are paired only for `Isa::Avx512Bf16`,
            // which was current, so detected, when they were packed.
            unsafe { crate::avx512bf16::round(x, &mut xb) };
            Some(xb)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("panels are paired only for AVX512-BF16")
    }

    /// The dtype the panels hold.
    pub(crate) fn dtype(&self) -> DType {
        match self.panels {
            PanelData::F32(_) => DType::F32,
            PanelData::Bf16(_) => DType::BF16,
            PanelData::F16(_) => DType::F16,
        }
    }

    /// `(out_features, in_features)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The weight, `n` rows of `k` floats, and the bias.
    pub(crate) fn unpack(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let ids: Vec<u32> = (0..self.n as u32).collect();
        (
            self.rows(&ids),
            self.has_bias.then(|| self.bias[..self.n].to_vec()),
        )
    }

    /// Rows `ids` of the weight (each `< n`), one after another, as f32:
    /// the lookup of an embedding table tied to this layer.
    pub(crate) fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let (nr, k, paired) = (self.nr(), self.k, self.rounds_inputs());
        let mut out = vec![0f32; ids.len() * k];
        on_panels!(&self.panels, p => out
            .par_chunks_mut(k)
            .zip(ids)
            .for_each(|(row, &j)| p.row_into(j as usize, nr, paired, row)));
        out
    }

    /// The layer times a per-feature scale: each output feature's weights
    /// and bias times `gamma[feature]` (`n` floats), packed anew for the
    /// same instruction set and dtype.
    pub(crate) fn scaled(&self, gamma: &[f32]) -> Result<PackedWeight> {
        let (mut w, bias) = self.unpack();
        for (row, &g) in w.chunks_exact_mut(self.k).zip(gamma) {
            row.iter_mut().for_each(|x| *x *= g);
        }
        let bias = bias.map(|b| b.iter().zip(gamma).map(|(b, g)| b * g).collect::<Vec<_>>());
        PackedWeight::new(&w, self.n, self.k, bias.as_deref(), self.isa, self.dtype())
    }

    /// Whether output features `lo..hi` are whole panels (or end at `n`),
    /// so that [`PackedWeight::forward`] can compute them alone.
    pub(crate) fn serves_range(&self, lo: usize, hi: usize) -> bool {
        let nr = self.nr();
        lo < hi && hi <= self.n && lo.is_multiple_of(nr) && (hi.is_multiple_of(nr) || hi == self.n)
    }

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
        let (nr, k, width) = (self.nr(), self.k, hi - lo);
        debug_assert!(self.serves_range(lo, hi) && x.len() >= m * k);
        debug_assert!(residual.is_none_or(|r| r.len() == m * width && epilogue == Epilogue::Identity));
        let mut out: Vec<f32> = Vec::with_capacity(m * width);
        if m == 0 {
            return out;
        }
        let xb = self.paired_inputs(&x[..m * k]);
        #[cfg(target_arch = "x86_64")]
        if self.isa >= Isa::Avx2 && m == 1 {
            self.one_row(panels, x, xb.as_deref(), (lo, hi), &mut out);
            // SAFETY: one_row wrote the row's `width` floats.
            unsafe { out.set_len(width) };
            epilogue.apply(&mut out);
            if let Some(residual) = residual {
                for (y, r) in out.iter_mut().zip(residual) {
                    *y += r;
                }
            }
            return out;
        }
        // Both read the rows of x in place, in groups of `mr`. A tile
        // covers `tp` panels.
        #[cfg(target_arch = "x86_64")]
        let tile = crate::avx512::LinearTile::for_rows(m);
        let (mr, tp) = match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 => tile.shape(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => (crate::avx2::MR, 1),
            _ => unreachable!("weights are only packed for a SIMD instruction set"),
        };
        // Slices of the reduction of at most `slice_len` inputs, of equal
        // length, even where the inputs go in pairs.
        let kc_max = k.div_ceil(k.div_ceil(slice_len(self.isa)));
        let kc_max = if xb.is_some() {
            kc_max.next_multiple_of(2)
        } else {
            kc_max
        };
        let groups = m.div_ceil(mr);
        let (p_lo, p_hi) = (lo / nr, hi.div_ceil(nr));
        let threads = if m * width * k > PARALLEL_FROM {
            rayon::current_num_threads()
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
            // but where rayon splits the range). In a unit of more: the
            // first row group, which reads the slice from memory, its own
            // panels `AHEAD` steps on; the later ones reuse the slice from
            // L2, where the hardware's prefetch serves them.
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
            // Slice-major, then row groups, then tiles: a row group's slice
            // of inputs stays in L1 while the unit's panel slices (at most
            // `slice_len · UNIT_FEATURES` floats) stream past it from L2.
            for k0 in (0..k).step_by(kc_max) {
                let kc = kc_max.min(k - k0);
                for g in g0..g1 {
                    let rows = mr.min(m - g * mr);
                    for p in (p0..p1).step_by(tp) {
                        let (c0, cols) = ((p - p_lo) * nr, (tp * nr).min(hi - p * nr));
                        let w = panels[p * k * nr + k0 * nr..].as_ptr();
                        let xg = x[g * mr * k + k0..].as_ptr();
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
                                    use crate::avx512::{linear_tile, Tile, Widen};
                                    let (pf, pf_steps) = prefetch(k0, kc, g, p);
                                    macro_rules! tile {
                                        ($x:expr) => {
                                            Tile {
                                                cols,
                                                kc,
                                                x: $x,
                                                x_rs: k,
                                                w: w.cast(),
                                                w_next: k * nr,
                                                init: bias,
                                                res: res.0,
                                                res_rs: res.1,
                                                out: dst,
                                                out_rs: width,
                                                pf: pf.map(|pf| pf.cast()),
                                                pf_steps,
                                            }
                                        };
                                    }
                                    match &xb {
                                        // Paired panels are bf16.
                                        Some(xb) => linear_tile::<crate::avx512bf16::Pairs>(
                                            tile,
                                            rows,
                                            &tile!(xb[g * mr * k + k0..].as_ptr()),
                                        ),
                                        None => linear_tile::<Widen<E>>(tile, rows, &tile!(xg)),
                                    }
                                }
                                _ => self.avx2_tile(rows, cols, xg, kc, w, (bias, res), dst, width),
                            }
                            if k0 + kc == k && epilogue != Epilogue::Identity {
                                for r in 0..rows {
                                    epilogue.apply(std::slice::from_raw_parts_mut(dst.add(r * width), cols));
                                }
                            }
                        }
                    }
                }
            }
        };
        if threads > 1 {
            (0..units.len()).into_par_iter().for_each(run);
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
            use crate::avx2::MR;
            use crate::panel::NR;
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
                    crate::avx2::scores::<true, E>(rows, x, self.k, kc, w, 1, out, out_rs, None);
                    return;
                }
                let mut tile = [0f32; MR * NR];
                for r in 0..rows {
                    start(r, tile.as_mut_ptr().add(r * NR));
                }
                crate::avx2::scores::<true, E>(rows, x, self.k, kc, w, 1, tile.as_mut_ptr(), NR, None);
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

    /// `x · wᵀ + b` for one row and output features `lo..hi`, into `out`'s
    /// spare capacity: the panels split into one run per thread; `xb` is
    /// `x` rounded to bf16 where the panels are paired.
    #[cfg(target_arch = "x86_64")]
    fn one_row<E: PanelElem>(
        &self,
        panels: &[E],
        x: &[f32],
        xb: Option<&[bf16]>,
        (lo, hi): (usize, usize),
        out: &mut Vec<f32>,
    ) {
        let (nr, k, width) = (self.nr(), self.k, hi - lo);
        debug_assert!(out.capacity() >= width);
        let n_panels = width.div_ceil(nr);
        let tasks = if width * k > PARALLEL_FROM {
            rayon::current_num_threads().min(n_panels)
        } else {
            1
        };
        let per_task = n_panels.div_ceil(tasks) * nr;
        let out_ptr = SyncPtr(out.as_mut_ptr());
        par_for(width.div_ceil(per_task), width * k, |t| {
            let c0 = t * per_task;
            let (w, cols) = (
                panels[(lo + c0) / nr * k * nr..].as_ptr(),
                per_task.min(width - c0),
            );
            let (bias, out) = (self.bias[lo + c0..].as_ptr(), out_ptr.get().wrapping_add(c0));
            // SAFETY: this task's columns c0.. of the output are its own;
            // x holds k floats; panels from (lo + c0) / nr on cover the
            // columns, and the bias their panels' floats; `self.isa`, AVX2
            // (with FMA and F16C), AVX-512 or AVX512-BF16 (which paired
            // panels need), was detected when packed.
            unsafe {
                use crate::avx512::{Dot, Row, Widen};
                let init = bias;
                match (self.isa, xb) {
                    // Paired panels are bf16 over an even `k`.
                    (_, Some(xb)) => crate::avx512bf16::Pairs::one_row(&Row {
                        x: xb.as_ptr(),
                        k,
                        w: w.cast(),
                        cols,
                        init,
                        out,
                    }),
                    (Isa::Avx512 | Isa::Avx512Bf16, None) => Widen::<E>::one_row(&Row {
                        x: x.as_ptr(),
                        k,
                        w,
                        cols,
                        init,
                        out,
                    }),
                    _ => crate::avx2::one_row(x.as_ptr(), k, w, cols, init, out),
                }
            };
        });
    }
}
