//! The encoder block: pre-norm attention and MLP, each with an optional
//! LayerScale, around residual connections.

use candle::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use multihead_attention::{
    HydraAttention, HydraConfig, LayerNorm, MhaConfig, MhaOptions, MultiheadAttention, NeedWeights,
    PackOptions, PackedLinear, WeightLayout,
};

use crate::mlp::{Activation, Mlp};
use crate::vit::config::{AttentionKind, Naming, VitConfig};

/// The checkpoint names of one block's submodules.
struct BlockNames {
    norm1: &'static str,
    attn: &'static str,
    norm2: &'static str,
    fc1: &'static str,
    fc2: &'static str,
}

impl BlockNames {
    fn of(naming: Naming) -> Self {
        match naming {
            Naming::Timm => Self {
                norm1: "norm1",
                attn: "attn",
                norm2: "norm2",
                fc1: "mlp.fc1",
                fc2: "mlp.fc2",
            },
            // HF `ViTLayer`: `layernorm_before`, `attention`,
            // `layernorm_after`, `intermediate.dense`, `output.dense`.
            Naming::Hf | Naming::HfDeit => Self {
                norm1: "layernorm_before",
                attn: "attention",
                norm2: "layernorm_after",
                fc1: "intermediate.dense",
                fc2: "output.dense",
            },
        }
    }
}

/// Per-channel learned scale on a residual branch, `gamma` `(dim)`.
///
/// Port of timm's `LayerScale` (`timm/models/vision_transformer.py`).
#[derive(Debug, Clone)]
pub struct LayerScale {
    gamma: Tensor,
}

impl LayerScale {
    /// Loads `gamma`, or initialises it to `init_values`.
    pub fn new(dim: usize, init_values: f64, vb: VarBuilder) -> Result<Self> {
        let gamma = vb.get_with_hints(dim, "gamma", Init::Const(init_values))?;
        Ok(Self { gamma })
    }
}

impl Module for LayerScale {
    /// `(..., dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        xs.broadcast_mul(&self.gamma)
    }
}

/// `fc2(gelu(fc1(x)))` with the exact (erf) GELU, as timm's `Mlp` and HF's
/// `ViTIntermediate` + `ViTOutput` compute it: the linears at `fc1` and
/// `fc2` under `vb`.
fn mlp(cfg: &VitConfig, (fc1, fc2): (&str, &str), pack: &PackOptions, vb: VarBuilder) -> Result<Mlp> {
    let (d, hidden) = (cfg.embed_dim, cfg.mlp_hidden_dim());
    Mlp::new(
        PackedLinear::from_linear_with(candle_nn::linear(d, hidden, vb.pp(fc1))?, pack)?,
        PackedLinear::from_linear_with(candle_nn::linear(hidden, d, vb.pp(fc2))?, pack)?,
        Activation::Gelu,
    )
}

/// ViT's MLP built from its config and checkpoint names: a thin wrapper
/// over [`Mlp`].
#[deprecated(note = "use multihead_models::mlp::Mlp, which vit::Block builds")]
#[derive(Debug, Clone)]
pub struct VitMlp(Mlp);

#[allow(deprecated)]
impl VitMlp {
    /// Loads the two linears at `fc1` and `fc2` under `vb`.
    pub fn new(cfg: &VitConfig, names: (&str, &str), vb: VarBuilder) -> Result<Self> {
        mlp(cfg, names, &PackOptions::default(), vb).map(Self)
    }

    /// `residual + mlp(xs)`, the add fused into fc2's write-out where the
    /// weight is packed.
    pub fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.0.forward_add(xs, residual)
    }
}

#[allow(deprecated)]
impl Module for VitMlp {
    /// `(..., embed_dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// `x + ls1(attn(norm1(x)))`, then `x + ls2(mlp(norm2(x)))`.
///
/// Port of timm's `Block` (`timm/models/vision_transformer.py`) and HF's
/// `ViTLayer`.
#[derive(Debug, Clone)]
pub struct Block {
    norm1: LayerNorm,
    attn: Attention,
    ls1: Option<LayerScale>,
    norm2: LayerNorm,
    mlp: Mlp,
    ls2: Option<LayerScale>,
}

/// A block's attention; both load `attn.qkv` and `attn.proj` in timm
/// checkpoints.
#[derive(Debug, Clone)]
enum Attention {
    Softmax(Box<MultiheadAttention>),
    Hydra(HydraAttention),
}

impl Block {
    /// Loads one softmax-attention block; `vb` is `blocks.N` (timm) or
    /// `vit.encoder.layer.N` (HF).
    pub fn new(cfg: &VitConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with_attention(cfg, AttentionKind::Softmax, vb)
    }

