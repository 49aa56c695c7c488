//! HF transformers' `config.json` (`model_type` `vit` or `deit`) and
//! `preprocessor_config.json` as a [`VitConfig`].
//!
//! Reads the fields `transformers.ViTConfig` / `DeiTConfig`
//! (`models/vit/configuration_vit.py`) and `ViTImageProcessor` /
//! `DeiTImageProcessor` define, with their defaults when absent; the many
//! generic `PretrainedConfig` fields (`torch_dtype`, `label2id`, ...) are
//! ignored.

use candle::Result;

use crate::vit::config::{ImageResize, Naming, Resampler, VitConfig, MAX_RESIZE_FACTOR};
use crate::vit::folder::json::{parse_object, Fields};
use crate::vit::resample::Interpolation;

/// `IMAGENET_STANDARD_MEAN` / `_STD`: ViTImageProcessor's defaults.
const STANDARD: [f32; 3] = [0.5, 0.5, 0.5];
/// `IMAGENET_DEFAULT_MEAN`: DeiTImageProcessor's default.
const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// `IMAGENET_DEFAULT_STD`.
const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The classification models whose weights [`VitConfig`] can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfArchitecture {
    /// `ViTForImageClassification`.
    Vit,
    /// `DeiTForImageClassification`: the distillation token, one head on
    /// the class token.
    Deit,
    /// `DeiTForImageClassificationWithTeacher`: two heads, averaged.
    DeitWithTeacher,
}

impl HfArchitecture {
    /// The class name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vit => "ViTForImageClassification",
            Self::Deit => "DeiTForImageClassification",
            Self::DeitWithTeacher => "DeiTForImageClassificationWithTeacher",
        }
    }
}

