//! The feed-forward block every model here has, and its activations.

use candle::{bail, Module, Result, Tensor};
use candle_nn::Linear;
use multihead_attention::{
    gelu_tanh_and_mul, is_broadcast, silu_and_mul, PackFormat, PackOptions, PackedLinear,
};
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
/// ([`Mlp::forward_add`]).
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `(hidden, in)`; `(2 * hidden, in)` for a gated activation, the
    /// gate's rows first.
    up: PackedLinear,
    /// The gate of a gated MLP whose gate and up cannot be one projection
    /// (see [`Mlp::gated`]); `None` otherwise.
    gate: Option<PackedLinear>,
    /// `(out, hidden)`.
    down: PackedLinear,
    activation: Activation,
}

impl Mlp {
    /// `down(activation(up(x)))`; for a gated activation
    /// ([`Activation::SwiGlu`], [`Activation::GeGlu`]), `up` projects to
    /// `[gate | up]` at once.
    pub fn new(up: PackedLinear, down: PackedLinear, activation: Activation) -> Result<Self> {
        let (up_out, _) = up.dims()?;
        let (_, hidden) = down.dims()?;
        let want = match activation.is_gated() {
            true => hidden.checked_mul(2),
            false => Some(hidden),
        };
        if want != Some(up_out) {
            bail!("Mlp: up has {up_out} outputs, but down takes {hidden} features after {activation:?}")
        }
        Ok(Self {
            up,
            gate: None,
            down,
            activation,
        })
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
        if !activation.is_gated() {
            bail!("Mlp::gated: {activation:?} is not a gated activation")
        }
        let plain = |l: &Linear| {
            !l.weight().is_variable()
                && !is_broadcast(l.weight())
                && l.bias().is_none_or(|b| !b.is_variable())
        };
        // A GGUF file's blocks, lent to the layers (`LentBlocks`): joined
        // where both are in one format, kept apart otherwise.
        if pack.is_lent(gate.weight()) && pack.is_lent(up.weight()) {
            let (gate, up) = (
                PackedLinear::from_linear_with(gate, pack)?,
                PackedLinear::from_linear_with(up, pack)?,
            );
            if gate.joins_with(&up) {
                return Self::new(PackedLinear::cat_with(vec![gate, up], pack)?, down, activation);
            }
            let Self { up, down, .. } = Self::new(up, down, Activation::Silu)?;
            return Ok(Self {
                up,
                gate: Some(gate),
                down,
                activation,
            });
        }
        if plain(&gate) && plain(&up) {
            if gate.bias().is_some() != up.bias().is_some() {
                bail!("Mlp: the gate and up projections must both have a bias or neither")
            }
            let gate_up = if pack.format() != PackFormat::AsStored {
                // Each quantized, its tensors dropped, before the two are
                // joined: no copy of the fused weight in f32 (3.8 times
                // its Q8_0 size) beside them while a model loads. As
                // stored, one fused tensor packed at once leaves the heap
                // less fragmented than two parts and their join.
                let gate = PackedLinear::from_linear_with(gate, pack)?;
                PackedLinear::cat_with(vec![gate, PackedLinear::from_linear_with(up, pack)?], pack)?
            } else {
                let bias = match (gate.bias(), up.bias()) {
                    (Some(g), Some(u)) => Some(Tensor::cat(&[g, u], 0)?),
                    _ => None,
                };
                PackedLinear::with_options(Tensor::cat(&[gate.weight(), up.weight()], 0)?, bias, pack)?
            };
            Self::new(gate_up, down, activation)
        } else {
            let gate = PackedLinear::from_linear_with(gate, pack)?;
            // Checked as an ungated MLP: up's width is down's input.
            let up = PackedLinear::from_linear_with(up, pack)?;
            let Self { up, down, .. } = Self::new(up, down, Activation::Silu)?;
            Ok(Self {
                up,
                gate: Some(gate),
                down,
                activation,
            })
        }
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// The same MLP with its outputs scaled per channel by `gamma`, folded
    /// into `down`'s weights; `None` where they cannot be (see
    /// [`PackedLinear::scaled_outputs`]).
    pub fn with_output_scale(&self, gamma: &Tensor) -> Result<Option<Self>> {
        Ok(self
            .down
            .scaled_outputs(gamma)?
            .map(|down| Self { down, ..self.clone() }))
    }

    /// `activation(up(x))`, fused into `up`'s write-out where it can be.
    fn hidden(&self, xs: &Tensor) -> Result<Tensor> {
        match (self.activation, &self.gate) {
            (Activation::SwiGlu, Some(gate)) => gate.forward(xs)?.silu()? * self.up.forward(xs)?,
            // candle's `gelu` is the tanh approximation.
            (Activation::GeGlu, Some(gate)) => gate.forward(xs)?.gelu()? * self.up.forward(xs)?,
            (Activation::Relu, _) => self.up.forward_relu(xs),
            (Activation::Gelu, _) => self.up.forward_gelu(xs),
            (Activation::GeluTanh, _) => self.up.forward_gelu_tanh(xs),
            (act, _) => act.apply(&self.up.forward(xs)?),
        }
    }

    /// `residual + mlp(xs)`, the add fused into `down`'s write-out where
    /// its weight is packed.
    ///
    /// # Shapes
    /// - `xs`: `(..., in)`, `residual`: `(..., out)`
    /// - returns `(..., out)`
    pub fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.down.forward_add(&self.hidden(xs)?, residual)
    }
}

impl Module for Mlp {
    /// `(..., in)` → `(..., out)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.down.forward(&self.hidden(xs)?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle::{DType, Device, Result, Tensor};
    use candle_nn::{linear_b, VarBuilder, VarMap};
    use multihead_attention::PackedLinear;

    use super::{Activation, Mlp};

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
            assert!(live.gate.is_some());
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
            assert!(fused.gate.is_none());
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
