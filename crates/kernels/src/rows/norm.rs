//! A LayerNorm that trains.

use std::mem::MaybeUninit;

use candle::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use candle_nn::{Init, Module, VarBuilder};

use super::norm_grad::{grads, rms_grads, rms_rows};
use crate::elem::{f32_data, grad_for, with_f32_data};
use crate::runtime::isa::{current, Isa};
use crate::runtime::pool::par_chunks_mut;

/// LayerNorm over the last dim, `torch.nn.LayerNorm` with an affine weight
/// and, unless built with [`LayerNorm::new_no_bias`], a bias.
///
/// candle-nn's `LayerNorm` runs its fused kernel on contiguous inputs, and
/// that kernel has no backward (`apply_op3_no_bwd`), so gradients stop
/// there. On the CPU in f32 this takes this crate's kernel (two passes a
/// row for the mean and variance, vectorised for the processor, rows over
/// the threads, the output never zeroed first), and where the input or
/// the weights track gradients, the same rows as an op with a backward of
/// its own (`norm_grad.rs`); elsewhere candle-nn's fused kernel, or its
/// op-by-op `layer_norm_slow` where gradients flow. Every LayerNorm in
/// this workspace is this one.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    /// The loaded bias, or zeros (a constant, never trained) without one.
    bias: Tensor,
    has_bias: bool,
    eps: f64,
}

impl LayerNorm {
    /// Loads `weight` and `bias` of width `dim` (initialised to 1 and 0 in
    /// a `VarMap`).
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.))?;
        let bias = vb.get_with_hints(dim, "bias", Init::Const(0.))?;
        Ok(Self {
            weight,
            bias,
            has_bias: true,
            eps,
        })
    }

    /// Loads only `weight`: PyTorch's `LayerNorm(dim, bias=False)`.
    pub fn new_no_bias(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.))?;
        let bias = Tensor::zeros(dim, weight.dtype(), weight.device())?;
        Ok(Self {
            weight,
            bias,
            has_bias: false,
            eps,
        })
    }

    /// Whether the norm has a (loaded or trained) bias.
    pub fn has_bias(&self) -> bool {
        self.has_bias
    }

    /// `norm(xs + residual)`, a post-norm block's residual connection
    /// (`nn.Transformer`'s default). On plain f32 CPU tensors of the same
    /// shape, one pass with one output: the sum is never a tensor of its
    /// own (which would cost a fresh buffer and a pass over it); anything
    /// else (gradients, other devices and dtypes, broadcasting) adds, then
    /// normalises.
    pub fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_add_on(xs, residual, current())
    }

    /// [`LayerNorm::forward_add`] with the CPU kernel's rows on `isa` (at
    /// most what the processor runs).
    pub(crate) fn forward_add_on(&self, xs: &Tensor, residual: &Tensor, isa: Isa) -> Result<Tensor> {
        match FusedLayerNorm::for_input(self, xs, isa)? {
            Some(op) if crate::elem::plain_cpu_f32(residual) && xs.dims() == residual.dims() => {
                xs.contiguous()?.apply_op2_no_bwd(&residual.contiguous()?, &op)
            }
            _ => self.forward_on(&(xs + residual)?, isa),
        }
    }

    /// `forward` with the CPU kernel's rows on `isa` (at most what the
    /// processor runs).
    pub(crate) fn forward_on(&self, xs: &Tensor, isa: Isa) -> Result<Tensor> {
        let eps = self.eps as f32;
        if xs.track_op() || self.weight.track_op() || self.bias.track_op() {
            match FusedLayerNorm::for_training(self, xs, isa)? {
                Some(op) => xs.contiguous()?.apply_op3(
                    &self.weight.contiguous()?,
                    &self.bias.contiguous()?,
                    TrainedLayerNorm(op),
                ),
                None => candle_nn::ops::layer_norm_slow(xs, &self.weight, &self.bias, eps),
            }
        } else if let Some(op) = FusedLayerNorm::for_input(self, xs, isa)? {
            // On the CPU in f32, the same rows as `forward_add`'s.
            xs.contiguous()?.apply_op1_no_bwd(&op)
        } else {
            candle_nn::ops::layer_norm(&xs.contiguous()?, &self.weight, &self.bias, eps)
        }
    }
}

