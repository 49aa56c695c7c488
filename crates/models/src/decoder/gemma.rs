//! Gemma 2 and Gemma 3 (text), as HF transformers' `Gemma2ForCausalLM`
//! (`transformers/models/gemma2/modeling_gemma2.py`) and
//! `Gemma3ForCausalLM` (`gemma3/modeling_gemma3.py`), on
//! [`MultiheadAttention`].
//!
//! What sets them apart from Llama: four RMSNorms a block, around each
//! branch as well as before it ("sandwich" norms), each scaling by `1 + w`
//! (zero-centred weights); embeddings multiplied by `√hidden_size`; a
//! GeGLU MLP; scores scaled by `query_pre_attn_scalar^-1/2`; sliding or
//! full attention chosen per layer (`layer_types`). Gemma 2 soft-caps the
//! scores (`attn_logit_softcapping`, inside the attention kernel) and the
//! logits (`final_logit_softcapping`); Gemma 3 instead normalises each
//! head of q and k, and gives its sliding and full layers their own rope
//! base.

use candle::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::{linear_b, VarBuilder};
use multihead_attention::{
    KvCache, MhaConfig, MhaOptions, MultiheadAttention, NormKind, PackOptions, PackedLinear,
    PositionEncoding, RmsNorm, RopeScaling, RotaryConfig, WeightLayout,
};
use serde_json::{Map, Value};

use super::config::{check_dims, check_eps, checked_layers, ties_in};
use super::llama::{check_ids, GatedMlp, TokenEmbedding};
use super::llama::{GGUF_LAYER, GGUF_TOP};
use super::{CausalLm, DecoderCache};
use crate::formats::gguf::{GgufNames, NamePair};
use crate::formats::safetensors::{Checkpoint, MinWeights};
use crate::mlp::Activation;

/// Which Gemma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmaFamily {
    /// `gemma2`.
    Gemma2,
    /// `gemma3_text`, or the text tower of a `gemma3` folder.
    Gemma3,
}

/// The attention of one layer: a window of the last `sliding_window` keys
/// or all of them (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// `sliding_attention`.
    Sliding,
    /// `full_attention`.
    Full,
}

/// A rotary base and its scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// `rope_theta`.
    pub theta: f64,
    /// `rope_type` `linear`'s factor, or none.
    pub scaling: Option<RopeScaling>,
}

/// HF `Gemma2Config` / `Gemma3TextConfig`, the fields that shape the model,
/// read with each family's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// Which Gemma.
    pub family: GemmaFamily,
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
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Per-head width (default 256).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Biases on q/k/v/o.
    pub attention_bias: bool,
    /// Scores are scaled by `query_pre_attn_scalar^-1/2` (default 256).
    pub query_pre_attn_scalar: f64,
    /// Keys a sliding layer sees (`None`: sliding layers see all).
    pub sliding_window: Option<usize>,
    /// Each layer's attention.
    pub layer_types: Vec<LayerKind>,
    /// Scores become `cap · tanh(s / cap)` (Gemma 2: 50).
    pub attn_logit_softcapping: Option<f64>,
    /// Logits become `cap · tanh(x / cap)` (Gemma 2: 30).
    pub final_logit_softcapping: Option<f64>,
    /// The output projection shares `embed_tokens` (default true).
    pub tie_word_embeddings: bool,
    /// Context length the model was trained for (not enforced).
    pub max_position_embeddings: Option<usize>,
    /// Rotary of the full layers (Gemma 3: base 1M, with the config's
    /// scaling); of every layer in Gemma 2.
    pub rope_full: Rope,
    /// Rotary of the sliding layers (Gemma 3: base 10k, unscaled).
    pub rope_sliding: Rope,
}

/// The `model_type` values [`GemmaConfig::from_value`] reads.
pub const GEMMA_TYPES: [&str; 3] = ["gemma2", "gemma3_text", "gemma3"];

