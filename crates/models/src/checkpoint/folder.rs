//! Model folders, for every model kind (ViT, decoders, the seq2seq model,
//! the binary's commands and `inspect`): a path resolved to its weights
//! (the sharded index, `model.safetensors`, or the one `*.safetensors`
//! file; pickles refused with the command that converts them) and the
//! folder its config and other files are read from, each read capped.

use std::path::{Path, PathBuf};

use candle::{bail, Result};

use super::dtype::WeightDtype;
use crate::formats::files;
use crate::formats::safetensors::{export_hint, is_pickle, pickle_error, Checkpoint};

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
            if is_pickle(&path) {
                pickles.push(path);
            } else if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"))
            {
                safetensors.push(path);
            }
        }
        safetensors.sort();
        pickles.sort();
        match (safetensors.as_slice(), pickles.first()) {
            ([one], _) => Ok(Self::File(one.clone())),
            ([], Some(p)) => bail!(
                "folder '{}' holds no safetensors, only the PyTorch pickle '{}' (loading a pickle can run \
                 arbitrary code, so multihead does not read them); {}",
                dir.display(),
                p.display(),
                export_hint(
                    &p.display().to_string(),
                    &dir.join("model.safetensors").display().to_string()
                )
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

/// A model as a path names it: a folder, or a weights file (a
/// `.safetensors` file or a shard index) in one. The one resolution every
/// model kind and command goes through; its config and other files are
/// read from [`ModelFiles::dir`], each capped in size
/// ([`ModelFiles::read_beside`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    weights: Weights,
    dir: PathBuf,
}

impl ModelFiles {
    /// A folder means its weights as [`Weights::find`] finds them; a file
    /// means that file, with the folder it is in. Refused before any config
    /// is read: a path that does not exist, a device or FIFO, a pickle
    /// (with the command that converts it), a JSON file other than a
    /// shard index.
    pub fn resolve(path: &Path) -> Result<Self> {
        if !path.exists() {
            bail!("reading weights '{}': no such file or folder", path.display())
        }
        if path.is_dir() {
            return Ok(Self {
                weights: Weights::find(path)?,
                dir: path.to_path_buf(),
            });
        }
        files::regular_file_len(path, "weights")?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        let weights = if name.ends_with(".index.json") {
            Weights::Sharded(path.to_path_buf())
        } else if name.ends_with(".json") {
            bail!(
                "'{}' is a JSON file, not weights: pass the folder, a .safetensors file or {INDEX_NAME}",
                path.display()
            )
        } else if is_pickle(path) {
            return Err(pickle_error(&path.display().to_string()));
        } else {
            Weights::File(path.to_path_buf())
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Ok(Self { weights, dir })
    }

    /// Where the weights are.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The folder the config and the other files are read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `name` in [`ModelFiles::dir`].
    pub fn beside(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The text of `name` in [`ModelFiles::dir`] (a config, vocabulary,
    /// tokenizer config), at most [`files::MAX_CONFIG_BYTES`]; errors name
    /// it as `what` and give its path.
    pub fn read_beside(&self, name: &str, what: &str) -> Result<String> {
        files::read_text(&self.beside(name), what, files::MAX_CONFIG_BYTES)
    }

    /// The checkpoint: the file mapped, or the shards merged.
    pub fn read(&self) -> Result<Checkpoint> {
        self.weights.read()
    }

    /// The dtype HF transformers loads these weights in by default
    /// ([`WeightDtype::auto`] of the config.json beside them and the
    /// checkpoint's headers).
    pub fn auto_dtype(&self) -> Result<WeightDtype> {
        let config = self.read_beside("config.json", "config")?;
        Ok(WeightDtype::auto(&config, &self.read()?))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{ModelFiles, Weights, INDEX_NAME};

    fn err(path: &Path) -> String {
        ModelFiles::resolve(path).unwrap_err().to_string()
    }

    /// A folder, a weights file and a shard index resolve to their weights
    /// and the folder beside them; a missing path, a pickle and a JSON file
    /// that is no index are refused, each naming the path.
    #[test]
    fn paths_resolve_to_weights_and_their_folder() -> candle::Result<()> {
        let dir = std::env::temp_dir().join(format!("multihead-model-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let model = dir.join("model.safetensors");
        std::fs::write(&model, b"not read here")?;
        let folder = ModelFiles::resolve(&dir)?;
        assert_eq!(folder.weights(), &Weights::File(model.clone()));
        assert_eq!(
            (folder.dir(), folder.beside("config.json")),
            (dir.as_path(), dir.join("config.json"))
        );
        assert_eq!(ModelFiles::resolve(&model)?, folder);
        let index = dir.join(INDEX_NAME);
        std::fs::write(&index, b"{}")?;
        assert_eq!(
            ModelFiles::resolve(&index)?.weights(),
            &Weights::Sharded(index.clone())
        );
        assert_eq!(ModelFiles::resolve(&dir)?.weights(), &Weights::Sharded(index));
        let missing = dir.join("nowhere");
        assert!(
            err(&missing).contains("no such file or folder"),
            "{}",
            err(&missing)
        );
        for (name, says) in [("pytorch_model.bin", "pickle"), ("config.json", "is a JSON file")] {
            let path = dir.join(name);
            std::fs::write(&path, b"{}")?;
            let e = err(&path);
            assert!(e.contains(says) && e.contains(name), "{name}: {e}");
        }
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
