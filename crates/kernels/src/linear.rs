//! `PackedLinear`: a linear layer whose weight is packed for the CPU
//! micro-kernels once, when it is built (`packed.rs`).

use std::sync::Arc;

use candle::{bail, DType, Module, Result, Storage, Tensor};

use crate::activation::relu;
use crate::packed::{Epilogue, PackedWeight};
use crate::q8::Q8Weight;

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
/// Anything else keeps candle's `Linear`: weights that track gradients (a
/// `VarMap`'s variables, which a training step changes in place: a packed
/// copy would go stale), other devices and dtypes, and calls whose input
/// tracks gradients (computed through the unpacked weight, so gradients
/// reach the input). Both give the same results within float rounding.
#[derive(Debug, Clone)]
pub struct PackedLinear {
    inner: Inner,
}

#[derive(Debug, Clone)]
enum Inner {
    Candle(candle_nn::Linear),
    Packed(Arc<PackedWeight>),
    Q8(Arc<Q8Weight>),
}

/// How [`PackedLinear::new`] packs the weights of the layers it builds on
/// the calling thread (see [`packing_as`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PackFormat {
    /// In the weight's own dtype: f32, bf16 or f16.
    #[default]
    AsStored,
    /// Quantized to llama.cpp's Q8_0 (blocks of 32 int8 with an f16
    /// scale; the inputs quantized alike at each call, integer dot
    /// products), where the input size is a multiple of 32; as stored
    /// otherwise.
    Q8_0,
}

thread_local! {
    static PACK_FORMAT: std::cell::Cell<PackFormat> = const { std::cell::Cell::new(PackFormat::AsStored) };
}

/// Runs `build` with every layer [`PackedLinear::new`] packs on this
/// thread in `format`, then restores the format before (also when `build`
/// panics): a model loader quantizes every linear layer of a model it
/// builds without each layer's constructor taking an option.
pub fn packing_as<R>(format: PackFormat, build: impl FnOnce() -> R) -> R {
    struct Restore(PackFormat);
    impl Drop for Restore {
        fn drop(&mut self) {
            PACK_FORMAT.with(|f| f.set(self.0));
        }
    }
    let _restore = Restore(PACK_FORMAT.with(|f| f.replace(format)));
    build()
}

/// The format [`PackedLinear::new`] packs in on this thread now (see
/// [`packing_as`]).
pub fn packing_format() -> PackFormat {
    PACK_FORMAT.with(|f| f.get())
}

/// Whether a tensor can take part in the packed path (and the other fused
/// CPU ops): an f32 CPU tensor that tracks no gradient.
pub(crate) fn plain_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op()
}

/// Whether a weight can be packed: a CPU tensor of a dtype the panels hold
/// that tracks no gradient.
fn packable_weight(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && !t.track_op()
}

/// Whether `t` repeats its data along some dimension (a zero stride over
/// more than one element): a broadcast, such as the zeros a checkpoint's
/// pre-flight recorder answers with. Packing or copying one would
/// allocate the full size for no information, so it is left as it is.
pub fn is_broadcast(t: &Tensor) -> bool {
    t.stride().iter().zip(t.dims()).any(|(&s, &d)| s == 0 && d > 1)
}

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

/// `a`'s output features then `b`'s, `a`'s buffers grown to take `b`'s
/// panels, where both are packed alike and `a` is held by no other layer;
/// `a` given back otherwise.
fn join(a: Inner, b: &Inner) -> std::result::Result<Inner, Inner> {
    match (a, b) {
        (Inner::Packed(a), Inner::Packed(b)) => match Arc::try_unwrap(a) {
            Ok(a) => a
                .join(b)
                .map(|w| Inner::Packed(Arc::new(w)))
                .map_err(|a| Inner::Packed(Arc::new(a))),
            Err(a) => Err(Inner::Packed(a)),
        },
        (Inner::Q8(a), Inner::Q8(b)) => match Arc::try_unwrap(a) {
            Ok(a) => a
                .join(b)
                .map(|w| Inner::Q8(Arc::new(w)))
                .map_err(|a| Inner::Q8(Arc::new(a))),
            Err(a) => Err(Inner::Q8(a)),
        },
        (a, _) => Err(a),
    }
}

