//! Model folders as they come: a folder (or a weights file in one) written
//! by HF transformers' `save_pretrained`, by timm's `save_for_hf` /
//! `push_to_hf_hub`, or by this project, recognised from the `config.json`
//! beside the weights.
//!
//! ```no_run
//! use candle::{DType, Device};
//! use multihead_models::vit::ModelFolder;
//!
//! # fn main() -> candle::Result<()> {
//! let folder = ModelFolder::open("deit-small-distilled/".as_ref())?; // HF, timm or our own
//! let vit = folder.load(DType::F32, &Device::Cpu)?;
//! println!("{}: {} classes", folder.describe(), folder.config().num_classes);
//! # let _ = vit; Ok(()) }
//! ```

pub mod hf;
pub mod json;
pub mod timm;

use std::path::{Path, PathBuf};

use candle::{bail, DType, Device, Result};

use crate::checkpoint::ModelFiles;
use crate::formats::safetensors::Checkpoint;
use crate::vit::config::VitConfig;
use crate::vit::folder::hf::HfArchitecture;
use crate::vit::folder::json::parse_object;
use crate::vit::model::VisionTransformer;

pub use crate::checkpoint::Weights;
pub use crate::formats::files::MAX_CONFIG_BYTES;

/// Which writer the `config.json` comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigKind {
    /// This project's [`VitConfig`] JSON.
    Multihead,
    /// HF transformers, with the class it describes and whether a
    /// `preprocessor_config.json` was read.
    Hf {
        /// The model class.
        architecture: HfArchitecture,
        /// `preprocessor_config.json` beside the config, if there was one.
        preprocessor: Option<PathBuf>,
    },
    /// timm's hub format, with its `architecture` name.
    Timm {
        /// `architecture` as written (`vit_base_patch16_224`, ...).
        architecture: String,
    },
}

/// A model folder: where its weights are, and its config read as a
/// [`VitConfig`] whatever format it came in.
#[derive(Debug, Clone)]
pub struct ModelFolder {
    weights: Weights,
    config_path: PathBuf,
    kind: ConfigKind,
    cfg: VitConfig,
}

/// Reads a small JSON file, refusing one over [`MAX_CONFIG_BYTES`].
fn read_json(path: &Path, what: &str) -> Result<String> {
    crate::formats::files::read_text(path, what, MAX_CONFIG_BYTES)
}

impl ModelFolder {
    /// Opens a folder, or a weights file (`*.safetensors` or
    /// `model.safetensors.index.json`) in one, with the `config.json`
    /// beside it.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with_config(path, None)
    }

    /// [`Self::open`] with the config at `config` instead of beside the
    /// weights (any of the three formats).
    pub fn open_with_config(path: &Path, config: Option<&Path>) -> Result<Self> {
        let files = ModelFiles::resolve(path)?;
        let weights = files.weights().clone();
        let config_path = config.map_or_else(|| files.beside("config.json"), Path::to_path_buf);
        if config.is_none() && !config_path.is_file() {
            bail!(
                "no config.json beside weights '{}' (a VitConfig, HF transformers or timm config.json); \
                 pass --config",
                weights.path().display()
            )
        }
        let text = read_json(&config_path, "config")?;
        let label = config_path.display().to_string();
        let map = parse_object(&text, &label)?;
        let (cfg, kind) = if map.contains_key("model_type") || map.contains_key("architectures") {
            let pre_path = config_path.with_file_name("preprocessor_config.json");
            let pre_text = if pre_path.is_file() {
                Some(read_json(&pre_path, "preprocessor config")?)
            } else {
                None
            };
            let pre_label = pre_path.display().to_string();
            let pre = pre_text.as_deref().map(|t| (t, pre_label.as_str()));
            let (cfg, architecture) = hf::parse(&text, &label, pre)?;
            let preprocessor = pre_text.is_some().then_some(pre_path);
            (
                cfg,
                ConfigKind::Hf {
                    architecture,
                    preprocessor,
                },
            )
        } else if map.contains_key("architecture") {
            let architecture = map
                .get("architecture")
                .and_then(|a| a.as_str())
                .unwrap_or_default()
                .to_string();
            (timm::parse(&text, &label)?, ConfigKind::Timm { architecture })
        } else {
            let cfg = VitConfig::from_json(&text)
                .map_err(|e| candle::Error::Msg(format!("config '{label}': {e}")))?;
            (cfg, ConfigKind::Multihead)
        };
        cfg.validate()
            .map_err(|e| candle::Error::Msg(format!("config '{label}': {e}")))?;
        Ok(Self {
            weights,
            config_path,
            kind,
            cfg,
        })
    }

    /// The config, whatever format it was read from.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Where the weights are.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The config file read.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Which format the config was.
    pub fn kind(&self) -> &ConfigKind {
        &self.kind
    }

    /// One line saying what was recognised, e.g.
    /// `HF transformers DeiTForImageClassificationWithTeacher (config.json, preprocessor_config.json)`.
    pub fn describe(&self) -> String {
        let files = |p: &Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let shards = match &self.weights {
            Weights::Sharded(_) => ", sharded",
            Weights::File(_) => "",
        };
        match &self.kind {
            ConfigKind::Multihead => format!("multihead VitConfig ({}{shards})", files(&self.config_path)),
            ConfigKind::Hf {
                architecture,
                preprocessor,
            } => format!(
                "HF transformers {} ({}{}{shards})",
                architecture.name(),
                files(&self.config_path),
                preprocessor
                    .as_deref()
                    .map(|p| format!(", {}", files(p)))
                    .unwrap_or_else(|| ", no preprocessor_config.json: processor defaults".into())
            ),
            ConfigKind::Timm { architecture } => {
                format!("timm {architecture} ({}{shards})", files(&self.config_path))
            }
        }
    }

    /// Reads the weights (merging shards) and validates the file.
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        self.weights.read()
    }

    /// Reads the weights and builds the model after the checks of
    /// [`Checkpoint::load_bounded`]: a config whose sizes the file cannot
    /// hold is refused before anything of its size is built, and one that
    /// disagrees with the weights is one error naming the config file and
    /// every tensor that differs.
    pub fn load(&self, dtype: DType, device: &Device) -> Result<VisionTransformer> {
        self.load_checkpoint(&self.checkpoint()?, dtype, device)
    }

    /// [`Self::load`] from a checkpoint already read.
    pub fn load_checkpoint(
        &self,
        ckpt: &Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<VisionTransformer> {
        let label = self.config_path.display();
        let with_config = |e: candle::Error| candle::Error::Msg(format!("config '{label}': {e}"));
        ckpt.load_bounded(&self.cfg.budget_owner(), dtype, device, |vb, pack| {
            VisionTransformer::new_with(&self.cfg, pack, vb)
        })
        .map_err(with_config)
    }
}