/// `LayerNorm(a)` or `LayerNorm(a + b)` over the last dim, row by row over
/// the threads.
pub(super) struct FusedLayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    pub(super) eps: f32,
    isa: Isa,
}

impl FusedLayerNorm {
    /// The op over `x`'s last dim, or `None` where it does not apply
    /// (gradients, other devices and dtypes, a width other than `norm`'s).
    fn for_input(norm: &LayerNorm, x: &Tensor, isa: Isa) -> Result<Option<Self>> {
        let plain = crate::elem::plain_cpu_f32;
        match plain(x) && plain(&norm.weight) && plain(&norm.bias) {
            true => Self::for_training(norm, x, isa),
            false => Ok(None),
        }
    }

    /// The op over `x`'s last dim, whether or not the tensors track
    /// gradients (its forward's, over the weights' values now), or `None`
    /// where it does not apply (other devices and dtypes, a width other
    /// than `norm`'s).
    fn for_training(norm: &LayerNorm, x: &Tensor, isa: Isa) -> Result<Option<Self>> {
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle::DType::F32;
        let dim = norm.weight.dim(0)?;
        if !(f32_cpu(x) && f32_cpu(&norm.weight) && f32_cpu(&norm.bias)) || x.dims().last() != Some(&dim) {
            return Ok(None);
        }
        Ok(Some(FusedLayerNorm {
            weight: norm.weight.to_vec1()?,
            bias: norm.bias.to_vec1()?,
            eps: norm.eps as f32,
            isa,
        }))
    }

    /// The normalised rows of `a` (plus `b`, of `a`'s length).
    pub(super) fn rows(&self, a: &[f32], b: Option<&[f32]>) -> Result<Vec<f32>> {
        let d = self.weight.len();
        if b.is_some_and(|b| b.len() != a.len()) || d == 0 || !a.len().is_multiple_of(d) {
            bail!(
                "layer-norm: inputs of {} and {:?} floats for rows of {d}",
                a.len(),
                b.map(<[f32]>::len)
            )
        }
        // Written row by row below, never zeroed first: a zeroing pass
        // would run on the calling thread while the pool waits.
        let mut out: Vec<f32> = Vec::with_capacity(a.len());
        // Each row in one vectorised call (`simd::layer_norm_row`, compiled
        // for AVX-512, AVX2+FMA and the baseline; the same sums in the same
        // order on each, so the same result).
        let norm_row = |(i, o): (usize, &mut [MaybeUninit<f32>])| {
            let b = b.map(|b| &b[i * d..][..d]);
            crate::rows::simd::layer_norm_row(
                self.isa,
                &a[i * d..][..d],
                b,
                &self.weight,
                &self.bias,
                self.eps,
                o,
            );
        };
        let spare = &mut out.spare_capacity_mut()[..a.len()];
        // About four operations a value (two passes, the scale and shift).
        par_chunks_mut(spare, d, 4 * a.len(), |i, row| norm_row((i, row)));
        // SAFETY: every row was written.
        unsafe { out.set_len(a.len()) };
        Ok(out)
    }
}

impl CustomOp1 for FusedLayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.rows(f32_data(s, l, "layer-norm")?, None)?;
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

impl CustomOp2 for FusedLayerNorm {
    fn name(&self) -> &'static str {
        "add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = self.rows(
            f32_data(s1, l1, "layer-norm")?,
            Some(f32_data(s2, l2, "layer-norm")?),
        )?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

impl Module for LayerNorm {
    /// `(..., dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_on(xs, current())
    }
}