impl GemmaConfig {
    /// Reads a `gemma2`, `gemma3_text` or (its `text_config`) `gemma3`
    /// config; `label` names the file in errors.
    pub fn from_value(value: &Value, model_type: &str, label: &str) -> Result<Self> {
        let (family, value, label) = match model_type {
            "gemma2" => (GemmaFamily::Gemma2, value, label.to_string()),
            "gemma3_text" => (GemmaFamily::Gemma3, value, label.to_string()),
            "gemma3" => match value.get("text_config") {
                Some(v @ Value::Object(_)) => (GemmaFamily::Gemma3, v, format!("{label}: text_config")),
                Some(other) => bail!("{label}: field 'text_config' must be an object, found {other}"),
                None => bail!("{label}: model_type 'gemma3' needs its 'text_config'"),
            },
            other => bail!("{label}: model_type '{}' is not a Gemma", other.escape_debug()),
        };
        let label = label.as_str();
        let Some(obj) = value.as_object() else {
            bail!("{label}: must be a JSON object")
        };
        let f = Fields { obj, label };
        let gemma2 = family == GemmaFamily::Gemma2;
        let num_hidden_layers =
            checked_layers(label, "num_hidden_layers", f.usize_or("num_hidden_layers", 26)?)?;
        let num_attention_heads = f.usize_or("num_attention_heads", 8)?;
        let activation = f.string_or("hidden_activation", "gelu_pytorch_tanh")?;
        if !matches!(
            activation.as_str(),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast"
        ) {
            bail!(
                "{label}: hidden_activation '{}' is not supported (gelu_pytorch_tanh)",
                activation.escape_debug()
            )
        }
        if f.bool_or("use_bidirectional_attention", false)? {
            bail!("{label}: field 'use_bidirectional_attention' is true (an encoder's attention), which is not supported")
        }
        let (cap_attn, cap_final) = if gemma2 {
            (Some(50.), Some(30.))
        } else {
            (None, None)
        };
        let sliding_window = f.optional_usize("sliding_window", Some(4096))?;
        let layer_types = match obj.get("layer_types") {
            None | Some(Value::Null) => {
                // Gemma 2 alternates, sliding first; Gemma 3 has one full
                // layer in every `sliding_window_pattern` (6).
                let pattern = match gemma2 {
                    true => 2,
                    false => match f.usize_or("sliding_window_pattern", 6)? {
                        0 => bail!("{label}: field 'sliding_window_pattern' must be >= 1"),
                        p => p,
                    },
                };
                (0..num_hidden_layers)
                    .map(|i| match (i + 1) % pattern {
                        0 => LayerKind::Full,
                        _ => LayerKind::Sliding,
                    })
                    .collect()
            }
            Some(Value::Array(types)) if types.len() == num_hidden_layers => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => bail!(
                        "{label}: field 'layer_types' entry {i} is {t}; 'sliding_attention' or 'full_attention' are supported"
                    ),
                })
                .collect::<Result<_>>()?,
            Some(other) => bail!(
                "{label}: field 'layer_types' must be a list of {num_hidden_layers} layer kinds, found {other}"
            ),
        };
        let (rope_full, rope_sliding) = f.ropes(family)?;
        let cfg = Self {
            family,
            vocab_size: f.usize_or("vocab_size", if gemma2 { 256_000 } else { 262_208 })?,
            hidden_size: f.usize_or("hidden_size", 2304)?,
            intermediate_size: f.usize_or("intermediate_size", 9216)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", 4)?,
            head_dim: f.usize_or("head_dim", 256)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            attention_bias: f.bool_or("attention_bias", false)?,
            query_pre_attn_scalar: f.f64_or("query_pre_attn_scalar", 256.)?,
            sliding_window,
            layer_types,
            attn_logit_softcapping: f.optional_f64("attn_logit_softcapping", cap_attn)?,
            final_logit_softcapping: f.optional_f64("final_logit_softcapping", cap_final)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
            max_position_embeddings: f.optional_usize("max_position_embeddings", None)?,
            rope_full,
            rope_sliding,
        };
        cfg.validate(label)?;
        Ok(cfg)
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
                ("num_key_value_heads", self.num_key_value_heads),
                ("head_dim", self.head_dim),
            ],
        )?;
        let (h, kvh) = (self.num_attention_heads, self.num_key_value_heads);
        if !h.is_multiple_of(kvh) {
            bail!("{label}: num_attention_heads ({h}) must be a multiple of num_key_value_heads ({kvh})")
        }
        check_eps(label, "rms_norm_eps", self.rms_norm_eps)?;
        let q = self.query_pre_attn_scalar;
        if !(q.is_finite() && q > 0.) {
            bail!("{label}: field 'query_pre_attn_scalar' must be finite and > 0, found {q}")
        }
        if self.sliding_window == Some(0) {
            bail!("{label}: field 'sliding_window' must be >= 1 when set")
        }
        for (name, cap) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            if let Some(c) = cap.filter(|c| !(c.is_finite() && *c > 0.)) {
                bail!("{label}: field '{name}' must be finite and > 0 when set, found {c}")
            }
        }
        for (name, rope) in [
            ("full_attention", &self.rope_full),
            ("sliding_attention", &self.rope_sliding),
        ] {
            if !(rope.theta.is_finite() && rope.theta > 1.) {
                bail!(
                    "{label}: the {name} layers' rope_theta must be finite and > 1, found {}",
                    rope.theta
                )
            }
            if let Some(s) = &rope.scaling {
                s.validate().map_err(|e| {
                    candle::Error::Msg(format!("{label}: the {name} layers' rope scaling: {e}"))
                })?;
            }
        }
        Ok(())
    }

    /// The attention of layer `i`.
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        self.layer_types.get(i).copied().unwrap_or(LayerKind::Full)
    }

    /// The names the model of this config gives its tensors in a GGUF
    /// file (what the GGUF loader reads them by): Llama's attention and
    /// MLP, and Gemma's four norms. gguf-py's `gemma2` has no `output`
    /// (llama.cpp's Gemma 2 always projects with the embeddings).
    pub(crate) fn gguf_names(&self) -> GgufNames {
        GgufNames {
            top: GGUF_TOP
                .iter()
                .filter(|(_, g)| self.family != GemmaFamily::Gemma2 || *g != "output.weight")
                .copied()
                .collect(),
            layer: [&GGUF_LAYER[..], &GGUF_NORMS].concat(),
        }
    }

    /// The weights a model of this config asks for, counted from what
    /// [`Gemma::new`] asks for.
    #[deprecated(
        note = "a decoder's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    pub fn min_weights(&self) -> Result<MinWeights> {
        MinWeights::recorded("GemmaConfig", self.num_hidden_layers, |n, vb| {
            let cfg = GemmaConfig {
                num_hidden_layers: n,
                layer_types: self.layer_types.iter().copied().take(n).collect(),
                ..self.clone()
            };
            Gemma::new(&cfg, vb)
        })
    }
}

