//! A timm hub `config.json` (written by `timm.models.push_to_hf_hub` /
//! `save_for_hf`) as a [`VitConfig`]: the architecture name gives the
//! sizes of the standard ViT and DeiT families, `model_args` overrides
//! them, `pretrained_cfg` gives the eval transform.

use candle::Result;

use crate::vit::config::{GlobalPool, ImageResize, Resampler, VitConfig};
use crate::vit::folder::json::{parse_object, short, Fields};
use crate::vit::resample::Interpolation;

/// timm's `IMAGENET_DEFAULT_MEAN` / `_STD` and `DEFAULT_CROP_PCT`.
const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
const DEFAULT_CROP_PCT: f64 = 0.875;

/// `(embed_dim, depth, num_heads)` of a size name, as
/// `timm/models/vision_transformer.py` and `deit.py` define them.
fn sizes(size: &str) -> Option<(usize, usize, usize)> {
    Some(match size {
        "tiny" => (192, 12, 3),
        "small" => (384, 12, 6),
        "medium" => (512, 12, 8),
        "base" => (768, 12, 12),
        "large" => (1024, 24, 16),
        "huge" => (1280, 32, 16),
        _ => return None,
    })
}

/// The config timm's factory builds for `name` (the part before any
/// `.tag`): `vit_{size}_patch{p}_{img}`, `deit_{size}_patch{p}_{img}`,
/// `deit_{size}_distilled_patch{p}_{img}` and `deit3_{size}_patch{p}_{img}`
/// (LayerScale 1e-6, no position embedding on the class token). Any other
/// name (CLIP, SigLIP, `_miil`, `_gap`, ...) is `None`: those differ in
/// ways the name's sizes do not show.
pub fn architecture(name: &str) -> Option<VitConfig> {
    let base = name.split('.').next()?;
    let parts: Vec<&str> = base.split('_').collect();
    let (family, size, distilled, rest) = match parts.as_slice() {
        [f @ ("vit" | "deit" | "deit3"), size, rest @ ..] => (*f, *size, false, rest),
        _ => return None,
    };
    let (distilled, rest) = match rest {
        ["distilled", rest @ ..] if family == "deit" => (true, rest),
        _ => (distilled, rest),
    };
    let [patch, img] = rest else { return None };
    let patch: usize = patch.strip_prefix("patch")?.parse().ok()?;
    let img: usize = img.parse().ok()?;
    let (d, depth, heads) = sizes(size)?;
    if !matches!(patch, 8 | 14 | 16 | 32) || !(32..=1024).contains(&img) {
        return None;
    }
    let mut cfg = VitConfig {
        img_size: img,
        patch_size: patch,
        embed_dim: d,
        depth,
        num_heads: heads,
        dist_token: distilled,
        head_dist: distilled,
        ..VitConfig::default()
    };
    if family == "deit3" {
        cfg.no_embed_class = true;
        cfg.init_values = Some(1e-6);
    }
    Some(cfg)
}

/// `model_args` keys that only change training or the factory's input
/// checks, not the eval forward.
const IGNORED_ARGS: &[&str] = &[
    "dynamic_img_size",
    "strict_img_size",
    "weight_init",
    "fix_init",
    "pretrained_strict",
    "proj_drop_rate",
    "attn_drop_rate",
    "pos_drop_rate",
    "patch_drop_rate",
];

/// Applies timm `model_args` (the constructor's keyword arguments).
fn model_args(cfg: &mut VitConfig, a: &Fields) -> Result<()> {
    for key in a.keys() {
        let k = key.as_str();
        if IGNORED_ARGS.contains(&k) || a.get(k).is_none() {
            continue;
        }
        match k {
            "img_size" => cfg.img_size = a.square(k)?.unwrap_or(cfg.img_size),
            "patch_size" => cfg.patch_size = a.square(k)?.unwrap_or(cfg.patch_size),
            "in_chans" => cfg.in_chans = a.size_req(k, false)?,
            "num_classes" => cfg.num_classes = a.size_req(k, true)?,
            "embed_dim" => cfg.embed_dim = a.size_req(k, false)?,
            "depth" => cfg.depth = a.size_req(k, true)?,
            "num_heads" => cfg.num_heads = a.size_req(k, false)?,
            "reg_tokens" => cfg.reg_tokens = a.size_req(k, true)?,
            "mlp_ratio" => cfg.mlp_ratio = a.number(k)?.unwrap_or(cfg.mlp_ratio),
            "init_values" => cfg.init_values = a.number(k)?,
            "qkv_bias" => cfg.qkv_bias = a.boolean(k)?.unwrap_or(true),
            "qk_norm" => cfg.qk_norm = a.boolean(k)?.unwrap_or(false),
            "class_token" => cfg.class_token = a.boolean(k)?.unwrap_or(true),
            "no_embed_class" => cfg.no_embed_class = a.boolean(k)?.unwrap_or(false),
            "fc_norm" => cfg.fc_norm = a.boolean(k)?,
            "global_pool" => cfg.global_pool = pool(a, k)?,
            // Arguments whose default is the only value supported.
            "pre_norm" | "dynamic_img_pad" if a.boolean(k)? == Some(false) => {}
            "final_norm" | "proj_bias" if a.boolean(k)? == Some(true) => {}
            "drop_rate" | "drop_path_rate" => {}
            _ => {
                return Err(a.error(
                    k,
                    format!(
                        "{} is not supported by multihead's ViT (it would change the model)",
                        short(a.get(k).unwrap_or(&serde_json::Value::Null))
                    ),
                ))
            }
        }
    }
    Ok(())
}