impl PackedLinear {
    /// A layer over `weight` `(out, in)` and `bias` `(out)`, packed where
    /// the packed path serves them (see the type's docs), in the weight's
    /// dtype.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [n] {
                bail!("PackedLinear: bias has shape {:?}, expected ({n},)", b.dims())
            }
        }
        let packable = packable_weight(&weight)
            && !is_broadcast(&weight)
            && bias.as_ref().is_none_or(packable_weight)
            && n > 0
            && k > 0;
        let quantize = packable && k.is_multiple_of(32) && packing_format() == PackFormat::Q8_0;
        let isa = match quantize {
            true => Some(crate::isa::current()),
            false => PackedWeight::isa().filter(|_| packable),
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
        let inner = match quantize {
            true => Inner::Q8(Arc::new(from_weight!(w => Q8Weight::quantize(w, n, k, b, isa)))),
            false => Inner::Packed(Arc::new(
                from_weight!(w => PackedWeight::new(w, n, k, b, isa, dtype)),
            )),
        };
        Ok(Self { inner })
    }

    /// A layer over a weight stored `(in, out)`, as GPT-2's `Conv1D` stores
    /// it: transposed once here (a broadcast placeholder is left as a view,
    /// see [`is_broadcast`]), then [`PackedLinear::new`].
    pub fn from_in_out(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let w = weight.t()?;
        let w = if is_broadcast(&w) { w } else { w.contiguous()? };
        Self::new(w, bias)
    }

    /// [`PackedLinear::new`] over a candle `Linear`'s weight and bias.
    pub fn from_linear(linear: candle_nn::Linear) -> Result<Self> {
        Self::new(linear.weight().clone(), linear.bias().cloned())
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
    /// packs, in Q8_0 where one of them is.
    pub fn cat(parts: Vec<PackedLinear>) -> Result<Self> {
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
            match join(acc, &part.inner) {
                Ok(inner) => acc = inner,
                Err(inner) => break [Self { inner }, part].into_iter().chain(parts).collect(),
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
        let format = match parts.iter().any(PackedLinear::is_quantized) {
            true => PackFormat::Q8_0,
            false => PackFormat::AsStored,
        };
        packing_as(format, || Self::new(Tensor::cat(&weights, 0)?, bias))
    }

    /// Whether the weight is held packed (the fast path serves plain
    /// inputs).
    pub fn is_packed(&self) -> bool {
        matches!(self.inner, Inner::Packed(_) | Inner::Q8(_))
    }

    /// Whether the weight is held quantized (Q8_0, [`packing_as`]).
    pub fn is_quantized(&self) -> bool {
        matches!(self.inner, Inner::Q8(_))
    }

    /// `(out_features, in_features)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.inner {
            Inner::Candle(l) => l.weight().dims2(),
            Inner::Packed(p) => Ok(p.dims()),
            Inner::Q8(q) => Ok(q.dims()),
        }
    }

    /// The weight's dtype: the dtype it is packed (or held) in, the one
    /// [`PackedLinear::weight`] returns; f32 for a quantized weight, which
    /// it returns dequantized.
    pub fn dtype(&self) -> DType {
        match &self.inner {
            Inner::Candle(l) => l.weight().dtype(),
            Inner::Packed(p) => p.dtype(),
            Inner::Q8(_) => DType::F32,
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
            Inner::Packed(_) | Inner::Q8(_) => {
                let idx = ids.flatten_all()?.to_vec1::<u32>()?;
                if let Some(&bad) = idx.iter().find(|&&i| i as usize >= n) {
                    bail!("PackedLinear::embed: id {bad} is out of range for {n} rows")
                }
                let mut dims = ids.dims().to_vec();
                dims.push(k);
                let rows = match &self.inner {
                    Inner::Packed(p) => p.rows(&idx),
                    Inner::Q8(q) => q.rows(&idx),
                    Inner::Candle(_) => unreachable!("matched above"),
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
            Inner::Packed(p) => {
                let (n, k) = p.dims();
                Tensor::from_vec(p.unpack().0, (n, k), &candle::Device::Cpu)?.to_dtype(p.dtype())
            }
            Inner::Q8(q) => Tensor::from_vec(q.unpack().0, q.dims(), &candle::Device::Cpu),
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
            Inner::Candle(_) | Inner::Packed(_) => None,
        }
    }

    /// The bias `(out)`, if any: the tensor itself, or an unpacked copy.
    pub fn bias(&self) -> Result<Option<Tensor>> {
        match &self.inner {
            Inner::Candle(l) => Ok(l.bias().cloned()),
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

    /// `gelu_erf(x · wᵀ + b)`, the GELU fused into the write-out where
    /// the weight is packed.
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims()?;
        self.forward_range(x, (0, n), Epilogue::GeluErf)
    }

    /// `gelu_tanh(x · wᵀ + b)` (PyTorch's `gelu(approximate='tanh')`, HF's
    /// `gelu_new`), fused into the write-out where the weight is packed.
    pub fn forward_gelu_tanh(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims()?;
        self.forward_range(x, (0, n), Epilogue::GeluTanh)
    }

    /// `relu(x · wᵀ + b)`, the ReLU fused into the write-out where the
    /// weight is packed (NaN stays NaN, as in PyTorch).
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims()?;
        self.forward_range(x, (0, n), Epilogue::Relu)
    }

    /// `residual + x · wᵀ + b`, a residual block's `x + layer(x)`: where
    /// the weight is packed, the output tiles start from the residual, so
    /// the add takes no pass, no output buffer and no parallel region of
    /// its own. `residual` has the output's shape.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims()?;
        self.forward_range_add(x, (0, n), Epilogue::Identity, Some(residual))
    }

    /// Output features `lo..hi` only: `x · w[lo..hi]ᵀ + b[lo..hi]`. For
    /// the fused `(3E, E)` input projection, whose q, k and v rows a
    /// cross-attention call needs one at a time.
    pub fn forward_features(&self, x: &Tensor, lo: usize, hi: usize) -> Result<Tensor> {
        self.forward_range(x, (lo, hi), Epilogue::Identity)
    }

    fn forward_range(&self, x: &Tensor, range: (usize, usize), epilogue: Epilogue) -> Result<Tensor> {
        self.forward_range_add(x, range, epilogue, None)
    }

    /// `epilogue(x · w[lo..hi]ᵀ + b[lo..hi])`, plus `residual` (with
    /// [`Epilogue::Identity`] only).
    fn forward_range_add(
        &self,
        x: &Tensor,
        (lo, hi): (usize, usize),
        epilogue: Epilogue,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (n, k) = self.dims()?;
        if !(lo < hi && hi <= n) {
            bail!("PackedLinear: output features {lo}..{hi} out of 0..{n}")
        }
        let dims = x.dims();
        if dims.last() != Some(&k) {
            bail!("PackedLinear: input has shape {dims:?}, expected (..., {k}) features")
        }
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = hi - lo;
        }
        if let Some(r) = residual {
            if r.dims() != shape {
                bail!(
                    "PackedLinear: residual has shape {:?}, expected the output's {shape:?}",
                    r.dims()
                )
            }
            debug_assert!(epilogue == Epilogue::Identity);
        }
        let epilogue_of = |y: Tensor| {
            let y = match epilogue {
                Epilogue::Identity => y,
                Epilogue::GeluErf => y.gelu_erf()?,
                Epilogue::GeluTanh => y.gelu()?,
                Epilogue::Relu => relu(&y)?,
            };
            match residual {
                Some(r) => r + y,
                None => Ok(y),
            }
        };
        // Whether the packed (or quantized) weight computes these features.
        let serves = match &self.inner {
            Inner::Packed(p) => p.serves_range(lo, hi),
            Inner::Q8(_) => true,
            Inner::Candle(_) => false,
        };
        if !(serves && plain_cpu_f32(x) && residual.is_none_or(plain_cpu_f32)) {
            // Half-precision inputs: widened, through the packed path, and
            // the output rounded back.
            if serves
                && x.device().is_cpu()
                && !x.track_op()
                && matches!(x.dtype(), DType::BF16 | DType::F16)
                && residual.is_none_or(|r| !r.track_op())
            {
                let r = residual.map(|r| r.to_dtype(DType::F32)).transpose()?;
                let y = self.forward_range_add(&x.to_dtype(DType::F32)?, (lo, hi), epilogue, r.as_ref())?;
                return y.to_dtype(x.dtype());
            }
            let (w, b) = match &self.inner {
                Inner::Candle(l) => (l.weight().clone(), l.bias().cloned()),
                _ => (self.weight()?, self.bias()?),
            };
            let b = b.map(|b| b.narrow(0, lo, hi - lo)).transpose()?;
            return epilogue_of(candle_linear(&w.narrow(0, lo, hi - lo)?, b.as_ref(), x)?);
        }
        let m = x.elem_count() / k.max(1);
        let x = x.contiguous()?;
        let residual = residual.map(Tensor::contiguous).transpose()?;
        let out = {
            let (storage, layout) = x.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                bail!("PackedLinear: input is not on the CPU")
            };
            let xs = &cpu.as_slice::<f32>()?[layout.start_offset()..][..m * k];
            match &residual {
                Some(r) => {
                    let (storage, layout) = r.storage_and_layout();
                    let Storage::Cpu(cpu) = &*storage else {
                        bail!("PackedLinear: residual is not on the CPU")
                    };
                    let rs = &cpu.as_slice::<f32>()?[layout.start_offset()..][..m * (hi - lo)];
                    self.forward_slices(xs, m, (lo, hi), epilogue, Some(rs))
                }
                None => self.forward_slices(xs, m, (lo, hi), epilogue, None),
            }
        };
        Tensor::from_vec(out, shape, x.device())
    }
}