/// `LayerNorm(x)` over the arguments `x`, `γ` and `β` (contiguous f32 CPU
/// tensors), gradients flowing to each that tracks them.
struct TrainedLayerNorm(FusedLayerNorm);

impl CustomOp3 for TrainedLayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm-trained"
    }

    /// The rows of `x` normalised with the `γ` and `β` the op was built
    /// with, which are the values of the other two arguments.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = self.0.rows(f32_data(s1, l1, "layer-norm")?, None)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let gamma_data = gamma.to_vec1::<f32>()?;
        let (dx, dg, db) = with_f32_data([x, &dy], "layer-norm", |[x, dy]| {
            grads(x, dy, &gamma_data, self.0.eps)
        })?;
        Ok((grad_for(x, dx)?, grad_for(gamma, dg)?, grad_for(beta, db)?))
    }
}

/// RMSNorm over the last dim, `x / sqrt(mean(x²) + eps) · weight` (HF's
/// `LlamaRMSNorm`): candle-nn's fused kernel where no gradient flows; where
/// the input or the weight tracks gradients, on f32 CPU tensors an op with
/// a backward of its own (`norm_grad.rs`), elsewhere candle-nn's op-by-op
/// `rms_norm_slow`. candle-nn's own `RmsNorm` runs its fused op there too,
/// which has no backward: the gradients would stop at the norm, silently.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// Added to a weight that trains at each forward ([`RmsNorm::with_offset`]).
    offset: f64,
}

impl RmsNorm {
    /// Loads `weight` of width `dim` (initialised to 1 in a `VarMap`).
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.))?;
        Ok(Self::from_weight(weight, eps))
    }

    /// HF's Gemma norms (`Gemma2RMSNorm`), which scale by `offset + w`
    /// (`1.0 + weight.float()`): `weight` loaded as [`RmsNorm::new`] loads
    /// it, initialised to `1 - offset` in a `VarMap` (a scale of 1), then
    /// [`RmsNorm::with_offset`].
    pub fn new_with_offset(dim: usize, eps: f64, offset: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1. - offset))?;
        Self::from_weight(weight, eps).with_offset(offset)
    }

    /// The norm over a weight already loaded.
    pub fn from_weight(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps,
            offset: 0.,
        }
    }

    /// The norm scaling by `offset + weight`, the sum taken in f32: once
    /// here for a plain weight; at each forward for one that trains, so
    /// that a step writing the weight moves the norm and its gradient
    /// reaches the weight.
    pub fn with_offset(self, offset: f64) -> Result<Self> {
        if offset == 0. || self.weight.track_op() {
            return Ok(Self { offset, ..self });
        }
        Ok(Self {
            weight: plus(&self.weight, offset)?,
            offset: 0.,
            ..self
        })
    }

    /// The weight, `(dim,)`: as loaded, the offset added unless it trains.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

/// `offset + w`, in f32 (as HF computes Gemma's `1.0 + weight.float()`),
/// in `w`'s dtype.
fn plus(w: &Tensor, offset: f64) -> Result<Tensor> {
    w.to_dtype(candle::DType::F32)?
        .affine(1., offset)?
        .to_dtype(w.dtype())
}

impl Module for RmsNorm {
    /// `(..., dim)` → `(..., dim)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        if self.offset != 0. {
            let scale = Self::from_weight(plus(&self.weight, self.offset)?, self.eps);
            return scale.forward(xs);
        }
        let eps = self.eps as f32;
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle::DType::F32;
        let trains = xs.track_op() || self.weight.track_op();
        if trains
            && f32_cpu(xs)
            && f32_cpu(&self.weight)
            && xs.dims().last() == Some(&self.weight.elem_count())
        {
            xs.contiguous()?
                .apply_op2(&self.weight.contiguous()?, TrainedRmsNorm { eps })
        } else if trains || !xs.is_contiguous() {
            candle_nn::ops::rms_norm_slow(xs, &self.weight, eps)
        } else {
            candle_nn::ops::rms_norm(xs, &self.weight, eps)
        }
    }
}

