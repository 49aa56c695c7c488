//! Rotary position embeddings, in the two pairings real checkpoints use.
//!
//! Ports `apply_rotary_pos_emb` of HF transformers'
//! `models/llama/modeling_llama.py` (half-split, `rotate_half`; GPT-NeoX's
//! partial `rotary_pct` too) and `models/gptj/modeling_gptj.py`
//! (interleaved, `rotate_every_two`, partial `rotary_dim`), with the
//! frequency scalings of `modeling_rope_utils.py` ([`RopeScaling`]).

use candle::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

use crate::config::{RopeScaling, RotaryConfig, RotaryStyle};
use crate::handover::Handover;

/// A rotary embedding for heads of `head_dim` features.
#[derive(Debug, Clone)]
pub struct Rotary {
    /// `theta^(-2i / dims)` for `i < dims / 2`, in f32 as HF computes it
    /// (rescaled; LongRoPE's short set).
    inv_freq: Vec<f32>,
    /// LongRoPE's frequencies for calls that reach past the original
    /// context.
    long: Option<LongFreqs>,
    /// The scale of cos and sin (LongRoPE's `attention_factor`; 1 for the
    /// others).
    attention_factor: f32,
    dims: usize,
    head_dim: usize,
    style: RotaryStyle,
}

/// The frequencies a call whose positions reach past `after` uses.
#[derive(Debug, Clone)]
struct LongFreqs {
    inv_freq: Vec<f32>,
    after: usize,
}

