//! `multihead generate --model FILE.gguf`: a GGUF file continues a prompt
//! with HF's greedy ids and text (`tests/fixtures/gguf`, written by
//! `scripts/make_gguf_fixtures.py`); a file whose tokenizer is not
//! rebuilt asks for `--tokenizer`, and runs with it.

mod common;

use std::process::Command;

use anyhow::{Context, Result};
use serde_json::Value;

fn multihead(args: &[&str]) -> Result<std::process::Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(args)
        .output()?)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// HF's greedy continuation of the llama fixture's first prompt.
fn expected() -> Result<Value> {
    let path = common::fixture_dir("gguf").join("expected.safetensors");
    let f = common::Fixture::load(&path, &candle::Device::Cpu)?;
    Ok(f.case["models"]["llama"]["prompts"][0].clone())
}

fn generate_json(model: &str, extra: &[&str], prompt: &str) -> Result<Value> {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--greedy",
        "--max-new-tokens",
        "8",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    args.push(prompt);
    let out = multihead(&args)?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice::<Value>(&out.stdout)?[0].clone())
}

#[test]
fn a_gguf_file_generates_hf_s_text() -> Result<()> {
    let want = expected()?;
    let prompt = want["text"].as_str().context("text")?;
    let model = common::fixture_dir("gguf").join("llama-f32.gguf");
    let got = generate_json(&model.display().to_string(), &[], prompt)?;
    assert_eq!(ids(&got["tokens"]), ids(&want["greedy"]["ids"]));
    assert_eq!(got["text"], want["greedy"]["text"]);
    assert_eq!(got["finish"], want["greedy"]["finish"]);
    Ok(())
}

#[test]
fn a_file_without_a_tokenizer_asks_for_one() -> Result<()> {
    let want = expected()?;
    let prompt = want["text"].as_str().context("text")?;
    // The key renamed in place: the file has no tokenizer.ggml.model.
    let mut bytes = std::fs::read(common::fixture_dir("gguf").join("llama-f32.gguf"))?;
    let at = bytes
        .windows(20)
        .position(|w| w == b"tokenizer.ggml.model")
        .context("no tokenizer.ggml.model key")?;
    bytes[at + 19] = b'x';
    let path = std::env::temp_dir().join(format!("multihead-gguf-cli-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes)?;
    let model = path.display().to_string();

    let out = multihead(&["generate", "--model", &model, prompt])?;
    common::assert_one_line_error(&out, &[&model, "no tokenizer", "--tokenizer"]);

    let json = common::fixture_dir("text").join("llama3").join("tokenizer.json");
    let got = generate_json(&model, &["--tokenizer", &json.display().to_string()], prompt)?;
    std::fs::remove_file(&path)?;
    assert_eq!(ids(&got["tokens"]), ids(&want["greedy"]["ids"]));

    let folder = common::fixture_dir("text").join("llama3");
    let out = multihead(&[
        "generate",
        "--model",
        &folder.display().to_string(),
        "--tokenizer",
        "x.json",
        "hi",
    ])?;
    common::assert_one_line_error(&out, &["--tokenizer is for a GGUF model"]);
    Ok(())
}
