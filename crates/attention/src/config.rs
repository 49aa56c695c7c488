//! The configuration of a [`crate::MultiheadAttention`], mirroring the
//! constructor of PyTorch's `nn.MultiheadAttention`.

use candle::{bail, Result};
use serde::{Deserialize, Serialize};

/// Constructor arguments of `torch.nn.MultiheadAttention`, plus a `scale`
/// override (as `F.scaled_dot_product_attention` has) and `qkv_bias` for
/// checkpoints whose input projection has no bias while the output
/// projection has one (timm's `qkv_bias=False`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MhaConfig {
    /// Model width `E`: the query's feature size and the output's.
    pub embed_dim: usize,
    /// Number of heads; `embed_dim` must be divisible by it.
    pub num_heads: usize,
    /// Dropout probability on the attention weights, applied in training
    /// only.
    #[serde(default)]
    pub dropout: f32,
    /// Whether the input and output projections have biases.
    #[serde(default = "default_true")]
    pub bias: bool,
    /// Overrides `bias` for the input (q/k/v) projection only.
    #[serde(default)]
    pub qkv_bias: Option<bool>,
    /// Learned `bias_k` and `bias_v` appended to the keys and values.
    #[serde(default)]
    pub add_bias_kv: bool,
    /// Appends a zero key and value after projection.
    #[serde(default)]
    pub add_zero_attn: bool,
    /// Feature size of the key input (default `embed_dim`).
    #[serde(default)]
    pub kdim: Option<usize>,
    /// Feature size of the value input (default `embed_dim`).
    #[serde(default)]
    pub vdim: Option<usize>,
    /// Score scale (default `1 / sqrt(head_dim)`).
    #[serde(default)]
    pub scale: Option<f64>,
    /// LayerNorm over `head_dim` on queries and keys after the head split
    /// (timm's `qk_norm=True`: `q_norm`, `k_norm`).
    #[serde(default)]
    pub qk_norm: bool,
    /// Epsilon of the qk-norm LayerNorms (timm ViT: 1e-6).
    #[serde(default = "default_qk_norm_eps")]
    pub qk_norm_eps: f64,
    /// Added to an RMSNorm qk-norm's weight (Gemma 3's norms scale by `1 +
    /// w`; 0 for the others): `RmsNorm::new_with_offset`.
    #[serde(default)]
    pub qk_norm_offset: f64,
    /// Width of each head (default `embed_dim / num_heads`); another value
    /// makes the query projection `num_heads * head_dim` wide and the
    /// output projection read that width back to `embed_dim` (Qwen3,
    /// Gemma).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// How qk-norm normalises (with `qk_norm`): timm's LayerNorm (default)
    /// or an RMSNorm with a weight only, per head (Qwen3) or over all heads
    /// at once (OLMo 2).
    #[serde(default)]
    pub qk_norm_kind: NormKind,
    /// Key/value heads (default `num_heads`): fewer is grouped-query
    /// attention (Llama 2 70B, Mistral), one is multi-query. The key and
    /// value projections then have `num_kv_heads * head_dim` outputs.
    #[serde(default)]
    pub num_kv_heads: Option<usize>,
    /// Positions encoded after the projection: rotary on q and k, or an
    /// ALiBi bias on the scores.
    #[serde(default)]
    pub position: PositionEncoding,
    /// Sliding-window causal attention (Mistral's `sliding_window`): with a
    /// causal rule, a query sees at most this many keys, the newest ones.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Logit soft-capping (Gemma 2's `attn_logit_softcapping`): scores
    /// become `cap · tanh(s / cap)` before the mask and the softmax,
    /// computed inside the CPU kernel ([`crate::Mask::softcap`]).
    #[serde(default)]
    pub softcap: Option<f32>,
}

/// A normalisation over the features of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// LayerNorm with weight and bias (timm: `q_norm`, `k_norm`).
    #[default]
    LayerNorm,
    /// RMSNorm with a weight only (`Qwen3RMSNorm`).
    RmsNorm,
    /// RMSNorm with a weight only over all heads' features of a token at
    /// once, `heads * head_dim` wide (OLMo 2's `q_norm` and `k_norm`,
    /// before its projections are split into heads).
    RmsNormAllHeads,
}

