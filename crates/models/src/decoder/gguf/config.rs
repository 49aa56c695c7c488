//! A GGUF file's `{arch}.*` metadata read into a [`LlamaConfig`], each
//! key checked as `config.json`'s are, and anything the models cannot
//! honour refused by name.

use candle::{bail, Result};
use multihead_attention::RopeScaling;

use super::GGUF_ARCHITECTURES;
use crate::checkpoint::GgufFile;
use crate::decoder::config::{LlamaConfig, NormPlacement, Projections, QkNorm};

/// A GGUF file's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub(super) fn of(file: &GgufFile) -> Result<Self> {
        let label = file.label();
        let Some(arch) = file.string("general.architecture")? else {
            bail!("GGUF file '{label}': no metadata 'general.architecture'")
        };
        Ok(match arch {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            other => bail!(
                "GGUF file '{label}': architecture '{}' is not supported; this loader runs {} (Mistral files are 'llama')",
                other.escape_debug(),
                GGUF_ARCHITECTURES.join(", ")
            ),
        })
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
}

/// The `{arch}.*` keys read below; any other is refused, since it may
/// change what the model computes.
const KNOWN_KEYS: [&str; 19] = [
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scale_linear",
    // Refused unless 0.
    "expert_count",
    "expert_used_count",
];

impl LlamaConfig {
    /// The config a GGUF file's metadata describes (`general.architecture`
    /// `llama`, `qwen2` or `qwen3`), checked as `config.json` is: the
    /// vocabulary from `token_embd.weight`'s rows, tied embeddings where
    /// `output.weight` is absent, biases where layer 0 has them. Metadata
    /// this loader cannot honour (rotary scaling other than linear,
    /// experts, an unknown `{arch}.*` key, Llama 3.1's `rope_freqs`
    /// tensor) is refused by name.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        Ok(gguf_config(file)?.0)
    }
}

/// [`LlamaConfig::from_gguf`], with the architecture.
pub(super) fn gguf_config(file: &GgufFile) -> Result<(LlamaConfig, Arch)> {
    let label = file.label();
    let arch = Arch::of(file)?;
    let prefix = format!("{}.", arch.name());
    let key = |k: &str| format!("{prefix}{k}");
    for k in file.keys() {
        if let Some(rest) = k.strip_prefix(&prefix) {
            if !KNOWN_KEYS.contains(&rest) {
                bail!(
                    "GGUF file '{label}': metadata '{}' is not one this loader can honour",
                    k.escape_debug()
                )
            }
        }
        if k == "split.count" && file.usize(k)?.unwrap_or(1) > 1 {
            bail!("GGUF file '{label}' is one part of a split model: merge the parts first (llama-gguf-split --merge)")
        }
    }
    let required = |k: &str| -> Result<usize> {
        file.usize(&key(k))?
            .ok_or_else(|| candle::Error::Msg(format!("GGUF file '{label}': no metadata '{}'", key(k))))
    };
    for k in ["expert_count", "expert_used_count"] {
        if file.usize(&key(k))?.unwrap_or(0) > 0 {
            bail!(
                "GGUF file '{label}': '{}' > 0: mixture-of-experts models are not supported",
                key(k)
            )
        }
    }
    if file.info("rope_freqs.weight").is_some() {
        bail!("GGUF file '{label}': tensor 'rope_freqs.weight' (Llama 3.1-style rotary scaling) is not supported")
    }
    let Some(embd) = file.info("token_embd.weight") else {
        bail!("GGUF file '{label}': no tensor 'token_embd.weight'")
    };
    let hidden = required("embedding_length")?;
    let vocab = match embd.shape.as_slice() {
        &[v, e] if e == hidden => v,
        dims => bail!(
            "GGUF file '{label}': tensor 'token_embd.weight' has shape {dims:?}, expected (vocab, {hidden}) for '{}' {hidden}",
            key("embedding_length")
        ),
    };
    if let Some(v) = file.usize(&key("vocab_size"))? {
        if v != vocab {
            bail!(
                "GGUF file '{label}': '{}' is {v} but token_embd.weight has {vocab} rows",
                key("vocab_size")
            )
        }
    }
    let heads = required("attention.head_count")?;
    let kv_heads = file.usize(&key("attention.head_count_kv"))?.unwrap_or(heads);
    let head_dim = file.usize(&key("attention.key_length"))?;
    if let (Some(k), Some(v)) = (head_dim, file.usize(&key("attention.value_length"))?) {
        if k != v {
            bail!(
                "GGUF file '{label}': key_length {k} and value_length {v} differ, which these models do not"
            )
        }
    }
    let Some(eps) = file.float(&key("attention.layer_norm_rms_epsilon"))? else {
        bail!(
            "GGUF file '{label}': no metadata '{}'",
            key("attention.layer_norm_rms_epsilon")
        )
    };
    let rope_scaling = match file.string(&key("rope.scaling.type"))? {
        None | Some("none") => match file.float(&key("rope.scale_linear"))? {
            Some(f) if f != 1. => Some(RopeScaling::Linear { factor: f }),
            _ => None,
        },
        Some("linear") => match file.float(&key("rope.scaling.factor"))? {
            Some(factor) => Some(RopeScaling::Linear { factor }),
            None => bail!(
                "GGUF file '{label}': rope scaling 'linear' without '{}'",
                key("rope.scaling.factor")
            ),
        },
        Some(other) => bail!(
            "GGUF file '{label}': '{}' '{}' is not supported; only 'none' and 'linear'",
            key("rope.scaling.type"),
            other.escape_debug()
        ),
    };
    if let Some(s) = &rope_scaling {
        s.validate()
            .map_err(|e| candle::Error::Msg(format!("GGUF file '{label}': rope scaling: {e}")))?;
    }
    let sliding_window = match file.usize(&key("attention.sliding_window"))? {
        None | Some(0) => None,
        Some(w) if arch == Arch::Llama => Some(w),
        Some(_) => bail!(
            "GGUF file '{label}': '{}' is set, and this loader does not run {}'s sliding windows",
            key("attention.sliding_window"),
            arch.name()
        ),
    };
    let has = |name: &str| file.info(name).is_some();
    let mut cfg = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: required("feed_forward_length")?,
        num_hidden_layers: required("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim,
        rms_norm_eps: eps,
        rope_theta: Some(file.float(&key("rope.freq_base"))?.unwrap_or(10_000.)),
        max_position_embeddings: file.usize(&key("context_length"))?,
        attention_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_gate.bias"),
        tie_word_embeddings: !has("output.weight"),
        hidden_act: "silu".into(),
        sliding_window,
        rope_scaling,
        qkv_bias: arch == Arch::Qwen2 || has("blk.0.attn_q.bias"),
        qk_norm: if arch == Arch::Qwen3 || has("blk.0.attn_q_norm.weight") {
            QkNorm::PerHead
        } else {
            QkNorm::None
        },
        norm_placement: NormPlacement::Pre,
        rotary_layers: Vec::new(),
        rotary_dims: None,
        projections: Projections::Separate,
    };
    if cfg.attention_bias {
        cfg.qkv_bias = false;
    }
    cfg.validate(&format!("GGUF file '{label}'"))?;
    if let Some(d) = file.usize(&key("rope.dimension_count"))? {
        if d != cfg.head_width() {
            bail!(
                "GGUF file '{label}': '{}' is {d} but the heads are {} wide: partial rotary is not supported",
                key("rope.dimension_count"),
                cfg.head_width()
            )
        }
    }
    Ok((cfg, arch))
}
