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
        }
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

    /// Feature size of each head, `embed_dim / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads.max(1)
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
        if !self.embed_dim.is_multiple_of(self.num_heads) {
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
        if let Some(s) = self.scale {
            if !s.is_finite() || s <= 0. {
                bail!("MhaConfig: scale must be finite and > 0, found {s}")
            }
        }
        Ok(())
    }
}