impl Rotary {
    /// The embedding `cfg` describes over heads of `head_dim` features.
    pub fn new(cfg: &RotaryConfig, head_dim: usize) -> Result<Self> {
        let dims = cfg.dims.unwrap_or(head_dim);
        if dims == 0 || !dims.is_multiple_of(2) || dims > head_dim {
            bail!("Rotary: dims must be even and in 1..=head_dim ({head_dim}), found {dims}")
        }
        if !cfg.theta.is_finite() || cfg.theta <= 1. {
            bail!("Rotary: theta must be finite and > 1, found {}", cfg.theta)
        }
        // HF: 1 / base ** (arange(0, dim, 2).float() / dim), in f32.
        let theta = cfg.theta as f32;
        let wavelengths: Vec<f32> = (0..dims / 2)
            .map(|i| theta.powf((2 * i) as f32 / dims as f32))
            .collect();
        let mut inv_freq: Vec<f32> = wavelengths.iter().map(|w| 1. / w).collect();
        let (mut long, mut attention_factor) = (None, 1.);
        if let Some(scaling) = &cfg.scaling {
            scaling.validate()?;
        }
        match &cfg.scaling {
            None => {}
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor: scale,
            }) => {
                if short_factor.len() != dims / 2 {
                    bail!(
                        "Rotary: LongRoPE needs one factor per rotated pair ({} for {dims} rotated dims), found {}",
                        dims / 2,
                        short_factor.len()
                    )
                }
                // `_compute_longrope_parameters`: 1 / (ext_factors * base ** (arange(0, dim, 2) / dim)).
                let scaled = |factors: &[f64]| -> Vec<f32> {
                    wavelengths
                        .iter()
                        .zip(factors)
                        .map(|(w, &f)| 1. / (f as f32 * w))
                        .collect()
                };
                inv_freq = scaled(short_factor);
                long = Some(LongFreqs {
                    inv_freq: scaled(long_factor),
                    after: *original_max_position_embeddings,
                });
                attention_factor = *scale as f32;
            }
            Some(scaling) => scaling.apply(&mut inv_freq),
        }
        Ok(Self {
            inv_freq,
            long,
            attention_factor,
            dims,
            head_dim,
            style: cfg.style,
        })
    }

    /// Rotates `x` at `positions`.
    ///
    /// # Shapes
    /// - `x`: `(batch, heads, seq, head_dim)`
    /// - `positions`: `(batch, seq)`, `u32`: each token's position (the
    ///   cache length plus its index, less the row's left padding)
    /// - returns the shape of `x`, in its dtype
    pub fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (cos, sin) = self.cos_sin(positions, x.device())?;
        self.rotate(x, &cos, &sin)
    }

    /// [`Rotary::apply`] to queries and keys at the same positions, the
    /// angles computed once.
    pub fn apply_qk(&self, q: &Tensor, k: &Tensor, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.cos_sin(positions, q.device())?;
        Ok((self.rotate(q, &cos, &sin)?, self.rotate(k, &cos, &sin)?))
    }

    /// `(cos, sin)` of the angles at `positions` `(batch, seq)`, each
    /// `(batch, 1, seq, rot/2)`: HF's `position_ids.float() @ inv_freq`,
    /// in f32, times the attention factor where there is one.
    fn cos_sin(&self, positions: &Tensor, device: &candle::Device) -> Result<(Tensor, Tensor)> {
        let (b, t) = match *positions.dims() {
            [b, t] => (b, t),
            ref dims => bail!("Rotary: positions must be (batch, seq), found {dims:?}"),
        };
        let half = self.dims / 2;
        let inv_freq = match &self.long {
            // HF's `longrope_frequency_update`: the set is chosen once for
            // the whole call, by `max(position_ids) + 1`.
            Some(long) if b * t > 0 && Self::reach(positions)? > long.after => &long.inv_freq,
            _ => &self.inv_freq,
        };
        let inv_freq = Tensor::new(inv_freq.as_slice(), device)?.reshape((1, 1, 1, half))?;
        let freqs = positions
            .to_dtype(DType::F32)?
            .reshape((b, 1, t, 1))?
            .broadcast_mul(&inv_freq)?;
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        if self.attention_factor == 1. {
            return Ok((cos, sin));
        }
        let scale = f64::from(self.attention_factor);
        Ok((cos.affine(scale, 0.)?, sin.affine(scale, 0.)?))
    }

    /// `max(positions) + 1` of non-empty `(batch, seq)` `u32` positions.
    fn reach(positions: &Tensor) -> Result<usize> {
        let max = positions
            .to_dtype(DType::U32)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<u32>()?;
        Ok(max as usize + 1)
    }

    /// Rotates `x` by the angles `cos`, `sin` from [`Rotary::cos_sin`].
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, _, t, hd) = x.dims4()?;
        if hd != self.head_dim {
            bail!("Rotary: x has head_dim {hd}, expected {}", self.head_dim)
        }
        let (cb, _, ct, _) = cos.dims4()?;
        if (cb, ct) != (b, t) {
            bail!("Rotary: positions must be (batch, seq) = ({b}, {t}), found ({cb}, {ct})")
        }
        if x.dtype() == DType::F32 {
            if !x.track_op() {
                return self.apply_fused(x, cos, sin);
            }
            if x.device().is_cpu() {
                // One op whose backward rotates the gradient back: the
                // tensor ops below would each give candle's backward a
                // zeroed buffer and a sum.
                let out = self.apply_fused(&x.detach(), cos, sin)?;
                let op = TrainedRotation {
                    rotary: self.clone(),
                    cos: cos.clone(),
                    sin: sin.clone(),
                    out: Handover::new(out),
                };
                return x.apply_op1(op);
            }
        }
        self.rotate_by_ops(x, cos, sin)
    }

    /// [`Rotary::rotate`] in candle's tensor ops, which backpropagate on
    /// every device and dtype.
    fn rotate_by_ops(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, h, t, hd) = x.dims4()?;
        let half = self.dims / 2;
        let dtype = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let rot = xf.narrow(D::Minus1, 0, self.dims)?;
        // The two members of each rotated pair, (B, H, T, rot/2) each.
        let (x1, x2) = match self.style {
            RotaryStyle::HalfSplit => (
                rot.narrow(D::Minus1, 0, half)?,
                rot.narrow(D::Minus1, half, half)?,
            ),
            RotaryStyle::Interleaved => {
                let pairs = rot.reshape((b, h, t, half, 2))?;
                let member = |i: usize| pairs.narrow(D::Minus1, i, 1)?.squeeze(D::Minus1);
                (member(0)?, member(1)?)
            }
        };
        let y1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let y2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
        let rotated = match self.style {
            RotaryStyle::HalfSplit => Tensor::cat(&[&y1, &y2], D::Minus1)?,
            RotaryStyle::Interleaved => Tensor::stack(&[&y1, &y2], D::Minus1)?.flatten_from(3)?,
        };
        let out = if self.dims < hd {
            Tensor::cat(
                &[&rotated, &xf.narrow(D::Minus1, self.dims, hd - self.dims)?],
                D::Minus1,
            )?
        } else {
            rotated
        };
        out.to_dtype(dtype)
    }

    /// [`Rotary::apply`] through candle's fused kernels (`rope`,
    /// `rope_i`; one pass, no temporaries), for f32 inputs that track no
    /// gradients (the kernels have no backward). `cos`, `sin`:
    /// `(B, 1, T, rot/2)`.
    fn apply_fused(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = x.dim(D::Minus1)?;
        let cs = |t: &Tensor| t.squeeze(1)?.contiguous();
        let (cos, sin) = (cs(cos)?, cs(sin)?);
        let rot = x.narrow(D::Minus1, 0, self.dims)?.contiguous()?;
        let rotated = match self.style {
            RotaryStyle::HalfSplit => candle_nn::rotary_emb::rope(&rot, &cos, &sin)?,
            RotaryStyle::Interleaved => candle_nn::rotary_emb::rope_i(&rot, &cos, &sin)?,
        };
        if self.dims == hd {
            return Ok(rotated);
        }
        Tensor::cat(
            &[&rotated, &x.narrow(D::Minus1, self.dims, hd - self.dims)?],
            D::Minus1,
        )
    }
}

