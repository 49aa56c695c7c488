//! The models the repository ships and the binary embeds (`weights/`):
//! the digits ViT and the date normaliser, trained by `scripts/train_*.py`
//! with PyTorch's answers on their held-out sets beside them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use multihead_models::transformer::{CharVocab, Seq2Seq, Seq2SeqConfig};

use crate::fixtures::repo_dir;

/// `weights/<name>`: `vit-digits` or `dates`.
pub fn folder(name: &str) -> PathBuf {
    repo_dir().join("weights").join(name)
}

/// The date normaliser and its vocabulary, loaded from `weights/dates` on
/// `dev`.
pub fn dates(dev: &Device) -> Result<(Seq2Seq, CharVocab)> {
    let dir = folder("dates");
    let cfg = Seq2SeqConfig::from_json(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let vocab = CharVocab::from_json(&std::fs::read_to_string(dir.join("vocab.json"))?)?;
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, dev)?;
    Ok((Seq2Seq::new(&cfg, vb)?, vocab))
}

/// The date normaliser's files written to folder `dir`, with `config`
/// applied to its `config.json` and `weights` to its tensors.
pub fn dates_with(
    dir: &Path,
    config: impl FnOnce(&mut serde_json::Value),
    weights: impl FnOnce(&mut HashMap<String, Tensor>) -> Result<()>,
) -> Result<()> {
    let src = folder("dates");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    config(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    std::fs::copy(src.join("vocab.json"), dir.join("vocab.json"))?;
    let mut tensors = candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu)?;
    weights(&mut tensors)?;
    candle::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(())
}
