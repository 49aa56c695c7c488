//! Hostile model folders: malformed `config.json` (HF and timm),
//! `preprocessor_config.json` and `model.safetensors.index.json`, shard
//! paths leaving the folder, configs that disagree with the weights,
//! pickle-only and empty folders. Each, through the library and through
//! `multihead vit --weights` (with RUST_BACKTRACE=1), is one error line
//! naming the file and the field, never a panic. Every case is a copy of a
//! committed fixture folder with one file changed, made in the test.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;
use candle::{DType, Device};
use multihead::models::vit::ModelFolder;
use multihead_test_support::{
    cli::assert_one_line_error,
    errors::assert_err,
    fixtures::fixture_dir,
    scratch::{copy_files, edit_json},
    scratch_dir,
};

/// A fresh copy of fixture folder `from` named `case`.
fn copy_of(from: &str, case: &str) -> Result<PathBuf> {
    let dir = scratch_dir!(case)?;
    if !from.is_empty() {
        copy_files(&fixture_dir("folders").join(from), &dir)?;
    }
    Ok(dir)
}

/// The folder fails to open or load with an error mentioning every one of
/// `needles`, from the library and as one line from the binary.
fn refused(weights: &Path, needles: &[&str]) -> Result<()> {
    assert_err(
        ModelFolder::open(weights).and_then(|f| f.load(DType::F32, &Device::Cpu)),
        needles,
    );
    let photo = fixture_dir("folders").join("photo.png");
    let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .env("RUST_BACKTRACE", "1")
        .args(["vit", "--weights"])
        .arg(weights)
        .arg(photo)
        .output()?;
    assert_one_line_error(&out, needles);
    Ok(())
}

#[test]
fn hf_config_json() -> Result<()> {
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        (
            "hidden_size",
            "32".into(),
            &["config.json: field 'hidden_size'", "expected a whole number"],
        ),
        (
            "num_hidden_layers",
            1_000_000_000.into(),
            &["field 'num_hidden_layers'", "over the limit"],
        ),
        ("num_attention_heads", 0.into(), &["field 'num_attention_heads'"]),
        (
            "image_size",
            [32, 48].into(),
            &["field 'image_size'", "not square"],
        ),
        (
            "model_type",
            "bert".into(),
            &["field 'model_type'", "'bert' is not supported"],
        ),
        (
            "architectures",
            ["ViTModel"].into(),
            &["field 'architectures'", "ViTModel"],
        ),
        (
            "id2label",
            serde_json::json!({"0": "a", "7": "b"}),
            &["field 'id2label'", "'7'"],
        ),
        ("hidden_act", "gelu_new".into(), &["field 'hidden_act'"]),
        ("layer_norm_eps", "tiny".into(), &["field 'layer_norm_eps'"]),
    ];
    for (field, value, needles) in cases {
        let dir = copy_of("hf_vit", &format!("hf_{field}"))?;
        edit_json(&dir.join("config.json"), |v| v[field] = value)?;
        refused(&dir, needles)?;
    }
    // Not JSON, not an object.
    for (case, text, needle) in [
        ("hf_not_json", "{\"model_type\": ", "not valid JSON"),
        ("hf_array", "[1]", "expected a JSON object"),
    ] {
        let dir = copy_of("hf_vit", case)?;
        std::fs::write(dir.join("config.json"), text)?;
        refused(&dir, &["config.json", needle])?;
    }
    Ok(())
}

/// A config that parses but disagrees with the weights: sizes the file
/// cannot hold are refused from the arithmetic, a near miss lists the
/// tensors, and both name the config file.
#[test]
fn config_disagrees_with_weights() -> Result<()> {
    let dir = copy_of("hf_vit", "hf_disagrees")?;
    edit_json(&dir.join("config.json"), |v| {
        v["num_hidden_layers"] = 3.into();
    })?;
    refused(
        &dir,
        &[
            "config.json",
            "do not match the model",
            "missing",
            "vit.encoder.layer.2.",
        ],
    )?;
    let dir = copy_of("hf_vit", "hf_too_big")?;
    edit_json(&dir.join("config.json"), |v| {
        v["hidden_size"] = 4096.into();
        v["intermediate_size"] = 16384.into();
    })?;
    refused(&dir, &["config.json", "larger than this file can hold"])?;
    // The HF default sizes (768 wide, 12 layers) when the sizes are missing.
    let dir = copy_of("hf_vit", "hf_missing_sizes")?;
    edit_json(&dir.join("config.json"), |v| {
        if let Some(map) = v.as_object_mut() {
            for k in ["hidden_size", "num_hidden_layers", "intermediate_size"] {
                map.remove(k);
            }
        }
    })?;
    refused(&dir, &["config.json", "larger than this file can hold"])?;
    let dir = copy_of("timm_vit", "timm_disagrees")?;
    edit_json(&dir.join("config.json"), |v| {
        v["model_args"]["embed_dim"] = 40.into()
    })?;
    refused(&dir, &["config.json", "mis-shaped", "cls_token"])?;
    Ok(())
}