/// A Gemma block's four norms under HF's names beside the converter's:
/// `post_attention_layernorm` follows attention (`post_attention_norm`),
/// `pre_feedforward_layernorm` leads the MLP (`ffn_norm`).
const GGUF_NORMS: [NamePair; 4] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
];

/// A config object's fields, read with defaults and errors naming them.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    label: &'a str,
}

impl Fields<'_> {
    fn present(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        match self.present(name) {
            None => Ok(default),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
                None => bail!("{}: field '{name}' must be a whole number, found {v}", self.label),
            },
        }
    }

    /// A whole number, `null` (none) or absent (`default`).
    fn optional_usize(&self, name: &str, default: Option<usize>) -> Result<Option<usize>> {
        match self.obj.get(name) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(_) => self.usize_or(name, 0).map(Some),
        }
    }

    fn f64_or(&self, name: &str, default: f64) -> Result<f64> {
        match self.present(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| {
                candle::Error::Msg(format!(
                    "{}: field '{name}' must be a number, found {v}",
                    self.label
                ))
            }),
        }
    }

    /// A number, `null` (none) or absent (`default`).
    fn optional_f64(&self, name: &str, default: Option<f64>) -> Result<Option<f64>> {
        match self.obj.get(name) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(_) => self.f64_or(name, 0.).map(Some),
        }
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.present(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => bail!("{}: field '{name}' must be true or false, found {v}", self.label),
        }
    }

    fn string_or(&self, name: &str, default: &str) -> Result<String> {
        match self.present(name) {
            None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => bail!("{}: field '{name}' must be a string, found {v}", self.label),
        }
    }

    /// The rotary of the full and the sliding layers, from wherever this
    /// transformers version put them: `rope_parameters` (transformers 5;
    /// per layer kind for Gemma 3), or `rope_theta`, `rope_scaling` (the
    /// full layers') and `rope_local_base_freq` (the sliding layers',
    /// Gemma 3) at the top.
    fn ropes(&self, family: GemmaFamily) -> Result<(Rope, Rope)> {
        let label = self.label;
        let top_theta = self.f64_or(
            "rope_theta",
            match family {
                GemmaFamily::Gemma2 => 10_000.,
                GemmaFamily::Gemma3 => 1_000_000.,
            },
        )?;
        let top_scaling = match self.present("rope_scaling") {
            None => None,
            Some(p) => rope_from(p, top_theta, "rope_scaling", label)?.scaling,
        };
        let full = Rope {
            theta: top_theta,
            scaling: top_scaling,
        };
        match family {
            GemmaFamily::Gemma2 => match self.present("rope_parameters") {
                None => Ok((full.clone(), full)),
                Some(p) => {
                    let rope = rope_from(p, top_theta, "rope_parameters", label)?;
                    Ok((rope.clone(), rope))
                }
            },
            GemmaFamily::Gemma3 => {
                let local = Rope {
                    theta: self.f64_or("rope_local_base_freq", 10_000.)?,
                    scaling: None,
                };
                let Some(params) = self.present("rope_parameters") else {
                    return Ok((full, local));
                };
                let Some(params) = params.as_object() else {
                    bail!("{label}: field 'rope_parameters' must be an object, found {params}")
                };
                let kind = |name: &str, default: Rope| -> Result<Rope> {
                    match params.get(name).filter(|v| !v.is_null()) {
                        None => Ok(default),
                        Some(p) => rope_from(p, default.theta, &format!("rope_parameters.{name}"), label),
                    }
                };
                if params.contains_key("rope_type") || params.contains_key("rope_theta") {
                    bail!(
                        "{label}: field 'rope_parameters' must hold 'full_attention' and 'sliding_attention' for Gemma 3"
                    )
                }
                Ok((kind("full_attention", full)?, kind("sliding_attention", local)?))
            }
        }
    }
}

