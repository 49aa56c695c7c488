//! The GGUF fixtures (`tests/fixtures/gguf`, written by
//! `scripts/make_gguf_fixtures.py`: tiny random-init HF models converted
//! by llama.cpp's `convert_hf_to_gguf.py`, HF's values beside them), edited
//! copies of them, and llama.cpp's vocabulary-only test files
//! (`tests/fixtures/gguf/vocab`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle::quantized::gguf_file::{self, Value as GgufValue};
use candle::quantized::QTensor;
use candle::{Device, Tensor};
use multihead_models::checkpoint::{LoadOptions, WeightDtype};
use multihead_models::decoder::{CausalLm, DecoderModel};
use serde_json::Value;

use crate::fixtures::{fixture_dir, Fixture};

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

/// The fixture file of model `name` converted to type `ty` (`f32`,
/// `q8_0`, ...; see [`FILES`]).
pub fn gguf(name: &str, ty: &str) -> PathBuf {
    fixture_dir("gguf").join(format!("{name}-{ty}.gguf"))
}

/// HF's values for the Llama-family models and the quantized files
/// (`expected.safetensors`).
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

/// Model `name`'s case in fixture `f`: HF's config, prompts and ids.
pub fn model_case<'a>(f: &'a Fixture, name: &str) -> Result<&'a Value> {
    f.case["models"]
        .get(name)
        .with_context(|| format!("no case for {name}"))
}

/// A model's logits over `input` in one pass from an empty cache.
pub fn logits(model: &DecoderModel, input: &Tensor) -> Result<Tensor> {
    Ok(model.forward(input, &mut model.new_cache(vec![]))?)
}

/// Load options keeping the weight matrices in `dtype`.
pub fn opts(dtype: WeightDtype) -> LoadOptions {
    LoadOptions {
        dtype,
        ..LoadOptions::default()
    }
}

/// A file's metadata, as [`rewrite`] edits it.
pub type Meta = Vec<(String, GgufValue)>;
/// A file's tensors, as [`rewrite`] edits them.
pub type Tensors = Vec<(String, QTensor)>;
/// One edit of a file's metadata.
pub type MetaEdit = Box<dyn Fn(&mut Meta)>;

/// Sets metadata `key` to `value`, replacing any value it had.
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

/// The first line of the error loading GGUF file `path` gives; panics if
/// it loads.
pub fn load_error(path: &Path) -> String {
    match DecoderModel::from_gguf(path, &Device::Cpu, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

/// llama.cpp's vocabulary-only test file `ggml-vocab-<name>.gguf`, of
/// those committed (`tests/fixtures/gguf/vocab/README.md`).
pub fn vocab(name: &str) -> PathBuf {
    fixture_dir("gguf")
        .join("vocab")
        .join(format!("ggml-vocab-{name}.gguf"))
}

/// The marker line between two texts of an `.inp` file.
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// The texts of `NAME.gguf.inp` and the ids of `NAME.gguf.out` beside
/// vocabulary file `gguf`, read as llama.cpp's `test-tokenizer-0.cpp`
/// reads them (the ids are HF tokenizers', which that test checks
/// llama.cpp against).
pub fn vocab_cases(gguf: &Path) -> Result<Vec<(String, Vec<u32>)>> {
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp"))
        .with_context(|| format!("{}.inp", gguf.display()))?;
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out"))
        .with_context(|| format!("{}.out", gguf.display()))?;
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(SEPARATOR) {
            Some(i) => {
                texts.push(rest[..i].to_string());
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => {
                texts.push(rest.to_string());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(str::parse).collect())
        .collect::<std::result::Result<_, _>>()
        .context("ids")?;
    if texts.len() != ids.len() {
        bail!(
            "{}: {} texts, {} lines of ids",
            gguf.display(),
            texts.len(),
            ids.len()
        )
    }
    Ok(texts.into_iter().zip(ids).collect())
}