#[test]
fn preprocessor_config_json() -> Result<()> {
    let cases: Vec<(&str, &str, serde_json::Value, &[&str])> = vec![
        (
            "hf_vit",
            "resample",
            1.into(),
            &["preprocessor_config.json: field 'resample'", "1 is not supported"],
        ),
        (
            "hf_vit",
            "image_mean",
            serde_json::json!(["a", 0, 0]),
            &["field 'image_mean'"],
        ),
        (
            "hf_vit",
            "image_std",
            serde_json::json!([0.5, 0.5]),
            &["field 'image_std'", "has 2 values"],
        ),
        (
            "hf_vit",
            "image_std",
            serde_json::json!([0.5, 0, 0.5]),
            &["field 'image_std'", "> 0"],
        ),
        (
            "hf_vit",
            "size",
            serde_json::json!({"height": -1, "width": 32}),
            &["field 'size.height'"],
        ),
        (
            "hf_vit",
            "size",
            serde_json::json!({"height": 64, "width": 64}),
            &["field 'size'", "differs from image_size 32"],
        ),
        ("hf_vit", "rescale_factor", 1.into(), &["field 'rescale_factor'"]),
        (
            "hf_deit",
            "crop_size",
            serde_json::json!({"height": 24, "width": 24}),
            &["field 'crop_size'"],
        ),
        (
            "hf_deit",
            "size",
            serde_json::json!({"height": 16, "width": 16}),
            &["field 'size'", "is not between crop_size"],
        ),
    ];
    for (i, (from, field, value, needles)) in cases.into_iter().enumerate() {
        let dir = copy_of(from, &format!("pre_{i}_{field}"))?;
        edit_json(&dir.join("preprocessor_config.json"), |v| v[field] = value)?;
        refused(&dir, needles)?;
    }
    let dir = copy_of("hf_vit", "pre_not_json")?;
    std::fs::write(dir.join("preprocessor_config.json"), "\u{0}")?;
    refused(&dir, &["preprocessor_config.json", "not valid JSON"])?;
    Ok(())
}

#[test]
fn timm_config_json() -> Result<()> {
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        (
            "architecture",
            "vit_base_patch16_clip_224".into(),
            &["config.json: field 'architecture'", "not a standard"],
        ),
        (
            "architecture",
            7.into(),
            &["field 'architecture'", "expected a string"],
        ),
        (
            "label_names",
            serde_json::json!(["a", "b"]),
            &["field 'label_names'", "2 names for num_classes 5"],
        ),
        ("global_pool", "map".into(), &["field 'global_pool'"]),
        (
            "model_args",
            serde_json::json!({"act_layer": "relu"}),
            &["field 'model_args.act_layer'"],
        ),
        (
            "model_args",
            serde_json::json!({"depth": "two"}),
            &["field 'model_args.depth'"],
        ),
        (
            "model_args",
            serde_json::json!({"img_size": 1e12}),
            &["field 'model_args.img_size'"],
        ),
        (
            "pretrained_cfg",
            serde_json::json!({"crop_pct": 0}),
            &["field 'pretrained_cfg.crop_pct'"],
        ),
        (
            "pretrained_cfg",
            serde_json::json!({"interpolation": "lanczos"}),
            &["field 'pretrained_cfg.interpolation'"],
        ),
        (
            "pretrained_cfg",
            serde_json::json!({"input_size": [3, 224, 224]}),
            &["field 'pretrained_cfg.input_size'"],
        ),
        (
            "pretrained_cfg",
            serde_json::json!({"mean": [0.5]}),
            &["field 'pretrained_cfg.mean'"],
        ),
        (
            "pretrained_cfg",
            "x".into(),
            &["field 'pretrained_cfg'", "expected an object"],
        ),
    ];
    for (i, (field, value, needles)) in cases.into_iter().enumerate() {
        let dir = copy_of("timm_vit", &format!("timm_{i}_{field}"))?;
        edit_json(&dir.join("config.json"), |v| v[field] = value)?;
        refused(&dir, needles)?;
    }
    Ok(())
}

