//! The Vision Transformer: patch embedding, prefix tokens, position
//! embedding, encoder blocks, norm, pooling and head.

use candle::{bail, Module, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use multihead_attention::{NeedWeights, PackOptions};

use crate::vit::block::Block;
use crate::vit::config::{GlobalPool, Naming, VitConfig};
use crate::vit::embed::PatchEmbed;
use crate::vit::resample::resample_abs_pos_embed;
use multihead_attention::{LayerNorm, PackedLinear};

/// Checkpoint names of the model-level tensors.
struct ModelNames {
    patch_embed: &'static str,
    cls_token: &'static str,
    dist_token: &'static str,
    pos_embed: &'static str,
    blocks: &'static str,
    norm: &'static str,
    head: &'static str,
    head_dist: &'static str,
}

impl ModelNames {
    fn of(naming: Naming, head_dist: bool) -> Self {
        match naming {
            Naming::Timm => Self {
                patch_embed: "patch_embed",
                cls_token: "cls_token",
                dist_token: "dist_token",
                pos_embed: "pos_embed",
                blocks: "blocks",
                norm: "norm",
                head: "head",
                head_dist: "head_dist",
            },
            Naming::Hf => Self {
                patch_embed: "vit.embeddings.patch_embeddings",
                cls_token: "vit.embeddings.cls_token",
                dist_token: "vit.embeddings.distillation_token",
                pos_embed: "vit.embeddings.position_embeddings",
                blocks: "vit.encoder.layer",
                norm: "vit.layernorm",
                head: "classifier",
                head_dist: "distillation_classifier",
            },
            // `DeiTForImageClassificationWithTeacher` renames its first head.
            Naming::HfDeit => Self {
                patch_embed: "deit.embeddings.patch_embeddings",
                cls_token: "deit.embeddings.cls_token",
                dist_token: "deit.embeddings.distillation_token",
                pos_embed: "deit.embeddings.position_embeddings",
                blocks: "deit.encoder.layer",
                norm: "deit.layernorm",
                head: if head_dist { "cls_classifier" } else { "classifier" },
                head_dist: "distillation_classifier",
            },
        }
    }
}

/// What [`VisionTransformer::forward_with_attention`] returns.
#[derive(Debug, Clone)]
pub struct VitOutput {
    /// `(batch, num_classes)`, or the pooled features `(batch, embed_dim)`
    /// when the model has no head.
    pub logits: Tensor,
    /// One `(batch, heads, tokens, tokens)` tensor per softmax block (Hydra
    /// blocks have no weights): the softmaxed attention weights, prefix
    /// tokens first.
    pub attentions: Vec<Tensor>,
    /// The patch grid `(grid_h, grid_w)` of the input.
    pub grid: (usize, usize),
}

/// A Vision Transformer classifier.
///
/// Port of timm's `VisionTransformer`
/// (`timm/models/vision_transformer.py`); also loads HF transformers'
/// `ViTForImageClassification` (`Naming::Hf`) and DeiT: timm's
/// `VisionTransformerDistilled` (`timm/models/deit.py`) and HF's
/// `DeiTForImageClassification[WithTeacher]` (`Naming::HfDeit`), with the
/// distillation token and the second head averaged in. Inputs of another
/// size than `img_size` get a resampled position embedding, as timm does
/// with `dynamic_img_size=True`.
#[derive(Debug, Clone)]
pub struct VisionTransformer {
    cfg: VitConfig,
    patch_embed: PatchEmbed,
    /// `(1, 1, D)`.
    cls_token: Option<Tensor>,
    /// `(1, 1, D)`, DeiT's distillation token.
    dist_token: Option<Tensor>,
    /// `(1, reg_tokens, D)`.
    reg_token: Option<Tensor>,
    /// `(1, [prefix +] grid², D)`.
    pos_embed: Tensor,
    blocks: Vec<Block>,
    /// Before pooling; absent when `fc_norm` replaces it.
    norm: Option<LayerNorm>,
    /// After pooling.
    fc_norm: Option<LayerNorm>,
    head: Option<PackedLinear>,
    /// DeiT's head on the distillation token.
    head_dist: Option<PackedLinear>,
}

impl VisionTransformer {
    /// Validates `cfg` and loads every tensor by its checkpoint name, or
    /// initialises it when `vb` is backed by a `VarMap`.
    pub fn new(cfg: &VitConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with(cfg, &PackOptions::default(), vb)
    }

    /// [`VisionTransformer::new`], every linear layer packed as `pack`
    /// asks (the format, the instruction set).
    pub fn new_with(cfg: &VitConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let names = ModelNames::of(cfg.naming, cfg.head_dist);
        let d = cfg.embed_dim;
        let patch_embed = PatchEmbed::build(cfg, pack, vb.pp(names.patch_embed))?;
        let cls_token = cfg
            .class_token
            .then(|| {
                vb.get_with_hints(
                    (1, 1, d),
                    names.cls_token,
                    Init::Randn {
                        mean: 0.,
                        stdev: 1e-6,
                    },
                )
            })
            .transpose()?;
        let dist_token = cfg
            .dist_token
            .then(|| {
                vb.get_with_hints(
                    (1, 1, d),
                    names.dist_token,
                    Init::Randn {
                        mean: 0.,
                        stdev: 1e-6,
                    },
                )
            })
            .transpose()?;
        let reg_token = (cfg.reg_tokens > 0)
            .then(|| {
                vb.get_with_hints(
                    (1, cfg.reg_tokens, d),
                    "reg_token",
                    Init::Randn {
                        mean: 0.,
                        stdev: 1e-6,
                    },
                )
            })
            .transpose()?;
        let g = cfg.grid_size();
        let prefix = if cfg.no_embed_class {
            0
        } else {
            cfg.num_prefix_tokens()
        };
        let Some(embed_len) = g.checked_mul(g).and_then(|n| n.checked_add(prefix)) else {
            bail!(
                "VitConfig: img_size {} over patch_size {} gives a position table whose length overflows",
                cfg.img_size,
                cfg.patch_size
            )
        };
        let pos_embed = vb.get_with_hints(
            (1, embed_len, d),
            names.pos_embed,
            Init::Randn {
                mean: 0.,
                stdev: 0.02,
            },
        )?;
        let blocks = (0..cfg.depth)
            .map(|i| Block::build(cfg, cfg.attention_kind(i), pack, vb.pp(names.blocks).pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let eps = cfg.layer_norm_eps;
        let (norm, fc_norm) = if cfg.use_fc_norm() {
            (None, Some(LayerNorm::new(d, eps, vb.pp("fc_norm"))?))
        } else {
            (Some(LayerNorm::new(d, eps, vb.pp(names.norm))?), None)
        };
        let linear = |name: &str| -> Result<PackedLinear> {
            PackedLinear::from_linear_with(candle_nn::linear(d, cfg.num_classes, vb.pp(name))?, pack)
        };
        let head = (cfg.num_classes > 0).then(|| linear(names.head)).transpose()?;
        let head_dist = (cfg.num_classes > 0 && cfg.head_dist)
            .then(|| linear(names.head_dist))
            .transpose()?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_embed,
            cls_token,
            dist_token,
            reg_token,
            pos_embed,
            blocks,
            norm,
            fc_norm,
            head,
            head_dist,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Patch tokens with prefix tokens and position embedding added: the
    /// encoder's input.
    ///
    /// # Shapes
    /// - `xs`: `(batch, in_chans, H, W)`
    /// - returns `(batch, prefix + grid_h * grid_w, embed_dim)` and the grid
    pub fn embed(&self, xs: &Tensor) -> Result<(Tensor, (usize, usize))> {
        let (x, grid) = self.patch_embed.forward_grid(xs)?;
        let b = x.dim(0)?;
        let g = self.cfg.grid_size();
        let n_pos_prefix = if self.cfg.no_embed_class {
            0
        } else {
            self.cfg.num_prefix_tokens()
        };
        let pos_embed = resample_abs_pos_embed(&self.pos_embed, grid, (g, g), n_pos_prefix)?;
        let d = self.cfg.embed_dim;
        let mut prefix = Vec::new();
        if let Some(cls) = &self.cls_token {
            prefix.push(cls.broadcast_as((b, 1, d))?);
        }
        if let Some(dist) = &self.dist_token {
            prefix.push(dist.broadcast_as((b, 1, d))?);
        }
        if let Some(reg) = &self.reg_token {
            prefix.push(reg.broadcast_as((b, self.cfg.reg_tokens, d))?);
        }
        let with_prefix = |x: Tensor| -> Result<Tensor> {
            if prefix.is_empty() {
                return Ok(x);
            }
            let mut parts = prefix.clone();
            parts.push(x);
            Tensor::cat(&parts, 1)
        };
        // DeiT-3's embedding skips the prefix tokens: add, then concatenate;
        // the original ViT's covers them: concatenate, then add.
        let x = if self.cfg.no_embed_class {
            with_prefix(x.broadcast_add(&pos_embed)?)?
        } else {
            with_prefix(x)?.broadcast_add(&pos_embed)?
        };
        Ok((x, grid))
    }

    /// Runs the encoder and the head, keeping each block's attention
    /// weights when `need_weights` is [`NeedWeights::PerHead`] or
    /// [`NeedWeights::Averaged`].
    ///
    /// # Shapes
    /// - `xs`: `(batch, in_chans, H, W)`, `H` and `W` multiples of the patch
    ///   size
    /// - logits: `(batch, num_classes)`
    pub fn forward_with_weights(&self, xs: &Tensor, need_weights: NeedWeights) -> Result<VitOutput> {
        let (mut x, grid) = self.embed(xs)?;
        let mut attentions = Vec::new();
        // With the class token pooled and no weights kept, only the prefix
        // tokens the head reads (the class token, and DeiT's distillation
        // token) leave the last block: its other tokens are keys and values
        // only.
        let read_after = match (self.cfg.global_pool, need_weights) {
            (GlobalPool::Token, NeedWeights::No) => Some(1 + usize::from(self.cfg.head_dist)),
            _ => None,
        };
        let full = match read_after {
            Some(_) => self.blocks.len().saturating_sub(1),
            None => self.blocks.len(),
        };
        for block in &self.blocks[..full] {
            let (y, w) = block.forward_attn(&x, need_weights)?;
            x = y;
            attentions.extend(w);
        }
        if let (Some(block), Some(tokens)) = (self.blocks.get(full), read_after) {
            x = block.forward_prefix(&x, tokens)?;
        }
        if let Some(norm) = &self.norm {
            x = norm.forward(&x)?;
        }
        let pooled = match self.cfg.global_pool {
            GlobalPool::Token => x.narrow(1, 0, 1)?.squeeze(1)?,
            GlobalPool::Avg => {
                let p = self.cfg.num_prefix_tokens();
                let n = x.dim(1)?;
                if n <= p {
                    bail!("VisionTransformer: average pooling needs at least one patch token")
                }
                x.narrow(1, p, n - p)?.mean(1)?
            }
        };
        let pooled = match &self.fc_norm {
            Some(n) => n.forward(&pooled)?,
            None => pooled,
        };
        let logits = match (&self.head, &self.head_dist) {
            // DeiT: the class token's head and the distillation token's,
            // averaged (timm in eval mode, HF's WithTeacher).
            (Some(h), Some(hd)) => {
                let dist = x.narrow(1, 1, 1)?.squeeze(1)?;
                ((h.forward(&pooled)? + hd.forward(&dist)?)? / 2.)?
            }
            (Some(h), None) => h.forward(&pooled)?,
            // timm's `pre_logits` of a distilled model averages the tokens.
            (None, _) if self.cfg.head_dist => ((pooled + x.narrow(1, 1, 1)?.squeeze(1)?)? / 2.)?,
            (None, _) => pooled,
        };
        Ok(VitOutput {
            logits,
            attentions,
            grid,
        })
    }

    /// Logits and every block's per-head attention weights, for maps.
    ///
    /// # Shapes
    /// - `xs`: `(batch, in_chans, H, W)`
    /// - `logits`: `(batch, num_classes)`; `attentions`: `depth` tensors
    ///   `(batch, heads, tokens, tokens)`
    pub fn forward_with_attention(&self, xs: &Tensor) -> Result<VitOutput> {
        self.forward_with_weights(xs, NeedWeights::PerHead)
    }

    /// Class probabilities, softmax over the logits in f32.
    ///
    /// # Shapes
    /// - `xs`: `(batch, in_chans, H, W)`; returns `(batch, num_classes)`
    pub fn probabilities(&self, xs: &Tensor) -> Result<Tensor> {
        let logits = self.forward(xs)?.to_dtype(candle::DType::F32)?;
        candle_nn::ops::softmax(&logits, D::Minus1)
    }
}

impl Module for VisionTransformer {
    /// `(batch, in_chans, H, W)` → logits `(batch, num_classes)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_weights(xs, NeedWeights::No)?.logits)
    }
}
