//! Where a model folder keeps its weights, for every model kind (ViT,
//! decoders): the sharded index, `model.safetensors`, or the one
//! `*.safetensors` file; pickles refused with the command that converts
//! them.

use std::path::{Path, PathBuf};

use candle::{bail, Result};

use super::file::Checkpoint;

/// The index of a sharded checkpoint.
pub(crate) const INDEX_NAME: &str = "model.safetensors.index.json";

/// Where the weights are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Weights {
    /// One safetensors file.
    File(PathBuf),
    /// `model.safetensors.index.json` and the shards it lists.
    Sharded(PathBuf),
}

impl Weights {
    /// The weights in `dir`: the sharded index, `model.safetensors`, or the
    /// one `*.safetensors` file; a folder with only pickles is refused with
    /// the command that converts them.
    pub fn find(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX_NAME);
        if index.is_file() {
            return Ok(Self::Sharded(index));
        }
        let model = dir.join("model.safetensors");
        if model.is_file() {
            return Ok(Self::File(model));
        }
        let mut safetensors = Vec::new();
        let mut pickles = Vec::new();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| candle::Error::Msg(format!("reading folder '{}': {e}", dir.display())))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let ext = path
                .extension()
                .and_then(|e| e.to_str())
                .map(str::to_ascii_lowercase);
            match ext.as_deref() {
                Some("safetensors") => safetensors.push(path),
                Some("bin" | "pt" | "pth" | "ckpt" | "pkl") => pickles.push(path),
                _ => {}
            }
        }
        safetensors.sort();
        pickles.sort();
        match (safetensors.as_slice(), pickles.first()) {
            ([one], _) => Ok(Self::File(one.clone())),
            ([], Some(p)) => bail!(
                "folder '{}' holds no safetensors, only the PyTorch pickle '{}' (loading a pickle can run \
                 arbitrary code, so multihead does not read them); export it once with: python -c \"import torch; \
                 from safetensors.torch import save_file; sd = torch.load('{}', map_location='cpu', weights_only=True); \
                 sd = sd.get('state_dict', sd.get('model', sd)); \
                 save_file({{k: v.contiguous() for k, v in sd.items()}}, '{}')\"",
                dir.display(),
                p.display(),
                p.display(),
                dir.join("model.safetensors").display()
            ),
            ([], None) => bail!(
                "folder '{}' holds no weights (model.safetensors, {INDEX_NAME} or one *.safetensors file)",
                dir.display()
            ),
            (many, _) => bail!(
                "folder '{}' holds {} safetensors files and no model.safetensors or {INDEX_NAME}: pass the file",
                dir.display(),
                many.len()
            ),
        }
    }

    /// The checkpoint: the file mapped, or the shards merged.
    pub fn read(&self) -> Result<Checkpoint> {
        match self {
            Self::File(p) => Checkpoint::read(p),
            Self::Sharded(p) => Checkpoint::read_sharded(p),
        }
    }

    /// The file to name in messages.
    pub fn path(&self) -> &Path {
        match self {
            Self::File(p) | Self::Sharded(p) => p,
        }
    }
}
