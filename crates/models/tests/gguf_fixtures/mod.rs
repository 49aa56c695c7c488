//! The GGUF fixtures (`tests/fixtures/gguf`, written by
//! `scripts/make_gguf_fixtures.py`) and edited copies of them, for
//! `decoders_gguf.rs` and `decoders_gguf_untrusted.rs`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::quantized::gguf_file::{self, Value as GgufValue};
use candle::quantized::QTensor;
use candle::{Device, Tensor};
use multihead_models::checkpoint::{LoadOptions, WeightDtype};
use multihead_models::decoder::{CausalLm, DecoderModel};
use serde_json::Value;

use crate::common::{fixture_dir, Fixture};

/// Each model and the types it was converted to.
pub const FILES: [(&str, &[&str]); 7] = [
    ("llama", &["f32", "f16", "bf16", "q8_0"]),
    ("qwen2", &["f32", "q8_0"]),
    ("qwen3", &["f32", "bf16"]),
    ("smollm3", &["f32"]),
    ("olmo2", &["f32"]),
    ("gemma2", &["f32", "q8_0"]),
    ("gemma3", &["f32"]),
];

/// The models whose HF values are in `expected-archs.safetensors`
/// (llama.cpp's archs `smollm3`, `olmo2`, `gemma2` and `gemma3`) rather
/// than `expected.safetensors`.
pub const ARCHS: [&str; 4] = ["smollm3", "olmo2", "gemma2", "gemma3"];

/// The models that are Gemmas ([`multihead_models::decoder::GemmaConfig`]),
/// the others Llama-family.
pub const GEMMAS: [&str; 2] = ["gemma2", "gemma3"];

pub fn gguf(name: &str, ty: &str) -> PathBuf {
    fixture_dir("gguf").join(format!("{name}-{ty}.gguf"))
}

pub fn expected() -> Result<Fixture> {
    Fixture::load(&fixture_dir("gguf").join("expected.safetensors"), &Device::Cpu)
}

/// The fixture holding model `name`'s HF values (`{name}.*` tensors and
/// its case), of the two the script writes for [`FILES`].
pub fn expected_for(name: &str) -> Result<Fixture> {
    let file = if ARCHS.contains(&name) {
        "expected-archs.safetensors"
    } else {
        "expected.safetensors"
    };
    Fixture::load(&fixture_dir("gguf").join(file), &Device::Cpu)
}

pub fn model_case<'a>(f: &'a Fixture, name: &str) -> Result<&'a Value> {
    f.case["models"]
        .get(name)
        .with_context(|| format!("no case for {name}"))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect())
        .unwrap_or_default()
}

pub fn logits(model: &DecoderModel, input: &Tensor) -> Result<Tensor> {
    Ok(model.forward(input, &mut model.new_cache(vec![]))?)
}

pub fn opts(dtype: WeightDtype) -> LoadOptions {
    LoadOptions {
        dtype,
        ..LoadOptions::default()
    }
}

pub type Meta = Vec<(String, GgufValue)>;
pub type Tensors = Vec<(String, QTensor)>;
pub type MetaEdit = Box<dyn Fn(&mut Meta)>;

pub fn set(meta: &mut Meta, key: &str, value: GgufValue) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), value));
}

/// The fixture `{name}-f32.gguf` read by candle, edited, and written back
/// with candle's writer to a temporary file.
pub fn rewrite(
    name: &str,
    tag: &str,
    edit: impl FnOnce(&mut Meta, &mut Tensors) -> Result<()>,
) -> Result<PathBuf> {
    let src = gguf(name, "f32");
    let mut file = std::fs::File::open(&src)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut meta: Meta = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Tensors = names
        .into_iter()
        .map(|n| Ok((n.clone(), content.tensor(&mut file, n, &Device::Cpu)?)))
        .collect::<Result<_>>()?;
    edit(&mut meta, &mut tensors)?;
    let path = std::env::temp_dir().join(format!("multihead-gguf-{}-{name}-{tag}.gguf", std::process::id()));
    let mut out = std::fs::File::create(&path)?;
    let m: Vec<(&str, &GgufValue)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &m, &t)?;
    Ok(path)
}

pub fn load_error(path: &Path) -> String {
    match DecoderModel::from_gguf(path, &Device::Cpu, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

#[track_caller]
pub fn assert_mentions(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}
