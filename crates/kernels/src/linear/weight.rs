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
//!   panels for more ([`super::avx512::LinearTile`]), which read the rows
//!   of `x` in place too, in groups of 12 or 6 (no per-call packing of the
//!   inputs);
//! - **AVX512-BF16**: AVX-512's panels, but bf16 weights over an even
//!   number of inputs interleave their inputs in pairs for `vdpbf16ps`
//!   (`avx512bf16.rs`), and a call rounds its inputs to bf16 once.
//!
//! A call (`tiles.rs`) streams each panel once for a single row (a
//! decoder's step, `one_row.rs`), or goes in work units of panels by row
//! groups (`tiles.rs`, `units.rs`).

use candle::{DType, Result};
use half::{bf16, f16};

use super::pack::Panels;
use crate::elem::PanelElem;
use crate::rows::simd;
use crate::runtime::isa::Isa;
use crate::runtime::pool::par_chunks_mut;

/// Output features per panel for `isa`.
fn panel_width(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => super::avx512::LINEAR_NR,
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
    /// Applies the epilogue to `xs` in place, on `isa`.
    pub(crate) fn apply(self, isa: Isa, xs: &mut [f32]) {
        match self {
            Epilogue::Identity => {}
            Epilogue::GeluErf => simd::gelu_erf(isa, xs),
            Epilogue::GeluTanh => simd::gelu_tanh(isa, xs),
            Epilogue::Relu => simd::relu(isa, xs),
        }
    }
}

/// The panels in the dtype they were packed in.
pub(super) enum PanelData {
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
pub(super) use on_panels;

/// A weight and bias in panel layout, for the instruction set it was
/// packed for: the weight in f32, bf16 or f16, the bias in f32.
pub(crate) struct PackedWeight {
    pub(super) panels: PanelData,
    /// `np` floats, zero past `n` (all zero without a bias).
    pub(super) bias: Vec<f32>,
    has_bias: bool,
    n: usize,
    pub(super) k: usize,
    pub(super) isa: Isa,
    /// Whether half-precision panels are widened to f32 once a unit (see
    /// [`PackedWeight::tiles`]) rather than as the tiles load them; `None`:
    /// as `calibrate.rs` measured for the instruction set.
    pub(super) widen_once: Option<bool>,
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
    /// The instruction set a weight packed for `isa` runs with, if any
    /// kernel serves it.
    pub(crate) fn isa_for(isa: Isa) -> Option<Isa> {
        match isa {
            Isa::Portable => None,
            isa => Some(isa),
        }
    }

    /// Output features per panel.
    pub(super) fn nr(&self) -> usize {
        panel_width(self.isa)
    }

