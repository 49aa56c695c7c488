//! `multihead inspect`, and bad input through the binary: one `error:`
//! line, a non-zero exit, no panic, no backtrace even with RUST_BACKTRACE.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result};

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/vit-digits")
}

fn scratch(name: &str) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("untrusted_cli")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn multihead(args: &[&str]) -> Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_multihead"))
        .current_dir(model_dir())
        .env("RUST_BACKTRACE", "1")
        .args(args)
        .output()?)
}

fn s(p: &Path) -> Result<&str> {
    p.to_str().context("path")
}

#[test]
fn inspect_the_shipped_model() -> Result<()> {
    let out = multihead(&["inspect", "model.safetensors"])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "blocks.0.attn.qkv.weight",
        "layout: timm VisionTransformer",
        "embed_dim 64, depth 4",
        "patch 4, image 16, in_chans 1, classes 10, mlp 128",
        "values: all finite",
        "every tensor matches",
    ] {
        assert!(stdout.contains(want), "no {want:?} in\n{stdout}");
    }
    let out = multihead(&["inspect", "--json", "model.safetensors"])?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["layout"]["kind"], "timm_vit");
    assert_eq!(v["layout"]["embed_dim"], 64);
    assert_eq!(v["config"]["clean"], true);
    assert!(v["total_params"].as_u64().is_some_and(|n| n > 100_000));
    Ok(())
}

#[test]
fn inspect_lists_every_mismatch_against_a_config() -> Result<()> {
    let dir = scratch("config")?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("config.json"))?)?;
    cfg["depth"] = serde_json::json!(5);
    cfg["num_classes"] = serde_json::json!(0);
    cfg["labels"] = serde_json::Value::Null;
    let path = dir.join("deeper.json");
    std::fs::write(&path, cfg.to_string())?;
    let out = multihead(&["inspect", "model.safetensors", "--config", s(&path)?])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("missing     blocks.4.attn.qkv.weight [192, 64]"),
        "{stdout}"
    );
    assert!(stdout.contains("unexpected  head.weight"), "{stdout}");
    common::assert_one_line_error(&out, &["does not fit config", "12 missing", "2 unexpected"]);
    Ok(())
}

/// A safetensors file whose tensor names and metadata hold terminal
/// escapes: ESC sequences (clear the screen, set the title) and a C1 CSI
/// (U+009B). Its two tensors are an `nn.MultiheadAttention`'s, under a
/// prefix that is the escape.
fn hostile_safetensors(path: &Path) -> Result<()> {
    let tensors = [
        ("\u{1b}[2J.in_proj_weight", [12usize, 4]),
        ("\u{1b}[2J.out_proj.weight", [4, 4]),
    ];
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "\u{1b}]0;title\u{7}": "\u{1b}[2J\u{9b}31m" }),
    );
    let mut offset = 0;
    for (name, shape) in &tensors {
        let end = offset + 4 * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let header = serde_json::to_vec(&header)?;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.resize(bytes.len() + offset, 0);
    Ok(std::fs::write(path, bytes)?)
}

/// Names and metadata from a safetensors file cannot drive the terminal:
/// every control character prints escaped (`\u{1b}`) in the listing, the
/// metadata, the layout, the config check and the one-line error, as a
/// GGUF file's do; the JSON writes them as `\u` escapes and parses back
/// to the file's own names.
#[test]
fn inspect_escapes_control_characters_from_a_safetensors_file() -> Result<()> {
    let dir = scratch("hostile_names")?;
    let path = dir.join("hostile.safetensors");
    hostile_safetensors(&path)?;
    let config = dir.join("mha.json");
    std::fs::write(&config, r#"{"embed_dim": 4, "num_heads": 1}"#)?;
    let raw = |bytes: &[u8]| -> bool {
        let text = String::from_utf8_lossy(bytes);
        text.chars().any(|c| c.is_control() && c != '\n')
    };

    let out = multihead(&["inspect", s(&path)?])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!raw(&out.stdout), "{:?}", String::from_utf8_lossy(&out.stdout));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in [
        r"\u{1b}[2J.out_proj.weight  F32    [4, 4]",
        r"metadata: \u{1b}]0;title\u{7} = \u{1b}[2J\u{9b}31m",
        r"  at '\u{1b}[2J.': embed_dim 4,",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }

    // Against a config: the missing biases under the file's prefix, named.
    let out = multihead(&["inspect", s(&path)?, "--config", s(&config)?])?;
    assert!(!raw(&out.stdout), "{:?}", String::from_utf8_lossy(&out.stdout));
    assert!(!raw(&out.stderr), "{:?}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains(r"  missing     \u{1b}[2J.in_proj_bias [12]"),
        "{text}"
    );
    common::assert_one_line_error(&out, &[r"2 missing: \u{1b}[2J.in_proj_bias [12]"]);

    let out = multihead(&["inspect", "--json", s(&path)?])?;
    assert!(!raw(&out.stdout), "{:?}", String::from_utf8_lossy(&out.stdout));
    let json = String::from_utf8(out.stdout)?;
    assert!(json.contains(r"\u001b[2J") && json.contains(r"\u009b"), "{json}");
    let v: serde_json::Value = serde_json::from_str(&json)?;
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .context("tensors")?
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["\u{1b}[2J.in_proj_weight", "\u{1b}[2J.out_proj.weight"]);
    assert_eq!(v["metadata"]["\u{1b}]0;title\u{7}"], "\u{1b}[2J\u{9b}31m");
    Ok(())
}