/// How token positions enter the attention, beside any mask.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEncoding {
    /// None here (learned or sinusoidal embeddings added to the input).
    #[default]
    None,
    /// Rotary position embeddings on q and k after projection (and after
    /// qk-norm), at each token's position: the cache length plus its index.
    Rotary(RotaryConfig),
    /// ALiBi (Press et al., 2022): `slope_h · (j - i)` added to the score
    /// of query position `i` and key position `j`, with the paper's
    /// geometric slopes per head, computed in the kernel without a matrix.
    Alibi,
}

/// Which dims a rotary embedding pairs up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RotaryStyle {
    /// Dim `i` with dim `i + rot/2` (GPT-NeoX, Llama, Mistral:
    /// `rotate_half`).
    #[default]
    HalfSplit,
    /// Dim `2i` with dim `2i + 1` (GPT-J, `rotate_every_two`).
    Interleaved,
}

/// A rotary position embedding (Su et al., RoFormer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotaryConfig {
    /// Base of the frequencies (HF `rope_theta`; 10000 for most models).
    #[serde(default = "default_theta")]
    pub theta: f64,
    /// Leading dims of each head that rotate, even, at most `head_dim`
    /// (default all; GPT-NeoX `rotary_pct`, GPT-J `rotary_dim`); the rest
    /// pass through.
    #[serde(default)]
    pub dims: Option<usize>,
    /// How dims pair up.
    #[serde(default)]
    pub style: RotaryStyle,
    /// Frequency scaling for contexts past the training length (HF
    /// `rope_scaling` / `rope_parameters`), none by default.
    #[serde(default)]
    pub scaling: Option<RopeScaling>,
}