impl PackedLinear {
    /// The packed or quantized weight's product over plain slices (see
    /// [`PackedWeight::forward`]).
    fn forward_slices(
        &self,
        x: &[f32],
        m: usize,
        range: (usize, usize),
        epilogue: Epilogue,
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        match &self.inner {
            Inner::Packed(p) => p.forward(x, m, range, epilogue, residual),
            Inner::Q8(q) => {
                let mut y = q.forward(x, m, range, residual);
                epilogue.apply(&mut y);
                y
            }
            Inner::Candle(_) => unreachable!("only packed weights take slices"),
        }
    }
}

impl Module for PackedLinear {
    /// `(..., in)` → `(..., out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims()?;
        self.forward_range(x, (0, n), Epilogue::Identity)
    }
}

#[cfg(test)]
mod tests {
    use candle::{Module, Result, Tensor};

    use super::PackedLinear;
    use crate::isa::{force, supported, Isa, FORCE_LOCK};
    use crate::testing::{randn, rel_err};

    /// Packed for every instruction set the processor runs, the layer
    /// equals candle's `Linear` (and `gelu_erf`, `gelu`, `relu` or a
    /// residual's add after it) on shapes off the
    /// row group, panel, unit and reduction-slice sizes, with and without
    /// bias, for the whole output and for panel-aligned feature ranges,
    /// single rows included; on 3 threads, so that units split the row
    /// groups as well as the panels.
    #[test]
    fn packed_equals_candle_linear_on_every_isa() -> Result<()> {
        let shapes = [
            (2, 97, 33, 37, true),
            (1, 197, 768, 2304, true),
            (3, 250, 300, 16, false),
            // Past one unit's 256 features, a last panel of 8 features
            // (AVX-512's 32-wide panels), two slices on AVX2.
            (1, 400, 600, 200, true),
            // Three slices on AVX-512 too (at most 1024 inputs each); 12
            // rows (one tall group) and 13.
            (1, 12, 2100, 300, true),
            (1, 13, 2100, 300, false),
            (2, 5, 40, 70, true),
            (1, 1, 8, 96, true),
            // One row (a decode step): each set's one-row kernel, one task
            // and two, with columns off the panels and the vector lanes,
            // and inputs off the four a step.
            (1, 1, 130, 261, false),
            (1, 1, 512, 1408, true),
            (1, 1, 300, 7, true),
            (1, 1, 7, 21, true),
        ];
        let _lock = FORCE_LOCK.lock();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| -> Result<()> {
            for isa in supported() {
                force(Some(isa));
                for (batch, rows, k, n, bias) in shapes {
                    let x = randn(&[batch, rows, k])?;
                    let (w, b) = (randn(&[n, k])?, bias.then(|| randn(&[n])).transpose()?);
                    let expected = candle_nn::Linear::new(w.clone(), b.clone()).forward(&x)?;
                    let ours = PackedLinear::new(w, b)?;
                    assert_eq!(ours.is_packed(), isa != Isa::Portable, "{isa:?}");
                    let what = format!("{isa:?} ({batch}, {rows}, {k}) x ({n}, {k})");
                    let y = ours.forward(&x)?;
                    assert_eq!(y.dims(), expected.dims(), "{what}");
                    assert!(
                        rel_err(&y, &expected)? < 1e-5,
                        "{what}: {:e}",
                        rel_err(&y, &expected)?
                    );
                    // The activations' error against the linear's output
                    // scale: where every output is far below zero (7
                    // outputs, one run in about 128), both sides are zero
                    // but for rounding (ours -5e-13, candle's -0.0), and a
                    // ratio to their own largest magnitude compares noise.
                    let scale = expected.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                    let act_err = |a: &Tensor, b: &Tensor| -> Result<f32> {
                        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? / scale)
                    };
                    let g = ours.forward_gelu(&x)?;
                    assert!(act_err(&g, &expected.gelu_erf()?)? < 1e-5, "{what} gelu");
                    let g = ours.forward_gelu_tanh(&x)?;
                    assert!(act_err(&g, &expected.gelu()?)? < 1e-5, "{what} gelu tanh");
                    let r = ours.forward_relu(&x)?;
                    assert!(act_err(&r, &expected.relu()?)? < 1e-5, "{what} relu");
                    let residual = randn(expected.dims())?;
                    let a = ours.forward_add(&x, &residual)?;
                    assert!(rel_err(&a, &(&expected + &residual)?)? < 1e-5, "{what} residual");
                    // The unpacked weight is the weight.
                    assert_eq!(ours.weight()?.dims(), [n, k]);
                    if n >= 64 {
                        let part = ours.forward_features(&x, 32, 64)?;
                        assert!(
                            rel_err(&part, &expected.narrow(2, 32, 32)?)? < 1e-5,
                            "{what} features 32..64"
                        );
                    }
                    let tail = ours.forward_features(&x, n - 5, n)?;
                    assert!(
                        rel_err(&tail, &expected.narrow(2, n - 5, 5)?)? < 1e-5,
                        "{what} last 5 features"
                    );
                }
            }
            Ok(())
        })?;
        force(None);
        Ok(())
    }

    /// bf16 and f16 weights are packed as they are, and the layer equals
    /// the f32 layer over the same weights widened, on every instruction
    /// set (the portable one through candle, over the widened weight):
    /// single rows, the tall and wide tiles, sliced reductions and a last
    /// panel cut short, a fused residual and a range of features. The
    /// unpacked weight and a tied table's rows are the stored values
    /// exactly. Half-precision inputs come back in their dtype, equal to
    /// the f32 result rounded to it.
    #[test]
    fn half_precision_weights_equal_the_f32_layer_over_them() -> Result<()> {
        use candle::DType;
        let shapes = [
            (1, 300, 7, true),
            (1, 512, 1408, false),
            (5, 40, 70, true),
            (13, 2100, 300, true),
            (40, 96, 200, false),
        ];
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            for dtype in [DType::BF16, DType::F16] {
                for (m, k, n, bias) in shapes {
                    let what = format!("{isa:?} {dtype:?} ({m}, {k}) x ({n}, {k})");
                    let x = randn(&[m, k])?;
                    let w = randn(&[n, k])?.to_dtype(dtype)?;
                    let b = bias.then(|| randn(&[n])).transpose()?;
                    let wide = w.to_dtype(DType::F32)?;
                    let expected = candle_nn::Linear::new(wide.clone(), b.clone()).forward(&x)?;
                    let ours = PackedLinear::new(w.clone(), b)?;
                    assert_eq!(ours.is_packed(), isa != Isa::Portable, "{what}");
                    assert_eq!(ours.dtype(), dtype, "{what}");
                    let y = ours.forward(&x)?;
                    assert_eq!(y.dtype(), DType::F32, "{what}");
                    assert!(
                        rel_err(&y, &expected)? < 1e-5,
                        "{what}: {:e}",
                        rel_err(&y, &expected)?
                    );
                    let residual = randn(expected.dims())?;
                    let a = ours.forward_add(&x, &residual)?;
                    assert!(rel_err(&a, &(&expected + &residual)?)? < 1e-5, "{what} residual");
                    let tail = ours.forward_features(&x, n - 5, n)?;
                    assert!(
                        rel_err(&tail, &expected.narrow(1, n - 5, 5)?)? < 1e-5,
                        "{what} tail"
                    );
                    let back = ours.weight()?;
                    assert_eq!(back.dtype(), dtype, "{what}");
                    assert_eq!(rel_err(&back.to_dtype(DType::F32)?, &wide)?, 0., "{what} weight");
                    if ours.is_packed() {
                        let ids = Tensor::new(&[0u32, n as u32 - 1, n as u32 / 2], &candle::Device::Cpu)?;
                        let rows = ours.embed(&ids)?;
                        assert_eq!(rel_err(&rows, &wide.index_select(&ids, 0)?)?, 0., "{what} rows");
                    }
                    let xh = x.to_dtype(dtype)?;
                    let yh = ours.forward(&xh)?;
                    assert_eq!(yh.dtype(), dtype, "{what} half input");
                    let want = candle_nn::Linear::new(wide, ours.bias()?)
                        .forward(&xh.to_dtype(DType::F32)?)?
                        .to_dtype(dtype)?;
                    let err = rel_err(&yh.to_dtype(DType::F32)?, &want.to_dtype(DType::F32)?)?;
                    assert!(err < 1e-2, "{what} half input: {err:e}");
                }
            }
        }
        force(None);
        Ok(())
    }

    /// `cat` of layers packed one at a time equals the layer packed from
    /// the concatenated weights and biases (a missing bias as zeros), bit
    /// for bit, on every instruction set and in f32, bf16 and Q8_0: parts
    /// filling whole panels are joined without unpacking, others (a first
    /// part cut short of a panel, mixed formats) unpacked and packed again.
    #[test]
    fn cat_equals_the_layer_over_the_concatenated_weights() -> Result<()> {
        use super::{packing_as, PackFormat};
        use candle::DType;
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            for (dtype, format) in [
                (DType::F32, PackFormat::AsStored),
                (DType::BF16, PackFormat::AsStored),
                (DType::F32, PackFormat::Q8_0),
            ] {
                // 64 and 96 fill whole panels (16 or 32 wide); 20 does not.
                for (n1, n2, k) in [(64, 40, 96), (96, 7, 64), (20, 33, 64)] {
                    let what = format!("{isa:?} {dtype:?} {format:?} ({n1} + {n2}, {k})");
                    let w1 = randn(&[n1, k])?.to_dtype(dtype)?;
                    let w2 = randn(&[n2, k])?.to_dtype(dtype)?;
                    let b2 = randn(&[n2])?;
                    let pack = |w: &Tensor, b: Option<Tensor>| {
                        packing_as(format, || PackedLinear::new(w.clone(), b))
                    };
                    let ours = PackedLinear::cat(vec![pack(&w1, None)?, pack(&w2, Some(b2.clone()))?])?;
                    let bias = Tensor::cat(&[&Tensor::zeros(n1, DType::F32, w1.device())?, &b2], 0)?;
                    let want = pack(&Tensor::cat(&[&w1, &w2], 0)?, Some(bias))?;
                    assert_eq!(ours.dims()?, (n1 + n2, k), "{what}");
                    assert_eq!(ours.is_quantized(), want.is_quantized(), "{what}");
                    assert_eq!(ours.q8_0_blocks(), want.q8_0_blocks(), "{what}");
                    let flat = |t: Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                    assert_eq!(flat(ours.weight()?)?, flat(want.weight()?)?, "{what} weight");
                    for rows in [1, 5] {
                        let x = randn(&[rows, k])?;
                        assert_eq!(
                            flat(ours.forward(&x)?)?,
                            flat(want.forward(&x)?)?,
                            "{what} {rows} rows"
                        );
                    }
                }
            }
            // Mixed formats: Q8_0 with a plain part, quantized together.
            let (w1, w2) = (randn(&[32, 64])?, randn(&[16, 64])?);
            let q = packing_as(PackFormat::Q8_0, || PackedLinear::new(w1.clone(), None))?;
            let mixed = PackedLinear::cat(vec![q.clone(), PackedLinear::new(w2.clone(), None)?])?;
            let want = packing_as(PackFormat::Q8_0, || {
                PackedLinear::new(Tensor::cat(&[&q.weight()?, &w2], 0)?, None)
            })?;
            assert_eq!(mixed.q8_0_blocks(), want.q8_0_blocks(), "{isa:?} mixed");
            let err = PackedLinear::cat(vec![q, PackedLinear::new(randn(&[16, 32])?, None)?]).unwrap_err();
            assert!(err.to_string().contains("different input sizes"), "{err}");
        }
        force(None);
        Ok(())
    }

    /// Under `packing_as(Q8_0)`, layers whose input size is a multiple of
    /// 32 are quantized (on every instruction set, the portable one
    /// included): the forward, the fused residual and GELU and a range of
    /// features equal candle's layer over the dequantized weight within
    /// the inputs' quantization error, a tied table's rows are the
    /// dequantized rows; other layers pack as stored; the format is
    /// restored after the scope.
    #[test]
    fn q8_0_packing_quantizes_within_its_scope() -> Result<()> {
        use super::{packing_as, PackFormat};
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            let (w, b) = (randn(&[70, 96])?, Some(randn(&[70])?));
            let layer = packing_as(PackFormat::Q8_0, || PackedLinear::new(w.clone(), b.clone()))?;
            let odd = packing_as(PackFormat::Q8_0, || PackedLinear::new(randn(&[8, 40])?, None))?;
            let after = PackedLinear::new(w.clone(), b.clone())?;
            assert!(
                layer.is_quantized() && !odd.is_quantized() && !after.is_quantized(),
                "{isa:?}"
            );
            let deq = layer.weight()?;
            assert!(rel_err(&deq, &w)? < 1e-2 && rel_err(&deq, &w)? > 0., "{isa:?}");
            // The blocks are the weight's: each d · q is its value.
            let blocks = layer.q8_0_blocks().expect("quantized");
            let from_blocks: Vec<f32> = blocks
                .chunks_exact(34)
                .flat_map(|b| {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    b[2..].iter().map(move |&q| d * f32::from(q as i8))
                })
                .collect();
            assert_eq!(
                from_blocks,
                deq.flatten_all()?.to_vec1::<f32>()?,
                "{isa:?} blocks"
            );
            assert!(odd.q8_0_blocks().is_none() && after.q8_0_blocks().is_none());
            let x = randn(&[2, 5, 96])?;
            let want = candle_nn::Linear::new(deq.clone(), layer.bias()?).forward(&x)?;
            let y = layer.forward(&x)?;
            assert!(rel_err(&y, &want)? < 2e-2, "{isa:?}: {:e}", rel_err(&y, &want)?);
            let residual = randn(want.dims())?;
            let a = layer.forward_add(&x, &residual)?;
            assert_eq!(rel_err(&a, &(&y + &residual)?)?, 0., "{isa:?} residual");
            assert!(
                rel_err(&layer.forward_gelu(&x)?, &y.gelu_erf()?)? < 1e-5,
                "{isa:?} gelu"
            );
            let tail = layer.forward_features(&x, 65, 70)?;
            assert_eq!(rel_err(&tail, &y.narrow(2, 65, 5)?)?, 0., "{isa:?} tail");
            let ids = Tensor::new(&[3u32, 69], &candle::Device::Cpu)?;
            assert_eq!(
                rel_err(&layer.embed(&ids)?, &deq.index_select(&ids, 0)?)?,
                0.,
                "{isa:?} rows"
            );
        }
        force(None);
        Ok(())
    }

    /// A NaN input reaches every output of its row through the fused ReLU,
    /// as through PyTorch's `relu`, on every instruction set.
    #[test]
    fn fused_relu_keeps_nan() -> Result<()> {
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            let mut x = randn(&[3, 40])?.to_vec2::<f32>()?;
            x[1][7] = f32::NAN;
            let x = candle::Tensor::new(x, &candle::Device::Cpu)?;
            let layer = PackedLinear::new(randn(&[70, 40])?, Some(randn(&[70])?))?;
            let y = layer.forward_relu(&x)?.to_vec2::<f32>()?;
            assert!(y[1].iter().all(|v| v.is_nan()), "{isa:?}");
            assert!(y[0].iter().chain(&y[2]).all(|&v| v >= 0.), "{isa:?}");
        }
        force(None);
        Ok(())
    }

    /// Weights that track gradients are never packed: a training step
    /// changes them in place, and a packed copy would go stale.
    #[test]
    fn variables_are_not_packed_and_inputs_with_gradients_get_them() -> Result<()> {
        let w = candle::Var::from_tensor(&randn(&[8, 4])?)?;
        let lin = PackedLinear::new(w.as_tensor().clone(), None)?;
        assert!(!lin.is_packed());
        let x = randn(&[3, 4])?;
        let before = lin.forward(&x)?;
        w.set(&(w.as_tensor() * 2.)?)?;
        let after = lin.forward(&x)?;
        assert!(
            rel_err(&after, &(before * 2.)?)? < 1e-6,
            "the layer must see the updated variable"
        );
        // A packed layer under an input that tracks gradients.
        let packed = PackedLinear::new(randn(&[8, 4])?, Some(randn(&[8])?))?;
        let xv = candle::Var::from_tensor(&x)?;
        let grads = packed.forward(xv.as_tensor())?.sum_all()?.backward()?;
        assert!(
            grads.get(xv.as_tensor()).is_some(),
            "no gradient reached the input"
        );
        Ok(())
    }

    /// A tied embedding's lookup through the packed layer equals the
    /// table's own rows, on every ISA, for ids in any shape (row counts off
    /// the panel width); an id past the table is an error. A broadcast
    /// weight (the pre-flight's placeholder) is neither packed nor copied.
    #[test]
    fn packed_rows_equal_the_table() -> Result<()> {
        let _lock = FORCE_LOCK.lock();
        for isa in supported().into_iter().filter(|&isa| isa != Isa::Portable) {
            force(Some(isa));
            let w = randn(&[70, 40])?;
            let layer = PackedLinear::new(w.clone(), None)?;
            assert!(layer.is_packed());
            let ids = Tensor::new(&[[0u32, 69, 33], [64, 1, 65]], &candle::Device::Cpu)?;
            let want = candle_nn::Embedding::new(w, 40).forward(&ids)?;
            let got = layer.embed(&ids)?;
            assert_eq!(got.dims(), [2, 3, 40]);
            assert_eq!(rel_err(&got, &want)?, 0., "{isa:?}");
            let err = layer.embed(&Tensor::new(&[70u32], &candle::Device::Cpu)?);
            assert!(err.is_err_and(|e| e.to_string().contains("id 70 is out of range for 70 rows")));
        }
        force(None);
        let placeholder =
            Tensor::zeros(1, candle::DType::F32, &candle::Device::Cpu)?.broadcast_as((4096, 4096))?;
        assert!(super::is_broadcast(&placeholder));
        assert!(!PackedLinear::new(placeholder, None)?.is_packed());
        assert!(!super::is_broadcast(&randn(&[3, 4])?));
        Ok(())
    }

    /// A scale folded into the weights equals the layer followed by the
    /// scale, on every ISA, with and without bias, through a fused residual
    /// too; a weight or scale that trains is not folded; a wrong-shaped
    /// scale is an error that names it.
    #[test]
    fn scaled_outputs_equal_the_layer_then_the_scale() -> Result<()> {
        use candle::Var;
        let _lock = FORCE_LOCK.lock();
        for isa in supported().into_iter().filter(|&isa| isa != Isa::Portable) {
            force(Some(isa));
            for bias in [true, false] {
                let (w, b) = (randn(&[70, 40])?, bias.then(|| randn(&[70])).transpose()?);
                let layer = PackedLinear::new(w, b)?;
                let gamma = randn(&[70])?;
                let scaled = layer
                    .scaled_outputs(&gamma)?
                    .expect("a packed layer folds a plain scale");
                let x = randn(&[2, 30, 40])?;
                let expected = layer.forward(&x)?.broadcast_mul(&gamma)?;
                let what = format!("{isa:?} bias {bias}");
                assert!(rel_err(&scaled.forward(&x)?, &expected)? < 1e-6, "{what}");
                let residual = randn(expected.dims())?;
                let fused = scaled.forward_add(&x, &residual)?;
                assert!(
                    rel_err(&fused, &(&expected + &residual)?)? < 1e-6,
                    "{what} residual"
                );
            }
        }
        force(None);
        let layer = PackedLinear::new(randn(&[8, 4])?, None)?;
        let trained = Var::from_tensor(&randn(&[8])?)?;
        assert!(layer.scaled_outputs(trained.as_tensor())?.is_none());
        let variables = PackedLinear::new(Var::from_tensor(&randn(&[8, 4])?)?.as_tensor().clone(), None)?;
        assert!(variables.scaled_outputs(&randn(&[8])?)?.is_none());
        for layer in [&layer, &variables] {
            let err = layer.scaled_outputs(&Tensor::ones(3, candle::DType::F32, &candle::Device::Cpu)?);
            let err = err.unwrap_err().to_string();
            assert!(err.contains("gamma") && err.contains("(8,)"), "{err}");
        }
        Ok(())
    }
}