#[test]
fn inspect_a_truncated_file() -> Result<()> {
    let dir = scratch("truncated")?;
    let bytes = std::fs::read(model_dir().join("model.safetensors"))?;
    let path = dir.join("cut.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() / 2])?;
    common::assert_one_line_error(
        &multihead(&["inspect", s(&path)?])?,
        &["cut.safetensors", "do not end where the file ends"],
    );
    std::fs::write(&path, &bytes[..5])?;
    common::assert_one_line_error(&multihead(&["inspect", s(&path)?])?, &["truncated"]);
    Ok(())
}

#[test]
fn inspect_refuses_a_pickle() -> Result<()> {
    let dir = scratch("pickle")?;
    let path = dir.join("pytorch_model.bin");
    std::fs::write(&path, b"\x80\x02}q\x00.")?;
    common::assert_one_line_error(
        &multihead(&["inspect", s(&path)?])?,
        &["PyTorch pickle", "save_file"],
    );
    Ok(())
}

#[test]
fn inspect_a_missing_file() -> Result<()> {
    common::assert_one_line_error(
        &multihead(&["inspect", "nope.safetensors"])?,
        &["reading weights 'nope.safetensors'"],
    );
    Ok(())
}

/// The shipped weights with one tensor's first value replaced.
fn poisoned_weights(dir: &Path, value: f32) -> Result<PathBuf> {
    let mut tensors = candle::safetensors::load(model_dir().join("model.safetensors"), &candle::Device::Cpu)?;
    let bias = tensors.get("head.bias").context("head.bias")?;
    let mut v: Vec<f32> = bias.to_vec1()?;
    v[0] = value;
    tensors.insert("head.bias".into(), candle::Tensor::new(v, &candle::Device::Cpu)?);
    let path = dir.join("model.safetensors");
    candle::safetensors::save(&tensors, &path)?;
    std::fs::copy(model_dir().join("config.json"), dir.join("config.json"))?;
    Ok(path)
}

#[test]
fn vit_refuses_nan_weights() -> Result<()> {
    let dir = scratch("nan")?;
    let w = poisoned_weights(&dir, f32::NAN)?;
    common::assert_one_line_error(
        &multihead(&["vit", "--weights", s(&w)?])?,
        &["do not match the model", "head.bias (1 NaN, 0 Inf)"],
    );
    let out = multihead(&["inspect", s(&w)?])?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("head.bias has 1 NaN and 0 Inf"));
    Ok(())
}

#[test]
fn vit_refuses_a_decompression_bomb() -> Result<()> {
    let dir = scratch("bomb")?;
    // An 8-bit grayscale PNG header claiming 100000 x 100000 pixels.
    let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
    png.extend_from_slice(&100_000u32.to_be_bytes());
    png.extend_from_slice(&100_000u32.to_be_bytes());
    png.extend_from_slice(&[8, 0, 0, 0, 0]);
    png.extend_from_slice(&0u32.to_be_bytes()); // CRC (checked after the limits or not at all)
    let path = dir.join("bomb.png");
    std::fs::write(&path, &png)?;
    common::assert_one_line_error(&multihead(&["vit", s(&path)?])?, &["bomb.png"]);
    Ok(())
}

#[test]
fn vit_refuses_an_empty_image_file() -> Result<()> {
    let dir = scratch("empty")?;
    let path = dir.join("empty.png");
    std::fs::write(&path, b"")?;
    common::assert_one_line_error(&multihead(&["vit", s(&path)?])?, &["empty.png", "empty file"]);
    Ok(())
}