/// One rope parameter object (`rope_type` `default` or `linear`, its
/// `rope_theta` or `theta`), at `key` in the config.
fn rope_from(p: &Value, theta: f64, key: &str, label: &str) -> Result<Rope> {
    let Some(p) = p.as_object() else {
        bail!("{label}: field '{key}' must be an object, found {p}")
    };
    let number = |name: &str| -> Result<Option<f64>> {
        match p.get(name).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                candle::Error::Msg(format!(
                    "{label}: field '{key}.{name}' must be a number, found {v}"
                ))
            }),
        }
    };
    let kind = match ["rope_type", "type"]
        .into_iter()
        .find_map(|k| p.get(k).map(|v| (k, v)))
    {
        None | Some((_, Value::Null)) => "default",
        Some((_, Value::String(s))) => s.as_str(),
        Some((name, other)) => bail!("{label}: field '{key}.{name}' must be a string, found {other}"),
    };
    let scaling = match kind {
        "default" => None,
        "linear" => match number("factor")? {
            Some(factor) => Some(RopeScaling::Linear { factor }),
            None => bail!("{label}: field '{key}.factor' is missing"),
        },
        other => bail!(
            "{label}: {key}.rope_type '{}' is not supported for Gemma; only 'default' and 'linear'",
            other.escape_debug()
        ),
    };
    Ok(Rope {
        theta: number("rope_theta")?.unwrap_or(theta),
        scaling,
    })
}

