//! One encoder layer and one decoder layer.
//!
//! Port of `TransformerEncoderLayer` and `TransformerDecoderLayer` in
//! `torch/nn/modules/transformer.py` (eval mode: dropout is the identity).

use candle::{Result, Tensor};
use candle_nn::{linear_b, Module, VarBuilder};
use multihead_attention::{
    KvCache, LayerNorm, Mask, MhaOptions, MultiheadAttention, NeedWeights, PackOptions, PackedLinear,
    WeightLayout,
};

use super::config::TransformerConfig;
use crate::mlp::Mlp;

/// A LayerNorm over `d_model` with the config's epsilon; without a bias
/// when `bias = false`, as PyTorch's `LayerNorm(bias=False)`. The
/// attention crate's, which trains (candle-nn's fused one has no backward).
pub(crate) fn norm(cfg: &TransformerConfig, vb: VarBuilder) -> Result<LayerNorm> {
    if cfg.bias {
        LayerNorm::new(cfg.d_model, cfg.layer_norm_eps, vb)
    } else {
        LayerNorm::new_no_bias(cfg.d_model, cfg.layer_norm_eps, vb)
    }
}

/// `linear2(activation(linear1(x)))`, the `_ff_block` both layers share:
/// `linear1` `(dim_feedforward, d_model)`, `linear2` `(d_model,
/// dim_feedforward)`, directly under the layer's prefix.
fn feed_forward(cfg: &TransformerConfig, pack: &PackOptions, vb: &VarBuilder) -> Result<Mlp> {
    let (d, ff) = (cfg.d_model, cfg.dim_feedforward);
    Mlp::new(
        PackedLinear::from_linear_with(linear_b(d, ff, cfg.bias, vb.pp("linear1"))?, pack)?,
        PackedLinear::from_linear_with(linear_b(ff, d, cfg.bias, vb.pp("linear2"))?, pack)?,
        cfg.activation,
    )
}

/// `nn.MultiheadAttention` of the layers under `vb`, packed as `pack` asks.
fn attention(cfg: &TransformerConfig, pack: &PackOptions, vb: VarBuilder) -> Result<MultiheadAttention> {
    MultiheadAttention::new_with_pack(&cfg.mha(), &WeightLayout::PyTorch, pack, vb)
}

/// The options with `residual` added to the output, where given.
fn plus(opts: MhaOptions, residual: Option<&Tensor>) -> MhaOptions {
    match residual {
        Some(residual) => opts.with_residual(residual.clone()),
        None => opts,
    }
}

/// Self-attention then feed-forward, each in a residual block:
/// `torch.nn.TransformerEncoderLayer`.
///
/// State-dict names: `self_attn.{in_proj_weight, in_proj_bias,
/// out_proj.weight, out_proj.bias}`, `linear1.*`, `linear2.*`, `norm1.*`,
/// `norm2.*`.
#[derive(Debug, Clone)]
pub struct TransformerEncoderLayer {
    self_attn: MultiheadAttention,
    ff: Mlp,
    norm1: LayerNorm,
    norm2: LayerNorm,
    cfg: TransformerConfig,
}

