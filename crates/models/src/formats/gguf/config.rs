//! A GGUF file's `{arch}.*` metadata read into the config of the HF model
//! it describes ([`LlamaConfig`] here, [`GemmaConfig`](crate::decoder::GemmaConfig) in `gemma.rs`),
//! each key checked as `config.json`'s are, and anything the models cannot
//! honour refused by name.

use candle::{bail, DType, Device, Result};
use multihead_attention::RopeScaling;

use super::GgufFile;
use super::GGUF_ARCHITECTURES;
use crate::decoder::config::{
    checked_layers, rotary_every, HfDecoderConfig, LlamaConfig, NormPlacement, Projections, QkNorm,
};

/// SmolLM3's layers without rotary in a GGUF file: every fourth, which
/// llama.cpp fixes (`n_no_rope_layer_step` in `src/llama-hparams.h`, read
/// by `src/models/smollm3.cpp`) and its converter writes no key for; HF's
/// default `no_rope_layer_interval`.
const SMOLLM3_NO_ROPE_STEP: usize = 4;

/// A GGUF file's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    /// SmolLM3: Llama with every fourth layer without rotary; q and k
    /// permuted as `llama`'s.
    SmolLm3,
    /// OLMo 2: norms after attention and MLP, q/k norms over all heads.
    Olmo2,
    /// Gemma 2: a [`crate::decoder::Gemma`], its norms stored as `1 + w`.
    Gemma2,
    /// Gemma 3 (text): as Gemma 2.
    Gemma3,
    /// Phi-3: fused q/k/v and gate/up projections, LongRoPE.
    Phi3,
}

/// Phi-3's LongRoPE factors, which the converter stores as tensors
/// (`Phi3MiniModel.generate_extra_tensors`): the config's, not weights.
pub(super) const LONGROPE_TENSORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

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
            "smollm3" => Self::SmolLm3,
            "olmo2" => Self::Olmo2,
            "gemma2" => Self::Gemma2,
            "gemma3" => Self::Gemma3,
            "phi3" => Self::Phi3,
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
            Self::SmolLm3 => "smollm3",
            Self::Olmo2 => "olmo2",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3",
            Self::Phi3 => "phi3",
        }
    }

    /// Whether the file holds a Gemma ([`crate::decoder::Gemma`]) rather
    /// than a [`crate::decoder::Llama`].
    pub(super) fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    /// Whether the converter permuted q and k (weights and biases) for
    /// llama.cpp's interleaved rotary (`LlamaModel.permute`; the archs
    /// whose `llama_model_rope_type` is `LLAMA_ROPE_TYPE_NORM`).
    pub(super) fn permutes_qk(self) -> bool {
        matches!(self, Self::Llama | Self::SmolLm3)
    }

    /// Where a Llama-family block's norms sit, which also decides their
    /// tensor names (`LlamaConfig::gguf_names`).
    pub(super) fn norm_placement(self) -> NormPlacement {
        match self {
            Self::Olmo2 => NormPlacement::Post,
            _ => NormPlacement::Pre,
        }
    }

    /// The `{arch}.*` keys llama.cpp reads for this arch beyond
    /// [`KNOWN_KEYS`] (its `load_arch_hparams`), which `gemma.rs` reads.
    fn own_keys(self) -> &'static [&'static str] {
        match self {
            Self::Gemma2 => &[
                "attn_logit_softcapping",
                "final_logit_softcapping",
                "attention.sliding_window_pattern",
                "rope.freq_base_swa",
            ],
            Self::Gemma3 => &[
                "final_logit_softcapping",
                "attention.sliding_window_pattern",
                "rope.freq_base_swa",
            ],
            _ => &[],
        }
    }
}

/// The `{arch}.*` keys every arch's reading reads; any other (but an
/// arch's [`Arch::own_keys`]) is refused, since it may change what the
/// model computes.
const KNOWN_KEYS: [&str; 20] = [
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
    "rope.scaling.attn_factor",
    "rope.scale_linear",
    // Refused unless 0.
    "expert_count",
    "expert_used_count",
];

/// A GGUF file's `{arch}.*` metadata, checked for what no arch's reading
/// honours (an unknown key, experts, a split file, Llama 3.1's
/// `rope_freqs` tensor), read by the key's name after `{arch}.`, errors
/// naming it whole.
pub(super) struct Meta<'a> {
    pub(super) file: &'a GgufFile,
    pub(super) arch: Arch,
    prefix: String,
}

