//! What a weights file is and what it holds, safetensors or GGUF, as one
//! [`InspectReport`]: its tensors and metadata, what it is (the layout
//! its tensors' names reveal, or a GGUF file's architecture), which
//! tensors hold NaN or infinity, and how its tensors compare with a
//! config (one given, the `config.json` beside the file, or a GGUF file's
//! own metadata). `multihead inspect` prints it.
//!
//! ```
//! use multihead_models::formats::inspect::{FileLayout, InspectReport, Layout};
//!
//! let report = InspectReport::read("../../weights/vit-digits".as_ref(), None)?;
//! assert!(matches!(report.layout, FileLayout::Tensors(Layout::TimmVit(_))));
//! assert!(report.non_finite.is_empty());
//! report.ensure_fits()?;
//! # Ok::<(), candle::Error>(())
//! ```

mod config;
mod layout;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle::quantized::gguf_file::Value;
use candle::{bail, Result};

use crate::checkpoint::{ModelFiles, WeightDtype};
use crate::decoder::DecoderModel;
use crate::formats::gguf::{ggml_type_name, is_gguf, GgufFile};
use crate::formats::preflight::{NonFinite, Preflight};
use crate::formats::safetensors::TensorInfo;
pub use layout::{recognise, DecoderFacts, Layout, MhaFacts, TransformerFacts, VitFacts};

/// The metadata keys of a GGUF file that make a decoder's config, after
/// `{arch}.`, with the names a report gives them.
const GGUF_SIZES: [(&str, &str); 8] = [
    ("layers", "block_count"),
    ("heads", "attention.head_count"),
    ("kv heads", "attention.head_count_kv"),
    ("hidden", "embedding_length"),
    ("vocab", "vocab_size"),
    ("MLP", "feed_forward_length"),
    ("rope theta", "rope.freq_base"),
    ("context", "context_length"),
];

/// One weights file described: what it holds, what it is, and how it
/// compares with a config. The text it holds comes from the file as
/// stored: names, keys and strings are untrusted, for the printer to
/// escape.
#[derive(Debug, Clone)]
pub struct InspectReport {
    /// The file, as its errors name it.
    pub file: String,
    /// Its size in bytes (a sharded checkpoint's: all of its shards').
    pub file_size: usize,
    /// Every tensor, in the file's order: its stored type by the format's
    /// name for it (safetensors' `F32`, `I64`; ggml's `Q8_0`, `Q4_K`).
    pub tensors: Vec<TensorInfo>,
    /// The metadata, sorted by key.
    pub metadata: Vec<(String, MetadataValue)>,
    /// What the file is.
    pub layout: FileLayout,
    /// The tensors holding NaN or infinity, with the counts: every tensor
    /// is scanned.
    pub non_finite: Vec<NonFinite>,
    /// The tensors compared with a config, or why the config there was
    /// not used; `None` without a config.
    pub config: Option<ConfigCheck>,
}

/// A metadata value as the format stores it.
#[derive(Debug, Clone)]
pub enum MetadataValue {
    /// A safetensors header's `__metadata__` value: text.
    Text(String),
    /// A GGUF metadata value, typed.
    Gguf(Value),
}

/// What a weights file is.
#[derive(Debug, Clone)]
pub enum FileLayout {
    /// A safetensors file: what its tensors' names and shapes reveal.
    Tensors(Layout),
    /// A GGUF file: what its metadata says.
    Gguf(GgufFacts),
}

/// What a GGUF file's metadata says of its model.
#[derive(Debug, Clone)]
pub struct GgufFacts {
    /// `general.architecture`, where it is a string.
    pub architecture: Option<String>,
    /// The config's main sizes: each name (`layers`, `heads`, ...), key
    /// after `{arch}.` (`block_count`, ...) and value; the vocabulary
    /// counted from `token_embd.weight`'s rows where no key gives it
    /// (llama.cpp's converter often writes none).
    pub sizes: Vec<(&'static str, &'static str, Option<Value>)>,
    /// How `multihead generate` keeps the weight matrices
    /// ([`GgufFile::weight_dtype`]); `None` without a matrix of a type
    /// the loader reads.
    pub weights: Option<WeightDtype>,
}

/// Where the config a file was compared with comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    /// A file the caller named.
    Given(PathBuf),
    /// The `config.json` beside the weights.
    Beside(PathBuf),
    /// A GGUF file's own metadata.
    Metadata,
}