/// `vb` under `prefix` (ending in a dot), or `vb` for none.
pub(super) fn at<'a>(vb: VarBuilder<'a>, prefix: &str) -> VarBuilder<'a> {
    match prefix.strip_suffix('.') {
        Some(p) if !p.is_empty() => vb.pp(p),
        _ => vb,
    }
}

/// `GemmaMLP`: `down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`, under
/// `vb` = `mlp`, its linears packed as `pack` asks.
fn mlp(cfg: &GemmaConfig, pack: &PackOptions, vb: VarBuilder) -> Result<GatedMlp> {
    let (e, i) = (cfg.hidden_size, cfg.intermediate_size);
    let gate = linear_b(e, i, false, vb.pp("gate_proj"))?;
    let up = linear_b(e, i, false, vb.pp("up_proj"))?;
    let down = PackedLinear::from_linear_with(linear_b(i, e, false, vb.pp("down_proj"))?, pack)?;
    GatedMlp::new(gate, up, down, Activation::GeGlu, pack)
}

/// `Gemma2Attention` / `Gemma3Attention` on [`MultiheadAttention`] for
/// layer `index`, under `vb` = `self_attn`, its projections packed as
/// `pack` asks.
fn mha(
    cfg: &GemmaConfig,
    index: usize,
    pack: &PackOptions,
    norm_offset: f64,
    vb: VarBuilder,
) -> Result<MultiheadAttention> {
    let kind = cfg.layer_kind(index);
    let rope = match kind {
        LayerKind::Sliding => &cfg.rope_sliding,
        LayerKind::Full => &cfg.rope_full,
    };
    let mut rotary = RotaryConfig::new(rope.theta);
    rotary.scaling = rope.scaling.clone();
    let mut mha = MhaConfig::new(cfg.hidden_size, cfg.num_attention_heads)
        .with_bias(cfg.attention_bias)
        .with_kv_heads(cfg.num_key_value_heads)
        .with_head_dim(cfg.head_dim)
        .with_position(PositionEncoding::Rotary(rotary))
        .with_scale(cfg.query_pre_attn_scalar.powf(-0.5));
    if let Some(cap) = cfg.attn_logit_softcapping {
        mha = mha.with_softcap(cap as f32);
    }
    if let (LayerKind::Sliding, Some(w)) = (kind, cfg.sliding_window) {
        mha = mha.with_sliding_window(w);
    }
    if cfg.family == GemmaFamily::Gemma3 {
        mha = mha.with_qk_norm(true);
        mha.qk_norm_kind = NormKind::RmsNorm;
        mha.qk_norm_eps = cfg.rms_norm_eps;
        mha.qk_norm_offset = norm_offset;
    }
    MultiheadAttention::new_with_pack(&mha, &WeightLayout::llama(), pack, vb)
}

/// `Gemma2DecoderLayer`: each branch normed before and after, then added
/// back.
#[derive(Debug, Clone)]
struct Layer {
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    self_attn: MultiheadAttention,
    mlp: GatedMlp,
}

impl Layer {
    fn new(
        cfg: &GemmaConfig,
        index: usize,
        pack: &PackOptions,
        norm_offset: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let norm = |name: &str| {
            RmsNorm::new_with_offset(cfg.hidden_size, cfg.rms_norm_eps, norm_offset, vb.pp(name))
        };
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            self_attn: mha(cfg, index, pack, norm_offset, vb.pp("self_attn"))?,
            mlp: mlp(cfg, pack, vb.pp("mlp"))?,
        })
    }

    /// `(B, T, E)` → `(B, T, E)`, appending to `cache`.
    fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let a = self
            .self_attn
            .forward_cached(&self.input_layernorm.forward(x)?, cache, &MhaOptions::new())?
            .output;
        let x = (x + self.post_attention_layernorm.forward(&a)?)?;
        let m = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&x)?)?;
        &x + self.post_feedforward_layernorm.forward(&m)?
    }
}

/// Gemma 2 or Gemma 3 (text) with its language-model head.
#[derive(Debug, Clone)]
pub struct Gemma {
    embed_tokens: TokenEmbedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: PackedLinear,
    cfg: GemmaConfig,
    device: Device,
    /// The dtype its caches store keys and values in (`None`: f32).
    kv_dtype: Option<DType>,
}