/// `RmsNorm(x)` over the arguments `x` and `w` (contiguous f32 CPU
/// tensors), gradients flowing to each that tracks them.
struct TrainedRmsNorm {
    eps: f32,
}

impl CustomOp2 for TrainedRmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-trained"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = rms_rows(
            f32_data(s1, l1, "rms-norm")?,
            f32_data(s2, l2, "rms-norm")?,
            self.eps,
        )?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let w_data = w.to_vec1::<f32>()?;
        let (dx, dw) = with_f32_data([x, &dy], "rms-norm", |[x, dy]| {
            rms_grads(x, dy, &w_data, self.eps)
        })?;
        Ok((grad_for(x, dx)?, grad_for(w, dw)?))
    }
}

#[cfg(test)]
mod tests {
    use candle::{DType, Device, Module, Result, Tensor};
    use candle_nn::{VarBuilder, VarMap};

    use super::{LayerNorm, RmsNorm};
    use crate::testing::{randn, rel_err};

    /// RMSNorm's output equals candle-nn's fused kernel's where nothing
    /// trains, and where the input and weight are variables, its gradients
    /// reach both and equal those of the formula written op by op here
    /// (candle-nn's `RmsNorm` gives the input none: its fused op has no
    /// backward).
    #[test]
    fn rms_norm_trains_through_its_input() -> Result<()> {
        // One block of rows of the backward, and several with a partial one.
        for dims in [[3, 5, 40], [2, 40, 33]] {
            let d = dims[2];
            let (x, w, g) = (randn(&dims)?, randn(&[d])?, randn(&dims)?);
            let eps = 1e-6;
            let ours = RmsNorm::from_weight(w.clone(), eps).forward(&x)?;
            let fused = candle_nn::RmsNorm::new(w.clone(), eps).forward(&x)?;
            assert!(rel_err(&ours, &fused)? < 1e-6);

            let (xv, wv) = (candle::Var::from_tensor(&x)?, candle::Var::from_tensor(&w)?);
            let y = RmsNorm::from_weight(wv.as_tensor().clone(), eps).forward(xv.as_tensor())?;
            assert!(rel_err(&y, &fused)? < 1e-6, "{dims:?}: the training forward");
            let grads = (y * &g)?.sum_all()?.backward()?;
            let (xr, wr) = (candle::Var::from_tensor(&x)?, candle::Var::from_tensor(&w)?);
            let rms = (xr.as_tensor().sqr()?.mean_keepdim(2)? + eps)?.sqrt()?;
            let expected = xr
                .as_tensor()
                .broadcast_div(&rms)?
                .broadcast_mul(wr.as_tensor())?;
            let want = (expected * &g)?.sum_all()?.backward()?;
            for (ours, theirs, name) in [(&xv, &xr, "x"), (&wv, &wr, "weight")] {
                let (Some(a), Some(b)) = (grads.get(ours.as_tensor()), want.get(theirs.as_tensor())) else {
                    candle::bail!("no gradient for {name}")
                };
                assert!(rel_err(a, b)? < 1e-5, "{dims:?}: {name}");
            }
            let dropped = candle_nn::RmsNorm::new(wv.as_tensor().clone(), eps).forward(xv.as_tensor())?;
            let grads = (dropped * &g)?.sum_all()?.backward()?;
            assert!(
                grads.get(xv.as_tensor()).is_none(),
                "candle-nn's RmsNorm backpropagates now: RmsNorm could be it"
            );
        }
        Ok(())
    }

