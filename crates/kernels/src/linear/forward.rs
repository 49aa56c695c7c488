//! The calls of a [`PackedLinear`]: the fused epilogues, the residual
//! add and a range of output features, through the packed or quantized
//! weight where it serves the call, a training weight's op (`trained.rs`)
//! where it trains, and candle's linear where neither does.

use candle::{bail, DType, Module, Result, Storage, Tensor};

use super::weight::Epilogue;
use super::{candle_linear, Inner, PackedLinear};
use crate::elem::plain_cpu_f32;
use crate::rows::activation_grad::{activate, Activation};
use crate::rows::relu;
use crate::runtime::isa::current;

impl PackedLinear {
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
        // Where gradients flow, the GELUs' ops with a backward of their own
        // (`rows/activation_grad.rs`), candle's where not.
        let isa = match &self.inner {
            Inner::Trained(t) => t.isa(),
            _ => current(),
        };
        let epilogue_of = |y: Tensor| {
            let y = match epilogue {
                Epilogue::Identity => y,
                Epilogue::GeluErf => activate(&y, Activation::GeluErf, isa)?,
                Epilogue::GeluTanh => activate(&y, Activation::GeluTanh, isa)?,
                Epilogue::Relu => relu(&y)?,
            };
            match residual {
                Some(r) => r + y,
                None => Ok(y),
            }
        };
        // A training layer: the op that packs the weight as it is now and
        // whose backward runs on the packed kernels.
        if let Inner::Trained(t) = &self.inner {
            if let Some(y) = t.forward(x, (lo, hi))? {
                return epilogue_of(y);
            }
        }
        // Whether the packed (or quantized) weight computes these features.
        let serves = match &self.inner {
            Inner::Packed(p) => p.serves_range(lo, hi),
            Inner::Q8(_) | Inner::Blocks(_) => true,
            Inner::Candle(_) | Inner::Trained(_) => false,
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
            // Where the packed path rounds its inputs to bf16, so does
            // this one.
            let x = match &self.inner {
                Inner::Packed(p) if p.rounds_inputs() => &x.to_dtype(DType::BF16)?.to_dtype(x.dtype())?,
                _ => x,
            };
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

    /// The packed or quantized weight's product over plain slices (see
    /// [`PackedWeight::forward`](super::weight::PackedWeight::forward)).
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
                epilogue.apply(q.isa(), &mut y);
                y
            }
            Inner::Blocks(b) => {
                let mut y = b.forward(x, m, range, residual);
                epilogue.apply(b.isa(), &mut y);
                y
            }
            Inner::Candle(_) | Inner::Trained(_) => unreachable!("only packed weights take slices"),
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
