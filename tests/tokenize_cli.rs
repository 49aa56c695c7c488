//! `multihead tokenize`: on llama.cpp's vocabulary-only GGUF files
//! (`tests/fixtures/gguf/vocab`), the ids of their `.out` files (HF's
//! tokenizers' ids, which llama.cpp's tokenizer test checks llama.cpp
//! against), from arguments and from standard input; the BOS/EOS the file
//! asks for unless `--no-special`; `--chat` on a folder gives HF's
//! `apply_chat_template` ids (`tests/fixtures/text/expected.json`).

use std::process::Output;

use anyhow::{Context, Result};
use multihead_test_support::{
    cli::assert_one_line_error,
    gguf::{vocab, vocab_cases},
    multihead, text,
    tokens::ids,
};
use serde_json::Value;

/// `multihead tokenize ARGS` with `stdin` on its standard input.
fn run(args: &[&str], stdin: &str) -> Result<Output> {
    multihead!(&[&["tokenize"], args].concat(), stdin)
}

/// The JSON `multihead tokenize --format json ARGS` writes.
fn json(args: &[&str], stdin: &str) -> Result<Vec<Value>> {
    let out = run(&[&["--format", "json"], args].concat(), stdin)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout)?;
    v.as_array().cloned().context("an array")
}

/// Every text of llama-spm (SentencePiece) and deepseek-coder (byte-level
/// BPE) given as arguments, one result each: the `.out` ids with
/// `--no-special`, and after the BOS each file asks for without it
/// (`<s>` = 1, `<｜begin▁of▁sentence｜>` = 32013).
#[test]
fn vocabulary_only_files_give_llama_cpps_ids() -> Result<()> {
    for (name, bos) in [("llama-spm", 1), ("deepseek-coder", 32013)] {
        let cases = vocab_cases(&vocab(name))?;
        // Arguments cannot hold an empty text the way they are compared
        // here; the rest go in one call.
        let cases: Vec<_> = cases.into_iter().filter(|(t, _)| !t.is_empty()).collect();
        let model = vocab(name).display().to_string();
        let texts: Vec<&str> = cases.iter().map(|(t, _)| t.as_str()).collect();
        let got = json(
            &[&["--model", &model, "--no-special", "--"], &texts[..]].concat(),
            "",
        )?;
        assert_eq!(got.len(), cases.len(), "{name}");
        for ((text, want), got) in cases.iter().zip(&got) {
            assert_eq!(&ids(&got["ids"]), want, "{name}: {text:?}");
            assert_eq!(
                got["pieces"].as_array().map(Vec::len),
                Some(want.len()),
                "{name}: {text:?}"
            );
        }
        let (text, want) = &cases[0];
        let got = json(&["--model", &model, "--", text], "")?;
        assert_eq!(
            ids(&got[0]["ids"]),
            [&[bos][..], want].concat(),
            "{name}: {text:?}"
        );
    }
    Ok(())
}

/// With no text the whole of standard input is one text, newlines and all.
#[test]
fn standard_input_is_one_text() -> Result<()> {
    let model = vocab("llama-spm").display().to_string();
    let cases = vocab_cases(&vocab("llama-spm"))?;
    for (text, want) in cases.iter().filter(|(t, _)| t.contains('\n')).take(3) {
        let got = json(&["--model", &model, "--no-special"], text)?;
        assert_eq!(got.len(), 1);
        assert_eq!(&ids(&got[0]["ids"]), want, "{text:?}");
    }
    Ok(())
}

/// The text format: a line a token, its id and piece (`▁` as a space).
#[test]
fn text_format_shows_ids_and_pieces() -> Result<()> {
    let model = vocab("llama-spm").display().to_string();
    let out = run(&["--model", &model, "Hello world"], "")?;
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
    let expected = text::expected()?;
    let chat = &expected["llama3"]["chats"][0];
    assert_eq!(chat["messages"].as_array().map(Vec::len), Some(1));
    let text = chat["messages"][0]["content"].as_str().context("content")?;
    let folder = text::fixtures().join("llama3").display().to_string();
    let got = json(&["--model", &folder, "--chat", text], "")?;
    assert_eq!(ids(&got[0]["ids"]), ids(&chat["ids"]));

    // A file without a template says so.
    let model = vocab("llama-spm").display().to_string();
    let out = run(&["--model", &model, "--chat", "hi"], "")?;
    assert_one_line_error(&out, &["--chat", &model, "no chat template"]);
    Ok(())
}