/// A file's tensors compared with a config, or why the config was not
/// used.
#[derive(Debug, Clone)]
pub enum ConfigCheck {
    /// Compared with the model of the config `kind` (`VitConfig`,
    /// `HF transformers decoder config`, `LlamaConfig`, ...).
    Compared {
        /// The config's kind.
        kind: &'static str,
        /// Where it comes from.
        source: ConfigSource,
        /// The comparison.
        report: Preflight,
    },
    /// The config could not be used (another kind of model, sizes the
    /// file cannot hold, an architecture the loader does not run): the
    /// inspection stands without it.
    NotUsed {
        /// Where it comes from.
        source: ConfigSource,
        /// Why: the first line of its error.
        why: String,
    },
}

impl InspectReport {
    /// Describes the weights at `path`: a GGUF file (by its extension or
    /// magic), else a safetensors file, a sharded checkpoint's index or a
    /// folder holding either, as [`ModelFiles::resolve`] finds them; then
    /// compares its tensors with the model `config` describes, or with the
    /// `config.json` beside a safetensors file where there is one (which
    /// is passed over with a note when it cannot be used). A GGUF file's
    /// config is its metadata: `config` is refused for one.
    pub fn read(path: &Path, config: Option<&Path>) -> Result<Self> {
        if is_gguf(path) && !path.is_dir() {
            if let Some(config) = config {
                bail!(
                    "--config '{}' does not apply to the GGUF file '{}': its config is its metadata",
                    config.display(),
                    path.display()
                )
            }
            return Self::from_gguf(&GgufFile::read(path)?);
        }
        Self::from_safetensors(&ModelFiles::resolve(path)?, config)
    }

    /// Describes the safetensors weights `files` names, compared with the
    /// config at `config` or, without one, beside the weights.
    pub fn from_safetensors(files: &ModelFiles, config: Option<&Path>) -> Result<Self> {
        let ckpt = files.read()?;
        let layout = recognise(ckpt.tensors());
        let non_finite = non_finite(ckpt.non_finite(ckpt.tensors().iter().map(|t| t.name.as_str()))?);
        let beside = files.beside("config.json");
        let config = match config {
            Some(path) => {
                let (kind, report) = config::compare(&ckpt, &layout, path)?;
                Some(ConfigCheck::Compared {
                    kind,
                    source: ConfigSource::Given(path.to_path_buf()),
                    report,
                })
            }
            // A config.json beside the file that cannot be used (another
            // kind, or sizes the file cannot hold) does not fail the
            // inspection, but is not passed over in silence either.
            None if beside.is_file() => Some(match config::compare(&ckpt, &layout, &beside) {
                Ok((kind, report)) => ConfigCheck::Compared {
                    kind,
                    source: ConfigSource::Beside(beside),
                    report,
                },
                Err(e) => ConfigCheck::NotUsed {
                    source: ConfigSource::Beside(beside),
                    why: first_line(&e),
                },
            }),
            None => None,
        };
        Ok(Self {
            file: ckpt.label().to_string(),
            file_size: ckpt.file_size(),
            tensors: ckpt.tensors().to_vec(),
            metadata: ckpt
                .metadata()
                .iter()
                .map(|(k, v)| (k.clone(), MetadataValue::Text(v.clone())))
                .collect(),
            layout: FileLayout::Tensors(layout),
            non_finite,
            config,
        })
    }

