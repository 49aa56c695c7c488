//! `PackedLinear`: a linear layer whose weight is packed for the CPU
//! micro-kernels once, when it is built (`weight.rs`), or quantized
//! (`quant/`); its calls are `forward.rs`'s.
//!
//! - `options.rs`: [`PackOptions`], what a loader passes to every layer
//!   it builds (format, instruction set, lent blocks: `lent.rs`);
//!   `calibrate.rs` decides once whether bf16 weights take `vdpbf16ps`, and
//!   whether half-precision panels are widened once a work unit or as loaded;
//! - `weight.rs`: the packed weight and its epilogues; `pack.rs` its
//!   panels in one element type (packing, joining, reading a feature
//!   back);
//! - the driver: `tiles.rs` (a call of several rows, in work units of
//!   `units.rs`) and `one_row.rs` (a decoder's step);
//! - `trained.rs`: a weight that trains, packed again where a step changed
//!   it, its forward and backward a candle op over the same driver;
//! - the micro-kernels, leaves: `avx2.rs` (one row; the tiles are the
//!   AVX2 panel product of `panel/avx2.rs`, which the attention runs
//!   too), `avx512.rs` (tiles and one row, written once over their step)
//!   and `avx512bf16.rs` (`vdpbf16ps` as that step; it implements
//!   `avx512.rs`'s step trait and imports nothing else).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod calibrate;
mod forward;
mod lent;
#[cfg(target_arch = "x86_64")]
mod one_row;
mod options;
mod pack;
mod tiles;
mod trained;
mod units;
pub(crate) mod weight;

use std::sync::Arc;

use candle::{bail, DType, Module, Result, Tensor};

use crate::elem::plain_cpu_f32;
use crate::quant::blocks::BlockWeight;
use crate::quant::q8_0::Q8Weight;
use crate::quant::BlockFormat;
use crate::runtime::isa::{current, Isa};
pub use lent::LentBlocks;
pub use options::{PackFormat, PackOptions};
use trained::TrainedWeight;
use weight::PackedWeight;

/// `x · wᵀ + b`, `torch.nn.Linear` (weight `(out, in)`, optional bias),
/// optionally fused with the exact GELU ([`PackedLinear::forward_gelu`]).
///
/// Built from plain CPU tensors (f32, bf16 or f16 weights) on an x86-64
/// processor with AVX2+FMA or AVX-512F, it packs the weight into the
/// micro-kernels' panel layout once, in the weight's own dtype, and keeps
/// only that copy (no second resident weight); every call then runs
/// without the per-call packing a general GEMM does, with the bias and the
/// GELU applied while the output is in cache. A bf16 or f16 weight stays
/// bf16 or f16 (half the bytes to hold and to read), widened to f32 in
/// registers: the products accumulate in f32, so the layer equals the
/// f32 layer over the same (rounded) weights within float rounding. Inputs
/// are f32; bf16 and f16 inputs are widened on the way in and the output
/// rounded back to their dtype, as PyTorch's half-precision `linear`
/// rounds its f32 accumulators.
///
/// f32 CPU weights that track gradients (a `VarMap`'s variables, which a
/// training step changes in place) train on the packed kernels too: every
/// call of an f32 input is a candle op whose forward packs the weight
/// (again only where its values changed since the last call) and whose
/// backward takes `dX = dY · W` on the same kernels (`dW = dYᵀ · X` on
/// candle's matmul, which reads `dYᵀ` in place), so that gradients reach the
/// input, the weight and the bias.
///
/// Anything else keeps candle's `Linear`: other devices and dtypes, a
/// range of a training layer's features, and calls whose input tracks
/// gradients through a packed weight (computed through the unpacked
/// weight, so gradients reach the input). All give the same results within
/// float rounding.
#[derive(Debug, Clone)]
pub struct PackedLinear {
    inner: Inner,
}

#[derive(Debug, Clone)]
enum Inner {
    Candle(candle_nn::Linear),
    Packed(Arc<PackedWeight>),
    Q8(Arc<Q8Weight>),
    Blocks(Arc<BlockWeight>),
    Trained(Arc<TrainedWeight>),
}

/// Whether a weight can be packed: a CPU tensor of a dtype the panels hold
/// that tracks no gradient.
fn packable_weight(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && !t.track_op()
}

pub use crate::elem::is_broadcast;

