//! The feed-forward block every model here has, and its activations.

use candle::{bail, Module, Result, Tensor};
use candle_nn::Linear;
use multihead_attention::{gelu_tanh_and_mul, silu_and_mul, PackOptions, PackedLinear};
use serde::{Deserialize, Serialize};

use crate::decoder::GatedMlp;

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
    /// `gelu_tanh(gate) * up` over `[gate | up]`: Gemma's gated MLP
    /// (GeGLU, `gelu_pytorch_tanh`), which halves the width.
    #[serde(rename = "geglu")]
    GeGlu,
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
    /// - returns `(..., n)`, or `(..., n / 2)` for the gated
    ///   [`Activation::SwiGlu`] and [`Activation::GeGlu`]
    pub fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Relu => multihead_attention::relu(xs),
            Self::Gelu => xs.gelu_erf(),
            // candle's `gelu` is the tanh approximation.
            Self::GeluTanh => xs.gelu(),
            Self::Silu => xs.silu(),
            Self::SwiGlu => silu_and_mul(xs),
            Self::GeGlu => gelu_tanh_and_mul(xs),
        }
    }

    /// Whether the activation gates one half of its input by the other.
    pub fn is_gated(&self) -> bool {
        matches!(self, Self::SwiGlu | Self::GeGlu)
    }
}

/// Two linear layers around an activation, `down(activation(up(x)))`: the
/// feed-forward block of every model here. Each model loads `up` and
/// `down` under its checkpoint's own names (timm's `mlp.fc1`/`mlp.fc2`,
/// `nn.Transformer`'s `linear1`/`linear2`, GPT-2's `mlp.c_fc`/`mlp.c_proj`,
/// Llama's `mlp.gate_proj` and `mlp.up_proj` fused, `mlp.down_proj`).
///
/// Where a weight is packed, the activation (ReLU, both GELUs) is fused
/// into `up`'s write-out, and a residual add into `down`'s
/// ([`Mlp::forward_add`]). A gated MLP (SwiGLU, GeGLU) is the one Llama
/// and Gemma run, written beside Llama (`decoder/llama.rs`).
#[derive(Debug, Clone)]
pub struct Mlp(Kind);

#[derive(Debug, Clone)]
enum Kind {
    Plain {
        /// `(hidden, in)`.
        up: PackedLinear,
        /// `(out, hidden)`.
        down: PackedLinear,
        activation: Activation,
    },
    Gated(GatedMlp),
}

impl Mlp {
    /// `down(activation(up(x)))`; for a gated activation
    /// ([`Activation::SwiGlu`], [`Activation::GeGlu`]), `up` projects to
    /// `[gate | up]` at once.
    pub fn new(up: PackedLinear, down: PackedLinear, activation: Activation) -> Result<Self> {
        if activation.is_gated() {
            return Ok(Self(Kind::Gated(GatedMlp::fused(up, down, activation)?)));
        }
        check_widths(&up, &down, activation)?;
        Ok(Self(Kind::Plain { up, down, activation }))
    }

    /// The SwiGLU MLP `down(silu(gate(x)) * up(x))` from the two linears a
    /// checkpoint stores; see [`Mlp::gated`].
    pub fn swiglu(gate: Linear, up: Linear, down: PackedLinear) -> Result<Self> {
        Self::gated(gate, up, down, Activation::SwiGlu)
    }

    /// The gated MLP `down(act(gate(x)) * up(x))` (`activation` is
    /// [`Activation::SwiGlu`] or [`Activation::GeGlu`]) from the two
    /// linears a checkpoint stores: fused into one projection to `[gate | up]` (one
    /// pass over `x`) where their weights are plain tensors; two where they
    /// are variables, which a fused copy would leave behind as they train,
    /// or the pre-flight's broadcast placeholders (a full-size copy for
    /// nothing).
    pub fn gated(gate: Linear, up: Linear, down: PackedLinear, activation: Activation) -> Result<Self> {
        Self::gated_with(gate, up, down, activation, &PackOptions::default())
    }

    /// [`Mlp::gated`], gate and up packed as `pack` asks (the format, the
    /// instruction set, a GGUF file's lent blocks), as the loader packed
    /// `down`.
    pub fn gated_with(
        gate: Linear,
        up: Linear,
        down: PackedLinear,
        activation: Activation,
        pack: &PackOptions,
    ) -> Result<Self> {
        Ok(Self(Kind::Gated(GatedMlp::new(
            gate, up, down, activation, pack,
        )?)))
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        match &self.0 {
            Kind::Plain { activation, .. } => *activation,
            Kind::Gated(mlp) => mlp.activation(),
        }
    }

