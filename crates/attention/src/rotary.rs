//! Rotary position embeddings, in the two pairings real checkpoints use.
//!
//! Ports `apply_rotary_pos_emb` of HF transformers'
//! `models/llama/modeling_llama.py` (half-split, `rotate_half`; GPT-NeoX's
//! partial `rotary_pct` too) and `models/gptj/modeling_gptj.py`
//! (interleaved, `rotate_every_two`, partial `rotary_dim`).

use candle::{bail, DType, Result, Tensor, D};

use crate::config::{RotaryConfig, RotaryStyle};

/// A rotary embedding for heads of `head_dim` features.
#[derive(Debug, Clone)]
pub struct Rotary {
    /// `theta^(-2i / dims)` for `i < dims / 2`, in f32 as HF computes it.
    inv_freq: Vec<f32>,
    dims: usize,
    head_dim: usize,
    style: RotaryStyle,
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
        let mut inv_freq: Vec<f32> = (0..dims / 2)
            .map(|i| 1. / theta.powf((2 * i) as f32 / dims as f32))
            .collect();
        if let Some(scaling) = &cfg.scaling {
            scaling.validate()?;
            scaling.apply(&mut inv_freq);
        }
        Ok(Self {
            inv_freq,
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
    /// in f32.
    fn cos_sin(&self, positions: &Tensor, device: &candle::Device) -> Result<(Tensor, Tensor)> {
        let (b, t) = match *positions.dims() {
            [b, t] => (b, t),
            ref dims => bail!("Rotary: positions must be (batch, seq), found {dims:?}"),
        };
        let half = self.dims / 2;
        let inv_freq = Tensor::new(self.inv_freq.as_slice(), device)?.reshape((1, 1, 1, half))?;
        let freqs = positions
            .to_dtype(DType::F32)?
            .reshape((b, 1, t, 1))?
            .broadcast_mul(&inv_freq)?;
        Ok((freqs.cos()?, freqs.sin()?))
    }

    /// Rotates `x` by the angles `cos`, `sin` from [`Rotary::cos_sin`].
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, h, t, hd) = x.dims4()?;
        if hd != self.head_dim {
            bail!("Rotary: x has head_dim {hd}, expected {}", self.head_dim)
        }
        let (cb, _, ct, _) = cos.dims4()?;
        if (cb, ct) != (b, t) {
            bail!("Rotary: positions must be (batch, seq) = ({b}, {t}), found ({cb}, {ct})")
        }
        let half = self.dims / 2;
        if !x.track_op() && x.dtype() == DType::F32 {
            return self.apply_fused(x, cos, sin);
        }
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

#[cfg(test)]
mod tests {
    use candle::{Device, Result, Tensor, Var};

    use super::Rotary;
    use crate::config::{RotaryConfig, RotaryStyle};

    /// The fused kernels (plain inputs) equal the tensor-op path (inputs
    /// that track gradients), in both pairings, whole and partial, with
    /// per-row positions.
    #[test]
    fn fused_equals_differentiable_path() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 3, 5, 16), &dev)?;
        let tracked = Var::from_tensor(&x)?;
        let positions = Tensor::new(&[[0u32, 1, 2, 3, 4], [7, 8, 9, 10, 11]], &dev)?;
        for style in [RotaryStyle::HalfSplit, RotaryStyle::Interleaved] {
            for dims in [16, 8] {
                let rotary = Rotary::new(&RotaryConfig::new(10_000.).with_dims(dims).with_style(style), 16)?;
                let fused = rotary.apply(&x, &positions)?;
                let slow = rotary.apply(tracked.as_tensor(), &positions)?;
                let err = (fused - slow)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert!(err < 1e-6, "{style:?} dims {dims}: {err}");
            }
        }
        Ok(())
    }
}