fn pool(f: &Fields, key: &str) -> Result<GlobalPool> {
    match f.string(key)? {
        None | Some("token") => Ok(GlobalPool::Token),
        Some("avg") => Ok(GlobalPool::Avg),
        Some(other) => Err(f.error(key, format!("'{other}' is not supported: 'token' and 'avg' are"))),
    }
}

/// Parses a timm hub `config.json`; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<VitConfig> {
    let map = parse_object(text, file)?;
    let f = Fields::new(file, &map);
    let Some(name) = f.string("architecture")? else {
        return Err(f.error("architecture", "missing"));
    };
    let Some(mut cfg) = architecture(name) else {
        return Err(f.error(
            "architecture",
            format!(
                "'{name}' is not a standard ViT/DeiT name multihead maps to sizes \
                 (vit|deit|deit3_{{tiny,small,medium,base,large,huge}}[_distilled]_patch{{8,14,16,32}}_{{img}})"
            ),
        ));
    };
    let pretrained = f.object("pretrained_cfg")?;
    if let Some(p) = &pretrained {
        if let Some(n) = p.size("num_classes", true)? {
            cfg.num_classes = n;
        }
    }
    if f.has("global_pool") {
        cfg.global_pool = pool(&f, "global_pool")?;
    }
    if let Some(a) = f.object("model_args")? {
        model_args(&mut cfg, &a)?;
    }
    if let Some(n) = f.size("num_classes", true)? {
        cfg.num_classes = n;
    }
    if cfg.dist_token && cfg.global_pool != GlobalPool::Token {
        return Err(f.error("global_pool", "a distilled DeiT pools its tokens, not 'avg'"));
    }
    let labels = f.labels("label_names")?.or(match &pretrained {
        Some(p) => p.labels("label_names")?,
        None => None,
    });
    if let Some(l) = &labels {
        if l.len() != cfg.num_classes {
            return Err(f.error(
                "label_names",
                format!("{} names for num_classes {}", l.len(), cfg.num_classes),
            ));
        }
    }
    cfg.labels = labels;
    let c = cfg.in_chans;
    cfg.image_mean = IMAGENET_MEAN[..c.min(3)].to_vec();
    cfg.image_std = IMAGENET_STD[..c.min(3)].to_vec();
    cfg.image_resampler = Resampler::Pil;
    cfg.image_interpolation = Interpolation::Bicubic;
    let mut crop_pct = DEFAULT_CROP_PCT;
    let mut squash = false;
    if let Some(p) = &pretrained {
        if let Some(v) = p.get("input_size") {
            let dims: Vec<Option<u64>> = v
                .as_array()
                .map_or(vec![], |a| a.iter().map(|x| x.as_u64()).collect());
            match dims.as_slice() {
                [Some(ch), Some(h), Some(w)]
                    if *ch as usize == c && h == w && *h as usize == cfg.img_size => {}
                _ => {
                    return Err(p.error(
                        "input_size",
                        format!(
                            "{} is not [in_chans {c}, img_size {}, img_size {}] of the model",
                            short(v),
                            cfg.img_size,
                            cfg.img_size
                        ),
                    ))
                }
            }
        }
        cfg.image_interpolation = match p.string("interpolation")? {
            None | Some("bicubic") => Interpolation::Bicubic,
            Some("bilinear") => Interpolation::Bilinear,
            Some(other) => {
                return Err(p.error(
                    "interpolation",
                    format!("'{other}' is not supported: 'bicubic' and 'bilinear' are"),
                ))
            }
        };
        if let Some(pct) = p.number("crop_pct")? {
            if !(0.25..=1.).contains(&pct) {
                return Err(p.error("crop_pct", format!("{pct} is not in [0.25, 1]")));
            }
            crop_pct = pct;
        }
        squash = match p.string("crop_mode")? {
            None | Some("center") => false,
            Some("squash") => true,
            Some(other) => {
                return Err(p.error(
                    "crop_mode",
                    format!("'{other}' is not supported: 'center' and 'squash' are"),
                ))
            }
        };
        if let Some(m) = p.channels("mean", c)? {
            cfg.image_mean = m;
        }
        if let Some(s) = p.channels("std", c)? {
            if s.iter().any(|&s| s <= 0.) {
                return Err(p.error("std", "values must be > 0"));
            }
            cfg.image_std = s;
        }
    }
    // timm: `scale_size = math.floor(img_size / crop_pct)`.
    let scale = (cfg.img_size as f64 / crop_pct).floor() as usize;
    cfg.image_resize = if squash {
        ImageResize::SquashCrop {
            height: scale,
            width: scale,
            round_half_even: true,
        }
    } else {
        ImageResize::ShortSideCrop { short_side: scale }
    };
    Ok(cfg)
}

