//! Where a command's model comes from: `--weights PATH` (a weights file, or
//! a folder holding `model.safetensors`, with the config and any vocabulary
//! beside it), or, without `--weights`, the demo models built into the
//! binary, so that an installed or copied `multihead` runs from any
//! directory. Both go through [`Checkpoint`]'s checks: the built-in bytes
//! are parsed by [`Checkpoint::from_bytes`] exactly as a file would be.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use multihead::models::checkpoint::{Checkpoint, Weights};
use multihead::models::files;

/// A text file of a model (config, vocabulary): its contents and the name
/// errors give it.
#[derive(Debug, Clone)]
pub struct Text {
    /// `'path'` of a file, or `built-in 'weights/…'` for an embedded one.
    pub label: String,
    pub text: String,
}

impl Text {
    /// Reads `path`; the error names it as `what` (`config`, `vocab`).
    pub fn read(path: &Path, what: &str) -> Result<Self> {
        let text = files::read_text(path, what, files::MAX_CONFIG_BYTES)?;
        Ok(Self {
            label: format!("'{}'", path.display()),
            text,
        })
    }

    fn built_in(name: &str, text: &'static str) -> Self {
        Self {
            label: format!("built-in '{name}'"),
            text: text.to_string(),
        }
    }
}

/// `--weights PATH` resolved: the weights file and the folder its config
/// (and vocabulary) are read from.
#[derive(Debug, Clone)]
pub struct WeightsPath {
    pub weights: Weights,
    pub dir: PathBuf,
}

impl WeightsPath {
    /// A folder means its weights as every model kind finds them
    /// ([`Weights::find`]: `model.safetensors`, a shard index, or the one
    /// `*.safetensors` file) with its files beside them; a file means that
    /// file (a `.safetensors` or a shard index), with its config in the
    /// same folder.
    pub fn resolve(path: &Path) -> Result<Self> {
        let meta =
            std::fs::metadata(path).with_context(|| format!("reading weights '{}'", path.display()))?;
        if meta.is_dir() {
            return Ok(Self {
                weights: Weights::find(path)?,
                dir: path.to_path_buf(),
            });
        }
        // A device or FIFO is refused here, before its config is looked for.
        files::regular_file_len(path, "weights")?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let is_index = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(".index.json"));
        Ok(Self {
            weights: if is_index {
                Weights::Sharded(path.to_path_buf())
            } else {
                Weights::File(path.to_path_buf())
            },
            dir,
        })
    }

    /// The checkpoint (shards merged).
    pub fn read(&self) -> Result<Checkpoint> {
        Ok(self.weights.read()?)
    }

    /// `name` in the weights' folder.
    pub fn beside(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// The digits ViT of `weights/vit-digits`: its config and weights.
pub fn vit_digits() -> Result<(Text, Checkpoint)> {
    let config = Text::built_in(
        "weights/vit-digits/config.json",
        include_str!("../../weights/vit-digits/config.json"),
    );
    let ckpt = Checkpoint::from_bytes(
        include_bytes!("../../weights/vit-digits/model.safetensors").to_vec(),
        "built-in weights/vit-digits/model.safetensors",
    )?;
    Ok((config, ckpt))
}

macro_rules! sample {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../../weights/vit-digits/samples/", $name)),
        )
    };
}

/// The shipped sample images of `weights/vit-digits/samples`, by name,
/// sorted: what `multihead vit` classifies when given no images.
pub const VIT_DIGIT_SAMPLES: [(&str, &[u8]); 12] = [
    sample!("digit0_0386.png"),
    sample!("digit1_0442.png"),
    sample!("digit2_1466.png"),
    sample!("digit3_0705.png"),
    sample!("digit4_1221.png"),
    sample!("digit5_1319.png"),
    sample!("digit6_0188.png"),
    sample!("digit7_0413.png"),
    sample!("digit7_0820.png"),
    sample!("digit7_1496.png"),
    sample!("digit8_0500.png"),
    sample!("digit9_0254.png"),
];

/// The date normaliser of `weights/dates`: config, vocabulary, weights.
pub fn dates() -> Result<(Text, Text, Checkpoint)> {
    let config = Text::built_in(
        "weights/dates/config.json",
        include_str!("../../weights/dates/config.json"),
    );
    let vocab = Text::built_in(
        "weights/dates/vocab.json",
        include_str!("../../weights/dates/vocab.json"),
    );
    let ckpt = Checkpoint::from_bytes(
        include_bytes!("../../weights/dates/model.safetensors").to_vec(),
        "built-in weights/dates/model.safetensors",
    )?;
    Ok((config, vocab, ckpt))
}
