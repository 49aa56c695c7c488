//! The feed-forward block every model here has, and its activations.

use candle::{bail, Result, Tensor};
use multihead_attention::silu_and_mul;
use serde::{Deserialize, Serialize};

/// A feed-forward activation.
///
/// Serialised by the names `nn.Transformer` takes for its `activation`
/// (`"relu"`, `"gelu"`), and the others in the same style; HF configs
/// name them otherwise, read by [`Activation::from_hf_name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `F.relu` (PyTorch's default): NaN stays NaN, as in PyTorch.
    #[default]
    Relu,
    /// `F.gelu` with its default `approximate="none"`: the exact, erf-based
    /// GELU.
    Gelu,
    /// `F.gelu(approximate="tanh")`, HF's `gelu_new` (GPT-2's).
    GeluTanh,
    /// `F.silu`, also called swish.
    Silu,
    /// `silu(gate) * up` over `[gate | up]`, the two halves of the last
    /// dim: the gated activation of Llama's MLP (SwiGLU), which halves the
    /// width.
    #[serde(rename = "swiglu")]
    SwiGlu,
}

impl Activation {
    /// The activation of an HF config's `activation_function` or
    /// `hidden_act` for an ungated MLP; `label` names the config in errors.
    pub fn from_hf_name(name: &str, label: &str) -> Result<Self> {
        Ok(match name {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Self::GeluTanh,
            "gelu" => Self::Gelu,
            "relu" => Self::Relu,
            "silu" | "swish" => Self::Silu,
            other => bail!(
                "{label}: activation '{other}' is not supported (gelu_new, gelu_pytorch_tanh, gelu, relu, silu)"
            ),
        })
    }

    /// Applies the activation.
    ///
    /// # Shapes
    /// - `xs`: `(..., n)`
    /// - returns `(..., n)`, or `(..., n / 2)` for [`Activation::SwiGlu`]
    pub fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Relu => multihead_attention::relu(xs),
            Self::Gelu => xs.gelu_erf(),
            // candle's `gelu` is the tanh approximation.
            Self::GeluTanh => xs.gelu(),
            Self::Silu => xs.silu(),
            Self::SwiGlu => silu_and_mul(xs),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::Activation;

    /// PyTorch's `relu` keeps NaN (candle's own turns it into 0).
    #[test]
    fn relu_keeps_nan() -> candle::Result<()> {
        let x = Tensor::new(
            &[f32::NAN, -1., 2., f32::NEG_INFINITY, f32::INFINITY],
            &Device::Cpu,
        )?;
        let y = Activation::Relu.apply(&x)?.to_vec1::<f32>()?;
        assert!(y[0].is_nan());
        assert_eq!(y[1..], [0., 2., 0., f32::INFINITY]);
        Ok(())
    }

    /// The names `nn.Transformer` configs use still read, and every kind
    /// round-trips.
    #[test]
    fn serde_names() {
        for (name, act) in [
            ("relu", Activation::Relu),
            ("gelu", Activation::Gelu),
            ("gelu_tanh", Activation::GeluTanh),
            ("silu", Activation::Silu),
            ("swiglu", Activation::SwiGlu),
        ] {
            let json = format!("\"{name}\"");
            assert_eq!(serde_json::from_str::<Activation>(&json).ok(), Some(act));
            assert_eq!(serde_json::to_string(&act).ok(), Some(json));
        }
    }
}