#[test]
fn index_json() -> Result<()> {
    const INDEX: &str = "model.safetensors.index.json";
    let first_tensor = |v: &serde_json::Value| -> String {
        v["weight_map"]
            .as_object()
            .and_then(|m| m.keys().next().cloned())
            .unwrap_or_default()
    };
    for (case, shard) in [
        ("index_parent", "../hf_vit/model.safetensors"),
        ("index_absolute", "/etc/passwd"),
        ("index_subdir", "sub/model.safetensors"),
        ("index_pickle", "pytorch_model-00001-of-00002.bin"),
    ] {
        let dir = copy_of("hf_deit_teacher", case)?;
        edit_json(&dir.join(INDEX), |v| {
            let t = first_tensor(v);
            v["weight_map"][t] = shard.into();
        })?;
        refused(&dir, &[INDEX, "field 'weight_map.", shard])?;
    }
    let dir = copy_of("hf_deit_teacher", "index_wrong_shard")?;
    edit_json(&dir.join(INDEX), |v| {
        let t = first_tensor(v);
        let other = if v["weight_map"][&t] == "model-00001-of-00003.safetensors" {
            "model-00002-of-00003.safetensors"
        } else {
            "model-00001-of-00003.safetensors"
        };
        v["weight_map"][t] = other.into();
    })?;
    refused(&dir, &[INDEX, "but the index puts it in"])?;
    let dir = copy_of("hf_deit_teacher", "index_missing_shard")?;
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors"))?;
    refused(&dir, &["reading weights", "model-00002-of-00003.safetensors"])?;
    let dir = copy_of("hf_deit_teacher", "index_unlisted")?;
    edit_json(&dir.join(INDEX), |v| {
        let t = first_tensor(v);
        v["weight_map"].as_object_mut().map(|m| m.remove(&t));
    })?;
    refused(&dir, &[INDEX, "which the index does not list"])?;
    for (case, text, needle) in [
        (
            "index_not_object",
            r#"{"weight_map": ["a"]}"#,
            "field 'weight_map'",
        ),
        ("index_empty", r#"{"weight_map": {}}"#, "empty"),
        ("index_not_json", "{", "not valid JSON"),
        (
            "index_number",
            r#"{"weight_map": {"a": 5}}"#,
            "field 'weight_map.a'",
        ),
    ] {
        let dir = copy_of("hf_deit_teacher", case)?;
        std::fs::write(dir.join(INDEX), text)?;
        refused(&dir, &[INDEX, needle])?;
    }
    Ok(())
}

/// A 2000 x 1 strip: timm's short-side resize would make it 35 x 70000.
#[test]
fn extreme_aspect_ratio() -> Result<()> {
    let dir = copy_of("", "strip")?;
    let path = dir.join("strip.png");
    image::RgbImage::from_pixel(2000, 1, image::Rgb([9, 99, 199])).save(&path)?;
    let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .env("RUST_BACKTRACE", "1")
        .args(["vit", "--weights"])
        .arg(fixture_dir("folders").join("timm_vit"))
        .arg(&path)
        .output()?;
    assert_one_line_error(&out, &["1x2000", "aspect ratio is too extreme"]);
    Ok(())
}

#[test]
fn folders_without_usable_weights_or_config() -> Result<()> {
    let dir = copy_of("", "pickle_only")?;
    std::fs::write(dir.join("pytorch_model.bin"), b"PK\x03\x04")?;
    std::fs::copy(
        fixture_dir("folders").join("hf_vit/config.json"),
        dir.join("config.json"),
    )?;
    refused(
        &dir,
        &["only the PyTorch pickle", "pytorch_model.bin", "save_file"],
    )?;
    let dir = copy_of("", "empty")?;
    refused(&dir, &["holds no weights"])?;
    refused(
        &dir.join("nowhere"),
        &["reading weights", "nowhere", "no such file or folder"],
    )?;
    let dir = copy_of("timm_vit", "no_config")?;
    std::fs::remove_file(dir.join("config.json"))?;
    refused(&dir, &["no config.json beside"])?;
    let dir = copy_of("timm_vit", "huge_config")?;
    let mut text = vec![b' '; 17 << 20];
    text.extend_from_slice(b"{}");
    std::fs::write(dir.join("config.json"), text)?;
    refused(&dir, &["config.json", "over the limit"])?;
    let dir = copy_of("timm_vit", "two_safetensors")?;
    std::fs::rename(dir.join("model.safetensors"), dir.join("a.safetensors"))?;
    std::fs::copy(dir.join("a.safetensors"), dir.join("b.safetensors"))?;
    refused(&dir, &["2 safetensors files", "pass the file"])?;
    Ok(())
}
