//! The `config.json` HF transformers writes for GPT-2 and Llama, read as
//! untrusted input: every value checked, every error naming the file and
//! the field.

use candle::{bail, Result};
use multihead_attention::RopeScaling;
use serde::Deserialize;
use serde_json::Value;

use super::gemma::GemmaConfig;
use crate::formats::safetensors::Checkpoint;
use crate::mlp::Activation;

/// Largest width, vocabulary, layer count or context a config may ask for:
/// far beyond any released model, small enough that products of two of
/// them cannot overflow.
const MAX_DIM: usize = 1 << 24;

/// A decoder's config, by `model_type`.
#[derive(Debug, Clone, PartialEq)]
pub enum HfDecoderConfig {
    /// `gpt2`.
    Gpt2(Gpt2Config),
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `smollm3`, `olmo2`, `phi3`.
    Llama(LlamaConfig),
    /// `gemma2`, `gemma3_text`, and the text tower of `gemma3`.
    Gemma(GemmaConfig),
}

/// The `model_type` values [`HfDecoderConfig::from_json`] reads.
pub const HF_DECODER_TYPES: [&str; 11] = [
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
];

/// How a checkpoint stores a block's input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Projections {
    /// One linear each: `q_proj`, `k_proj`, `v_proj`; `gate_proj`,
    /// `up_proj` (Llama).
    #[default]
    Separate,
    /// Fused: `qkv_proj` (the query rows, then the key rows, then the
    /// value rows, `(heads + 2 * kv_heads) * head_dim` in all) and
    /// `gate_up_proj` (the gate rows, then the up rows) (Phi-3).
    Fused,
}

/// Where a block's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormPlacement {
    /// Before attention and before the MLP (`input_layernorm`,
    /// `post_attention_layernorm`): `x + attn(norm(x))` (Llama).
    #[default]
    Pre,
    /// After attention and after the MLP, on the branch
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`):
    /// `x + norm(attn(x))` (OLMo 2).
    Post,
}

/// The RMSNorms on queries and keys after their projections, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkNorm {
    /// None (Llama).
    #[default]
    None,
    /// Over each head's `head_dim` features, one weight shared by the
    /// heads (Qwen3).
    PerHead,
    /// Over all heads' features at once, before the split into heads:
    /// `num_heads * head_dim` weights for q, `num_key_value_heads *
    /// head_dim` for k (OLMo 2).
    AllHeads,
}

impl HfDecoderConfig {
    /// The config's type, as errors and `multihead inspect` name it
    /// (`LlamaConfig`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "Gpt2Config",
            Self::Llama(_) => "LlamaConfig",
            Self::Gemma(_) => "GemmaConfig",
        }
    }

    /// Parses `config.json` text; `label` names the file in errors.
    pub fn from_json(text: &str, label: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| candle::Error::Msg(format!("{label}: not valid JSON: {e}")))?;
        let model_type = match value.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => bail!("{label}: field 'model_type' must be a string, found {other}"),
            None => bail!("{label}: no field 'model_type' (is this a HF transformers config.json?)"),
        };
        match model_type.as_str() {
            "gpt2" => {
                let cfg: Gpt2Config = serde_json::from_value(value.clone())
                    .map_err(|e| candle::Error::Msg(format!("{label}: {e}")))?;
                cfg.validate(label)?;
                Ok(Self::Gpt2(cfg))
            }
            "llama" | "mistral" | "qwen2" | "qwen3" | "smollm3" | "olmo2" | "phi3" => {
                let mut cfg: LlamaConfig = serde_json::from_value(value.clone())
                    .map_err(|e| candle::Error::Msg(format!("{label}: {e}")))?;
                if model_type == "phi3" {
                    cfg.resolve_phi3(&value, label)?;
                } else {
                    cfg.resolve_rope(&value, label, None)?;
                }
                if model_type == "smollm3" {
                    cfg.resolve_smollm3(&value, label)?;
                }
                if model_type == "olmo2" {
                    cfg.resolve_olmo2(&value);
                }
                if model_type == "qwen2" || model_type == "qwen3" {
                    // Qwen2: biases on q, k and v only; Qwen3: an RMSNorm on
                    // each head of q and k instead. Their sliding window
                    // applies only where `use_sliding_window` says so.
                    if model_type == "qwen2" {
                        cfg.qkv_bias = true;
                    } else {
                        cfg.qk_norm = QkNorm::PerHead;
                    }
                    match value.get("use_sliding_window") {
                        Some(Value::Bool(true)) => bail!(
                            "{label}: use_sliding_window true (windows on some layers, max_window_layers) is not supported"
                        ),
                        None | Some(Value::Null | Value::Bool(false)) => cfg.sliding_window = None,
                        Some(other) => {
                            bail!("{label}: field 'use_sliding_window' must be true or false, found {other}")
                        }
                    }
                }
                cfg.validate(label)?;
                Ok(Self::Llama(cfg))
            }
            t @ ("gemma2" | "gemma3_text" | "gemma3") => {
                Ok(Self::Gemma(GemmaConfig::from_value(&value, t, label)?))
            }
            other => bail!(
                "{label}: model_type '{}' is not a decoder this crate runs ({})",
                other.escape_debug(),
                HF_DECODER_TYPES.join(", ")
            ),
        }
    }
}

