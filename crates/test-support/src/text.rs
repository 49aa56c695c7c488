//! The text fixtures (`tests/fixtures/text`, written by
//! `scripts/make_text_fixtures.py`): decoder folders with a tokenizer and
//! a generation config, and what HF transformers made of them
//! (`expected.json`).

use std::path::PathBuf;

use anyhow::Result;
use serde_json::Value;

use crate::fixtures::fixture_dir;
use crate::scratch::copy_files;

/// Byte-level BPE (GPT-2's kind), the same with Llama 3's special tokens
/// and two end tokens, and SentencePiece-style BPE with byte fallback
/// (Llama 2's kind).
pub const FOLDERS: [&str; 3] = ["gpt2-bpe", "llama3", "llama2-sp"];

/// `tests/fixtures/text`.
pub fn fixtures() -> PathBuf {
    fixture_dir("text")
}

/// HF's prompts, ids and texts for every folder (`expected.json`).
pub fn expected() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("expected.json"),
    )?)?)
}

/// A copy of text fixture folder `name` in the empty folder `dir` (a
/// [`scratch_dir!`](crate::scratch_dir)), with `edit` applied to it.
pub fn folder_with(
    dir: PathBuf,
    name: &str,
    edit: impl FnOnce(&std::path::Path) -> Result<()>,
) -> Result<PathBuf> {
    copy_files(&fixtures().join(name), &dir)?;
    edit(&dir)?;
    Ok(dir)
}
