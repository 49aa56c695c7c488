//! Patch embedding: images to tokens.

use candle::{bail, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use multihead_attention::{PackOptions, PackedLinear};

use crate::vit::config::{Naming, VitConfig};

/// Cuts the image into non-overlapping `patch_size` squares and projects
/// each to `embed_dim`: a Conv2d whose kernel and stride are the patch
/// size, computed as what it is, one linear layer over the unfolded
/// patches (the conv weight `(D, C, p, p)` read as `(D, C·p·p)`), packed
/// once like every linear of the model.
///
/// Port of timm's `PatchEmbed` (`timm/layers/patch_embed.py`), also HF's
/// `ViTPatchEmbeddings`. The convolution is `proj` (timm) or `projection`
/// (HF) under `vb`.
#[derive(Debug, Clone)]
pub struct PatchEmbed {
    /// `(embed_dim, in_chans · p · p)`.
    proj: PackedLinear,
    patch_size: usize,
    in_chans: usize,
}

impl PatchEmbed {
    /// Loads `proj.weight` `(embed_dim, in_chans, p, p)` and `proj.bias`
    /// (HF: `projection.*`).
    pub fn new(cfg: &VitConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, &PackOptions::default(), vb)
    }

    /// [`PatchEmbed::new`], the projection packed as `pack` asks.
    pub(crate) fn build(cfg: &VitConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        let name = match cfg.naming {
            Naming::Timm => "proj",
            Naming::Hf | Naming::HfDeit => "projection",
        };
        let (d, c, p) = (cfg.embed_dim, cfg.in_chans, cfg.patch_size);
        // As candle_nn::conv2d initialises them.
        let bound = 1. / (c as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let vb = vb.pp(name);
        let weight = vb.get_with_hints((d, c, p, p), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
        let bias = vb.get_with_hints(d, "bias", init)?;
        let proj = PackedLinear::with_options(weight.reshape((d, c * p * p))?, Some(bias), pack)?;
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
        let (b, (gh, gw)) = (xs.dim(0)?, (h / p, w / p));
        // (B, C, gh, p, gw, p) -> (B, gh, gw, C, p, p) -> (B, gh*gw, C*p*p)
        let patches = xs
            .reshape((b, c, gh, p, gw, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b, gh * gw, c * p * p))?;
        // (B, gh*gw, D)
        Ok((self.proj.forward(&patches)?, (gh, gw)))
    }
}

impl Module for PatchEmbed {
    /// `(batch, in_chans, H, W)` → `(batch, num_patches, embed_dim)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(self.forward_grid(xs)?.0)
    }
}