/// Whether a model whose config says `tie_word_embeddings` is tied once
/// built from `ckpt`, whose token embedding is `embedding`. HF
/// transformers' rule (`PreTrainedModel.tie_weights` in `from_pretrained`):
/// a file that also holds `lm_head.weight` (as a `.bin` export does, its
/// shared table copied) is tied where the two are equal; where they differ
/// the config is taken to be wrong and the head keeps its own weight.
/// Equal here means the same stored bytes: a head that equals the table
/// only once converted stays untied, which computes the same logits.
pub(crate) fn ties_in(tie_word_embeddings: bool, ckpt: &Checkpoint, embedding: &str) -> bool {
    tie_word_embeddings
        && (ckpt.info("lm_head.weight").is_none() || ckpt.same_values(embedding, "lm_head.weight"))
}

pub(super) fn check_dims(label: &str, dims: &[(&str, usize)]) -> Result<()> {
    for &(name, d) in dims {
        if d == 0 || d > MAX_DIM {
            bail!("{label}: field '{name}' must be in 1..={MAX_DIM}, found {d}")
        }
    }
    Ok(())
}

/// `n` layers where that many is in range ([`check_dims`]): checked before
/// anything is built per layer, so that a config asking for 2⁴⁰ layers is
/// an error, not an allocation that aborts.
pub(crate) fn checked_layers(label: &str, name: &str, n: usize) -> Result<usize> {
    check_dims(label, &[(name, n)])?;
    Ok(n)
}

pub(super) fn check_eps(label: &str, name: &str, eps: f64) -> Result<()> {
    if !(eps.is_finite() && eps > 0. && eps < 1.) {
        bail!("{label}: field '{name}' must be in (0, 1), found {eps}")
    }
    Ok(())
}

/// HF `GPT2Config`, the fields that shape the model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length (learned position embeddings).
    pub n_positions: usize,
    /// Width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Heads.
    pub n_head: usize,
    /// MLP width (default `4 * n_embd`).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (tanh GELU, the default), `gelu_pytorch_tanh`, `gelu`,
    /// `relu`, `silu`.
    #[serde(default = "gelu_new")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "ln_eps")]
    pub layer_norm_epsilon: f64,
    /// Scores scaled by `1 / sqrt(head_dim)` (default true).
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Scores also scaled by `1 / (layer_index + 1)`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The output projection shares `wte` (default true).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn gelu_new() -> String {
    "gelu_new".into()
}

fn ln_eps() -> f64 {
    1e-5
}

fn yes() -> bool {
    true
}

