//! The configuration of a [`crate::vit::VisionTransformer`]: timm's
//! `VisionTransformer` constructor arguments, the checkpoint's naming
//! scheme, and how images are preprocessed.

use candle::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::vit::resample::Interpolation;

/// Which names the checkpoint stores its tensors under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Naming {
    /// timm `VisionTransformer`: `patch_embed.proj`, `cls_token`,
    /// `pos_embed`, `blocks.N.{norm1,attn.qkv,attn.proj,ls1,norm2,mlp.fc1,mlp.fc2,ls2}`,
    /// `norm`, `fc_norm`, `head`.
    #[default]
    Timm,
    /// HF transformers `ViTForImageClassification`: `vit.embeddings.*`,
    /// `vit.encoder.layer.N.*`, `vit.layernorm`, `classifier`.
    Hf,
    /// HF transformers `DeiTForImageClassification` and
    /// `DeiTForImageClassificationWithTeacher`: `deit.embeddings.*` (with
    /// `distillation_token`), `deit.encoder.layer.N.*` (named as HF ViT's),
    /// `deit.layernorm`, and `classifier` or, with `head_dist`,
    /// `cls_classifier` and `distillation_classifier`.
    HfDeit,
}

/// How the encoder's tokens become one feature vector for the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GlobalPool {
    /// The class token (timm `global_pool='token'`).
    #[default]
    Token,
    /// The mean of the patch tokens, prefix tokens excluded (timm `'avg'`).
    Avg,
}

/// A Vision Transformer, as timm's
/// `timm.models.vision_transformer.VisionTransformer` is configured.
///
/// Deserialised from the `config.json` beside a checkpoint; fields other
/// than the five architecture sizes have timm's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VitConfig {
    /// Side of the square training image, in pixels. The position
    /// embedding has one entry per patch of this grid; other input sizes
    /// resample it (see [`crate::vit::resample_abs_pos_embed`]).
    pub img_size: usize,
    /// Side of the square patches (the patch embedding's kernel and stride).
    pub patch_size: usize,
    /// Image channels (3 for RGB, 1 for grayscale).
    #[serde(default = "default_in_chans")]
    pub in_chans: usize,
    /// Number of classes; 0 means no head (the forward returns the pooled
    /// features).
    #[serde(default = "default_num_classes")]
    pub num_classes: usize,
    /// Token width.
    pub embed_dim: usize,
    /// Number of encoder blocks.
    pub depth: usize,
    /// Attention heads per block; must divide `embed_dim`.
    pub num_heads: usize,
    /// MLP hidden width over `embed_dim` (hidden = `floor(embed_dim * mlp_ratio)`).
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: f64,
    /// Whether the fused qkv projection has a bias.
    #[serde(default = "default_true")]
    pub qkv_bias: bool,
    /// LayerNorm over each head's queries and keys (timm `qk_norm=True`).
    #[serde(default)]
    pub qk_norm: bool,
    /// LayerScale's initial value; `Some` means each block has `ls1.gamma`
    /// and `ls2.gamma` (timm `init_values`).
    #[serde(default)]
    pub init_values: Option<f64>,
    /// Whether a class token is prepended.
    #[serde(default = "default_true")]
    pub class_token: bool,
    /// A distillation token after the class token (DeiT: timm
    /// `VisionTransformerDistilled`'s `dist_token`, HF's
    /// `distillation_token`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub dist_token: bool,
    /// A second head, on the distillation token, whose logits are averaged
    /// with the class token's head: timm's `head_dist` in eval mode, HF's
    /// `DeiTForImageClassificationWithTeacher`. Needs `dist_token`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub head_dist: bool,
    /// Number of register tokens after the class token (timm `reg_tokens`).
    #[serde(default)]
    pub reg_tokens: usize,
    /// Whether the position embedding covers only the patches, not the
    /// prefix tokens (timm `no_embed_class`, DeiT-3).
    #[serde(default)]
    pub no_embed_class: bool,
    /// Pooling before the head.
    #[serde(default)]
    pub global_pool: GlobalPool,
    /// Whether the final norm is applied after pooling (`fc_norm`) instead
    /// of before. `None`: timm's default, true for average pooling.
    #[serde(default)]
    pub fc_norm: Option<bool>,
    /// Epsilon of every LayerNorm (timm: 1e-6; HF ViT checkpoints: 1e-12).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The checkpoint's naming scheme.
    #[serde(default)]
    pub naming: Naming,
    /// Per-channel mean subtracted from pixels scaled to `[0, 1]`.
    #[serde(default = "default_half")]
    pub image_mean: Vec<f32>,
    /// Per-channel standard deviation the centred pixels are divided by.
    #[serde(default = "default_half")]
    pub image_std: Vec<f32>,
    /// Filter resizing input images to `img_size` (always antialiased, as
    /// torchvision's `Resize` on tensors with `antialias=True`).
    #[serde(default = "default_image_interpolation")]
    pub image_interpolation: Interpolation,
    /// How images are brought to the input size: squashed (the default),
    /// or resized and centre-cropped as timm's eval transform or HF's DeiT
    /// processor do.
    #[serde(default, skip_serializing_if = "is_default")]
    pub image_resize: ImageResize,
    /// PyTorch's float resampler (the default) or PIL's 8-bit one, as the
    /// checkpoint's preprocessing ran.
    #[serde(default, skip_serializing_if = "is_default")]
    pub image_resampler: Resampler,
    /// Class names, one per class; printed instead of indices when present.
    #[serde(default)]
    pub labels: Option<Vec<String>>,
    /// Indices of the blocks whose attention is Hydra attention
    /// ([`multihead_attention::HydraAttention`], on the same `qkv`/`proj`
    /// weights) instead of softmax attention. Empty (the default): a plain
    /// ViT.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hydra_layers: Vec<usize>,
}