impl TransformerEncoderLayer {
    /// Loads the layer's weights (or initialises them from a `VarMap`).
    pub fn new(cfg: &TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, &PackOptions::default(), vb)
    }

    /// [`TransformerEncoderLayer::new`], its linears packed as `pack` asks.
    pub(crate) fn build(cfg: &TransformerConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            self_attn: attention(cfg, pack, vb.pp("self_attn"))?,
            ff: feed_forward(cfg, pack, &vb)?,
            norm1: norm(cfg, vb.pp("norm1"))?,
            norm2: norm(cfg, vb.pp("norm2"))?,
            cfg: cfg.clone(),
        })
    }

    /// The layer's self-attention block.
    pub fn self_attn(&self) -> &MultiheadAttention {
        &self.self_attn
    }

    /// One layer over `src`; `mask` is PyTorch's `src_mask`,
    /// `src_key_padding_mask` and `is_causal` in one.
    ///
    /// # Shapes
    /// - `src`: `(batch, seq, d_model)` when `batch_first`, else
    ///   `(seq, batch, d_model)`; or unbatched `(seq, d_model)`
    /// - returns the same shape
    pub fn forward(&self, src: &Tensor, mask: &Mask) -> Result<Tensor> {
        // `residual + self_attn(x)`, or `self_attn(x)` alone.
        let sa = |x: &Tensor, residual: Option<&Tensor>| -> Result<Tensor> {
            let opts = MhaOptions::new()
                .with_mask(mask.clone())
                .with_layout(self.cfg.layout());
            // The same tensor three times: self-attention, one fused
            // projection.
            Ok(self
                .self_attn
                .forward_attn(x, x, x, &plus(opts, residual))?
                .output)
        };
        if self.cfg.norm_first {
            // The residual adds fused into the output projections.
            let x = sa(&self.norm1.forward(src)?, Some(src))?;
            self.ff.forward_add(&self.norm2.forward(&x)?, &x)
        } else {
            let x = self.norm1.forward_add(&sa(src, None)?, src)?;
            self.norm2.forward_add(&self.ff.forward(&x)?, &x)
        }
    }
}

/// Keys and values a decoder layer attends over, already projected:
/// `(batch, heads, len, head_dim)` each.
#[derive(Debug, Clone)]
pub(crate) struct ProjectedKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// Masked self-attention, cross-attention over the encoder memory, then
/// feed-forward, each in a residual block: `torch.nn.TransformerDecoderLayer`.
///
/// State-dict names: `self_attn.*`, `multihead_attn.*` (the
/// cross-attention), `linear1.*`, `linear2.*`, `norm1.*`, `norm2.*`,
/// `norm3.*`.
#[derive(Debug, Clone)]
pub struct TransformerDecoderLayer {
    self_attn: MultiheadAttention,
    multihead_attn: MultiheadAttention,
    ff: Mlp,
    norm1: LayerNorm,
    norm2: LayerNorm,
    norm3: LayerNorm,
    cfg: TransformerConfig,
}

