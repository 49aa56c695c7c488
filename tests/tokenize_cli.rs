//! `multihead tokenize`: on llama.cpp's vocabulary-only GGUF files
//! (`tests/fixtures/gguf/vocab`), the ids of their `.out` files (HF's
//! tokenizers' ids, which llama.cpp's tokenizer test checks llama.cpp
//! against), from arguments and from standard input; the BOS/EOS the file
//! asks for unless `--no-special`; `--chat` on a folder gives HF's
//! `apply_chat_template` ids (`tests/fixtures/text/expected.json`).

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use serde_json::Value;

fn vocab(name: &str) -> PathBuf {
    common::fixture_dir("gguf")
        .join("vocab")
        .join(format!("ggml-vocab-{name}.gguf"))
}

/// The texts of `NAME.gguf.inp` and the ids of its `.out`.
fn cases(name: &str) -> Result<Vec<(String, Vec<u64>)>> {
    let path = vocab(name);
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp"))?;
    let out = std::fs::read_to_string(path.with_extension("gguf.out"))?;
    let texts = inp
        .strip_suffix("\n__ggml_vocab_test__\n")
        .unwrap_or(&inp)
        .split("\n__ggml_vocab_test__\n");
    let ids = out.lines().map(|l| {
        l.split_whitespace()
            .map(str::parse)
            .collect::<Result<Vec<u64>, _>>()
    });
    texts.zip(ids).map(|(t, i)| Ok((t.to_string(), i?))).collect()
}

fn run(args: &[&str], stdin: Option<&str>) -> Result<std::process::Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut input = child.stdin.take().context("stdin")?;
    input.write_all(stdin.unwrap_or_default().as_bytes())?;
    drop(input);
    Ok(child.wait_with_output()?)
}

/// The JSON `multihead tokenize --format json ARGS` writes.
fn json(args: &[&str], stdin: Option<&str>) -> Result<Vec<Value>> {
    let out = run(&[&["--format", "json"], args].concat(), stdin)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout)?;
    v.as_array().cloned().context("an array")
}

fn ids(v: &Value) -> Vec<u64> {
    v["ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// Every text of llama-spm (SentencePiece) and deepseek-coder (byte-level
/// BPE) given as arguments, one result each: the `.out` ids with
/// `--no-special`, and after the BOS each file asks for without it
/// (`<s>` = 1, `<｜begin▁of▁sentence｜>` = 32013).
#[test]
fn vocabulary_only_files_give_llama_cpps_ids() -> Result<()> {
    for (name, bos) in [("llama-spm", 1), ("deepseek-coder", 32013)] {
        let cases = cases(name)?;
        // Arguments cannot hold an empty text the way they are compared
        // here; the rest go in one call.
        let cases: Vec<_> = cases.into_iter().filter(|(t, _)| !t.is_empty()).collect();
        let model = vocab(name).display().to_string();
        let texts: Vec<&str> = cases.iter().map(|(t, _)| t.as_str()).collect();
        let got = json(
            &[&["--model", &model, "--no-special", "--"], &texts[..]].concat(),
            None,
        )?;
        assert_eq!(got.len(), cases.len(), "{name}");
        for ((text, want), got) in cases.iter().zip(&got) {
            assert_eq!(&ids(got), want, "{name}: {text:?}");
            assert_eq!(
                got["pieces"].as_array().map(Vec::len),
                Some(want.len()),
                "{name}: {text:?}"
            );
        }
        let (text, want) = &cases[0];
        let got = json(&["--model", &model, "--", text], None)?;
        assert_eq!(ids(&got[0]), [&[bos][..], want].concat(), "{name}: {text:?}");
    }
    Ok(())
}

/// With no text the whole of standard input is one text, newlines and all.
#[test]
fn standard_input_is_one_text() -> Result<()> {
    let model = vocab("llama-spm").display().to_string();
    let cases = cases("llama-spm")?;
    for (text, want) in cases.iter().filter(|(t, _)| t.contains('\n')).take(3) {
        let got = json(&["--model", &model, "--no-special"], Some(text))?;
        assert_eq!(got.len(), 1);
        assert_eq!(&ids(&got[0]), want, "{text:?}");
    }
    Ok(())
}

/// The text format: a line a token, its id and piece (`▁` as a space).
#[test]
fn text_format_shows_ids_and_pieces() -> Result<()> {
    let model = vocab("llama-spm").display().to_string();
    let out = run(&["--model", &model, "Hello world"], None)?;
    assert!(out.status.success());
    // ▁Hello ▁world, the ids of llama-spm's .out for "Hello world".
    assert_eq!(
        String::from_utf8(out.stdout)?,
        "1 '<s>'\n15043 ' Hello'\n3186 ' world'\n"
    );
    Ok(())
}

/// `--chat` renders the folder's template (Llama 3 Instruct's) around the
/// text as a user's message, as HF's `apply_chat_template` gives it.
#[test]
fn chat_renders_the_template_first() -> Result<()> {
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(
        common::fixture_dir("text").join("expected.json"),
    )?)?;
    let chat = &expected["llama3"]["chats"][0];
    assert_eq!(chat["messages"].as_array().map(Vec::len), Some(1));
    let text = chat["messages"][0]["content"].as_str().context("content")?;
    let folder = common::fixture_dir("text").join("llama3").display().to_string();
    let got = json(&["--model", &folder, "--chat", text], None)?;
    assert_eq!(ids(&got[0]), ids(chat));

    // A file without a template says so.
    let model = vocab("llama-spm").display().to_string();
    let out = run(&["--model", &model, "--chat", "hi"], None)?;
    common::assert_one_line_error(&out, &["--chat", &model, "no chat template"]);
    Ok(())
}