    /// Describes a GGUF file, compared with the config its metadata
    /// describes ([`DecoderModel::gguf_preflight`]), or with a note where
    /// the metadata gives none the loader runs.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let non_finite = non_finite(file.non_finite(file.tensors().iter().map(|t| t.name.as_str()))?);
        let config = match DecoderModel::gguf_preflight(file) {
            Ok((cfg, report)) => ConfigCheck::Compared {
                kind: cfg.kind(),
                source: ConfigSource::Metadata,
                report,
            },
            Err(e) => ConfigCheck::NotUsed {
                source: ConfigSource::Metadata,
                why: first_line(&e),
            },
        };
        let architecture = match file.get("general.architecture") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        let sizes = GGUF_SIZES
            .iter()
            .map(|&(name, key)| {
                let stored = architecture
                    .as_ref()
                    .and_then(|a| file.get(&format!("{a}.{key}")));
                let value = match (key, stored) {
                    (_, Some(v)) => Some(v.clone()),
                    ("vocab_size", None) => file
                        .info("token_embd.weight")
                        .and_then(|t| t.shape.first())
                        .map(|&n| Value::U64(n as u64)),
                    (_, None) => None,
                };
                (name, key, value)
            })
            .collect();
        Ok(Self {
            file: file.label().to_string(),
            file_size: file.file_size(),
            tensors: file
                .tensors()
                .iter()
                .map(|t| TensorInfo {
                    name: t.name.clone(),
                    dtype: ggml_type_name(t.ggml_type).to_string(),
                    shape: t.shape.clone(),
                    bytes: t.range.len(),
                })
                .collect(),
            metadata: file
                .keys()
                .into_iter()
                .filter_map(|k| Some((k.to_string(), MetadataValue::Gguf(file.get(k)?.clone()))))
                .collect(),
            layout: FileLayout::Gguf(GgufFacts {
                architecture,
                sizes,
                weights: file.weight_dtype(),
            }),
            non_finite,
            config: Some(config),
        })
    }

    /// Elements over all tensors (saturating: each tensor's count was
    /// checked by its reader, not their sum).
    pub fn total_params(&self) -> usize {
        self.tensors
            .iter()
            .fold(0usize, |n, t| n.saturating_add(t.numel()))
    }

    /// Bytes of tensor data over all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// How many tensors each stored type holds, by type name.
    pub fn dtype_counts(&self) -> BTreeMap<&str, usize> {
        let mut counts = BTreeMap::new();
        for t in &self.tensors {
            *counts.entry(t.dtype.as_str()).or_insert(0) += 1;
        }
        counts
    }

    /// An error naming every tensor that does not fit the config the file
    /// was compared with, where one does not; `Ok` otherwise (no config,
    /// or one not used, included).
    pub fn ensure_fits(&self) -> Result<()> {
        let Some(ConfigCheck::Compared { source, report, .. }) = &self.config else {
            return Ok(());
        };
        let Some(summary) = report.summary() else {
            return Ok(());
        };
        match source {
            ConfigSource::Given(path) | ConfigSource::Beside(path) => bail!(
                "'{}' does not fit config '{}': {summary}",
                self.file,
                path.display()
            ),
            ConfigSource::Metadata => bail!(
                "'{}' does not fit the config its metadata describes: {summary}",
                self.file
            ),
        }
    }
}

/// A scan's `(name, nan, inf)` as the pre-flight's entries.
fn non_finite(found: Vec<(String, usize, usize)>) -> Vec<NonFinite> {
    found
        .into_iter()
        .map(|(name, nan, inf)| NonFinite { name, nan, inf })
        .collect()
}

/// The first line of `e` (candle appends a backtrace to its messages when
/// `RUST_BACKTRACE` is set).
fn first_line(e: &candle::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of the repository (this crate's tests run from a checkout).
    fn repo(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
    }

    /// A GGUF file and a safetensors folder fill the one report, each
    /// compared with its config: the GGUF file's metadata, the folder's
    /// `config.json`.
    #[test]
    fn both_formats_fill_one_report() -> Result<()> {
        let gguf = InspectReport::read(&repo("tests/fixtures/gguf/llama-q8_0.gguf"), None)?;
        let FileLayout::Gguf(facts) = &gguf.layout else {
            panic!("not GGUF: {:?}", gguf.layout)
        };
        assert_eq!(facts.architecture.as_deref(), Some("llama"));
        assert_eq!(facts.weights, Some(WeightDtype::Q8_0));
        assert!(gguf.dtype_counts().contains_key("Q8_0"));
        assert!(matches!(
            &gguf.config,
            Some(ConfigCheck::Compared { kind: "LlamaConfig", source: ConfigSource::Metadata, report })
                if report.is_clean()
        ));
        gguf.ensure_fits()?;

        let folder = InspectReport::read(&repo("weights/vit-digits"), None)?;
        assert!(matches!(folder.layout, FileLayout::Tensors(Layout::TimmVit(_))));
        assert!(matches!(
            &folder.config,
            Some(ConfigCheck::Compared {
                kind: "VitConfig",
                source: ConfigSource::Beside(_),
                ..
            })
        ));
        let params: usize = folder.tensors.iter().map(TensorInfo::numel).sum();
        assert_eq!(folder.total_params(), params);

        let err = InspectReport::read(
            &repo("tests/fixtures/gguf/llama-f32.gguf"),
            Some(Path::new("config.json")),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("its config is its metadata"), "{err}");
        Ok(())
    }
}