    /// The CPU kernel's `norm(x)` and one-pass `norm(x + residual)` equal
    /// candle-nn's op-by-op `layer_norm_slow` (after the add), with and
    /// without a bias, on widths off the 16 lanes, batched and not, in
    /// parallel and not, and fall back where the kernel does not apply.
    #[test]
    fn forward_add_equals_add_then_norm() -> Result<()> {
        for (shape, bias) in [
            (vec![3, 5, 37], true),
            (vec![700, 64], false),
            (vec![2, 1, 512], true),
        ] {
            let d = *shape.last().unwrap();
            let w = randn(&[d])?.affine(0.5, 1.)?;
            let b = randn(&[d])?;
            let vb = VarBuilder::from_tensors(
                [("weight".to_string(), w), ("bias".to_string(), b)].into(),
                DType::F32,
                &Device::Cpu,
            );
            let norm = if bias {
                LayerNorm::new(d, 1e-5, vb)?
            } else {
                LayerNorm::new_no_bias(d, 1e-5, vb)?
            };
            let (x, r) = (randn(&shape)?.affine(3., 2.)?, randn(&shape)?);
            let slow = |x: &Tensor| candle_nn::ops::layer_norm_slow(x, &norm.weight, &norm.bias, 1e-5);
            assert!(rel_err(&norm.forward(&x)?, &slow(&x)?)? < 1e-5, "{shape:?} norm");
            let expected = slow(&(&x + &r)?)?;
            assert!(
                rel_err(&norm.forward_add(&x, &r)?, &expected)? < 1e-5,
                "{shape:?}"
            );
            // A strided input, and a residual that is a broadcast view
            // (both copied to contiguous first).
            let xt = x.t()?.contiguous()?.t()?;
            assert!(
                rel_err(&norm.forward_add(&xt, &r)?, &expected)? < 1e-5,
                "{shape:?} strided"
            );
            let row = r.narrow(0, 0, 1)?;
            let expected = norm.forward(&x.broadcast_add(&row)?)?;
            assert!(rel_err(&norm.forward_add(&x, &row.broadcast_as(x.shape())?)?, &expected)? < 1e-5);
        }
        // Variables: the gradient reaches the input through the fallback.
        let varmap = VarMap::new();
        let norm = LayerNorm::new(
            8,
            1e-5,
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        )?;
        let x = candle::Var::from_tensor(&randn(&[2, 8])?)?;
        let y = norm.forward_add(x.as_tensor(), &Tensor::ones((2, 8), DType::F32, &Device::Cpu)?)?;
        let grads = y.sqr()?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some());
        Ok(())
    }

    /// Every instruction set the processor runs gives the same floats, bit
    /// for bit (each row's sums are taken in the same order on each), for
    /// `norm(x)` and `norm(x + residual)`, on widths off and on the 16
    /// lanes.
    #[test]
    fn every_instruction_set_gives_the_same_floats() -> Result<()> {
        use crate::runtime::isa::supported;
        for d in [37, 512, 768] {
            let vb = VarBuilder::from_tensors(
                [
                    ("weight".to_string(), randn(&[d])?.affine(0.5, 1.)?),
                    ("bias".to_string(), randn(&[d])?),
                ]
                .into(),
                DType::F32,
                &Device::Cpu,
            );
            let norm = LayerNorm::new(d, 1e-5, vb)?;
            let (x, r) = (randn(&[300, d])?.affine(3., 2.)?, randn(&[300, d])?);
            let mut outs = Vec::new();
            for isa in supported() {
                let bits = |t: Tensor| -> Result<Vec<u32>> {
                    Ok(t.flatten_all()?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(f32::to_bits)
                        .collect())
                };
                outs.push((
                    isa,
                    bits(norm.forward_on(&x, isa)?)?,
                    bits(norm.forward_add_on(&x, &r, isa)?)?,
                ));
            }
            let (first, norm_bits, add_bits) = &outs[0];
            for (isa, n, a) in &outs[1..] {
                assert!(
                    n == norm_bits,
                    "width {d}: norm(x) on {isa:?} differs from {first:?}"
                );
                assert!(
                    a == add_bits,
                    "width {d}: norm(x + r) on {isa:?} differs from {first:?}"
                );
            }
        }
        Ok(())
    }
}