/// A rotation by the angles `cos`, `sin` (`(B, 1, T, rot/2)`) whose
/// gradient is the rotation by the opposite angles: the forward, computed
/// before the op is applied, is handed over by `cpu_fwd`.
struct TrainedRotation {
    rotary: Rotary,
    cos: Tensor,
    sin: Tensor,
    /// The rotated input, until `cpu_fwd` takes it.
    out: Handover,
}

impl CustomOp1 for TrainedRotation {
    fn name(&self) -> &'static str {
        "rotary"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.take("rotary")
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The rotation is orthogonal: its transpose turns by -θ, which
        // keeps cos and negates sin. Features past the rotated ones pass.
        let back = self.rotary.apply_fused(grad, &self.cos, &self.sin.neg()?)?;
        Ok(Some(back))
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Result, Tensor, Var};

    use super::Rotary;
    use crate::config::{RotaryConfig, RotaryStyle};

    /// The fused kernels (plain inputs) and the trained op (inputs that
    /// track gradients) equal the tensor-op path, outputs and gradients,
    /// in both pairings, whole and partial, with per-row positions.
    #[test]
    fn fused_equals_differentiable_path() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 3, 5, 16), &dev)?;
        let tracked = Var::from_tensor(&x)?;
        let positions = Tensor::new(&[[0u32, 1, 2, 3, 4], [7, 8, 9, 10, 11]], &dev)?;
        let max_diff =
            |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar() };
        for style in [RotaryStyle::HalfSplit, RotaryStyle::Interleaved] {
            for dims in [16, 8] {
                let rotary = Rotary::new(&RotaryConfig::new(10_000.).with_dims(dims).with_style(style), 16)?;
                let (cos, sin) = rotary.cos_sin(&positions, &dev)?;
                let by_ops = rotary.rotate_by_ops(tracked.as_tensor(), &cos, &sin)?;
                let fused = rotary.apply(&x, &positions)?;
                let trained = rotary.apply(tracked.as_tensor(), &positions)?;
                for (what, out) in [("fused", &fused), ("trained", &trained)] {
                    let err = max_diff(out, &by_ops)?;
                    assert!(err < 1e-6, "{style:?} dims {dims}: {what} {err}");
                }
                let g = Tensor::randn(0f32, 1., by_ops.shape(), &dev)?;
                let ours = (trained * &g)?.sum_all()?.backward()?;
                let theirs = (by_ops * &g)?.sum_all()?.backward()?;
                let (Some(a), Some(b)) = (ours.get(tracked.as_tensor()), theirs.get(tracked.as_tensor()))
                else {
                    candle::bail!("no gradient")
                };
                let err = max_diff(a, b)?;
                assert!(err < 1e-6, "{style:?} dims {dims}: gradient {err}");
            }
        }
        Ok(())
    }
}