/// `f` over the data of a contiguous CPU tensor of element type `S`,
/// borrowed in place.
fn with_slice<S: candle::WithDType, R>(t: &Tensor, f: impl FnOnce(&[S]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle::Storage::Cpu(cpu) = &*storage else {
        bail!("PackedLinear: the weight is not on the CPU")
    };
    let data = cpu.as_slice::<S>()?;
    match data.get(layout.start_offset()..layout.start_offset() + t.elem_count()) {
        Some(slice) => f(slice),
        None => bail!("PackedLinear: the weight's view runs past its storage"),
    }
}

/// The contiguous data of a CPU tensor as f32.
fn cpu_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// candle's `Linear` over `w` and `b`, in `x`'s dtype where the weight's
/// differs (a half-precision layer on a processor without the packed
/// kernels computes in f32 over the widened weight, as the packed path
/// does).
fn candle_linear(w: &Tensor, b: Option<&Tensor>, x: &Tensor) -> Result<Tensor> {
    let w = w.to_dtype(x.dtype())?;
    let b = b.map(|b| b.to_dtype(x.dtype())).transpose()?;
    candle_nn::Linear::new(w, b).forward(x)
}

/// `a`'s output features then `b`'s, where both are packed alike and `a`
/// is held by no other layer: `a`'s buffers grown to take `b`'s panels, or
/// for ggml blocks `b`'s buffers taken as they are (copied where another
/// layer holds `b`); both given back otherwise.
fn join(a: Inner, b: Inner) -> std::result::Result<Inner, (Inner, Inner)> {
    match (a, b) {
        (Inner::Packed(a), Inner::Packed(b)) => match Arc::try_unwrap(a) {
            Ok(a) => a
                .join(&b)
                .map(|w| Inner::Packed(Arc::new(w)))
                .map_err(|a| (Inner::Packed(Arc::new(a)), Inner::Packed(b))),
            Err(a) => Err((Inner::Packed(a), Inner::Packed(b))),
        },
        (Inner::Q8(a), Inner::Q8(b)) => match Arc::try_unwrap(a) {
            Ok(a) => a
                .join(&b)
                .map(|w| Inner::Q8(Arc::new(w)))
                .map_err(|a| (Inner::Q8(Arc::new(a)), Inner::Q8(b))),
            Err(a) => Err((Inner::Q8(a), Inner::Q8(b))),
        },
        (Inner::Blocks(a), Inner::Blocks(b)) if a.joins(&b) => match Arc::try_unwrap(a) {
            Ok(a) => Ok(Inner::Blocks(Arc::new(a.join(Arc::unwrap_or_clone(b))))),
            Err(a) => Err((Inner::Blocks(a), Inner::Blocks(b))),
        },
        (a, b) => Err((a, b)),
    }
}

impl PackedLinear {
    /// A layer over `weight` `(out, in)` and `bias` `(out)`, packed where
    /// the packed path serves them (see the type's docs), in the weight's
    /// dtype, for [`isa::current`](crate::isa::current): the default
    /// [`PackOptions`].
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Self::with_options(weight, bias, &PackOptions::default())
    }

    /// A layer over `weight` `(out, in)` and `bias` `(out)` packed as
    /// `options` asks: in its format (quantized where the format is and the
    /// input size allows), for its instruction set; a placeholder for
    /// blocks its [`LentBlocks`] holds takes them, as
    /// [`PackedLinear::from_blocks`] would.
    pub fn with_options(weight: Tensor, bias: Option<Tensor>, options: &PackOptions) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [n] {
                bail!("PackedLinear: bias has shape {:?}, expected ({n},)", b.dims())
            }
        }
        let isa = options.isa();
        if let Some((format, data)) = options.lent().and_then(|l| l.take(&weight)) {
            return Self::from_blocks_on(format, data, (n, k), bias.as_ref(), isa);
        }
        if let Some(t) = PackedWeight::isa_for(options.isa())
            .map(|isa| TrainedWeight::new(&weight, bias.as_ref(), isa))
            .transpose()?
            .flatten()
        {
            return Ok(Self {
                inner: Inner::Trained(Arc::new(t)),
            });
        }
        let format = options.format();
        let packable = packable_weight(&weight)
            && !is_broadcast(&weight)
            && bias.as_ref().is_none_or(packable_weight)
            && n > 0
            && k > 0;
        let quantize = packable && k.is_multiple_of(32) && format != PackFormat::AsStored;
        let isa = match (quantize, packable) {
            (true, _) => Some(isa),
            (false, true) => PackedWeight::isa_for(options.isa_for(weight.dtype())),
            (false, false) => None,
        };
        let Some(isa) = isa else {
            return Ok(Self {
                inner: Inner::Candle(candle_nn::Linear::new(weight, bias)),
            });
        };
        let b = bias.as_ref().map(cpu_f32).transpose()?;
        let b = b.as_deref();
        // Packed straight from the weight's storage: no copy of a layer
        // beside its packed form while a model loads.
        let weight = weight.contiguous()?;
        let dtype = weight.dtype();
        // `$body` over the weight's data as `&[$w]`, in its own dtype.
        macro_rules! from_weight {
            ($w:ident => $body:expr) => {
                match dtype {
                    DType::BF16 => with_slice(&weight, |$w: &[half::bf16]| $body)?,
                    DType::F16 => with_slice(&weight, |$w: &[half::f16]| $body)?,
                    _ => with_slice(&weight, |$w: &[f32]| $body)?,
                }
            };
        }
        let blocks = match format {
            PackFormat::Q4_0 => Some(BlockFormat::Q4_0),
            // llama-quantize's fallback for rows Q4_K's 256 do not divide.
            PackFormat::Q4_K if k.is_multiple_of(256) => Some(BlockFormat::Q4_K),
            PackFormat::Q4_K => Some(BlockFormat::Q5_0),
            PackFormat::AsStored | PackFormat::Q8_0 => None,
        };
        let inner = match (quantize, blocks) {
            (true, Some(blocks)) => Inner::Blocks(Arc::new(
                from_weight!(w => BlockWeight::quantize(blocks, w, n, k, b, isa)),
            )),
            (true, None) => Inner::Q8(Arc::new(from_weight!(w => Q8Weight::quantize(w, n, k, b, isa)))),
            (false, _) => Inner::Packed(Arc::new(
                from_weight!(w => PackedWeight::new(w, n, k, b, isa, dtype)),
            )),
        };
        Ok(Self { inner })
    }

    /// A layer over a weight `(out, in)` = `(n, k)` in a ggml block format,
    /// `data` its blocks as a GGUF file stores them (`n` rows of
    /// `k / block` blocks), kept as they are: every call quantizes its
    /// inputs per block and multiplies them in integers, as ggml does
    /// (Q8_0 on the Q8_0 kernels, [`PackFormat::Q8_0`]'s, its blocks
    /// copied into their panels as they are). `bias` `(n)` in any float
    /// dtype.
    pub fn from_blocks(
        format: BlockFormat,
        data: Vec<u8>,
        dims: (usize, usize),
        bias: Option<&Tensor>,
    ) -> Result<Self> {
        Self::from_blocks_on(format, data, dims, bias, current())
    }

    /// [`PackedLinear::from_blocks`] for `isa` (capped at what the
    /// processor runs).
    pub(crate) fn from_blocks_on(
        format: BlockFormat,
        data: Vec<u8>,
        (n, k): (usize, usize),
        bias: Option<&Tensor>,
        isa: Isa,
    ) -> Result<Self> {
        let b = bias.map(cpu_f32).transpose()?;
        // Q8_0 takes its own kernels, whose panels the blocks go into as
        // they are.
        let inner = match format {
            BlockFormat::Q8_0 => Inner::Q8(Arc::new(Q8Weight::from_blocks(&data, n, k, b.as_deref(), isa)?)),
            _ => Inner::Blocks(Arc::new(BlockWeight::new(format, data, n, k, b, isa)?)),
        };
        Ok(Self { inner })
    }

    /// A layer over a weight stored `(in, out)`, as GPT-2's `Conv1D` stores
    /// it: transposed once here (a broadcast placeholder is left as a view,
    /// see [`is_broadcast`], and so is a weight that trains, which a copy
    /// made here would leave behind at the first optimizer step), then
    /// [`PackedLinear::new`].
    pub fn from_in_out(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Self::from_in_out_with(weight, bias, &PackOptions::default())
    }

    /// [`PackedLinear::from_in_out`] packed as `options` asks
    /// ([`PackedLinear::with_options`]).
    pub fn from_in_out_with(weight: Tensor, bias: Option<Tensor>, options: &PackOptions) -> Result<Self> {
        let w = weight.t()?;
        let w = if is_broadcast(&w) || w.track_op() {
            w
        } else {
            w.contiguous()?
        };
        Self::with_options(w, bias, options)
    }

    /// [`PackedLinear::new`] over a candle `Linear`'s weight and bias.
    pub fn from_linear(linear: candle_nn::Linear) -> Result<Self> {
        Self::from_linear_with(linear, &PackOptions::default())
    }

    /// [`PackedLinear::with_options`] over a candle `Linear`'s weight and
    /// bias.
    pub fn from_linear_with(linear: candle_nn::Linear, options: &PackOptions) -> Result<Self> {
        Self::with_options(linear.weight().clone(), linear.bias().cloned(), options)
    }

    /// One layer computing `parts`' outputs side by side: their weights
    /// concatenated along the output features, as `Tensor::cat(.., 0)`
    /// makes them, and their biases (a part without one adds zeros). Parts
    /// packed alike (the same format, dtype and instruction set, all but
    /// the last filling whole panels, none shared with another layer) are
    /// joined without unpacking, the first's buffers grown to take the
    /// others' panels, so that a model packs a fused projection one part
    /// at a time and never holds its unpacked whole; other parts are
    /// unpacked, concatenated and packed again as [`PackedLinear::new`]
    /// packs, in Q8_0 where one of them is, for the instruction set the
    /// first packed part was packed for ([`isa::current`](crate::isa::current)
    /// where none is).
    pub fn cat(parts: Vec<PackedLinear>) -> Result<Self> {
        Self::cat_with(parts, &PackOptions::default())
    }

    /// [`PackedLinear::cat`], packing for `options`' instruction set where
    /// no part is packed.
    pub fn cat_with(parts: Vec<PackedLinear>, options: &PackOptions) -> Result<Self> {
        if parts.is_empty() {
            bail!("PackedLinear::cat: no parts")
        }
        let dims = parts.iter().map(PackedLinear::dims).collect::<Result<Vec<_>>>()?;
        if dims.iter().any(|&(_, k)| k != dims[0].1) {
            bail!("PackedLinear::cat: the parts take different input sizes: {dims:?} (out, in)")
        }
        // Joined in turn while each part joins; the first that does not
        // (and the rest) go the unpacking way.
        let mut parts = parts.into_iter();
        let mut acc = parts.next().expect("not empty").inner;
        let parts: Vec<PackedLinear> = loop {
            let Some(part) = parts.next() else {
                return Ok(Self { inner: acc });
            };
            match join(acc, part.inner) {
                Ok(inner) => acc = inner,
                Err((a, b)) => {
                    break [Self { inner: a }, Self { inner: b }]
                        .into_iter()
                        .chain(parts)
                        .collect()
                }
            }
        };
        let dims = parts.iter().map(PackedLinear::dims).collect::<Result<Vec<_>>>()?;
        let weights = parts.iter().map(|p| p.weight()).collect::<Result<Vec<_>>>()?;
        let dtype = match weights.iter().all(|w| w.dtype() == weights[0].dtype()) {
            true => weights[0].dtype(),
            false => DType::F32,
        };
        let weights = weights
            .iter()
            .map(|w| w.to_dtype(dtype))
            .collect::<Result<Vec<_>>>()?;
        let biases = parts.iter().map(|p| p.bias()).collect::<Result<Vec<_>>>()?;
        let given: Vec<&Tensor> = biases.iter().flatten().collect();
        let bias = match given.first() {
            None => None,
            Some(b) => {
                let bias_dtype = match given.iter().all(|g| g.dtype() == b.dtype()) {
                    true => b.dtype(),
                    false => DType::F32,
                };
                let biases = biases
                    .iter()
                    .zip(&dims)
                    .map(|(b, &(n, _))| match b {
                        Some(b) => b.to_dtype(bias_dtype),
                        None => Tensor::zeros(n, bias_dtype, weights[0].device()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(Tensor::cat(&biases, 0)?)
            }
        };
        // Packed again in the format the parts hold where a pack format
        // writes it for this input size, in Q8_0 where one is quantized
        // otherwise (a GGUF file's other block formats).
        let k = dims[0].1;
        let format = match parts.iter().find_map(PackedLinear::block_format) {
            Some(BlockFormat::Q4_0) => PackFormat::Q4_0,
            Some(BlockFormat::Q4_K) if k.is_multiple_of(256) => PackFormat::Q4_K,
            Some(BlockFormat::Q5_0) if !k.is_multiple_of(256) => PackFormat::Q4_K,
            _ if parts.iter().any(PackedLinear::is_quantized) => PackFormat::Q8_0,
            _ => PackFormat::AsStored,
        };
        let isa = parts
            .iter()
            .find_map(PackedLinear::isa)
            .unwrap_or_else(|| options.isa());
        let options = PackOptions::new().with_format(format).with_isa(isa);
        Self::with_options(Tensor::cat(&weights, 0)?, bias, &options)
    }

    /// The instruction set the weight is packed for, where it is.
    fn isa(&self) -> Option<Isa> {
        match &self.inner {
            Inner::Candle(_) | Inner::Trained(_) => None,
            Inner::Packed(p) => Some(p.isa),
            Inner::Q8(q) => Some(q.isa()),
            Inner::Blocks(b) => Some(b.isa()),
        }
    }

    /// Whether the weight is held packed (the fast path serves plain
    /// inputs).
    pub fn is_packed(&self) -> bool {
        matches!(self.inner, Inner::Packed(_) | Inner::Q8(_) | Inner::Blocks(_))
    }

    /// Whether the weight is held quantized (Q8_0 or Q4_0,
    /// [`PackOptions::with_format`], or a ggml block format,
    /// [`PackedLinear::from_blocks`]).
    pub fn is_quantized(&self) -> bool {
        matches!(self.inner, Inner::Q8(_) | Inner::Blocks(_))
    }

    /// The ggml block format the weight is kept in
    /// ([`PackedLinear::from_blocks`]), if any: layers of different
    /// formats are not joined ([`PackedLinear::joins_with`]).
    pub fn block_format(&self) -> Option<BlockFormat> {
        match &self.inner {
            Inner::Blocks(b) => Some(b.format()),
            _ => None,
        }
    }

    /// Whether [`PackedLinear::cat`] joins `self` and `other` as they are
    /// held, rather than unpacking them: a layer in a block format joins
    /// only another of the same format (a Q4_K_M file mixes Q4_K and
    /// Q6_K rows, which stay separate layers).
    pub fn joins_with(&self, other: &PackedLinear) -> bool {
        self.block_format() == other.block_format()
    }

    /// `(out_features, in_features)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.inner {
            Inner::Candle(l) => l.weight().dims2(),
            Inner::Packed(p) => Ok(p.dims()),
            Inner::Q8(q) => Ok(q.dims()),
            Inner::Blocks(b) => Ok(b.dims()),
            Inner::Trained(t) => Ok(t.dims()),
        }
    }

    /// The weight's dtype: the dtype it is packed (or held) in, the one
    /// [`PackedLinear::weight`] returns; f32 for a quantized weight, which
    /// it returns dequantized.
    pub fn dtype(&self) -> DType {
        match &self.inner {
            Inner::Candle(l) => l.weight().dtype(),
            Inner::Packed(p) => p.dtype(),
            Inner::Q8(_) | Inner::Blocks(_) => DType::F32,
            Inner::Trained(t) => t.weight().dtype(),
        }
    }

    /// Rows `ids` of the weight: the lookup of a token embedding tied to
    /// this layer (GPT-2's `wte`, Llama's `embed_tokens` with
    /// `tie_word_embeddings`), so that a model keeps one copy of the table,
    /// packed for the output projection. The rows of a packed weight come
    /// as f32 (a half-precision table's rows widened exactly), the inputs
    /// the packed layers take; those of an unpacked one in its dtype.
    ///
    /// # Shapes
    /// - `ids`: any shape, `u32`, each `< out_features`
    /// - returns `ids`' shape plus `in_features`
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (n, k) = self.dims()?;
        match &self.inner {
            Inner::Candle(l) => candle_nn::Embedding::new(l.weight().clone(), k).forward(ids),
            Inner::Trained(t) => candle_nn::Embedding::new(t.weight().clone(), k).forward(ids),
            Inner::Packed(_) | Inner::Q8(_) | Inner::Blocks(_) => {
                let idx = ids.flatten_all()?.to_vec1::<u32>()?;
                if let Some(&bad) = idx.iter().find(|&&i| i as usize >= n) {
                    bail!("PackedLinear::embed: id {bad} is out of range for {n} rows")
                }
                let mut dims = ids.dims().to_vec();
                dims.push(k);
                let rows = match &self.inner {
                    Inner::Packed(p) => p.rows(&idx),
                    Inner::Q8(q) => q.rows(&idx),
                    Inner::Blocks(b) => b.rows(&idx),
                    Inner::Candle(_) | Inner::Trained(_) => unreachable!("matched above"),
                };
                Tensor::from_vec(rows, dims, &candle::Device::Cpu)
            }
        }
    }

    /// The weight `(out, in)`: the tensor itself, or an unpacked copy in
    /// the dtype it was packed in.
    pub fn weight(&self) -> Result<Tensor> {
        match &self.inner {
            Inner::Candle(l) => Ok(l.weight().clone()),
            Inner::Trained(t) => Ok(t.weight().clone()),
            Inner::Packed(p) => {
                let (n, k) = p.dims();
                Tensor::from_vec(p.unpack().0, (n, k), &candle::Device::Cpu)?.to_dtype(p.dtype())
            }
            Inner::Q8(q) => Tensor::from_vec(q.unpack().0, q.dims(), &candle::Device::Cpu),
            Inner::Blocks(b) => Tensor::from_vec(b.unpack().0, b.dims(), &candle::Device::Cpu),
        }
    }

    /// The weight in llama.cpp's Q8_0 blocks (ggml's `block_q8_0`: per
    /// row, `in / 32` blocks of an f16 scale `d`, little-endian, and 32
    /// `i8` values `q`), the bytes a GGUF file stores for a Q8_0 tensor of
    /// shape `(out, in)`; `None` where the weight is not quantized
    /// ([`PackedLinear::is_quantized`]).
    pub fn q8_0_blocks(&self) -> Option<Vec<u8>> {
        match &self.inner {
            Inner::Q8(q) => Some(q.blocks()),
            Inner::Candle(_) | Inner::Packed(_) | Inner::Blocks(_) | Inner::Trained(_) => None,
        }
    }

    /// The bias `(out)`, if any: the tensor itself, or an unpacked copy.
    pub fn bias(&self) -> Result<Option<Tensor>> {
        match &self.inner {
            Inner::Candle(l) => Ok(l.bias().cloned()),
            Inner::Trained(t) => Ok(t.bias().cloned()),
            Inner::Packed(p) => {
                let n = p.dims().0;
                p.unpack()
                    .1
                    .map(|b| Tensor::from_vec(b, n, &candle::Device::Cpu))
                    .transpose()
            }
            Inner::Q8(q) => {
                let n = q.dims().0;
                q.unpack()
                    .1
                    .map(|b| Tensor::from_vec(b, n, &candle::Device::Cpu))
                    .transpose()
            }
            Inner::Blocks(w) => {
                let n = w.dims().0;
                w.unpack()
                    .1
                    .map(|b| Tensor::from_vec(b, n, &candle::Device::Cpu))
                    .transpose()
            }
        }
    }

    /// `gamma ∘ (x · wᵀ + b)` as one layer, `gamma` `(out)`: each output
    /// feature's weights and bias scaled once, so that a per-channel scale
    /// after the layer (timm's `LayerScale`) costs no pass of its own and
    /// a residual add after it can still be fused
    /// ([`PackedLinear::forward_add`]). Only where the weight is packed and
    /// `gamma` is a plain f32 CPU tensor; `None` otherwise, so that a scale
    /// or weight that trains stays a separate op. Equals the layer followed
    /// by the scale within float rounding.
    pub fn scaled_outputs(&self, gamma: &Tensor) -> Result<Option<Self>> {
        let (n, _) = self.dims()?;
        if gamma.dims() != [n] {
            bail!(
                "PackedLinear::scaled_outputs: gamma has shape {:?}, expected ({n},)",
                gamma.dims()
            )
        }
        let Inner::Packed(p) = &self.inner else {
            return Ok(None);
        };
        if !plain_cpu_f32(gamma) {
            return Ok(None);
        }
        Ok(Some(Self {
            inner: Inner::Packed(Arc::new(p.scaled(&cpu_f32(gamma)?)?)),
        }))
    }
}

#[cfg(test)]
mod tests;
