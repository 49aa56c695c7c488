//! The committed fixtures (`tests/fixtures`, written by `scripts/make_*`
//! from PyTorch, timm, HF transformers and llama.cpp), found from any
//! crate of the checkout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::{Device, Tensor};

/// The checkout's root folder (this crate is `crates/test-support` in it).
pub fn repo_dir() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().and_then(Path::parent).unwrap_or(here).to_path_buf()
}

/// `tests/fixtures/<sub>` of the checkout (the one place every crate's
/// tests read fixtures from); `MULTIHEAD_FIXTURES` names another fixtures
/// folder (test binaries carried to a machine where the checkout lives
/// elsewhere).
pub fn fixture_dir(sub: &str) -> PathBuf {
    std::env::var_os("MULTIHEAD_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_dir().join("tests/fixtures"))
        .join(sub)
}

/// Every `*.safetensors` file in `dir`, sorted.
pub fn fixture_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "safetensors"));
    files.sort();
    Ok(files)
}

/// A fixture: its tensors and the JSON in its metadata under "case".
#[derive(Debug, Clone)]
pub struct Fixture {
    pub name: String,
    pub tensors: HashMap<String, Tensor>,
    pub case: serde_json::Value,
}

impl Fixture {
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
        let case = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("case"))
            .context("fixture has no 'case' metadata")?;
        let case = serde_json::from_str(case)?;
        let file = safetensors::SafeTensors::deserialize(&bytes)?;
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let t = match view.dtype() {
                    // Boolean masks load as u8 (candle has no bool dtype).
                    safetensors::Dtype::BOOL => Tensor::from_vec(view.data().to_vec(), view.shape(), device)?,
                    _ => candle::safetensors::Load::load(&view, device)?,
                };
                Ok((name, t))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self { name, tensors, case })
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("{}: no tensor '{name}'", self.name))
    }

    /// The tensors whose names start with `prefix.`, with the prefix removed.
    pub fn with_prefix(&self, prefix: &str) -> HashMap<String, Tensor> {
        let p = format!("{prefix}.");
        self.tensors
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&p).map(|k| (k.to_string(), v.clone())))
            .collect()
    }

    pub fn str(&self, key: &str) -> Option<&str> {
        self.case.get(key).and_then(|v| v.as_str())
    }
}
