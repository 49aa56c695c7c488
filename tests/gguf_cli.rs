//! `multihead generate --model FILE.gguf`: a GGUF file continues a prompt
//! with HF's greedy ids and text (`tests/fixtures/gguf`, written by
//! `scripts/make_gguf_fixtures.py`); a file whose tokenizer is not
//! rebuilt asks for `--tokenizer`, and runs with it.

use anyhow::{Context, Result};
use multihead_test_support::{cli::assert_one_line_error, gguf, multihead, text, tokens::ids};
use serde_json::Value;

/// HF's greedy continuation of the llama fixture's first prompt.
fn expected() -> Result<Value> {
    Ok(gguf::expected()?.case["models"]["llama"]["prompts"][0].clone())
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
    let out = multihead!(&args)?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice::<Value>(&out.stdout)?[0].clone())
}

#[test]
fn a_gguf_file_generates_hf_s_text() -> Result<()> {
    let want = expected()?;
    let prompt = want["text"].as_str().context("text")?;
    let model = gguf::gguf("llama", "f32");
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
    let mut bytes = std::fs::read(gguf::gguf("llama", "f32"))?;
    let at = bytes
        .windows(20)
        .position(|w| w == b"tokenizer.ggml.model")
        .context("no tokenizer.ggml.model key")?;
    bytes[at + 19] = b'x';
    let path = std::env::temp_dir().join(format!("multihead-gguf-cli-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes)?;
    let model = path.display().to_string();

    let out = multihead!(&["generate", "--model", &model, prompt])?;
    assert_one_line_error(&out, &[&model, "no tokenizer", "--tokenizer"]);

    let json = text::fixtures().join("llama3").join("tokenizer.json");
    let got = generate_json(&model, &["--tokenizer", &json.display().to_string()], prompt)?;
    std::fs::remove_file(&path)?;
    assert_eq!(ids(&got["tokens"]), ids(&want["greedy"]["ids"]));

    let folder = text::fixtures().join("llama3");
    let out = multihead!(&[
        "generate",
        "--model",
        &folder.display().to_string(),
        "--tokenizer",
        "x.json",
        "hi",
    ])?;
    assert_one_line_error(&out, &["--tokenizer is for a GGUF model"]);
    Ok(())
}
