//! Where a command's model comes from: `--weights PATH` (a weights file, or
//! a folder holding `model.safetensors`, with the config and any vocabulary
//! beside it: [`multihead::models::checkpoint::ModelFiles`], as every
//! model kind resolves it), or, without `--weights`, the demo models built
//! into the binary, so that an installed or copied `multihead` runs from
//! any directory. Both go through [`Checkpoint`]'s checks: the built-in bytes
//! are parsed by [`Checkpoint::from_bytes`] exactly as a file would be.

use std::path::Path;

use anyhow::Result;
use multihead::models::formats::files;
use multihead::models::formats::safetensors::Checkpoint;

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
