//! A `gemma2` or `gemma3` GGUF file's metadata read into a [`GemmaConfig`]
//! with the values llama.cpp runs the file with (`src/models/gemma2.cpp`,
//! `src/models/gemma3.cpp`, `load_swa_pattern` and `get_rope_freq_base` in
//! `src/llama-model.cpp`), where they differ from what HF's config would
//! default to: the scores scaled by `head_dim^-1/2` (but for the 27B sizes),
//! Gemma 2's rope base 10000 where the file gives none, Gemma 3's sliding
//! layers at base 10000 where it gives no `rope.freq_base_swa`.

use candle::quantized::gguf_file::Value;
use candle::{bail, Result};

use super::config::{Arch, Meta};
use super::GgufFile;
use crate::decoder::{GemmaConfig, GemmaFamily, LayerKind, Rope};

/// llama.cpp's layer counts of the 27B models (`LLM_TYPE_27B`), whose
/// scores it scales by `(hidden / heads)^-1/2` rather than `head_dim^-1/2`
/// (as Google's `gemma_pytorch` config does): Gemma 2's and Gemma 3's.
const LAYERS_27B: [(Arch, usize); 2] = [(Arch::Gemma2, 46), (Arch::Gemma3, 62)];

/// Gemma 2's window where the file gives none (llama.cpp's `n_swa`).
const GEMMA2_WINDOW: usize = 4096;

/// The sliding layers' rope base where a `gemma3` file gives none
/// (`rope_freq_base_train_swa`'s default).
const GEMMA3_SLIDING_BASE: f64 = 10_000.;

impl GemmaConfig {
    /// The config a `gemma2` or `gemma3` GGUF file's metadata describes,
    /// as llama.cpp reads it (see the module's doc), checked as
    /// `config.json` is; the norm weights such a file holds are `1 + w`
    /// ([`crate::decoder::Gemma::with_unit_norms`]). Metadata this loader
    /// cannot honour is refused by name.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let meta = Meta::new(file)?;
        if !meta.arch.is_gemma() {
            bail!(
                "GGUF file '{}': architecture '{}' is not a Gemma (LlamaConfig::from_gguf)",
                meta.label(),
                meta.arch.name()
            )
        }
        gemma_config(&meta)
    }
}

/// [`GemmaConfig::from_gguf`] of a file's checked metadata.
pub(super) fn gemma_config(meta: &Meta) -> Result<GemmaConfig> {
    let (label, arch) = (meta.label(), meta.arch);
    let gemma2 = arch == Arch::Gemma2;
    let hidden = meta.required("embedding_length")?;
    let heads = meta.required("attention.head_count")?;
    let layers = meta.layers()?;
    if heads == 0 {
        bail!("GGUF file '{label}': '{}' is 0", meta.key("attention.head_count"))
    }
    let head_dim = meta.head_dim()?.unwrap_or(hidden / heads);
    let query_pre_attn_scalar = match LAYERS_27B.contains(&(arch, layers)) {
        true => (hidden / heads) as f64,
        false => head_dim as f64,
    };
    // Gemma 2 always has sliding layers (4096 keys unless the file says);
    // Gemma 3 only where the file gives a window.
    let window = meta.usize("attention.sliding_window")?;
    let sliding_window = match (arch, window) {
        (Arch::Gemma2, None) => Some(GEMMA2_WINDOW),
        (Arch::Gemma2, Some(0)) => bail!(
            "GGUF file '{label}': '{}' is 0, which would hide every key from a sliding layer",
            meta.key("attention.sliding_window")
        ),
        (_, Some(0) | None) => None,
        (_, Some(w)) => Some(w),
    };
    let layer_types = match sliding_window {
        Some(_) => sliding_pattern(meta, layers, if gemma2 { 2 } else { 6 })?,
        None => vec![LayerKind::Full; layers],
    };
    let rope_full = Rope {
        theta: meta.float("rope.freq_base")?.unwrap_or(10_000.),
        scaling: meta.rope_scaling()?,
    };
    // Gemma 2's sliding layers share the full layers' rotary (base and
    // scaling) unless the file gives them a base; Gemma 3's are unscaled.
    let swa_base = meta.float("rope.freq_base_swa")?;
    let rope_sliding = match arch {
        Arch::Gemma2 => Rope {
            theta: swa_base.unwrap_or(rope_full.theta),
            ..rope_full.clone()
        },
        _ => Rope {
            theta: swa_base.unwrap_or(GEMMA3_SLIDING_BASE),
            scaling: None,
        },
    };
    let (attn_cap, final_cap) = match arch {
        Arch::Gemma2 => (
            soft_cap(meta, "attn_logit_softcapping", Some(50.))?,
            soft_cap(meta, "final_logit_softcapping", Some(30.))?,
        ),
        _ => (None, soft_cap(meta, "final_logit_softcapping", None)?),
    };
    let cfg = GemmaConfig {
        family: if gemma2 {
            GemmaFamily::Gemma2
        } else {
            GemmaFamily::Gemma3
        },
        vocab_size: meta.vocab(hidden)?,
        hidden_size: hidden,
        intermediate_size: meta.required("feed_forward_length")?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: meta.usize("attention.head_count_kv")?.unwrap_or(heads),
        head_dim,
        rms_norm_eps: meta.rms_norm_eps()?,
        // llama.cpp's Gemma graphs load no biases.
        attention_bias: false,
        query_pre_attn_scalar,
        sliding_window,
        layer_types,
        attn_logit_softcapping: attn_cap,
        final_logit_softcapping: final_cap,
        // llama.cpp's Gemma 2 always projects with the embeddings (a file
        // of it holding `output.weight` is refused as unexpected).
        tie_word_embeddings: gemma2 || !meta.has("output.weight"),
        max_position_embeddings: meta.usize("context_length")?,
        rope_full,
        rope_sliding,
    };
    cfg.validate(&format!("GGUF file '{label}'"))?;
    meta.check_rotary_width(head_dim)?;
    Ok(cfg)
}

