//! The Llama-like families a checkpoint's tensors tell apart, each as the
//! `config.json` options that select it, and the tensors of one layer its
//! constructor asks for. `multihead inspect` tells a file's family by
//! which family's constructor asks for the tensors its first layer holds
//! (`formats/inspect/layout.rs`): the constructors are the one
//! description of a model's tensors, not a second list of names.

use candle::Result;

use super::config::HfDecoderConfig;
use super::{Gemma, Llama};
use crate::formats::preflight::{wanted_tensors, Wanted};

/// Each family `inspect` reports (Llama, Mistral and SmolLM3 store the
/// same tensors: `llama`), with the options of its `config.json` beyond
/// the sizes, in the order a tie is settled.
pub(crate) const FAMILIES: [(&str, &str); 10] = [
    ("llama", r#""model_type": "llama""#),
    ("llama", r#""model_type": "llama", "attention_bias": true"#),
    ("llama", r#""model_type": "llama", "mlp_bias": true"#),
    (
        "llama",
        r#""model_type": "llama", "attention_bias": true, "mlp_bias": true"#,
    ),
    ("qwen2", r#""model_type": "qwen2""#),
    ("qwen3", r#""model_type": "qwen3""#),
    ("olmo2", r#""model_type": "olmo2""#),
    ("phi3", r#""model_type": "phi3""#),
    ("gemma2", r#""model_type": "gemma2""#),
    ("gemma3", r#""model_type": "gemma3_text""#),
];

/// The width of a head in the small model each family is recorded at
/// ([`PROBE_SIZES`]); its q has two heads, its k and v one.
pub(crate) const PROBE_HEAD_DIM: usize = 4;

/// The sizes of that small model: names do not depend on sizes, and
/// these differ where a shape tells a head from all heads.
const PROBE_SIZES: &str = r#""vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "tie_word_embeddings": true"#;

/// The config of family `options` ([`FAMILIES`]) at `sizes` (JSON
/// members, as [`PROBE_SIZES`]), read as `config.json` is.
pub(crate) fn family_config(options: &str, sizes: &str) -> Result<HfDecoderConfig> {
    HfDecoderConfig::from_json(&format!("{{{options}, {sizes}}}"), "a decoder family")
}

/// The tensors the Llama-like model `cfg` describes asks for, `present`
/// answering which optional ones the file holds (a tied model's
/// `lm_head.weight`).
pub(crate) fn recorded(cfg: &HfDecoderConfig, present: &[&str]) -> Result<Vec<Wanted>> {
    match cfg {
        HfDecoderConfig::Llama(c) => wanted_tensors(present, |vb| Llama::new(c, vb)),
        HfDecoderConfig::Gemma(c) => wanted_tensors(present, |vb| Gemma::new(c, vb)),
        HfDecoderConfig::Gpt2(_) => candle::bail!("GPT-2 is not a Llama-like family"),
    }
}

/// One family's first layer as its constructor asks for it.
#[derive(Debug, Clone)]
pub(crate) struct FamilyLayer {
    /// The family's name ([`FAMILIES`]).
    pub family: &'static str,
    /// The tensors, named after `model.layers.0.`, shaped as in the
    /// small model the family is recorded at.
    pub layer: Vec<Wanted>,
    /// Whether its q norm spans one head ([`PROBE_HEAD_DIM`] wide), so
    /// that a file's q norm tells its head width.
    pub per_head_norms: bool,
}

/// Every family of [`FAMILIES`], its first layer recorded.
pub(crate) fn family_layers() -> Result<Vec<FamilyLayer>> {
    FAMILIES
        .iter()
        .map(|&(family, options)| {
            let wanted = recorded(&family_config(options, PROBE_SIZES)?, &[])?;
            let layer: Vec<Wanted> = wanted
                .into_iter()
                .filter_map(|w| {
                    Some(Wanted {
                        name: w.name.strip_prefix("model.layers.0.")?.to_string(),
                        shape: w.shape,
                    })
                })
                .collect();
            let per_head_norms = layer
                .iter()
                .any(|w| w.name.ends_with("q_norm.weight") && w.shape == [PROBE_HEAD_DIM]);
            Ok(FamilyLayer {
                family,
                layer,
                per_head_norms,
            })
        })
        .collect()
}