/// How an image is brought to the model's input size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum ImageResize {
    /// Resize to the input size, aspect ratio not kept (HF
    /// `ViTImageProcessor`; the shipped digits model).
    #[default]
    Squash,
    /// timm's eval transform: resize the shorter side to `short_side`
    /// keeping the aspect ratio (torchvision `Resize(int)`), then crop the
    /// centre to the input size (torchvision `CenterCrop`, offsets rounded
    /// half to even). timm's `short_side` is `floor(img_size / crop_pct)`.
    ShortSideCrop {
        /// The shorter side after resizing, at the config's `img_size`.
        short_side: usize,
    },
    /// HF `DeiTImageProcessor`, timm's `crop_mode='squash'`: resize to
    /// `height x width`, then crop the centre to the input size.
    SquashCrop {
        /// Height after resizing, at the config's `img_size`.
        height: usize,
        /// Width after resizing, at the config's `img_size`.
        width: usize,
        /// Round the crop offsets half to even, as torchvision's
        /// `CenterCrop` (timm; transformers' `...Fast` processors), instead
        /// of down, as transformers' PIL processors' `center_crop`.
        #[serde(default, skip_serializing_if = "is_false")]
        round_half_even: bool,
    },
    /// No resize (HF's `do_resize: false`): the image is used at its own
    /// size, which must be the input size.
    AsIs,
}

/// Most times the input size a resize before the crop may be (timm's
/// `crop_pct` down to 0.25).
pub const MAX_RESIZE_FACTOR: usize = 4;

impl ImageResize {
    /// Checks that the resize before the centre crop covers an input of
    /// `img_size` and is at most [`MAX_RESIZE_FACTOR`] times it.
    pub fn validate(&self, img_size: usize) -> Result<()> {
        let sides = match *self {
            Self::Squash | Self::AsIs => return Ok(()),
            Self::ShortSideCrop { short_side } => [short_side, short_side],
            Self::SquashCrop { height, width, .. } => [height, width],
        };
        let most = img_size.saturating_mul(MAX_RESIZE_FACTOR);
        if let Some(s) = sides.iter().find(|&&s| s < img_size || s > most) {
            bail!(
                "VitConfig: image_resize size {s} must be between img_size ({img_size}) and \
                 {MAX_RESIZE_FACTOR} times it ({most}) for the centre crop"
            )
        }
        Ok(())
    }
}

/// Which resampler resizes images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resampler {
    /// PyTorch's `F.interpolate(x / 255, mode, antialias=True)` on floats
    /// (torchvision `Resize` on tensors).
    #[default]
    Torch,
    /// PIL's `Image.resize` on 8-bit pixels, rounded after each axis: what
    /// timm's eval transform and transformers' PIL image processors run.
    Pil,
}

/// Which attention a block computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Multi-head softmax attention (timm `Attention`).
    Softmax,
    /// Hydra attention: as many heads as features, linear in the tokens.
    Hydra,
}

