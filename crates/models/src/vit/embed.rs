//! Patch embedding: images to tokens.

use candle::{bail, Module, Result, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, VarBuilder};

use crate::vit::config::{Naming, VitConfig};

/// Cuts the image into non-overlapping `patch_size` squares and projects
/// each to `embed_dim`: a Conv2d whose kernel and stride are the patch
/// size.
///
/// Port of timm's `PatchEmbed` (`timm/layers/patch_embed.py`), also HF's
/// `ViTPatchEmbeddings`. The convolution is `proj` (timm) or `projection`
/// (HF) under `vb`.
#[derive(Debug, Clone)]
pub struct PatchEmbed {
    proj: Conv2d,
    patch_size: usize,
    in_chans: usize,
}

impl PatchEmbed {
    /// Loads `proj.weight` `(embed_dim, in_chans, p, p)` and `proj.bias`
    /// (HF: `projection.*`).
    pub fn new(cfg: &VitConfig, vb: VarBuilder) -> Result<Self> {
        let name = match cfg.naming {
            Naming::Timm => "proj",
            Naming::Hf => "projection",
        };
        let conv_cfg = Conv2dConfig {
            stride: cfg.patch_size,
            ..Default::default()
        };
        let proj = candle_nn::conv2d(cfg.in_chans, cfg.embed_dim, cfg.patch_size, conv_cfg, vb.pp(name))?;
        Ok(Self {
            proj,
            patch_size: cfg.patch_size,
            in_chans: cfg.in_chans,
        })
    }

    /// Tokens and the patch grid they come from.
    ///
    /// # Shapes
    /// - `xs`: `(batch, in_chans, height, width)`, both sides divisible by
    ///   the patch size
    /// - returns `(batch, grid_h * grid_w, embed_dim)` and `(grid_h, grid_w)`
    pub fn forward_grid(&self, xs: &Tensor) -> Result<(Tensor, (usize, usize))> {
        let (_, c, h, w) = xs.dims4()?;
        let p = self.patch_size;
        if c != self.in_chans {
            bail!(
                "PatchEmbed: the image has {c} channels, the model expects {}",
                self.in_chans
            )
        }
        if h % p != 0 || w % p != 0 || h == 0 || w == 0 {
            bail!("PatchEmbed: image size {h}x{w} is not a non-zero multiple of the patch size {p}")
        }
        // (B, D, gh, gw) -> (B, gh*gw, D)
        let x = self.proj.forward(xs)?;
        let x = x.flatten_from(2)?.transpose(1, 2)?;
        Ok((x, (h / p, w / p)))
    }
}

impl Module for PatchEmbed {
    /// `(batch, in_chans, H, W)` → `(batch, num_patches, embed_dim)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(self.forward_grid(xs)?.0)
    }
}