    /// Loads one block with the given attention.
    pub fn new_with_attention(cfg: &VitConfig, kind: AttentionKind, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, kind, &PackOptions::default(), vb)
    }

    /// [`Block::new_with_attention`], its linears packed as `pack` asks.
    pub(crate) fn build(
        cfg: &VitConfig,
        kind: AttentionKind,
        pack: &PackOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        let names = BlockNames::of(cfg.naming);
        let d = cfg.embed_dim;
        let mut mha_cfg = MhaConfig::new(d, cfg.num_heads).with_qk_norm(cfg.qk_norm);
        mha_cfg.qkv_bias = Some(cfg.qkv_bias);
        mha_cfg.qk_norm_eps = cfg.layer_norm_eps;
        let layout = match cfg.naming {
            Naming::Timm => WeightLayout::timm(),
            Naming::Hf | Naming::HfDeit => WeightLayout::hf_vit(),
        };
        let ls = |name: &str| -> Result<Option<LayerScale>> {
            cfg.init_values
                .map(|v| LayerScale::new(d, v, vb.pp(name)))
                .transpose()
        };
        // Loaded in the checkpoint's order (a `VarMap` initialises them in
        // this order too).
        let norm1 = LayerNorm::new(d, cfg.layer_norm_eps, vb.pp(names.norm1))?;
        let attn = match kind {
            AttentionKind::Softmax => Attention::Softmax(Box::new(MultiheadAttention::new_with_pack(
                &mha_cfg,
                &layout,
                pack,
                vb.pp(names.attn),
            )?)),
            AttentionKind::Hydra => {
                let hydra_cfg = HydraConfig {
                    qkv_bias: cfg.qkv_bias,
                    ..HydraConfig::new(d)
                };
                Attention::Hydra(HydraAttention::new_with_layout(
                    &hydra_cfg,
                    &layout,
                    vb.pp(names.attn),
                )?)
            }
        };
        let ls1 = ls("ls1")?;
        let norm2 = LayerNorm::new(d, cfg.layer_norm_eps, vb.pp(names.norm2))?;
        let mlp = mlp(cfg, (names.fc1, names.fc2), pack, vb.clone())?;
        let mut block = Self {
            norm1,
            attn,
            ls1,
            norm2,
            mlp,
            ls2: ls("ls2")?,
        };
        // A LayerScale that does not train is folded into the weights of
        // the branch's last linear, where they are packed: no pass of its
        // own, and the residual add is then fused as without one.
        if let (Attention::Softmax(mha), Some(ls)) = (&block.attn, &block.ls1) {
            if let Some(folded) = mha.with_output_scale(&ls.gamma)? {
                block.attn = Attention::Softmax(Box::new(folded));
                block.ls1 = None;
            }
        }
        if let Some(ls) = &block.ls2 {
            if let Some(mlp) = block.mlp.with_output_scale(&ls.gamma)? {
                block.mlp = mlp;
                block.ls2 = None;
            }
        }
        Ok(block)
    }

    /// The block's output, and its per-head attention weights when asked.
    ///
    /// # Shapes
    /// - `xs`: `(batch, tokens, embed_dim)`
    /// - returns `(batch, tokens, embed_dim)` and, with
    ///   [`NeedWeights::PerHead`], `(batch, heads, tokens, tokens)`: timm's
    ///   `attn.softmax(dim=-1)` output; a Hydra block returns no weights
    pub fn forward_attn(&self, xs: &Tensor, need_weights: NeedWeights) -> Result<(Tensor, Option<Tensor>)> {
        let h = self.norm1.forward(xs)?;
        let (xs, weights) = self.attention_half(&h, &h, xs, need_weights)?;
        Ok((self.mlp_half(&xs)?, weights))
    }

    /// The block's output for the first `tokens` tokens only, every token
    /// still attended to as a key and value: what the last block must
    /// compute when only the prefix tokens (the class token, DeiT's
    /// distillation token) are read after it. Equal to
    /// `forward(xs).narrow(1, 0, tokens)`; a softmax block skips the other
    /// tokens' queries, output projection and MLP (a Hydra block computes
    /// every token).
    ///
    /// # Shapes
    /// - `xs`: `(batch, tokens_in, embed_dim)`, `tokens <= tokens_in`
    /// - returns `(batch, tokens, embed_dim)`
    pub fn forward_prefix(&self, xs: &Tensor, tokens: usize) -> Result<Tensor> {
        let n = xs.dim(1)?;
        if tokens == 0 || tokens > n {
            candle::bail!("Block::forward_prefix: {tokens} prefix tokens asked of {n}")
        }
        if tokens == n {
            return self.forward(xs);
        }
        if let Attention::Hydra(_) = self.attn {
            return self.forward(xs)?.narrow(1, 0, tokens);
        }
        let h = self.norm1.forward(xs)?;
        // Queries from the prefix only; keys and values from every token.
        let q = h.narrow(1, 0, tokens)?.contiguous()?;
        let residual = xs.narrow(1, 0, tokens)?.contiguous()?;
        let (xs, _) = self.attention_half(&q, &h, &residual, NeedWeights::No)?;
        self.mlp_half(&xs)
    }