impl<'a> Meta<'a> {
    pub(super) fn new(file: &'a GgufFile) -> Result<Self> {
        let label = file.label();
        let arch = Arch::of(file)?;
        let prefix = format!("{}.", arch.name());
        for k in file.keys() {
            if let Some(rest) = k.strip_prefix(&prefix) {
                if !KNOWN_KEYS.contains(&rest) && !arch.own_keys().contains(&rest) {
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
        let meta = Self { file, arch, prefix };
        for k in ["expert_count", "expert_used_count"] {
            if meta.usize(k)?.unwrap_or(0) > 0 {
                bail!(
                    "GGUF file '{label}': '{}' > 0: mixture-of-experts models are not supported",
                    meta.key(k)
                )
            }
        }
        if file.info("rope_freqs.weight").is_some() {
            bail!("GGUF file '{label}': tensor 'rope_freqs.weight' (Llama 3.1-style rotary scaling) is not supported")
        }
        Ok(meta)
    }

    pub(super) fn label(&self) -> &str {
        self.file.label()
    }

    /// The full name of key `k` (`{arch}.k`).
    pub(super) fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    pub(super) fn usize(&self, k: &str) -> Result<Option<usize>> {
        self.file.usize(&self.key(k))
    }

    pub(super) fn float(&self, k: &str) -> Result<Option<f64>> {
        self.file.float(&self.key(k))
    }

    pub(super) fn required(&self, k: &str) -> Result<usize> {
        self.usize(k)?.ok_or_else(|| {
            candle::Error::Msg(format!(
                "GGUF file '{}': no metadata '{}'",
                self.label(),
                self.key(k)
            ))
        })
    }

    /// `block_count`, in range before anything is built per layer
    /// ([`checked_layers`]).
    pub(super) fn layers(&self) -> Result<usize> {
        checked_layers(
            &format!("GGUF file '{}'", self.label()),
            &self.key("block_count"),
            self.required("block_count")?,
        )
    }

    /// Whether the file holds tensor `name`.
    pub(super) fn has(&self, name: &str) -> bool {
        self.file.info(name).is_some()
    }

    /// The vocabulary: `token_embd.weight`'s rows, which `vocab_size`
    /// must match where given; the embeddings `embedding_length` wide.
    pub(super) fn vocab(&self, hidden: usize) -> Result<usize> {
        let label = self.label();
        let Some(embd) = self.file.info("token_embd.weight") else {
            bail!("GGUF file '{label}': no tensor 'token_embd.weight'")
        };
        let vocab = match embd.shape.as_slice() {
            &[v, e] if e == hidden => v,
            dims => bail!(
                "GGUF file '{label}': tensor 'token_embd.weight' has shape {dims:?}, expected (vocab, {hidden}) for '{}' {hidden}",
                self.key("embedding_length")
            ),
        };
        if let Some(v) = self.usize("vocab_size")? {
            if v != vocab {
                bail!(
                    "GGUF file '{label}': '{}' is {v} but token_embd.weight has {vocab} rows",
                    self.key("vocab_size")
                )
            }
        }
        Ok(vocab)
    }

    /// `attention.key_length`, which `value_length` must equal where both
    /// are given.
    pub(super) fn head_dim(&self) -> Result<Option<usize>> {
        let head_dim = self.usize("attention.key_length")?;
        if let (Some(k), Some(v)) = (head_dim, self.usize("attention.value_length")?) {
            if k != v {
                bail!(
                    "GGUF file '{}': key_length {k} and value_length {v} differ, which these models do not",
                    self.label()
                )
            }
        }
        Ok(head_dim)
    }

    pub(super) fn rms_norm_eps(&self) -> Result<f64> {
        let k = "attention.layer_norm_rms_epsilon";
        self.float(k)?.ok_or_else(|| {
            candle::Error::Msg(format!(
                "GGUF file '{}': no metadata '{}'",
                self.label(),
                self.key(k)
            ))
        })
    }

    /// The rotary scaling: none or linear (`rope.scaling.*`, or the older
    /// `rope.scale_linear`), validated.
    pub(super) fn rope_scaling(&self) -> Result<Option<RopeScaling>> {
        let label = self.label();
        let scaling = match self.file.string(&self.key("rope.scaling.type"))? {
            None | Some("none") => match self.float("rope.scale_linear")? {
                Some(f) if f != 1. => Some(RopeScaling::Linear { factor: f }),
                _ => None,
            },
            Some("linear") => match self.float("rope.scaling.factor")? {
                Some(factor) => Some(RopeScaling::Linear { factor }),
                None => bail!(
                    "GGUF file '{label}': rope scaling 'linear' without '{}'",
                    self.key("rope.scaling.factor")
                ),
            },
            Some(other) => bail!(
                "GGUF file '{label}': '{}' '{}' is not supported; only 'none' and 'linear'",
                self.key("rope.scaling.type"),
                other.escape_debug()
            ),
        };
        if let Some(s) = &scaling {
            s.validate()
                .map_err(|e| candle::Error::Msg(format!("GGUF file '{label}': rope scaling: {e}")))?;
        }
        Ok(scaling)
    }

    /// Refuses a `rope.dimension_count` other than the heads' width:
    /// partial rotary.
    pub(super) fn check_rotary_width(&self, head_width: usize) -> Result<()> {
        if let Some(d) = self.usize("rope.dimension_count")? {
            if d != head_width {
                bail!(
                    "GGUF file '{}': '{}' is {d} but the heads are {head_width} wide: partial rotary is not supported",
                    self.label(),
                    self.key("rope.dimension_count"),
                )
            }
        }
        Ok(())
    }
}

impl LlamaConfig {
    /// The config a GGUF file's metadata describes (`general.architecture`
    /// `llama`, `qwen2`, `qwen3`, `smollm3`, `olmo2` or `phi3`), checked as
    /// `config.json` is: the vocabulary from `token_embd.weight`'s rows,
    /// tied embeddings where `output.weight` is absent, biases where layer
    /// 0 has them. Metadata this loader cannot honour (rotary scaling other
    /// than linear, experts, an unknown `{arch}.*` key, Llama 3.1's
    /// `rope_freqs` tensor) is refused by name; so is a Gemma's file
    /// ([`crate::decoder::GemmaConfig::from_gguf`]).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let meta = Meta::new(file)?;
        if meta.arch.is_gemma() {
            bail!(
                "GGUF file '{}': architecture '{}' is a Gemma (GemmaConfig::from_gguf)",
                meta.label(),
                meta.arch.name()
            )
        }
        llama_config(&meta)
    }
}

/// The config of the HF model a GGUF file describes, and its architecture.
pub(super) fn gguf_config(file: &GgufFile) -> Result<(HfDecoderConfig, Arch)> {
    let meta = Meta::new(file)?;
    let cfg = match meta.arch.is_gemma() {
        true => HfDecoderConfig::Gemma(super::gemma::gemma_config(&meta)?),
        false => HfDecoderConfig::Llama(llama_config(&meta)?),
    };
    Ok((cfg, meta.arch))
}

/// [`LlamaConfig::from_gguf`] of a file's checked metadata.
fn llama_config(meta: &Meta) -> Result<LlamaConfig> {
    let (label, arch) = (meta.label(), meta.arch);
    let hidden = meta.required("embedding_length")?;
    let heads = meta.required("attention.head_count")?;
    let sliding_window = match meta.usize("attention.sliding_window")? {
        None | Some(0) => None,
        // Phi-3's window is HF's (`Phi3Model` masks with `sliding_window`),
        // which llama.cpp's graph leaves off for now; the converter writes 0
        // where the config has none.
        Some(w) if matches!(arch, Arch::Llama | Arch::Phi3) => Some(w),
        Some(_) => bail!(
            "GGUF file '{label}': '{}' is set, and this loader does not run {}'s sliding windows",
            meta.key("attention.sliding_window"),
            arch.name()
        ),
    };
    let has = |name: &str| meta.has(name);
    let mut cfg = LlamaConfig {
        vocab_size: meta.vocab(hidden)?,
        hidden_size: hidden,
        intermediate_size: meta.required("feed_forward_length")?,
        num_hidden_layers: meta.layers()?,
        num_attention_heads: heads,
        num_key_value_heads: Some(meta.usize("attention.head_count_kv")?.unwrap_or(heads)),
        head_dim: meta.head_dim()?,
        rms_norm_eps: meta.rms_norm_eps()?,
        rope_theta: Some(meta.float("rope.freq_base")?.unwrap_or(10_000.)),
        max_position_embeddings: meta.usize("context_length")?,
        attention_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_gate.bias"),
        tie_word_embeddings: !has("output.weight"),
        hidden_act: "silu".into(),
        sliding_window,
        rope_scaling: rope_scaling(meta)?,
        qkv_bias: arch == Arch::Qwen2 || has("blk.0.attn_q.bias"),
        qk_norm: match arch {
            Arch::Olmo2 => QkNorm::AllHeads,
            Arch::Qwen3 => QkNorm::PerHead,
            _ if has("blk.0.attn_q_norm.weight") => QkNorm::PerHead,
            _ => QkNorm::None,
        },
        norm_placement: arch.norm_placement(),
        rotary_layers: Vec::new(),
        rotary_dims: None,
        projections: match arch {
            Arch::Phi3 => Projections::Fused,
            _ => Projections::Separate,
        },
    };
    if arch == Arch::SmolLm3 {
        cfg.rotary_layers = rotary_every(cfg.num_hidden_layers, SMOLLM3_NO_ROPE_STEP);
    }
    if cfg.attention_bias {
        cfg.qkv_bias = false;
    }
    let rope_dims = meta.usize("rope.dimension_count")?;
    if arch == Arch::Phi3 {
        // Phi-4-mini rotates the first `partial_rotary_factor` of each head.
        cfg.rotary_dims = rope_dims.filter(|&d| d != cfg.head_width());
    }
    cfg.validate(&format!("GGUF file '{label}'"))?;
    if arch != Arch::Phi3 {
        meta.check_rotary_width(cfg.head_width())?;
    }
    Ok(cfg)
}

/// The rotary scaling: linear ([`Meta::rope_scaling`]) or Phi-3's
/// LongRoPE ([`longrope`]), one at most.
fn rope_scaling(meta: &Meta) -> Result<Option<RopeScaling>> {
    match (meta.rope_scaling()?, longrope(meta)?) {
        (None, Some(long)) => {
            long.validate().map_err(|e| {
                candle::Error::Msg(format!("GGUF file '{}': rope scaling: {e}", meta.label()))
            })?;
            Ok(Some(long))
        }
        (None, None) => Ok(None),
        (Some(s), None) => Ok(Some(s)),
        (Some(_), Some(_)) => bail!(
            "GGUF file '{}': both '{}' and LongRoPE factors ({}): one scaling at a time is supported",
            meta.label(),
            meta.key("rope.scaling.type"),
            LONGROPE_TENSORS.join(", ")
        ),
    }
}

/// Phi-3's LongRoPE from the factor tensors and the `{arch}.rope.scaling.*`
/// keys the converter writes with them (`original_context_length`,
/// `attn_factor`, else HF's default from `context_length`); `None` where
/// the file has no factors. Other architectures' files with factors or an
/// attention factor are refused.
fn longrope(meta: &Meta) -> Result<Option<RopeScaling>> {
    let (file, arch, label) = (meta.file, meta.arch, meta.label());
    let key = |k: &str| meta.key(k);
    let present: Vec<&str> = LONGROPE_TENSORS
        .into_iter()
        .filter(|t| file.info(t).is_some())
        .collect();
    let attn_factor = file.float(&key("rope.scaling.attn_factor"))?;
    if arch != Arch::Phi3 {
        if let Some(t) = present.first() {
            bail!("GGUF file '{label}': tensor '{t}' (LongRoPE) is supported in arch 'phi3' files only")
        }
        if attn_factor.is_some_and(|f| f != 1.) {
            bail!(
                "GGUF file '{label}': '{}' is not supported in arch '{}' files",
                key("rope.scaling.attn_factor"),
                arch.name()
            )
        }
        return Ok(None);
    }
    match present.len() {
        0 => {
            if attn_factor.is_some_and(|f| f != 1.) {
                bail!(
                    "GGUF file '{label}': '{}' without LongRoPE factors ({})",
                    key("rope.scaling.attn_factor"),
                    LONGROPE_TENSORS.join(", ")
                )
            }
            return Ok(None);
        }
        1 => bail!(
            "GGUF file '{label}': tensor '{}' without '{}': LongRoPE needs both",
            present[0],
            LONGROPE_TENSORS
                .into_iter()
                .find(|t| *t != present[0])
                .unwrap_or_default()
        ),
        _ => {}
    }
    let factors = |name: &str| -> Result<Vec<f64>> {
        let t = file.tensor(name, &Device::Cpu)?;
        if t.rank() != 1 {
            bail!(
                "GGUF file '{label}': tensor '{name}' has shape {:?}, expected one factor per rotated pair",
                t.dims()
            )
        }
        t.to_dtype(DType::F64)?.to_vec1()
    };
    let Some(original) = file.usize(&key("rope.scaling.original_context_length"))? else {
        bail!(
            "GGUF file '{label}': LongRoPE factors without '{}'",
            key("rope.scaling.original_context_length")
        )
    };
    if original == 0 {
        bail!(
            "GGUF file '{label}': '{}' must be > 0",
            key("rope.scaling.original_context_length")
        )
    }
    let attention_factor = match attn_factor {
        Some(f) => f,
        // `_compute_longrope_parameters` with factor = context / original.
        None => {
            let context = file.usize(&key("context_length"))?.unwrap_or(original);
            let factor = context as f64 / original as f64;
            if factor <= 1. {
                1.
            } else {
                (1. + factor.ln() / (original as f64).ln()).sqrt()
            }
        }
    };
    Ok(Some(RopeScaling::LongRope {
        short_factor: factors("rope_factors_short.weight")?,
        long_factor: factors("rope_factors_long.weight")?,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}