/// Soft-cap `k`, `default` where absent. Gemma 2's graph always caps (a
/// cap of 0 would divide by it); Gemma 3's caps the logits where the cap
/// is not 0 (`default` `None`: a 0 is none). Any other cap that is not
/// finite and > 0 is refused naming the key.
fn soft_cap(meta: &Meta, k: &str, default: Option<f64>) -> Result<Option<f64>> {
    match meta.float(k)?.or(default) {
        None => Ok(None),
        Some(0.) if default.is_none() => Ok(None),
        Some(c) if c.is_finite() && c > 0. => Ok(Some(c)),
        Some(c) => bail!(
            "GGUF file '{}': '{}' must be finite and > 0, found {c}",
            meta.label(),
            meta.key(k)
        ),
    }
}

/// Each of `layers` layers' attention as llama.cpp's `load_swa_pattern`
/// reads `attention.sliding_window_pattern`: an array, one flag a layer
/// (nonzero: sliding); or a number `n`, every `n`-th layer full, the
/// others sliding (`n` = 0: all sliding); or, absent, `default` as that
/// number.
fn sliding_pattern(meta: &Meta, layers: usize, default: usize) -> Result<Vec<LayerKind>> {
    let k = meta.key("attention.sliding_window_pattern");
    let kind = |sliding: bool| match sliding {
        true => LayerKind::Sliding,
        false => LayerKind::Full,
    };
    let flags: Vec<bool> = match meta.file.get(&k) {
        Some(Value::Array(items)) if items.iter().all(|v| matches!(v, Value::Bool(_))) => {
            items.iter().map(|v| matches!(v, Value::Bool(true))).collect()
        }
        Some(Value::Array(_)) => match meta.file.integers(&k)? {
            Some(v) => v.into_iter().map(|x| x != 0).collect(),
            None => Vec::new(),
        },
        _ => {
            let n = meta.usize("attention.sliding_window_pattern")?.unwrap_or(default);
            return Ok((0..layers).map(|i| kind(n == 0 || i % n < n - 1)).collect());
        }
    };
    if flags.len() != layers {
        bail!(
            "GGUF file '{}': '{}' has {} entries for {layers} layers",
            meta.label(),
            k.escape_debug(),
            flags.len()
        )
    }
    Ok(flags.into_iter().map(kind).collect())
}