impl Gemma {
    /// Builds the model from `vb` rooted at a `Gemma2ForCausalLM` /
    /// `Gemma3ForCausalLM` checkpoint's top (`model.*`, a tied model's
    /// `lm_head.weight` ignored), its RMSNorm weights zero-centred as HF
    /// stores them (scaling by `1 + w`).
    pub fn new(cfg: &GemmaConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with(cfg, &PackOptions::default(), vb)
    }

    /// [`Gemma::new`], every linear layer packed as `pack` asks (the
    /// format, the instruction set, a GGUF file's lent blocks).
    pub fn new_with(cfg: &GemmaConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, pack, vb, 1.)
    }

    /// [`Gemma::new`] from a checkpoint whose RMSNorm weights already hold
    /// the `1 + w` they scale by (llama.cpp's converter adds the one).
    pub fn with_unit_norms(cfg: &GemmaConfig, vb: VarBuilder) -> Result<Self> {
        Self::with_unit_norms_with(cfg, &PackOptions::default(), vb)
    }

    /// [`Gemma::with_unit_norms`], every linear layer packed as `pack`
    /// asks.
    pub fn with_unit_norms_with(cfg: &GemmaConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, pack, vb, 0.)
    }

    /// The model, its RMSNorms scaling by `norm_offset + w` (HF's
    /// checkpoints: 1; llama.cpp's, which hold `1 + w`: 0), the sum taken
    /// once at load for plain weights and at each forward for variables.
    fn build(cfg: &GemmaConfig, pack: &PackOptions, vb: VarBuilder, norm_offset: f64) -> Result<Self> {
        let e = cfg.hidden_size;
        let m = vb.pp("model");
        let embed_tokens = candle_nn::embedding(cfg.vocab_size, e, m.pp("embed_tokens"))?;
        let head = (!cfg.tie_word_embeddings || vb.contains_tensor("lm_head.weight"))
            .then(|| vb.get((cfg.vocab_size, e), "lm_head.weight"))
            .transpose()?
            .filter(|_| !cfg.tie_word_embeddings);
        let (embed_tokens, lm_head) = TokenEmbedding::with_head(embed_tokens, head, pack)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, pack, norm_offset, m.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new_with_offset(e, cfg.rms_norm_eps, norm_offset, m.pp("norm"))?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            cfg: cfg.clone(),
            device: vb.device().clone(),
            kv_dtype: None,
        })
    }

    /// Builds the model from a checkpoint, after the pre-flight check: a
    /// `Gemma2ForCausalLM` / `Gemma3ForCausalLM` one, or the text of a
    /// multimodal `Gemma3ForConditionalGeneration` (see
    /// [`Gemma::text_checkpoint`]).
    pub fn load(cfg: &GemmaConfig, ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        let (ckpt, prefix) = Self::text_checkpoint(ckpt);
        let cfg = GemmaConfig {
            tie_word_embeddings: ties_in(
                cfg.tie_word_embeddings,
                &ckpt,
                &format!("{prefix}model.embed_tokens.weight"),
            ),
            ..cfg.clone()
        };
        // A config far larger than the file is refused as it is recorded,
        // before anything of its size is built.
        ckpt.load_bounded("GemmaConfig", DType::F32, device, |vb, pack| {
            Self::new_with(&cfg, pack, at(vb, prefix))
        })
    }

    /// The checkpoint of the text model and the prefix of its names: as
    /// it is, `""`; or, for a multimodal Gemma 3 (its text under
    /// `language_model.`, as `save_pretrained` and the hub's files store
    /// `Gemma3ForConditionalGeneration`), without its vision tower and
    /// projector, `"language_model."`.
    pub fn text_checkpoint(ckpt: &Checkpoint) -> (std::borrow::Cow<'_, Checkpoint>, &'static str) {
        match ckpt.info("language_model.model.embed_tokens.weight") {
            Some(_) => (
                std::borrow::Cow::Owned(
                    ckpt.clone()
                        .without_prefixes(&["vision_tower.", "multi_modal_projector."]),
                ),
                "language_model.",
            ),
            None => (std::borrow::Cow::Borrowed(ckpt), ""),
        }
    }

    /// The model, its caches storing keys and values in `dtype` (`None`:
    /// f32, as computed).
    pub fn with_kv_dtype(mut self, dtype: Option<DType>) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// The config.
    pub fn config(&self) -> &GemmaConfig {
        &self.cfg
    }

    /// The last layer's output for `ids` (checked, `b > 0`), `(B, T, E)`,
    /// appending them to `cache`.
    fn hidden(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        // `Gemma2TextScaledWordEmbedding`: the rows times √hidden_size.
        let scale = (self.cfg.hidden_size as f32).sqrt() as f64;
        let mut x = (self.embed_tokens.forward(ids, &self.lm_head)? * scale)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, cache.layer(i)?)?;
        }
        Ok(x)
    }

    /// The head over the final norm, soft-capped where the config says.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward(&self.norm.forward(hidden)?)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }
}