impl VitConfig {
    /// Reads a timm hub `config.json`: `architecture` (a standard ViT,
    /// DeiT, distilled DeiT or DeiT-3 name, with or without its
    /// `.pretrained_tag`), `model_args`, `num_classes`, `global_pool`,
    /// `label_names` and `pretrained_cfg` (`input_size`, `mean`, `std`,
    /// `interpolation`, `crop_pct`, `crop_mode`): timm's eval transform,
    /// PIL's resampler included, is reproduced.
    pub fn from_timm_config(config_json: &str) -> Result<Self> {
        let cfg = parse(config_json, "config.json")?;
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_sizes() {
        let b = architecture("vit_base_patch16_224.augreg2_in21k_ft_in1k")
            .map(|c| (c.embed_dim, c.depth, c.num_heads, c.patch_size, c.img_size));
        assert_eq!(b, Some((768, 12, 12, 16, 224)));
        let l = architecture("vit_large_patch32_384")
            .map(|c| (c.embed_dim, c.depth, c.num_heads, c.patch_size, c.img_size));
        assert_eq!(l, Some((1024, 24, 16, 32, 384)));
        let d = architecture("deit_small_distilled_patch16_224.fb_in1k");
        assert!(d
            .as_ref()
            .is_some_and(|c| c.dist_token && c.head_dist && c.embed_dim == 384));
        let d3 = architecture("deit3_base_patch16_384");
        assert!(d3.is_some_and(|c| c.no_embed_class && c.init_values == Some(1e-6)));
        for other in [
            "vit_base_patch16_clip_224.openai",
            "vit_base_patch16_224_miil",
            "vit_so400m_patch14_siglip_384",
            "resnet50",
            "vit_base_patch16_rope_224",
        ] {
            assert!(architecture(other).is_none(), "{other}");
        }
    }

    /// timm/vit_base_patch16_224.augreg2_in21k_ft_in1k's config.json.
    #[test]
    fn reads_a_hub_config() -> Result<()> {
        let cfg = VitConfig::from_timm_config(
            r#"{"architecture": "vit_base_patch16_224", "num_classes": 1000, "num_features": 768,
                "global_pool": "token",
                "pretrained_cfg": {"tag": "augreg2_in21k_ft_in1k", "custom_load": false,
                  "input_size": [3, 224, 224], "fixed_input_size": true, "interpolation": "bicubic",
                  "crop_pct": 0.9, "crop_mode": "center", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
                  "num_classes": 1000, "pool_size": null, "first_conv": "patch_embed.proj",
                  "classifier": "head"}}"#,
        )?;
        assert_eq!(cfg.num_classes, 1000);
        assert_eq!(cfg.image_resize, ImageResize::ShortSideCrop { short_side: 248 });
        assert_eq!(cfg.image_mean, [0.5; 3]);
        // crop_mode 'squash': Resize((s, s)) then torchvision's CenterCrop.
        let cfg = VitConfig::from_timm_config(
            r#"{"architecture": "vit_base_patch16_224", "pretrained_cfg": {"crop_pct": 0.95, "crop_mode": "squash"}}"#,
        )?;
        let want = ImageResize::SquashCrop {
            height: 235,
            width: 235,
            round_half_even: true,
        };
        assert_eq!(cfg.image_resize, want);
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        let bad = [
            (
                r#"{"architecture": "vit_base_patch16_clip_224"}"#,
                "field 'architecture'",
            ),
            (r#"{"architecture": 3}"#, "field 'architecture'"),
            (
                r#"{"architecture": "vit_tiny_patch16_224", "model_args": {"act_layer": "relu"}}"#,
                "field 'model_args.act_layer'",
            ),
            (
                r#"{"architecture": "vit_tiny_patch16_224", "model_args": {"depth": -1}}"#,
                "field 'model_args.depth'",
            ),
            (
                r#"{"architecture": "vit_tiny_patch16_224", "pretrained_cfg": {"crop_pct": 7}}"#,
                "field 'pretrained_cfg.crop_pct'",
            ),
            (
                r#"{"architecture": "vit_tiny_patch16_224", "pretrained_cfg": {"input_size": [3, 99, 99]}}"#,
                "field 'pretrained_cfg.input_size'",
            ),
            (
                r#"{"architecture": "vit_tiny_patch16_224", "num_classes": 2, "label_names": ["a"]}"#,
                "field 'label_names'",
            ),
        ];
        for (json, want) in bad {
            let err = VitConfig::from_timm_config(json).unwrap_err().to_string();
            assert!(
                err.starts_with("config.json: ") && err.contains(want),
                "{json}: {err}"
            );
        }
    }
}