fn default_in_chans() -> usize {
    3
}
fn default_num_classes() -> usize {
    1000
}
fn default_mlp_ratio() -> f64 {
    4.
}
fn default_true() -> bool {
    true
}
fn default_eps() -> f64 {
    1e-6
}
fn default_half() -> Vec<f32> {
    vec![0.5; 3]
}
fn default_image_interpolation() -> Interpolation {
    Interpolation::Bicubic
}
fn is_false(b: &bool) -> bool {
    !b
}
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

impl Default for VitConfig {
    /// timm's `VisionTransformer()` defaults: 224-pixel images in 16-pixel
    /// patches, width 768, 12 blocks, 12 heads (`vit_base_patch16_224`),
    /// 1000 classes. Set the sizes by name:
    /// `VitConfig { embed_dim: 64, depth: 2, num_heads: 4, ..VitConfig::default() }`.
    fn default() -> Self {
        Self {
            img_size: 224,
            patch_size: 16,
            in_chans: default_in_chans(),
            num_classes: default_num_classes(),
            embed_dim: 768,
            depth: 12,
            num_heads: 12,
            mlp_ratio: default_mlp_ratio(),
            qkv_bias: true,
            qk_norm: false,
            init_values: None,
            class_token: true,
            dist_token: false,
            head_dist: false,
            reg_tokens: 0,
            no_embed_class: false,
            global_pool: GlobalPool::Token,
            fc_norm: None,
            layer_norm_eps: default_eps(),
            naming: Naming::Timm,
            image_mean: default_half(),
            image_std: default_half(),
            image_interpolation: default_image_interpolation(),
            image_resize: ImageResize::Squash,
            image_resampler: Resampler::Torch,
            labels: None,
            hydra_layers: Vec::new(),
        }
    }
}

impl VitConfig {
    /// A config with timm's defaults around the given architecture sizes.
    #[deprecated(
        note = "name the sizes: VitConfig { img_size, patch_size, embed_dim, depth, num_heads, ..VitConfig::default() }"
    )]
    pub fn new(img_size: usize, patch_size: usize, embed_dim: usize, depth: usize, num_heads: usize) -> Self {
        Self {
            img_size,
            patch_size,
            embed_dim,
            depth,
            num_heads,
            ..Self::default()
        }
    }

    /// timm `vit_tiny_patch16_224`: width 192, 12 blocks, 3 heads.
    pub fn tiny_patch16_224() -> Self {
        Self {
            embed_dim: 192,
            num_heads: 3,
            ..Self::default()
        }
    }

    /// timm `vit_small_patch16_224`: width 384, 12 blocks, 6 heads.
    pub fn small_patch16_224() -> Self {
        Self {
            embed_dim: 384,
            num_heads: 6,
            ..Self::default()
        }
    }

    /// timm `vit_base_patch16_224`: width 768, 12 blocks, 12 heads.
    pub fn base_patch16_224() -> Self {
        Self::default()
    }

    /// Reads and validates a `config.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self =
            serde_json::from_str(json).map_err(|e| candle::Error::Msg(format!("VitConfig: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// MLP hidden width, timm's `int(embed_dim * mlp_ratio)`.
    pub fn mlp_hidden_dim(&self) -> usize {
        (self.embed_dim as f64 * self.mlp_ratio) as usize
    }

    /// Patches per side at the training size.
    pub fn grid_size(&self) -> usize {
        self.img_size / self.patch_size.max(1)
    }

    /// Class, distillation and register tokens in front of the patch
    /// tokens.
    pub fn num_prefix_tokens(&self) -> usize {
        usize::from(self.class_token) + usize::from(self.dist_token) + self.reg_tokens
    }

    /// Whether the final norm runs after pooling, resolving timm's default.
    pub fn use_fc_norm(&self) -> bool {
        self.fc_norm.unwrap_or(self.global_pool == GlobalPool::Avg)
    }

    /// The attention of block `layer`.
    pub fn attention_kind(&self, layer: usize) -> AttentionKind {
        if self.hydra_layers.contains(&layer) {
            AttentionKind::Hydra
        } else {
            AttentionKind::Softmax
        }
    }

    /// The label of class `i`, or `i` itself.
    pub fn label(&self, i: usize) -> String {
        self.labels
            .as_ref()
            .and_then(|l| l.get(i).cloned())
            .unwrap_or_else(|| i.to_string())
    }
}

#[cfg(test)]
mod tests;

mod checks;