    /// Packs `w`, `n` rows of `k` elements, into panels of `dtype` (F32,
    /// BF16 or F16; each element rounded to it), and `bias` (`n` floats),
    /// for `isa` (from [`PackedWeight::isa_for`]); `n, k > 0`.
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
            DType::F32 => PanelData::F32(Panels::pack(w, n, k, nr, false, isa)),
            DType::BF16 => PanelData::Bf16(Panels::pack(w, n, k, nr, paired, isa)),
            DType::F16 => PanelData::F16(Panels::pack(w, n, k, nr, false, isa)),
            other => candle::bail!("PackedLinear: weights cannot be packed as {other:?} (f32, bf16 or f16)"),
        };
        Ok(PackedWeight {
            panels,
            bias: b,
            has_bias: bias.is_some(),
            n,
            k,
            isa,
            widen_once: None,
        })
    }

    /// The weight with its half-precision panels widened once a unit
    /// (`once`) or as the tiles load them, whatever `calibrate.rs`
    /// measured: what the calibration times, and the tests check.
    pub(super) fn widening_once(self, once: bool) -> Self {
        PackedWeight {
            widen_once: Some(once),
            ..self
        }
    }

    /// The weight `aᵀ` in f32 for `isa` (from [`PackedWeight::isa_for`]),
    /// without a bias, `a` being `r` rows of `c` floats (`r, c > 0`): a
    /// layer of `c` output features over `r` inputs whose product of rows
    /// `x` is `x · a`: the product a linear layer's backward takes with its
    /// weight (`dY · W`).
    pub(crate) fn from_columns(a: &[f32], r: usize, c: usize, isa: Isa) -> Self {
        let nr = panel_width(isa);
        PackedWeight {
            panels: PanelData::F32(Panels::pack_columns(a, r, c, nr)),
            bias: vec![0f32; c.div_ceil(nr) * nr],
            has_bias: false,
            n: c,
            k: r,
            isa,
            widen_once: None,
        }
    }

    /// Packs `w`, `n` rows of `k` floats, and `bias` into this weight's own
    /// buffers, as [`PackedWeight::new`] packs them in f32, where it was
    /// packed so from a weight of the same shape and bias or none (a
    /// trained weight after a step); whether it did.
    pub(crate) fn repack(&mut self, w: &[f32], bias: Option<&[f32]>) -> bool {
        let (n, k, nr) = (self.n, self.k, self.nr());
        let PanelData::F32(panels) = &mut self.panels else {
            return false;
        };
        if w.len() != n * k || bias.is_some() != self.has_bias || bias.is_some_and(|b| b.len() != n) {
            return false;
        }
        panels.repack(w, n, k, nr, false, self.isa);
        if let Some(b) = bias {
            self.bias[..n].copy_from_slice(b);
        }
        true
    }

    /// [`PackedWeight::repack`] of a weight packed by
    /// [`PackedWeight::from_columns`] from an `a` of the same shape.
    pub(crate) fn repack_columns(&mut self, a: &[f32]) -> bool {
        let (c, r, nr) = (self.n, self.k, self.nr());
        match &mut self.panels {
            PanelData::F32(panels) if !self.has_bias && a.len() == r * c => {
                panels.repack_columns(a, r, c, nr);
                true
            }
            _ => false,
        }
    }

    /// Whether it holds `w`, `n` rows of `k` floats, and `bias` in f32 bit
    /// for bit, as [`PackedWeight::new`] packs them in f32: a packed copy
    /// of a weight that may have changed since (a variable a training step
    /// writes in place) is current.
    pub(crate) fn holds(&self, w: &[f32], bias: Option<&[f32]>) -> bool {
        let bits = |xs: &[f32], ys: &[f32]| xs.iter().zip(ys).all(|(x, y)| x.to_bits() == y.to_bits());
        let PanelData::F32(panels) = &self.panels else {
            return false;
        };
        let bias_held = match bias {
            Some(b) => self.has_bias && b.len() == self.n && bits(b, &self.bias),
            None => !self.has_bias,
        };
        bias_held && panels.holds_rows(w, self.n, self.k, self.nr())
    }

    /// Whether it holds `aᵀ` as [`PackedWeight::from_columns`] packs it,
    /// bit for bit.
    pub(crate) fn holds_columns(&self, a: &[f32]) -> bool {
        match &self.panels {
            PanelData::F32(panels) => !self.has_bias && panels.holds_columns(a, self.k, self.n, self.nr()),
            _ => false,
        }
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
            widen_once: self.widen_once,
        })
    }

    /// Whether [`PackedWeight::forward`] rounds its inputs to bf16: the
    /// panels are bf16 in input pairs, for `vdpbf16ps`.
    pub(crate) fn rounds_inputs(&self) -> bool {
        pairs_inputs(self.isa, self.dtype(), self.k)
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
        on_panels!(&self.panels, p => par_chunks_mut(&mut out, k, ids.len() * k, |i, row| {
            p.row_into(ids[i] as usize, nr, paired, row)
        }));
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
        serves_range(self.isa, self.n, (lo, hi))
    }
}

/// Whether a weight of `n` output features packed for `isa` serves
/// features `lo..hi` ([`PackedWeight::serves_range`]).
pub(super) fn serves_range(isa: Isa, n: usize, (lo, hi): (usize, usize)) -> bool {
    let nr = panel_width(isa);
    lo < hi && hi <= n && lo.is_multiple_of(nr) && (hi.is_multiple_of(nr) || hi == n)
}