/// How a rotary embedding's frequencies are rescaled, as HF transformers'
/// `modeling_rope_utils` computes them (`rope_type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept,
    /// a smooth blend between (`_compute_llama3_parameters`).
    Llama3 {
        /// The divisor of the low frequencies (8 in Llama 3.1).
        factor: f64,
        /// Wavelengths past `original_max_position_embeddings /
        /// low_freq_factor` count as low.
        low_freq_factor: f64,
        /// Wavelengths under `original_max_position_embeddings /
        /// high_freq_factor` count as high.
        high_freq_factor: f64,
        /// The context the model was first trained for.
        original_max_position_embeddings: usize,
    },
    /// LongRoPE (Phi-3.5, Phi-4-mini; `_compute_longrope_parameters`):
    /// frequency `i` divided by its own factor, `short_factor[i]` while a
    /// call's positions stay within `original_max_position_embeddings`
    /// and `long_factor[i]` for every position of a call that reaches
    /// past it (HF's `longrope_frequency_update`: the longest row's
    /// `max(position_ids) + 1` picks the set); cos and sin scaled by
    /// `attention_factor` in both.
    #[serde(rename = "longrope")]
    LongRope {
        /// One divisor per rotated pair (`dims / 2`), for short contexts.
        short_factor: Vec<f64>,
        /// One divisor per rotated pair, for long contexts.
        long_factor: Vec<f64>,
        /// The context the model was first trained for: a call whose
        /// positions reach past it uses `long_factor`.
        original_max_position_embeddings: usize,
        /// The scale of cos and sin (HF's `attention_scaling`; by default
        /// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`,
        /// which the config reader computes).
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// Checks the values, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        let positive = |name: &str, v: f64| -> Result<()> {
            if !(v.is_finite() && v > 0.) {
                bail!("RopeScaling: {name} must be finite and > 0, found {v}")
            }
            Ok(())
        };
        match *self {
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    bail!(
                        "RopeScaling: high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                    )
                }
                if original_max_position_embeddings == 0 {
                    bail!("RopeScaling: original_max_position_embeddings must be > 0")
                }
                Ok(())
            }
            RopeScaling::LongRope {
                ref short_factor,
                ref long_factor,
                original_max_position_embeddings,
                attention_factor,
            } => {
                positive("attention_factor", attention_factor)?;
                for (name, factors) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.)) {
                        bail!("RopeScaling: every {name} must be finite and > 0, found {f}")
                    }
                }
                if short_factor.len() != long_factor.len() {
                    bail!(
                        "RopeScaling: short_factor has {} entries and long_factor {}; both need one per rotated pair",
                        short_factor.len(),
                        long_factor.len()
                    )
                }
                if original_max_position_embeddings == 0 {
                    bail!("RopeScaling: original_max_position_embeddings must be > 0")
                }
                Ok(())
            }
        }
    }

    /// The context past which a call's positions switch to another set of
    /// frequencies (LongRoPE's `original_max_position_embeddings`); `None`
    /// where the frequencies do not depend on the positions fed.
    pub fn switch_after(&self) -> Option<usize> {
        match *self {
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => Some(original_max_position_embeddings),
            _ => None,
        }
    }

    /// `inv_freq` rescaled, in f32 as HF computes it. LongRoPE's two
    /// sets are computed from the base frequencies by `Rotary::new`.
    pub(crate) fn apply(&self, inv_freq: &mut [f32]) {
        match *self {
            RopeScaling::LongRope { .. } => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (factor as f32, low_freq_factor as f32, high_freq_factor as f32);
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2. * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low) / (high - low);
                        *f = (1. - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

fn default_theta() -> f64 {
    10_000.
}

impl RotaryConfig {
    /// Half-split rotary over all dims with base `theta` (Llama).
    pub fn new(theta: f64) -> Self {
        Self {
            theta,
            dims: None,
            style: RotaryStyle::HalfSplit,
            scaling: None,
        }
    }

    /// The same, with its frequencies rescaled.
    pub fn with_scaling(mut self, scaling: RopeScaling) -> Self {
        self.scaling = Some(scaling);
        self
    }

    /// The same, rotating only the first `dims` dims of each head.
    pub fn with_dims(mut self, dims: usize) -> Self {
        self.dims = Some(dims);
        self
    }

    /// The same, pairing dims as `style` says.
    pub fn with_style(mut self, style: RotaryStyle) -> Self {
        self.style = style;
        self
    }
}

fn default_qk_norm_eps() -> f64 {
    1e-6
}

fn default_true() -> bool {
    true
}

impl MhaConfig {
    /// PyTorch's defaults: `dropout=0`, `bias=True`, no `bias_kv`, no zero
    /// attention, `kdim = vdim = embed_dim`.
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        Self {
            embed_dim,
            num_heads,
            dropout: 0.,
            bias: true,
            qkv_bias: None,
            add_bias_kv: false,
            add_zero_attn: false,
            kdim: None,
            vdim: None,
            scale: None,
            qk_norm: false,
            qk_norm_eps: default_qk_norm_eps(),
            qk_norm_offset: 0.,
            head_dim: None,
            qk_norm_kind: NormKind::LayerNorm,
            num_kv_heads: None,
            position: PositionEncoding::None,
            sliding_window: None,
            softcap: None,
        }
    }

    /// Sets the number of key/value heads (grouped-query attention).
    pub fn with_kv_heads(mut self, num_kv_heads: usize) -> Self {
        self.num_kv_heads = Some(num_kv_heads);
        self
    }

    /// Sets the position encoding.
    pub fn with_position(mut self, position: PositionEncoding) -> Self {
        self.position = position;
        self
    }

    /// Sets a sliding causal window of `window` keys.
    pub fn with_sliding_window(mut self, window: usize) -> Self {
        self.sliding_window = Some(window);
        self
    }

    /// Sets `kdim` and `vdim` (cross-attention from another width).
    pub fn with_kv_dims(mut self, kdim: usize, vdim: usize) -> Self {
        self.kdim = Some(kdim);
        self.vdim = Some(vdim);
        self
    }

    /// Sets the attention-weight dropout probability.
    pub fn with_dropout(mut self, dropout: f32) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets whether both projections have biases.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets `add_bias_kv`.
    pub fn with_bias_kv(mut self, add_bias_kv: bool) -> Self {
        self.add_bias_kv = add_bias_kv;
        self
    }

    /// Sets `add_zero_attn`.
    pub fn with_zero_attn(mut self, add_zero_attn: bool) -> Self {
        self.add_zero_attn = add_zero_attn;
        self
    }

    /// Sets logit soft-capping at `cap` (see [`MhaConfig::softcap`]).
    pub fn with_softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Sets the score scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Enables timm's qk-norm.
    pub fn with_qk_norm(mut self, qk_norm: bool) -> Self {
        self.qk_norm = qk_norm;
        self
    }

    /// Feature size of each head: `head_dim` when set, else
    /// `embed_dim / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.embed_dim / self.num_heads.max(1))
    }

    /// Output size of the query projection, `num_heads * head_dim`
    /// (`embed_dim` unless `head_dim` says otherwise).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim()
    }

    /// Sets the width of each head.
    pub fn with_head_dim(mut self, head_dim: usize) -> Self {
        self.head_dim = Some(head_dim);
        self
    }

    /// Number of key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_kv_heads.unwrap_or(self.num_heads)
    }

    /// Output size of the key and value projections,
    /// `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Feature size of the key input.
    pub fn kdim(&self) -> usize {
        self.kdim.unwrap_or(self.embed_dim)
    }

    /// Feature size of the value input.
    pub fn vdim(&self) -> usize {
        self.vdim.unwrap_or(self.embed_dim)
    }

    /// Whether the input projection has a bias.
    pub fn has_qkv_bias(&self) -> bool {
        self.qkv_bias.unwrap_or(self.bias)
    }

    /// Whether key and value inputs have the query's width, so PyTorch
    /// stores one fused `in_proj_weight` (its `_qkv_same_embed_dim`).
    pub fn qkv_same_embed_dim(&self) -> bool {
        self.kdim() == self.embed_dim && self.vdim() == self.embed_dim
    }

    /// Checks every value, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        if self.embed_dim == 0 {
            bail!("MhaConfig: embed_dim must be > 0")
        }
        if self.num_heads == 0 {
            bail!("MhaConfig: num_heads must be > 0")
        }
        if self.head_dim == Some(0) {
            bail!("MhaConfig: head_dim must be > 0 when set")
        }
        if self
            .head_dim
            .is_some_and(|hd| hd.checked_mul(self.num_heads).is_none())
        {
            bail!("MhaConfig: num_heads * head_dim overflows")
        }
        if self.q_dim() != self.embed_dim && (self.add_bias_kv || self.add_zero_attn) {
            bail!(
                "MhaConfig: head_dim {} (num_heads * head_dim = {} != embed_dim {}) conflicts with add_bias_kv / add_zero_attn",
                self.head_dim(),
                self.q_dim(),
                self.embed_dim
            )
        }
        if self.head_dim.is_none() && !self.embed_dim.is_multiple_of(self.num_heads) {
            bail!(
                "MhaConfig: embed_dim ({}) must be divisible by num_heads ({})",
                self.embed_dim,
                self.num_heads
            )
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("MhaConfig: dropout must be in [0, 1), found {}", self.dropout)
        }
        if self.kdim == Some(0) || self.vdim == Some(0) {
            bail!("MhaConfig: kdim and vdim must be > 0 when set")
        }
        if let Some(kvh) = self.num_kv_heads {
            if kvh == 0 || !self.num_heads.is_multiple_of(kvh) {
                bail!(
                    "MhaConfig: num_heads ({}) must be a multiple of num_kv_heads ({kvh})",
                    self.num_heads
                )
            }
            if kvh != self.num_heads && (self.add_bias_kv || self.add_zero_attn) {
                bail!(
                    "MhaConfig: num_kv_heads ({kvh}) != num_heads conflicts with add_bias_kv / add_zero_attn"
                )
            }
        }
        if let PositionEncoding::Rotary(r) = &self.position {
            let hd = self.head_dim();
            let dims = r.dims.unwrap_or(hd);
            if dims == 0 || !dims.is_multiple_of(2) || dims > hd {
                bail!("MhaConfig: rotary dims must be even and in 1..=head_dim ({hd}), found {dims}")
            }
            if !r.theta.is_finite() || r.theta <= 1. {
                bail!(
                    "MhaConfig: rotary theta must be finite and > 1, found {}",
                    r.theta
                )
            }
        }
        if self.sliding_window == Some(0) {
            bail!("MhaConfig: sliding_window must be >= 1 when set")
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.) {
                bail!("MhaConfig: softcap must be finite and > 0 when set, found {cap}")
            }
        }
        if let Some(s) = self.scale {
            if !crate::sdpa::scale_is_valid(s) {
                bail!("MhaConfig: scale must be finite and > 0 as an f32 (the scores' dtype), found {s}")
            }
        }
        Ok(())
    }
}
