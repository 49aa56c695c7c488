//! A LayerNorm that trains.

use candle::{Result, Tensor};
use candle_nn::{Init, Module, VarBuilder};

/// LayerNorm over the last dim, `torch.nn.LayerNorm` with an affine weight
/// and, unless built with [`LayerNorm::new_no_bias`], a bias.
///
/// candle-nn's `LayerNorm` runs its fused kernel on contiguous inputs, and
/// that kernel has no backward (`apply_op3_no_bwd`), so gradients stop
/// there. When the input or the weights track gradients this takes
/// candle-nn's op-by-op `layer_norm_slow`, otherwise the fused kernel.
/// Every LayerNorm in this workspace is this one.
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
}

impl Module for LayerNorm {
    /// `(..., dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let eps = self.eps as f32;
        if xs.track_op() || self.weight.track_op() || self.bias.track_op() {
            candle_nn::ops::layer_norm_slow(xs, &self.weight, &self.bias, eps)
        } else {
            candle_nn::ops::layer_norm(&xs.contiguous()?, &self.weight, &self.bias, eps)
        }
    }
}
