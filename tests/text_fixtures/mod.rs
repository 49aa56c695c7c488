//! The text fixtures (`tests/fixtures/text`, written by
//! `scripts/make_text_fixtures.py`) and what HF transformers made of
//! them, shared by the library's and the CLI's tests, and the binary
//! to run.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    super::common::fixture_dir("text")
}

pub fn expected() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("expected.json"),
    )?)?)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
        .unwrap_or_default()
}

/// Byte-level BPE (GPT-2's kind), the same with Llama 3's special tokens
/// and two end tokens, and SentencePiece-style BPE with byte fallback
/// (Llama 2's kind).
pub const FOLDERS: [&str; 3] = ["gpt2-bpe", "llama3", "llama2-sp"];

/// A copy of a text fixture folder with `edit` applied to it.
pub fn folder_with(name: &str, tag: &str, edit: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("text_generation")
        .join(format!("{name}-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(fixtures().join(name))? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
    }
    edit(&dir)?;
    Ok(dir)
}

/// `multihead ARGS`, with `stdin` on its standard input where given.
pub fn multihead(args: &[&str], stdin: Option<&str>) -> Result<std::process::Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multihead"));
    cmd.args(args).env("RUST_BACKTRACE", "1");
    if let Some(input) = stdin {
        use std::io::Write;
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        child.stdin.take().context("stdin")?.write_all(input.as_bytes())?;
        return Ok(child.wait_with_output()?);
    }
    Ok(cmd.output()?)
}
