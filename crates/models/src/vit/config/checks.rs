//! A [`VitConfig`]'s checks: every value named where it is wrong, and the
//! fewest weights a checkpoint of it stores.

use candle::{bail, Result};

use super::{GlobalPool, Naming, VitConfig};
use crate::formats::safetensors::{checked_product, MinWeights};

impl VitConfig {
    /// The fewest weights a checkpoint of this config stores (weight
    /// matrices only, no biases or norms), computed with checked arithmetic
    /// so that an absurd size is an error naming it; see
    /// [`crate::formats::safetensors::Checkpoint::ensure_holds`]. The
    /// loaders bound a config by recording its model within the file's
    /// budget instead ([`crate::formats::safetensors::Checkpoint::load_bounded`]).
    #[deprecated(
        note = "a model's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    pub fn min_weights(&self) -> Result<MinWeights> {
        let d = self.embed_dim;
        let p = self.patch_size;
        let mut m = MinWeights::new("VitConfig");
        m.add(
            format!(
                "patch_embed (embed_dim {d} x in_chans {} x patch_size {p}²)",
                self.in_chans
            ),
            &[d, self.in_chans, p, p],
        )?;
        let grid = self.grid_size();
        let prefix = if self.no_embed_class {
            0
        } else {
            self.num_prefix_tokens()
        };
        let Some(len) = checked_product(&[grid, grid]).and_then(|n| n.checked_add(prefix)) else {
            bail!(
                "VitConfig: img_size {} over patch_size {p} gives a position table whose length overflows",
                self.img_size
            )
        };
        m.add(format!("pos_embed ({len} positions x embed_dim {d})"), &[len, d])?;
        m.add(
            format!("reg_token ({} x embed_dim {d})", self.reg_tokens),
            &[self.reg_tokens, d],
        )?;
        // qkv (3d x d) and proj (d x d), fc1 and fc2 (hidden x d each).
        let hidden = self.mlp_hidden_dim();
        let Some(per_block) = checked_product(&[4, d, d])
            .zip(checked_product(&[2, d, hidden]))
            .and_then(|(a, b)| a.checked_add(b))
        else {
            bail!("VitConfig: one block's weights overflow (embed_dim {d}, MLP width {hidden})")
        };
        m.add(
            format!("blocks (depth {} x {per_block} each)", self.depth),
            &[self.depth, per_block],
        )?;
        let heads = 1 + usize::from(self.head_dist);
        m.add(
            format!(
                "head (num_classes {} x embed_dim {d}, {heads} heads)",
                self.num_classes
            ),
            &[heads, self.num_classes, d],
        )?;
        Ok(m)
    }

    /// The config as a recording within a file's budget names it
    /// ([`crate::formats::safetensors::Checkpoint::load_bounded`]): with
    /// the sizes that decide how many weights its model asks for.
    pub fn budget_owner(&self) -> String {
        format!(
            "VitConfig (depth {}, embed_dim {}, MLP width {}, img_size {} over patch_size {})",
            self.depth,
            self.embed_dim,
            self.mlp_hidden_dim(),
            self.img_size,
            self.patch_size
        )
    }

    /// Checks every value, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("img_size", self.img_size),
            ("patch_size", self.patch_size),
            ("in_chans", self.in_chans),
            ("embed_dim", self.embed_dim),
            ("num_heads", self.num_heads),
        ] {
            if v == 0 {
                bail!("VitConfig: {name} must be > 0")
            }
        }
        if !self.img_size.is_multiple_of(self.patch_size) {
            bail!(
                "VitConfig: img_size ({}) must be divisible by patch_size ({})",
                self.img_size,
                self.patch_size
            )
        }
        if !self.embed_dim.is_multiple_of(self.num_heads) {
            bail!(
                "VitConfig: embed_dim ({}) must be divisible by num_heads ({})",
                self.embed_dim,
                self.num_heads
            )
        }
        if !(self.mlp_ratio.is_finite() && self.mlp_hidden_dim() > 0) {
            bail!(
                "VitConfig: mlp_ratio ({}) must give an MLP width > 0 (embed_dim {})",
                self.mlp_ratio,
                self.embed_dim
            )
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.) {
            bail!(
                "VitConfig: layer_norm_eps must be finite and > 0, found {}",
                self.layer_norm_eps
            )
        }
        if let Some(v) = self.init_values {
            if !v.is_finite() {
                bail!("VitConfig: init_values must be finite, found {v}")
            }
        }
        if self.global_pool == GlobalPool::Token && !self.class_token {
            bail!("VitConfig: global_pool 'token' needs class_token = true")
        }
        self.validate_distillation()?;
        self.image_resize.validate(self.img_size)?;
        for (name, v) in [("image_mean", &self.image_mean), ("image_std", &self.image_std)] {
            if v.len() != self.in_chans {
                bail!(
                    "VitConfig: {name} has {} values but in_chans is {}",
                    v.len(),
                    self.in_chans
                )
            }
        }
        if let Some(s) = self.image_std.iter().find(|s| !(s.is_finite() && **s > 0.)) {
            bail!("VitConfig: image_std values must be finite and > 0, found {s}")
        }
        if let Some(labels) = &self.labels {
            if labels.len() != self.num_classes {
                bail!(
                    "VitConfig: {} labels given for num_classes {}",
                    labels.len(),
                    self.num_classes
                )
            }
        }
        if let Some(l) = self.hydra_layers.iter().find(|&&l| l >= self.depth) {
            bail!(
                "VitConfig: hydra_layers names block {l}, but there are only {} (depth)",
                self.depth
            )
        }
        if !self.hydra_layers.is_empty() && (self.naming != Naming::Timm || self.qk_norm) {
            // Hydra blocks load timm's fused qkv/proj and have no q/k norm.
            bail!("VitConfig: hydra_layers needs naming 'timm' and qk_norm = false")
        }
        if matches!(self.naming, Naming::Hf | Naming::HfDeit) {
            // HF's ViTForImageClassification has none of these; a config that
            // asks for them cannot describe an HF checkpoint.
            let unsupported = [
                ("init_values", self.init_values.is_some()),
                ("qk_norm", self.qk_norm),
                ("reg_tokens", self.reg_tokens > 0),
                ("no_embed_class", self.no_embed_class),
                ("global_pool 'avg'", self.global_pool == GlobalPool::Avg),
                ("fc_norm", self.use_fc_norm()),
                ("class_token = false", !self.class_token),
            ];
            if let Some((name, _)) = unsupported.iter().find(|(_, on)| *on) {
                bail!("VitConfig: naming 'hf' / 'hf_deit' (HF ViT and DeiT) does not support {name}")
            }
        }
        match (self.naming, self.dist_token) {
            (Naming::HfDeit, false) => {
                bail!("VitConfig: naming 'hf_deit' needs dist_token = true (HF's DeiT always has one)")
            }
            (Naming::Hf, true) => {
                bail!("VitConfig: naming 'hf' (ViTForImageClassification) has no distillation token; use 'hf_deit'")
            }
            _ => {}
        }
        Ok(())
    }

    /// DeiT's distillation token and second head.
    fn validate_distillation(&self) -> Result<()> {
        if self.head_dist && !self.dist_token {
            bail!("VitConfig: head_dist needs dist_token = true")
        }
        if self.dist_token {
            let clash = [
                ("class_token = false", !self.class_token),
                ("reg_tokens", self.reg_tokens > 0),
                ("no_embed_class", self.no_embed_class),
                ("global_pool 'avg'", self.global_pool == GlobalPool::Avg),
                ("hydra_layers", !self.hydra_layers.is_empty()),
            ];
            if let Some((name, _)) = clash.iter().find(|(_, on)| *on) {
                bail!("VitConfig: dist_token (DeiT distillation) does not combine with {name}")
            }
        }
        Ok(())
    }
}