    /// The same MLP with its outputs scaled per channel by `gamma`, folded
    /// into `down`'s weights; `None` where they cannot be (see
    /// [`PackedLinear::scaled_outputs`]).
    pub fn with_output_scale(&self, gamma: &Tensor) -> Result<Option<Self>> {
        Ok(match &self.0 {
            Kind::Plain { up, down, activation } => down.scaled_outputs(gamma)?.map(|down| {
                Self(Kind::Plain {
                    up: up.clone(),
                    down,
                    activation: *activation,
                })
            }),
            Kind::Gated(mlp) => mlp.with_output_scale(gamma)?.map(|mlp| Self(Kind::Gated(mlp))),
        })
    }

    /// `residual + mlp(xs)`, the add fused into `down`'s write-out where
    /// its weight is packed.
    ///
    /// # Shapes
    /// - `xs`: `(..., in)`, `residual`: `(..., out)`
    /// - returns `(..., out)`
    pub fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Result<Tensor> {
        match &self.0 {
            Kind::Plain { up, down, activation } => {
                down.forward_add(&plain_hidden(up, *activation, xs)?, residual)
            }
            Kind::Gated(mlp) => mlp.forward_add(xs, residual),
        }
    }
}

impl Module for Mlp {
    /// `(..., in)` → `(..., out)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match &self.0 {
            Kind::Plain { up, down, activation } => down.forward(&plain_hidden(up, *activation, xs)?),
            Kind::Gated(mlp) => mlp.forward(xs),
        }
    }
}

/// `activation(up(x))` of an ungated MLP, fused into `up`'s write-out where
/// it can be.
fn plain_hidden(up: &PackedLinear, activation: Activation, xs: &Tensor) -> Result<Tensor> {
    match activation {
        Activation::Relu => up.forward_relu(xs),
        Activation::Gelu => up.forward_gelu(xs),
        Activation::GeluTanh => up.forward_gelu_tanh(xs),
        act => act.apply(&up.forward(xs)?),
    }
}

/// Checks that `up`'s outputs are what `down` takes after `activation`
/// (twice as many for a gated one, which halves the width).
pub(crate) fn check_widths(up: &PackedLinear, down: &PackedLinear, activation: Activation) -> Result<()> {
    let (up_out, _) = up.dims()?;
    let (_, hidden) = down.dims()?;
    let want = match activation.is_gated() {
        true => hidden.checked_mul(2),
        false => Some(hidden),
    };
    if want != Some(up_out) {
        bail!("Mlp: up has {up_out} outputs, but down takes {hidden} features after {activation:?}")
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle::{DType, Device, Result, Tensor};
    use candle_nn::{linear_b, VarBuilder, VarMap};
    use multihead_attention::PackedLinear;

    use super::{Activation, Kind, Mlp};

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
            ("geglu", Activation::GeGlu),
        ] {
            let json = format!("\"{name}\"");
            assert_eq!(serde_json::from_str::<Activation>(&json).ok(), Some(act));
            assert_eq!(serde_json::to_string(&act).ok(), Some(json));
        }
    }

    fn gate_apart(mlp: &Mlp) -> bool {
        matches!(&mlp.0, Kind::Gated(g) if g.gate_apart())
    }

    /// A SwiGLU MLP over plain tensors projects to gate and up at once (and
    /// `silu_and_mul`s), over variables separately; both give the same
    /// result, and the variables' MLP follows a change to them (no fused
    /// copy left behind), with and without biases.
    #[test]
    fn fused_gate_up_equals_separate_and_variables_stay_live() -> Result<()> {
        let dev = Device::Cpu;
        let (e, i) = (24, 40);
        for bias in [false, true] {
            let build = |vb: VarBuilder| -> Result<Mlp> {
                Mlp::swiglu(
                    linear_b(e, i, bias, vb.pp("gate_proj"))?,
                    linear_b(e, i, bias, vb.pp("up_proj"))?,
                    PackedLinear::from_linear(linear_b(i, e, bias, vb.pp("down_proj"))?)?,
                )
            };
            let varmap = VarMap::new();
            let live = build(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
            assert!(gate_apart(&live));
            let plain = || -> Result<Mlp> {
                let tensors: HashMap<String, Tensor> = varmap
                    .data()
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
                    .collect();
                build(VarBuilder::from_tensors(tensors, DType::F32, &dev))
            };
            let fused = plain()?;
            assert!(!gate_apart(&fused));
            let (x, r) = (
                Tensor::randn(0f32, 1., (2, 5, e), &dev)?,
                Tensor::randn(0f32, 1., (2, 5, e), &dev)?,
            );
            // Largest difference over the largest magnitude.
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                let max = |t: Tensor| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>();
                Ok(max((a - b)?)? / max(b.clone())?)
            };
            assert!(diff(&live.forward_add(&x, &r)?, &fused.forward_add(&x, &r)?)? < 1e-5);
            for var in varmap.all_vars() {
                var.set(&(var.as_tensor() * 2.)?)?;
            }
            let moved = plain()?.forward_add(&x, &r)?;
            assert!(diff(&moved, &fused.forward_add(&x, &r)?)? > 0.1);
            assert!(diff(&live.forward_add(&x, &r)?, &moved)? < 1e-5, "bias {bias}");
        }
        Ok(())
    }
}