impl CausalLm for Gemma {
    fn forward(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Gemma")?;
        if b == 0 {
            return Tensor::zeros((0, t, self.cfg.vocab_size), DType::F32, &self.device);
        }
        self.logits(&self.hidden(ids, cache)?)
    }

    fn prefill(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<()> {
        let (b, _) = check_ids(ids, self.cfg.vocab_size, "Gemma")?;
        if b > 0 {
            self.hidden(ids, cache)?;
        }
        Ok(())
    }

    fn prefill_last(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Gemma")?;
        if b == 0 {
            return Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device);
        }
        let last = self.hidden(ids, cache)?.narrow(1, t - 1, 1)?.contiguous()?;
        self.logits(&last)?.squeeze(1)
    }

    fn new_cache(&self, left_padding: Vec<usize>) -> DecoderCache {
        DecoderCache::new(self.layers.len(), left_padding).with_kv_dtype(self.kv_dtype)
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

#[cfg(test)]
mod tests {
    use multihead_attention::RopeScaling;

    use super::super::HfDecoderConfig;
    use super::{GemmaConfig, GemmaFamily, GgufNames, LayerKind};

    fn parse(json: &str) -> candle::Result<GemmaConfig> {
        match HfDecoderConfig::from_json(json, "config.json")? {
            HfDecoderConfig::Gemma(c) => Ok(c),
            other => panic!("not a Gemma: {other:?}"),
        }
    }

    fn full_layers(c: &GemmaConfig) -> Vec<usize> {
        (0..c.num_hidden_layers)
            .filter(|&i| c.layer_kind(i) == LayerKind::Full)
            .collect()
    }

    /// The hub's configs, written by transformers 4 (no `layer_types`, no
    /// `rope_parameters`), read as transformers 5's `Gemma2Config` and
    /// `Gemma3TextConfig` read them (the values below are what those
    /// classes give for the same JSON).
    #[test]
    fn hub_configs_read_as_transformers_does() -> candle::Result<()> {
        // google/gemma-2-2b-it, its shaping fields.
        let c = parse(
            r#"{"model_type": "gemma2", "head_dim": 256, "hidden_size": 2304, "intermediate_size": 9216,
                "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
                "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256, "rope_theta": 10000.0, "sliding_window": 4096,
                "cache_implementation": "hybrid", "vocab_size": 256000}"#,
        )?;
        assert_eq!(c.family, GemmaFamily::Gemma2);
        assert_eq!(full_layers(&c)[..4], [1, 3, 5, 7]);
        assert_eq!(
            (c.attn_logit_softcapping, c.final_logit_softcapping),
            (Some(50.), Some(30.))
        );
        assert_eq!((c.rope_full.theta, c.rope_sliding.theta), (10_000., 10_000.));
        assert!(c.tie_word_embeddings);

        // google/gemma-3-1b-it.
        let c = parse(
            r#"{"model_type": "gemma3_text", "attn_logit_softcapping": null, "final_logit_softcapping": null,
                "head_dim": 256, "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
                "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
                "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
                "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}"#,
        )?;
        assert_eq!(full_layers(&c), [5, 11, 17, 23]);
        assert_eq!(
            (c.attn_logit_softcapping, c.final_logit_softcapping),
            (None, None)
        );
        assert_eq!((c.rope_full.theta, c.rope_sliding.theta), (1e6, 1e4));
        assert_eq!((c.rope_full.scaling, c.rope_sliding.scaling), (None, None));
        assert_eq!(c.sliding_window, Some(512));

        // google/gemma-3-4b-it: a multimodal config, its text_config
        // holding only what differs from Gemma3TextConfig's defaults.
        let c = parse(
            r#"{"model_type": "gemma3", "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                "model_type": "gemma3_text", "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                "vision_config": {"model_type": "siglip_vision_model"}}"#,
        )?;
        assert_eq!(full_layers(&c), [5, 11, 17, 23, 29]);
        assert_eq!(c.rope_full.scaling, Some(RopeScaling::Linear { factor: 8. }));
        assert_eq!(
            (c.rope_full.theta, c.rope_sliding.theta, c.rope_sliding.scaling),
            (1e6, 1e4, None)
        );
        assert_eq!(
            (
                c.num_attention_heads,
                c.num_key_value_heads,
                c.vocab_size,
                c.head_dim
            ),
            (8, 4, 262_208, 256)
        );
        assert_eq!(c.query_pre_attn_scalar, 256.);
        Ok(())
    }

    /// What the model does not implement is refused naming the field.
    #[test]
    fn unsupported_options_are_refused_by_name() {
        let base = r#""model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2"#;
        for (extra, field) in [
            (
                r#""use_bidirectional_attention": true"#,
                "use_bidirectional_attention",
            ),
            (r#""hidden_activation": "gelu""#, "hidden_activation"),
            (
                r#""layer_types": ["sliding_attention", "chunked_attention"]"#,
                "layer_types",
            ),
            (r#""layer_types": ["sliding_attention"]"#, "layer_types"),
            (
                r#""rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}}"#,
                "rope_parameters.full_attention",
            ),
            (r#""query_pre_attn_scalar": -1"#, "query_pre_attn_scalar"),
            (r#""sliding_window": 0"#, "sliding_window"),
            (r#""final_logit_softcapping": 0.0"#, "final_logit_softcapping"),
            (r#""sliding_window_pattern": 0"#, "sliding_window_pattern"),
        ] {
            let json = format!("{{{base}, {extra}}}");
            let err = parse(&json).expect_err(extra).to_string();
            assert!(
                err.contains("config.json") && err.contains(field),
                "{extra}: {err}"
            );
        }
        // A layer count far past any model's is an error before anything
        // is built per layer.
        let err = parse(r#"{"model_type": "gemma3_text", "num_hidden_layers": 1099511627776}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("field 'num_hidden_layers' must be in 1..="), "{err}");
        let err = parse(r#"{"model_type": "gemma3"}"#).unwrap_err().to_string();
        assert!(err.contains("text_config"), "{err}");
    }

    /// Gemma's norms by gguf-py's map; `gemma2` has no output projection,
    /// `gemma3` has.
    #[test]
    fn gemma_names_its_norms_and_its_head_by_family() -> candle::Result<()> {
        let names = |model_type: &str| -> candle::Result<GgufNames> {
            Ok(parse(&format!(
                r#"{{"model_type": "{model_type}", "num_hidden_layers": 2}}"#
            ))?
            .gguf_names())
        };
        let (gemma2, gemma3) = (names("gemma2")?, names("gemma3_text")?);
        for names in [&gemma2, &gemma3] {
            assert_eq!(
                names
                    .gguf_name("model.layers.3.post_attention_layernorm.weight")
                    .as_deref(),
                Some("blk.3.post_attention_norm.weight")
            );
            assert_eq!(
                names.hf_name("blk.3.ffn_norm.weight").as_deref(),
                Some("model.layers.3.pre_feedforward_layernorm.weight")
            );
        }
        assert_eq!(gemma2.hf_name("output.weight"), None);
        assert_eq!(gemma3.hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        Ok(())
    }
}