impl Gpt2Config {
    fn validate(&self, label: &str) -> Result<()> {
        check_dims(
            label,
            &[
                ("vocab_size", self.vocab_size),
                ("n_positions", self.n_positions),
                ("n_embd", self.n_embd),
                ("n_layer", self.n_layer),
                ("n_head", self.n_head),
                ("n_inner", self.n_inner()),
            ],
        )?;
        if !self.n_embd.is_multiple_of(self.n_head) {
            bail!(
                "{label}: n_embd ({}) must be divisible by n_head ({})",
                self.n_embd,
                self.n_head
            )
        }
        check_eps(label, "layer_norm_epsilon", self.layer_norm_epsilon)?;
        Activation::from_hf_name(&self.activation_function, label)?;
        Ok(())
    }

    /// MLP width.
    pub fn n_inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}

/// HF `LlamaConfig` / `MistralConfig`, the fields that shape the model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (default `num_attention_heads`).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width (default `hidden_size / num_attention_heads`; Qwen3
    /// and Gemma set another).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "rms_eps")]
    pub rms_norm_eps: f64,
    /// Rotary base: the top-level `rope_theta` (transformers 4) or
    /// `rope_parameters.rope_theta` (transformers 5); default 10000.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Context length the model was trained for (not enforced: rotary
    /// positions extrapolate).
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The output projection shares `embed_tokens`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// `silu` (Llama, Mistral).
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Mistral's sliding attention window, in keys.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Rotary frequency scaling (`rope_type` `linear` or `llama3`), read
    /// from `rope_parameters` or `rope_scaling`.
    #[serde(skip)]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on q, k and v but not o (Qwen2), whatever `attention_bias` says.
    #[serde(skip)]
    pub qkv_bias: bool,
    /// RMSNorms on q and k (`q_norm`, `k_norm`), with `rms_norm_eps`:
    /// over each head (Qwen3) or over all heads at once (OLMo 2).
    #[serde(skip)]
    pub qk_norm: QkNorm,
    /// Whether the block's norms come before its attention and MLP or
    /// after them (OLMo 2).
    #[serde(skip)]
    pub norm_placement: NormPlacement,
    /// Whether each layer applies the rotary embedding (SmolLM3's
    /// `no_rope_layers`, where 1 is rotary and 0 none); empty: every layer
    /// does.
    #[serde(skip)]
    pub rotary_layers: Vec<bool>,
    /// The leading dims of each head that rotate (Phi-4-mini's
    /// `partial_rotary_factor` of `head_dim`); `None`: all of them.
    #[serde(skip)]
    pub rotary_dims: Option<usize>,
    /// Separate or fused input projections (Phi-3's `qkv_proj`,
    /// `gate_up_proj`).
    #[serde(skip)]
    pub projections: Projections,
}

/// Phi-3's context defaults (`Phi3Config`): `max_position_embeddings` and
/// `original_max_position_embeddings` where `config.json` omits them.
const PHI3_CONTEXT: usize = 4096;

/// The top-level context fields of a Phi-3 `config.json`, which its
/// LongRoPE reads.
#[derive(Debug, Clone, Copy)]
struct Phi3Context {
    max_position_embeddings: usize,
    original_max_position_embeddings: usize,
}

fn rms_eps() -> f64 {
    1e-6
}

fn silu() -> String {
    "silu".into()
}

/// SmolLM3's [`LlamaConfig::rotary_layers`] for `n` layers where every
/// `interval`-th has no rotary (`no_rope_layer_interval`; `interval` >= 1).
pub(crate) fn rotary_every(n: usize, interval: usize) -> Vec<bool> {
    (0..n).map(|i| (i + 1) % interval != 0).collect()
}