    /// `residual + ls1(attn(q, kv, kv))` for normed queries `q` over normed
    /// keys and values `kv` (a Hydra block: `q` is `kv`), and the attention
    /// weights when asked. Without layer scale (or with one folded into the
    /// weights when the block was built) the residual add is fused into
    /// the output projection's write-out (no pass, buffer or thread
    /// hand-off of its own).
    fn attention_half(
        &self,
        q: &Tensor,
        kv: &Tensor,
        residual: &Tensor,
        need_weights: NeedWeights,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let opts = MhaOptions::new().with_weights(need_weights);
        match (&self.attn, &self.ls1) {
            (Attention::Softmax(mha), None) => {
                let out = mha.forward_attn(q, kv, kv, &opts.with_residual(residual.clone()))?;
                Ok((out.output, out.weights))
            }
            (attn, ls) => {
                let (a, weights) = match attn {
                    Attention::Softmax(mha) => {
                        let out = mha.forward_attn(q, kv, kv, &opts)?;
                        (out.output, out.weights)
                    }
                    Attention::Hydra(hydra) => (hydra.forward(q)?, None),
                };
                let a = match ls {
                    Some(ls) => ls.forward(&a)?,
                    None => a,
                };
                Ok(((residual + a)?, weights))
            }
        }
    }

    /// `xs + ls2(mlp(norm2(xs)))`, the add fused into fc2's write-out
    /// without layer scale (or with one folded).
    fn mlp_half(&self, xs: &Tensor) -> Result<Tensor> {
        let h = self.norm2.forward(xs)?;
        match &self.ls2 {
            Some(ls) => xs + ls.forward(&self.mlp.forward(&h)?)?,
            None => self.mlp.forward_add(&h, xs),
        }
    }
}

impl Module for Block {
    /// `(batch, tokens, embed_dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(self.forward_attn(xs, NeedWeights::No)?.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::{DType, Device, D};
    use candle_nn::VarMap;

    /// A block's prefix-only output equals its full output's first tokens,
    /// for a batch (the prefix a strided view) and each kind of block:
    /// plain, with a folded LayerScale, with one that trains (not folded:
    /// the scale and the adds as separate ops) and Hydra (the full block,
    /// cut).
    #[test]
    fn prefix_equals_the_full_blocks_first_tokens() -> Result<()> {
        let dev = Device::Cpu;
        let mut cfg = VitConfig {
            img_size: 32,
            patch_size: 8,
            embed_dim: 64,
            depth: 1,
            num_heads: 4,
            ..VitConfig::default()
        };
        let xs = Tensor::randn(0f32, 1., (3, 17, 64), &dev)?;
        for (kind, init_values, trains) in [
            (AttentionKind::Softmax, None, false),
            (AttentionKind::Softmax, Some(0.5), false),
            (AttentionKind::Softmax, Some(0.5), true),
            (AttentionKind::Hydra, None, false),
        ] {
            cfg.init_values = init_values;
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
            let block = match trains {
                // A block over the VarMap's variables: they track gradients,
                // so nothing is packed or folded.
                true => Block::new_with_attention(&cfg, kind, vb)?,
                // The same initial values, as loaded weights.
                false => {
                    Block::new_with_attention(&cfg, kind, vb)?;
                    let tensors = varmap
                        .data()
                        .lock()
                        .unwrap()
                        .iter()
                        .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
                        .collect();
                    Block::new_with_attention(
                        &cfg,
                        kind,
                        VarBuilder::from_tensors(tensors, DType::F32, &dev),
                    )?
                }
            };
            let full = block.forward(&xs)?;
            for tokens in [1, 2, 17] {
                let got = block.forward_prefix(&xs, tokens)?;
                let diff = (got - full.narrow(1, 0, tokens)?)?
                    .abs()?
                    .flatten_all()?
                    .max(D::Minus1)?;
                let diff = diff.to_scalar::<f32>()?;
                assert!(
                    diff < 1e-5,
                    "{kind:?} {init_values:?} trains {trains}, {tokens} tokens: {diff}"
                );
            }
            for tokens in [0, 18] {
                let err = block.forward_prefix(&xs, tokens).unwrap_err().to_string();
                assert!(
                    err.contains(&format!("{tokens} prefix tokens asked of 17")),
                    "{err}"
                );
            }
        }
        Ok(())
    }
}