/// Which model an HF `config.json` describes: from `architectures[0]`,
/// else from `model_type` (the plain classification model).
pub fn architecture(f: &Fields) -> Result<HfArchitecture> {
    let model_type = f.string("model_type")?;
    let arch = match f.get("architectures") {
        None => None,
        Some(v) => match v.as_array().map(|a| a.first().map(|s| s.as_str())) {
            Some(Some(Some(s))) => Some(s),
            Some(None) => None,
            _ => return Err(f.error("architectures", "expected a list of class names")),
        },
    };
    let from_arch = match arch {
        None => None,
        Some("ViTForImageClassification") => Some(HfArchitecture::Vit),
        Some("DeiTForImageClassification") => Some(HfArchitecture::Deit),
        Some("DeiTForImageClassificationWithTeacher") => Some(HfArchitecture::DeitWithTeacher),
        Some(other) => {
            return Err(f.error(
                "architectures",
                format!(
                    "'{other}' is not supported: ViTForImageClassification, DeiTForImageClassification \
                     and DeiTForImageClassificationWithTeacher are"
                ),
            ))
        }
    };
    let from_type = match model_type {
        None => None,
        Some("vit") => Some(HfArchitecture::Vit),
        Some("deit") => Some(HfArchitecture::Deit),
        Some(other) => {
            return Err(f.error(
                "model_type",
                format!("'{other}' is not supported: 'vit' and 'deit' are"),
            ))
        }
    };
    match (from_arch, from_type) {
        (Some(a), Some(t)) if (a == HfArchitecture::Vit) != (t == HfArchitecture::Vit) => Err(f.error(
            "model_type",
            format!(
                "'{}' does not match architectures '{}'",
                model_type.unwrap_or(""),
                a.name()
            ),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(f.error("model_type", "missing (and no architectures)")),
    }
}

/// Parses an HF `config.json` (and the `preprocessor_config.json` beside
/// it, if any); `file` and `pre_file` name them in errors.
pub fn parse(text: &str, file: &str, pre: Option<(&str, &str)>) -> Result<(VitConfig, HfArchitecture)> {
    let map = parse_object(text, file)?;
    let f = Fields::new(file, &map);
    let arch = architecture(&f)?;
    let hidden = f.size("hidden_size", false)?.unwrap_or(768);
    let heads = f.size("num_attention_heads", false)?.unwrap_or(12);
    let depth = f.size("num_hidden_layers", true)?.unwrap_or(12);
    let img = f.square("image_size")?.unwrap_or(224);
    let patch = f.square("patch_size")?.unwrap_or(16);
    let chans = f.size("num_channels", false)?.unwrap_or(3);
    let inter = f.size("intermediate_size", false)?.unwrap_or(3072);
    if !hidden.is_multiple_of(heads) {
        return Err(f.error(
            "num_attention_heads",
            format!("{heads} does not divide hidden_size {hidden}"),
        ));
    }
    if !img.is_multiple_of(patch) {
        return Err(f.error("patch_size", format!("{patch} does not divide image_size {img}")));
    }
    let mut cfg = VitConfig {
        img_size: img,
        patch_size: patch,
        embed_dim: hidden,
        depth,
        num_heads: heads,
        in_chans: chans,
        mlp_ratio: inter as f64 / hidden as f64,
        ..VitConfig::default()
    };
    if cfg.mlp_hidden_dim() != inter {
        return Err(f.error(
            "intermediate_size",
            format!("{inter} is not a width multihead's MLP can express over hidden_size {hidden}"),
        ));
    }
    match f.string("hidden_act")? {
        None | Some("gelu") => {}
        Some(other) => {
            return Err(f.error(
                "hidden_act",
                format!("'{other}' is not supported: only 'gelu' (exact, erf) is"),
            ))
        }
    }
    cfg.qkv_bias = f.boolean("qkv_bias")?.unwrap_or(true);
    cfg.layer_norm_eps = f.number("layer_norm_eps")?.unwrap_or(1e-12);
    if cfg.layer_norm_eps <= 0. {
        return Err(f.error("layer_norm_eps", "must be > 0"));
    }
    let labels = f.labels("id2label")?;
    let n = labels.as_ref().map_or(2, Vec::len);
    if let Some(k) = f.size("num_labels", true)? {
        if k != n {
            return Err(f.error("num_labels", format!("{k}, but id2label names {n} classes")));
        }
    }
    cfg.num_classes = n;
    // transformers' default names, `LABEL_0`, ..., say nothing: indices print.
    cfg.labels = labels.filter(|l| l.iter().enumerate().any(|(i, s)| *s != format!("LABEL_{i}")));
    let deit = arch != HfArchitecture::Vit;
    cfg.naming = if deit { Naming::HfDeit } else { Naming::Hf };
    cfg.dist_token = deit;
    cfg.head_dist = arch == HfArchitecture::DeitWithTeacher;
    // The processor's defaults, for a folder without preprocessor_config.json.
    let (mean, std) = if deit {
        (IMAGENET_MEAN, IMAGENET_STD)
    } else {
        (STANDARD, STANDARD)
    };
    cfg.image_mean = mean[..chans.min(3)].to_vec();
    cfg.image_std = std[..chans.min(3)].to_vec();
    cfg.image_resampler = Resampler::Pil;
    if deit {
        cfg.image_interpolation = Interpolation::Bicubic;
        let s = img * 256 / 224;
        cfg.image_resize = ImageResize::SquashCrop {
            height: s,
            width: s,
            round_half_even: false,
        };
    } else {
        cfg.image_interpolation = Interpolation::Bilinear;
    }
    if let Some((text, pre_file)) = pre {
        preprocessor(&mut cfg, text, pre_file, file)?;
    }
    Ok((cfg, arch))
}

/// A `{"height": h, "width": w}` size, or one number, or
/// `{"shortest_edge": s}` (older processors, square only here).
fn size_of(f: &Fields, key: &str) -> Result<Option<(usize, usize)>> {
    if f.get(key).is_some_and(|v| v.is_object()) {
        let Some(obj) = f.object(key)? else {
            return Ok(None);
        };
        if let Some(s) = obj.size("shortest_edge", false)? {
            return Ok(Some((s, s)));
        }
        return Ok(Some((
            obj.size_req("height", false)?,
            obj.size_req("width", false)?,
        )));
    }
    Ok(f.size(key, false)?.map(|s| (s, s)))
}

/// Applies a `preprocessor_config.json` to `cfg`.
fn preprocessor(cfg: &mut VitConfig, text: &str, file: &str, config_file: &str) -> Result<()> {
    let map = parse_object(text, file)?;
    let f = Fields::new(file, &map);
    let kind = f
        .string("image_processor_type")?
        .or(f.string("feature_extractor_type")?)
        .unwrap_or("ViTImageProcessor");
    // transformers 5's ViTImageProcessor runs torchvision on tensors, but
    // writes the same file as the PIL one every earlier version ran; the
    // checkpoints on the Hub were made with PIL. `...Fast` is torchvision.
    cfg.image_resampler = if kind.ends_with("Fast") {
        Resampler::Torch
    } else {
        Resampler::Pil
    };
    if let Some(r) = f.get("resample") {
        cfg.image_interpolation = match r.as_u64() {
            Some(2) => Interpolation::Bilinear,
            Some(3) => Interpolation::Bicubic,
            _ => {
                return Err(f.error(
                    "resample",
                    format!(
                        "{} is not supported: 2 (bilinear) and 3 (bicubic) are",
                        super::json::short(r)
                    ),
                ))
            }
        };
    }
    if f.boolean("do_rescale")? == Some(false) {
        return Err(f.error(
            "do_rescale",
            "false is not supported: pixels are always scaled to [0, 1]",
        ));
    }
    if let Some(r) = f.number("rescale_factor")? {
        if (r - 1. / 255.).abs() > 1e-9 {
            return Err(f.error("rescale_factor", format!("{r} is not supported: only 1/255 is")));
        }
    }
    let c = cfg.in_chans;
    if f.boolean("do_normalize")? == Some(false) {
        cfg.image_mean = vec![0.; c];
        cfg.image_std = vec![1.; c];
    } else {
        if let Some(m) = f.channels("image_mean", c)? {
            cfg.image_mean = m;
        }
        if let Some(s) = f.channels("image_std", c)? {
            if s.iter().any(|&s| s <= 0.) {
                return Err(f.error("image_std", "values must be > 0"));
            }
            cfg.image_std = s;
        }
    }
    let img = cfg.img_size;
    let size = size_of(&f, "size")?;
    let crop = f.boolean("do_center_crop")? == Some(true);
    if f.boolean("do_resize")? == Some(false) {
        // The processor takes the image at its size: `size` is unused.
        if crop {
            return Err(f.error(
                "do_resize",
                "false with do_center_crop true is not supported: a crop needs the resize before it",
            ));
        }
        cfg.image_resize = ImageResize::AsIs;
        return Ok(());
    }
    if crop {
        let crop = size_of(&f, "crop_size")?.unwrap_or((224, 224));
        if crop != (img, img) {
            return Err(f.error(
                "crop_size",
                format!(
                    "{}x{} differs from image_size {img} in {config_file}",
                    crop.0, crop.1
                ),
            ));
        }
        let (height, width) = size.unwrap_or((256, 256));
        if height < img || width < img || height.max(width) > img * MAX_RESIZE_FACTOR {
            return Err(f.error(
                "size",
                format!(
                    "{height}x{width} is not between crop_size {img}x{img} and {MAX_RESIZE_FACTOR} times it"
                ),
            ));
        }
        // torchvision's CenterCrop rounds half to even, transformers' down.
        cfg.image_resize = ImageResize::SquashCrop {
            height,
            width,
            round_half_even: cfg.image_resampler == Resampler::Torch,
        };
    } else {
        let (h, w) = size.unwrap_or((img, img));
        if (h, w) != (img, img) {
            return Err(f.error(
                "size",
                format!("{h}x{w} differs from image_size {img} in {config_file} (and there is no crop)"),
            ));
        }
        cfg.image_resize = ImageResize::Squash;
    }
    Ok(())
}

impl VitConfig {
    /// Reads an HF transformers `config.json` of a
    /// `ViTForImageClassification`, `DeiTForImageClassification` or
    /// `DeiTForImageClassificationWithTeacher`, with the
    /// `preprocessor_config.json` beside it when there is one (else
    /// `ViTImageProcessor`'s or `DeiTImageProcessor`'s defaults): sizes,
    /// `id2label`, mean, std, size, crop and resampling. The image
    /// processor's PIL resize is reproduced to the bit
    /// ([`crate::vit::Resampler::Pil`]).
    pub fn from_hf_config(config_json: &str, preprocessor_json: Option<&str>) -> Result<Self> {
        let pre = preprocessor_json.map(|t| (t, "preprocessor_config.json"));
        let (cfg, _) = parse(config_json, "config.json", pre)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// google/vit-base-patch16-224's config.json and preprocessor, abridged.
    #[test]
    fn reads_a_hub_vit() -> Result<()> {
        let cfg = VitConfig::from_hf_config(
            r#"{"architectures": ["ViTForImageClassification"], "model_type": "vit",
                "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                "intermediate_size": 3072, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
                "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": true,
                "id2label": {"0": "tench", "1": "goldfish"}, "label2id": {"tench": 0, "goldfish": 1},
                "torch_dtype": "float32", "transformers_version": "4.x"}"#,
            Some(
                r#"{"do_normalize": true, "do_resize": true, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224,
                    "feature_extractor_type": "ViTFeatureExtractor"}"#,
            ),
        )?;
        assert_eq!(
            (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.img_size),
            (768, 12, 12, 224)
        );
        assert_eq!(cfg.num_classes, 2);
        assert_eq!(cfg.label(1), "goldfish");
        assert_eq!(cfg.image_interpolation, Interpolation::Bilinear);
        assert_eq!(cfg.image_resampler, Resampler::Pil);
        assert_eq!(cfg.naming, Naming::Hf);
        Ok(())
    }

    /// `do_resize: false` takes images at their size (they must be the
    /// model's), whatever `size` says; with a centre crop it is refused.
    #[test]
    fn do_resize_false_resizes_nothing() -> Result<()> {
        let config = r#"{"model_type": "vit", "image_size": 224}"#;
        let cfg = VitConfig::from_hf_config(config, Some(r#"{"do_resize": false, "size": 384}"#))?;
        assert_eq!(cfg.image_resize, ImageResize::AsIs);
        let err = VitConfig::from_hf_config(
            config,
            Some(r#"{"do_resize": false, "do_center_crop": true, "crop_size": 224}"#),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("preprocessor_config.json: field 'do_resize'") && err.contains("do_center_crop"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let bad = [
            (
                r#"{"model_type": "vit", "hidden_size": "768"}"#,
                "field 'hidden_size'",
            ),
            (r#"{"model_type": "bert"}"#, "field 'model_type'"),
            (r#"{"architectures": ["ViTModel"]}"#, "field 'architectures'"),
            (
                r#"{"model_type": "vit", "hidden_size": 99999999999}"#,
                "over the limit",
            ),
            (
                r#"{"model_type": "vit", "num_attention_heads": 7}"#,
                "field 'num_attention_heads'",
            ),
            (
                r#"{"model_type": "vit", "id2label": {"0": "a", "2": "b"}}"#,
                "field 'id2label'",
            ),
            (
                r#"{"model_type": "vit", "hidden_act": "relu"}"#,
                "field 'hidden_act'",
            ),
            (r#"[1, 2]"#, "expected a JSON object"),
        ];
        for (json, want) in bad {
            let err = VitConfig::from_hf_config(json, None).unwrap_err().to_string();
            assert!(
                err.starts_with("config.json: ") && err.contains(want),
                "{json}: {err}"
            );
        }
        let err = VitConfig::from_hf_config(r#"{"model_type": "vit"}"#, Some(r#"{"size": {"height": 224}}"#))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("preprocessor_config.json: field 'size.width': missing"),
            "{err}"
        );
    }
}