impl LlamaConfig {
    /// SmolLM3's fields (`SmolLM3Config`, `configuration_smollm3.py`):
    /// its defaults where Llama's differ, the layers without rotary, and
    /// the sliding windows it does not run refused.
    fn resolve_smollm3(&mut self, value: &Value, label: &str) -> Result<()> {
        if self.rope_theta.is_none() {
            self.rope_theta = Some(2_000_000.);
        }
        if value.get("tie_word_embeddings").is_none() {
            self.tie_word_embeddings = true;
        }
        let n = checked_layers(label, "num_hidden_layers", self.num_hidden_layers)?;
        self.rotary_layers = match value.get("no_rope_layers") {
            None | Some(Value::Null) => {
                let interval = match value.get("no_rope_layer_interval") {
                    None | Some(Value::Null) => 4,
                    Some(v) => match v.as_u64() {
                        Some(i @ 1..) => i as usize,
                        _ => bail!("{label}: field 'no_rope_layer_interval' must be a whole number >= 1, found {v}"),
                    },
                };
                rotary_every(n, interval)
            }
            Some(Value::Array(flags)) if flags.len() >= n => flags
                .iter()
                .take(n)
                .enumerate()
                .map(|(i, f)| match f {
                    Value::Bool(b) => Ok(*b),
                    Value::Number(x) if x.as_u64() == Some(1) => Ok(true),
                    Value::Number(x) if x.as_u64() == Some(0) => Ok(false),
                    other => bail!("{label}: field 'no_rope_layers' entry {i} must be 0 or 1, found {other}"),
                })
                .collect::<Result<_>>()?,
            Some(other) => bail!(
                "{label}: field 'no_rope_layers' must be a list of 0 or 1 for each of the {n} layers, found {other}"
            ),
        };
        match value.get("use_sliding_window") {
            None | Some(Value::Null | Value::Bool(false)) => self.sliding_window = None,
            Some(Value::Bool(true)) => bail!(
                "{label}: field 'use_sliding_window' is true (windows on the layers without rotary), which is not supported"
            ),
            Some(other) => bail!("{label}: field 'use_sliding_window' must be true or false, found {other}"),
        }
        match value.get("layer_types") {
            None | Some(Value::Null) => {}
            Some(Value::Array(types)) => {
                if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
                    bail!(
                        "{label}: field 'layer_types' holds {t}; only 'full_attention' layers are supported"
                    )
                }
            }
            Some(other) => bail!("{label}: field 'layer_types' must be a list, found {other}"),
        }
        Ok(())
    }

    /// OLMo 2's (`Olmo2Config`, `configuration_olmo2.py`): norms after
    /// each branch, RMSNorms over the full width of q and k, its
    /// `rms_norm_eps` default, and the fields `Olmo2Config` lacks (a
    /// sliding window, MLP biases), which its model ignores, ignored.
    fn resolve_olmo2(&mut self, value: &Value) {
        self.norm_placement = NormPlacement::Post;
        self.qk_norm = QkNorm::AllHeads;
        if value.get("rms_norm_eps").is_none() {
            self.rms_norm_eps = 1e-5;
        }
        self.sliding_window = None;
        self.mlp_bias = false;
    }

    /// Whether layer `i` applies the rotary embedding.
    pub fn rotary_at(&self, i: usize) -> bool {
        self.rotary_layers.get(i).copied().unwrap_or(true)
    }

    /// Phi-3's (`Phi3Config`, `configuration_phi3.py`, run by
    /// `modeling_phi3.py`): fused projections, no biases whatever
    /// `attention_bias` or `mlp_bias` say (its model has none), its
    /// `rms_norm_eps` default, `partial_rotary_factor` (Phi-4-mini), and
    /// rotary scaling `longrope` (or its older names `su` and `yarn`,
    /// which `Phi3Config` renames to it) with the top-level
    /// `original_max_position_embeddings`, which `Phi3Config` puts in
    /// place of the scaling's own. Its `sliding_window` stays: HF's model
    /// masks with it.
    fn resolve_phi3(&mut self, value: &Value, label: &str) -> Result<()> {
        self.projections = Projections::Fused;
        if value.get("rms_norm_eps").is_none() {
            self.rms_norm_eps = 1e-5;
        }
        self.attention_bias = false;
        self.mlp_bias = false;
        let whole = |name: &str| -> Result<usize> {
            match value.get(name) {
                None | Some(Value::Null) => Ok(PHI3_CONTEXT),
                Some(v) => match v.as_u64() {
                    Some(n @ 1..) if n <= MAX_DIM as u64 => Ok(n as usize),
                    _ => bail!("{label}: field '{name}' must be a whole number in 1..={MAX_DIM}, found {v}"),
                },
            }
        };
        let context = Phi3Context {
            max_position_embeddings: whole("max_position_embeddings")?,
            original_max_position_embeddings: whole("original_max_position_embeddings")?,
        };
        self.resolve_rope(value, label, Some(context))?;
        // `Phi3Config.convert_rope_params_to_dict`: the scaling's own
        // value first, else the top-level one, else 1.
        let mut factor = None;
        for key in ["partial_rotary_factor", "rope_scaling", "rope_parameters"] {
            let (field, v) = match key {
                "partial_rotary_factor" => (key.to_string(), value.get(key)),
                _ => (
                    format!("{key}.partial_rotary_factor"),
                    value.get(key).and_then(|p| p.get("partial_rotary_factor")),
                ),
            };
            match v {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_f64() {
                    Some(f) if f > 0. && f <= 1. => factor = Some((field, f)),
                    _ => bail!("{label}: field '{field}' must be a number in (0, 1], found {v}"),
                },
            }
        }
        if let Some((field, f)) = factor {
            // HF: int(head_dim * partial_rotary_factor).
            let hd = self.head_width();
            let dims = (hd as f64 * f) as usize;
            if dims < 2 || !dims.is_multiple_of(2) {
                bail!(
                    "{label}: field '{field}' ({f}) rotates {dims} of each head's {hd} dims; that must be an even number >= 2"
                )
            }
            self.rotary_dims = (dims < hd).then_some(dims);
        }
        Ok(())
    }

    /// Reads the rotary parameters from wherever this transformers
    /// version put them, refusing scaled variants this crate does not
    /// implement (rather than running them unscaled). `phi3`: Phi-3's
    /// context fields, where its scaling (`longrope`) reads them; the
    /// others refuse it.
    fn resolve_rope(&mut self, value: &Value, label: &str, phi3: Option<Phi3Context>) -> Result<()> {
        for key in ["rope_parameters", "rope_scaling"] {
            let Some(p) = value.get(key).filter(|p| !p.is_null()) else {
                continue;
            };
            let Some(p) = p.as_object() else {
                bail!("{label}: field '{key}' must be an object, found {p}")
            };
            let number = |name: &str| -> Result<f64> {
                match p.get(name) {
                    Some(v) => v.as_f64().ok_or_else(|| {
                        candle::Error::Msg(format!(
                            "{label}: field '{key}.{name}' must be a number, found {v}"
                        ))
                    }),
                    None => bail!("{label}: field '{key}.{name}' is missing"),
                }
            };
            let kind = match ["rope_type", "type"]
                .into_iter()
                .find_map(|k| p.get(k).map(|v| (k, v)))
            {
                None | Some((_, Value::Null)) => None,
                Some((_, Value::String(s))) => Some(s.as_str()),
                Some((name, other)) => {
                    bail!("{label}: field '{key}.{name}' must be a string, found {other}")
                }
            };
            let factors = |name: &str| -> Result<Vec<f64>> {
                let bad = |v: &Value| {
                    candle::Error::Msg(format!(
                        "{label}: field '{key}.{name}' must be a list of numbers, found {v}"
                    ))
                };
                match p.get(name) {
                    Some(Value::Array(list)) => {
                        list.iter().map(|v| v.as_f64().ok_or_else(|| bad(v))).collect()
                    }
                    Some(v) => Err(bad(v)),
                    None => bail!("{label}: field '{key}.{name}' is missing"),
                }
            };
            let optional = |name: &str| -> Result<Option<f64>> {
                match p.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(_) => number(name).map(Some),
                }
            };
            let scaling = match (kind, phi3) {
                (None | Some("default"), _) => None,
                (Some("longrope" | "su" | "yarn"), Some(ctx)) => {
                    // `_compute_longrope_parameters`.
                    let original = ctx.original_max_position_embeddings;
                    let factor = match optional("factor")? {
                        Some(f) => f,
                        None => ctx.max_position_embeddings as f64 / original as f64,
                    };
                    let attention_factor = match optional("attention_factor")? {
                        Some(a) => a,
                        None if factor <= 1. => 1.,
                        None => (1. + factor.ln() / (original as f64).ln()).sqrt(),
                    };
                    if !(attention_factor.is_finite() && attention_factor > 0.) {
                        bail!(
                            "{label}: the attention factor of '{key}' (from 'attention_factor', or 'factor' {factor} and 'original_max_position_embeddings' {original}) must be finite and > 0, found {attention_factor}"
                        )
                    }
                    Some(RopeScaling::LongRope {
                        short_factor: factors("short_factor")?,
                        long_factor: factors("long_factor")?,
                        original_max_position_embeddings: original,
                        attention_factor,
                    })
                }
                (Some(kind), Some(_)) => bail!(
                    "{label}: {key}.rope_type '{}' is not one Phi-3 runs ('default', 'longrope')",
                    kind.escape_debug()
                ),
                (Some("linear"), None) => Some(RopeScaling::Linear { factor: number("factor")? }),
                (Some("llama3"), None) => {
                    let original = number("original_max_position_embeddings")?;
                    if !(original >= 1. && original <= MAX_DIM as f64 && original.fract() == 0.) {
                        bail!(
                            "{label}: field '{key}.original_max_position_embeddings' must be a whole number in 1..={MAX_DIM}, found {original}"
                        )
                    }
                    Some(RopeScaling::Llama3 {
                        factor: number("factor")?,
                        low_freq_factor: number("low_freq_factor")?,
                        high_freq_factor: number("high_freq_factor")?,
                        original_max_position_embeddings: original as usize,
                    })
                }
                (Some(kind), None) => bail!(
                    "{label}: {key}.rope_type '{kind}' is not supported; only 'default', 'linear' and 'llama3'"
                ),
            };
            if let Some(scaling) = scaling {
                scaling
                    .validate()
                    .map_err(|e| candle::Error::Msg(format!("{label}: field '{key}': {e}")))?;
                self.rope_scaling = Some(scaling);
            }
            if p.get("rope_theta").is_some() {
                self.rope_theta = Some(number("rope_theta")?);
            }
        }
        Ok(())
    }

    pub(crate) fn validate(&self, label: &str) -> Result<()> {
        check_dims(
            label,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.kv_heads()),
            ],
        )?;
        let (h, kvh) = (self.num_attention_heads, self.kv_heads());
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(h) {
            bail!(
                "{label}: hidden_size ({}) must be divisible by num_attention_heads ({h})",
                self.hidden_size
            )
        }
        if !h.is_multiple_of(kvh) {
            bail!("{label}: num_attention_heads ({h}) must be a multiple of num_key_value_heads ({kvh})")
        }
        if let Some(hd) = self.head_dim {
            check_dims(label, &[("head_dim", hd)])?;
        }
        check_eps(label, "rms_norm_eps", self.rms_norm_eps)?;
        let theta = self.theta();
        if !(theta.is_finite() && theta > 1.) {
            bail!("{label}: field 'rope_theta' must be finite and > 1, found {theta}")
        }
        if self.sliding_window == Some(0) {
            bail!("{label}: field 'sliding_window' must be >= 1 when set")
        }
        let rotated = self.rotary_dims.unwrap_or(self.head_width());
        if rotated == 0 || !rotated.is_multiple_of(2) || rotated > self.head_width() {
            bail!(
                "{label}: {rotated} rotary dims of heads {} wide: they must be even and at most the head's width",
                self.head_width()
            )
        }
        if let Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        }) = &self.rope_scaling
        {
            for (name, factors) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if factors.len() != rotated / 2 {
                    bail!(
                        "{label}: field '{name}' of 'rope_scaling' (or 'rope_parameters') has {} entries; it needs one per rotated pair of dims, {}",
                        factors.len(),
                        rotated / 2
                    )
                }
            }
        }
        if self.hidden_act != "silu" {
            bail!(
                "{label}: hidden_act '{}' is not supported (silu)",
                self.hidden_act
            )
        }
        Ok(())
    }

    /// Per-head width.
    pub fn head_width(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Rotary base.
    pub fn theta(&self) -> f64 {
        self.rope_theta.unwrap_or(10_000.)
    }
}
