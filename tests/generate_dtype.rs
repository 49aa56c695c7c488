//! `multihead generate`'s default `--dtype`: what HF transformers loads a
//! folder in (its config's dtype, else its weights'), and the type a GGUF
//! file stores its matrices in; `--dtype` overrides either.

use std::collections::HashMap;
use std::process::Command;

use anyhow::Result;
use candle::{DType, Device};
use multihead_test_support::{
    cli::assert_one_line_error, fixtures::fixture_dir, scratch::copy_files, scratch_dir,
};

/// `generate` on `model` with `extra` arguments: the dtype its "loaded"
/// line on stderr names.
fn loaded_dtype(model: &str, extra: &[&str]) -> Result<String> {
    let mut args = vec!["generate", "--model", model, "--max-new-tokens", "2"];
    args.extend_from_slice(extra);
    args.push("Hello");
    let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(&args)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("loaded "))
        .unwrap_or_default();
    let dtype = line.rsplit_once(" (").and_then(|(_, r)| r.split_once(')'));
    Ok(dtype
        .map(|(d, _)| d.to_string())
        .unwrap_or_else(|| format!("no dtype in {stderr:?}")))
}

/// A bf16 copy of the llama3 text fixture (f32): its weights rounded to
/// bf16, its config saying so under `dtype_key`, or saying nothing.
fn bf16_copy(tag: &str, dtype_key: Option<&str>) -> Result<std::path::PathBuf> {
    let src = fixture_dir("text").join("llama3");
    let dir = scratch_dir!(format!("bf16-{tag}"))?;
    copy_files(&src, &dir)?;
    let weights = candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    let bf16: HashMap<String, candle::Tensor> = weights
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(DType::BF16)?)))
        .collect::<Result<_>>()?;
    candle::safetensors::save(&bf16, dir.join("model.safetensors"))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    let config_map = config.as_object_mut().expect("config.json is an object");
    config_map.remove("dtype");
    config_map.remove("torch_dtype");
    if let Some(key) = dtype_key {
        config_map.insert(key.into(), "bfloat16".into());
    }
    std::fs::write(dir.join("config.json"), config.to_string())?;
    Ok(dir)
}

/// A folder runs in the dtype its config names (`dtype`, or the older
/// `torch_dtype`), else in its weights' dtype, as HF transformers' default
/// `dtype="auto"` loads it; `--dtype` overrides.
#[test]
fn a_folder_runs_in_its_own_dtype() -> Result<()> {
    let f32_folder = fixture_dir("text").join("llama3").display().to_string();
    assert_eq!(loaded_dtype(&f32_folder, &[])?, "f32");
    assert_eq!(loaded_dtype(&f32_folder, &["--dtype", "bf16"])?, "bf16");
    for (tag, key) in [
        ("dtype", Some("dtype")),
        ("torch", Some("torch_dtype")),
        ("weights", None),
    ] {
        let dir = bf16_copy(tag, key)?;
        let folder = dir.display().to_string();
        let got = (
            loaded_dtype(&folder, &[])?,
            loaded_dtype(&folder, &["--dtype", "f32"])?,
        );
        std::fs::remove_dir_all(&dir)?;
        assert_eq!(got, ("bf16".to_string(), "f32".to_string()), "config key {key:?}");
    }
    Ok(())
}

/// A GGUF file's matrices stay in the type it stores them in unless
/// `--dtype` says otherwise.
#[test]
fn a_gguf_file_runs_in_the_type_it_stores() -> Result<()> {
    for ty in ["f32", "bf16", "f16", "q8_0"] {
        let model = fixture_dir("gguf").join(format!("llama-{ty}.gguf"));
        let model = model.display().to_string();
        assert_eq!(loaded_dtype(&model, &[])?, ty);
        assert_eq!(loaded_dtype(&model, &["--dtype", "f32"])?, "f32");
    }
    Ok(())
}

/// `--dtype f16` on a folder holding a weight past f16's largest value
/// (65504): refused at load, in one line naming the file, the tensor, the
/// value and the dtypes that hold it, instead of running into infinity at
/// the first step; `--dtype bf16` runs it.
#[test]
fn a_weight_past_f16_s_range_is_refused_at_load() -> Result<()> {
    let src = fixture_dir("text").join("llama3");
    let dir = scratch_dir!("past-f16")?;
    copy_files(&src, &dir)?;
    let mut weights = candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    let name = "lm_head.weight";
    let head = weights.get(name).ok_or_else(|| anyhow::anyhow!("no {name}"))?;
    // Its first row all 1e5.
    let rows = head.dim(0)?;
    let first = (head.narrow(0, 0, 1)?.ones_like()? * 1e5)?;
    let big = candle::Tensor::cat(&[&first, &head.narrow(0, 1, rows - 1)?], 0)?;
    weights.insert(name.into(), big);
    candle::safetensors::save(&weights, dir.join("model.safetensors"))?;
    let model = dir.display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(["generate", "--model", &model, "--dtype", "f16", "Hello"])
        .output()?;
    let file = dir.join("model.safetensors").display().to_string();
    assert_one_line_error(
        &out,
        &[
            &file,
            "lm_head.weight: 64 values up to 100000, past f16's largest 65504",
            "bf16 or f32 hold them",
        ],
    );
    assert_eq!(loaded_dtype(&model, &["--dtype", "bf16"])?, "bf16");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