impl TransformerDecoderLayer {
    /// Loads the layer's weights (or initialises them from a `VarMap`).
    pub fn new(cfg: &TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, &PackOptions::default(), vb)
    }

    /// [`TransformerDecoderLayer::new`], its linears packed as `pack` asks.
    pub(crate) fn build(cfg: &TransformerConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            self_attn: attention(cfg, pack, vb.pp("self_attn"))?,
            multihead_attn: attention(cfg, pack, vb.pp("multihead_attn"))?,
            ff: feed_forward(cfg, pack, &vb)?,
            norm1: norm(cfg, vb.pp("norm1"))?,
            norm2: norm(cfg, vb.pp("norm2"))?,
            norm3: norm(cfg, vb.pp("norm3"))?,
            cfg: cfg.clone(),
        })
    }

    /// The masked self-attention block.
    pub fn self_attn(&self) -> &MultiheadAttention {
        &self.self_attn
    }

    /// The cross-attention block (PyTorch's `multihead_attn`).
    pub fn multihead_attn(&self) -> &MultiheadAttention {
        &self.multihead_attn
    }

    /// One layer over the whole target. `tgt_mask` is PyTorch's `tgt_mask`,
    /// `tgt_key_padding_mask` and `tgt_is_causal` in one; `memory_mask` is
    /// `memory_mask`, `memory_key_padding_mask` and `memory_is_causal`.
    ///
    /// # Shapes
    /// - `tgt`: `(batch, tgt_len, d_model)` when `batch_first`, else
    ///   `(tgt_len, batch, d_model)`; or unbatched `(tgt_len, d_model)`
    /// - `memory`: `(batch, src_len, d_model)` in the same layout
    /// - returns the shape of `tgt`
    pub fn forward(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        tgt_mask: &Mask,
        memory_mask: &Mask,
    ) -> Result<Tensor> {
        let layout = self.cfg.layout();
        let sa = |x: &Tensor, residual: Option<&Tensor>| -> Result<Tensor> {
            let opts = MhaOptions::new().with_mask(tgt_mask.clone()).with_layout(layout);
            Ok(self
                .self_attn
                .forward_attn(x, x, x, &plus(opts, residual))?
                .output)
        };
        let ca = |x: &Tensor, residual: Option<&Tensor>| -> Result<Tensor> {
            let opts = MhaOptions::new()
                .with_mask(memory_mask.clone())
                .with_layout(layout);
            Ok(self
                .multihead_attn
                .forward_attn(x, memory, memory, &plus(opts, residual))?
                .output)
        };
        self.residuals(tgt, sa, ca)
    }

    /// The three residual blocks around the given self- and
    /// cross-attention (each `residual + attention(x)` where given a
    /// residual), pre- or post-norm.
    fn residuals(
        &self,
        tgt: &Tensor,
        sa: impl FnOnce(&Tensor, Option<&Tensor>) -> Result<Tensor>,
        ca: impl FnOnce(&Tensor, Option<&Tensor>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if self.cfg.norm_first {
            // The residual adds fused into the output projections.
            let x = sa(&self.norm1.forward(tgt)?, Some(tgt))?;
            let x = ca(&self.norm2.forward(&x)?, Some(&x))?;
            self.ff.forward_add(&self.norm3.forward(&x)?, &x)
        } else {
            let x = self.norm1.forward_add(&sa(tgt, None)?, tgt)?;
            let x = self.norm2.forward_add(&ca(&x, None)?, &x)?;
            self.norm3.forward_add(&self.ff.forward(&x)?, &x)
        }
    }

    /// Projects the encoder memory for the cross-attention, once per
    /// sequence. `memory`: `(batch, src_len, d_model)`, batch-first.
    pub(crate) fn project_memory(&self, memory: &Tensor) -> Result<ProjectedKv> {
        let (k, v) = self.multihead_attn.project_kv(memory, memory)?;
        Ok(ProjectedKv { k, v })
    }

    /// The layer over new target positions, appending their self-attention
    /// keys and values to `cache` and attending over everything cached.
    /// Returns the output and, when asked, the cross-attention weights.
    ///
    /// # Shapes
    /// - `tgt`: `(batch, new_len, d_model)`, batch-first
    /// - `cache`: `(batch, heads, past_len, head_dim)` each, or `None`
    ///   before the first step; afterwards `past_len + new_len`
    /// - `memory`: projected memory, `(batch, heads, src_len, head_dim)`
    /// - returns `(batch, new_len, d_model)` and
    ///   `(batch, new_len, src_len)` weights (averaged over heads)
    pub(crate) fn forward_step(
        &self,
        tgt: &Tensor,
        cache: &mut KvCache,
        memory: &ProjectedKv,
        memory_mask: &Mask,
        need_weights: NeedWeights,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let mut weights = None;
        // The new queries sit after the cached keys: the cache gives the
        // causal offset.
        let sa = |x: &Tensor, residual: Option<&Tensor>| -> Result<Tensor> {
            Ok(self
                .self_attn
                .forward_cached(x, cache, &plus(MhaOptions::new(), residual))?
                .output)
        };
        let ca = |x: &Tensor, residual: Option<&Tensor>| -> Result<Tensor> {
            let opts = MhaOptions::new()
                .with_mask(memory_mask.clone())
                .with_weights(need_weights);
            let out =
                self.multihead_attn
                    .forward_projected(x, &memory.k, &memory.v, &plus(opts, residual))?;
            weights = out.weights;
            Ok(out.output)
        };
        let out = self.residuals(tgt, sa, ca)?;
        Ok((out, weights))
    }
}
