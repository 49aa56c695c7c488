//! Llama (and Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2), as HF transformers'
//! `LlamaForCausalLM` (`transformers/models/llama/modeling_llama.py`), on
//! [`MultiheadAttention`] with grouped-query heads and rotary positions.
//! The relatives differ in a few options of [`LlamaConfig`]: biases, qk
//! norms (per head, or over all heads as in
//! `transformers/models/olmo2/modeling_olmo2.py`, whose norms also follow
//! each branch rather than lead it), layers without rotary.

use candle::{DType, Device, Module, Result, Tensor};
use candle_nn::{linear_b, RmsNorm, VarBuilder};
use multihead_attention::{
    KvCache, MhaConfig, MhaOptions, MultiheadAttention, NormKind, PackedLinear, PositionEncoding,
    RotaryConfig, WeightLayout,
};

use super::config::{ties_in, LlamaConfig, NormPlacement, QkNorm};
use super::{check_ids, CausalLm, DecoderCache, TokenEmbedding};
use crate::checkpoint::Checkpoint;
use crate::mlp::Mlp;

/// `LlamaMLP`: `down_proj(silu(gate_proj(x)) * up_proj(x))`, under `vb`
/// = `mlp`.
fn mlp(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Mlp> {
    let (e, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
    let gate = linear_b(e, i, bias, vb.pp("gate_proj"))?;
    let up = linear_b(e, i, bias, vb.pp("up_proj"))?;
    let down = PackedLinear::from_linear(linear_b(i, e, bias, vb.pp("down_proj"))?)?;
    Mlp::swiglu(gate, up, down)
}

/// A block's RMSNorms, by where they sit ([`NormPlacement`]).
#[derive(Debug, Clone)]
enum Norms {
    /// Llama: `x + attn(input_layernorm(x))`, then `x + mlp(post_attention_layernorm(x))`.
    Pre {
        input_layernorm: RmsNorm,
        post_attention_layernorm: RmsNorm,
    },
    /// OLMo 2 (`Olmo2DecoderLayer`): `x + post_attention_layernorm(attn(x))`,
    /// then `x + post_feedforward_layernorm(mlp(x))`.
    Post {
        post_attention_layernorm: RmsNorm,
        post_feedforward_layernorm: RmsNorm,
    },
}

/// `LlamaDecoderLayer`: attention and MLP, each normed and added back.
#[derive(Debug, Clone)]
struct Layer {
    norms: Norms,
    self_attn: MultiheadAttention,
    mlp: Mlp,
}

impl Layer {
    /// Layer `index` of the model `cfg` describes.
    fn new(cfg: &LlamaConfig, index: usize, vb: VarBuilder) -> Result<Self> {
        let e = cfg.hidden_size;
        let norm = |name: &str| candle_nn::rms_norm(e, cfg.rms_norm_eps, vb.pp(name));
        let norms = match cfg.norm_placement {
            NormPlacement::Pre => Norms::Pre {
                input_layernorm: norm("input_layernorm")?,
                post_attention_layernorm: norm("post_attention_layernorm")?,
            },
            NormPlacement::Post => Norms::Post {
                post_attention_layernorm: norm("post_attention_layernorm")?,
                post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            },
        };
        Ok(Self {
            norms,
            self_attn: mha(cfg, index, vb.pp("self_attn"))?,
            mlp: mlp(cfg, vb.pp("mlp"))?,
        })
    }

    /// `(B, T, E)` → `(B, T, E)`, appending to `cache`.
    fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        match &self.norms {
            Norms::Pre {
                input_layernorm,
                post_attention_layernorm,
            } => {
                // Each residual add is fused into its branch's output projection.
                let opts = MhaOptions::new().with_residual(x.clone());
                let x = self
                    .self_attn
                    .forward_cached(&input_layernorm.forward(x)?, cache, &opts)?
                    .output;
                self.mlp.forward_add(&post_attention_layernorm.forward(&x)?, &x)
            }
            Norms::Post {
                post_attention_layernorm,
                post_feedforward_layernorm,
            } => {
                let a = self
                    .self_attn
                    .forward_cached(x, cache, &MhaOptions::new())?
                    .output;
                let x = (x + post_attention_layernorm.forward(&a)?)?;
                &x + post_feedforward_layernorm.forward(&self.mlp.forward(&x)?)?
            }
        }
    }
}

/// `LlamaAttention` on [`MultiheadAttention`] for layer `index`, under
/// `vb` = `self_attn`.
fn mha(cfg: &LlamaConfig, index: usize, vb: VarBuilder) -> Result<MultiheadAttention> {
    let mut rotary = RotaryConfig::new(cfg.theta());
    rotary.scaling = cfg.rope_scaling;
    // SmolLM3's layers without rotary see positions only through the
    // causal mask.
    let position = if cfg.rotary_at(index) {
        PositionEncoding::Rotary(rotary)
    } else {
        PositionEncoding::None
    };
    let mut mha = MhaConfig::new(cfg.hidden_size, cfg.num_attention_heads)
        .with_bias(cfg.attention_bias)
        .with_kv_heads(cfg.kv_heads())
        .with_position(position);
    if cfg.qkv_bias {
        mha.qkv_bias = Some(true);
    }
    if let Some(hd) = cfg.head_dim {
        mha = mha.with_head_dim(hd);
    }
    let qk_norm = match cfg.qk_norm {
        QkNorm::None => None,
        QkNorm::PerHead => Some(NormKind::RmsNorm),
        QkNorm::AllHeads => Some(NormKind::RmsNormAllHeads),
    };
    if let Some(kind) = qk_norm {
        mha = mha.with_qk_norm(true);
        mha.qk_norm_kind = kind;
        mha.qk_norm_eps = cfg.rms_norm_eps;
    }
    if let Some(w) = cfg.sliding_window {
        mha = mha.with_sliding_window(w);
    }
    MultiheadAttention::new_with_layout(&mha, &WeightLayout::llama(), vb)
}

/// Llama with its language-model head.
#[derive(Debug, Clone)]
pub struct Llama {
    embed_tokens: TokenEmbedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: PackedLinear,
    cfg: LlamaConfig,
    device: Device,
    /// The dtype its caches store keys and values in (`None`: f32).
    kv_dtype: Option<DType>,
}

impl Llama {
    /// Builds the model from `vb` rooted at a `LlamaForCausalLM`
    /// checkpoint's top (`model.*`, `lm_head.weight`). A tied model
    /// (`tie_word_embeddings`) whose `vb` also holds `lm_head.weight` takes
    /// it as a copy of the embedding and ignores it; [`Llama::load`] unties
    /// a model whose file holds a different one, as HF transformers does.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let e = cfg.hidden_size;
        let m = vb.pp("model");
        // The embedding and the head first: a tied table is packed and its
        // unpacked copy dropped before the layers take their memory.
        let embed_tokens = candle_nn::embedding(cfg.vocab_size, e, m.pp("embed_tokens"))?;
        // A tied copy is asked for too, so that the pre-flight counts it as
        // used and checks its shape; it is read once and dropped.
        let head = (!cfg.tie_word_embeddings || vb.contains_tensor("lm_head.weight"))
            .then(|| vb.get((cfg.vocab_size, e), "lm_head.weight"))
            .transpose()?
            .filter(|_| !cfg.tie_word_embeddings);
        let (embed_tokens, lm_head) = TokenEmbedding::with_head(embed_tokens, head)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, m.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = candle_nn::rms_norm(e, cfg.rms_norm_eps, m.pp("norm"))?;
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

    /// Builds the model from a checkpoint, after the pre-flight check.
    pub fn load(cfg: &LlamaConfig, ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        // A config far larger than the file is refused before anything of
        // its size is built.
        ckpt.ensure_holds(&cfg.min_weights()?)?;
        let cfg = LlamaConfig {
            tie_word_embeddings: ties_in(cfg.tie_word_embeddings, ckpt, "model.embed_tokens.weight"),
            ..cfg.clone()
        };
        ckpt.load(DType::F32, device, |vb| Self::new(&cfg, vb))
    }

    /// The model, its caches storing keys and values in `dtype` (`None`:
    /// f32, as computed): a bf16 or f16 cache takes half the memory, and
    /// the CPU attention reads it in place.
    pub fn with_kv_dtype(mut self, dtype: Option<DType>) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The last layer's output for `ids` (checked, `b > 0`), `(B, T, E)`,
    /// appending them to `cache`.
    fn hidden(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let mut x = self.embed_tokens.forward(ids, &self.lm_head)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, cache.layer(i)?)?;
        }
        Ok(x)
    }
}

impl CausalLm for Llama {
    fn forward(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Llama")?;
        if b == 0 {
            return Tensor::zeros((0, t, self.cfg.vocab_size), DType::F32, &self.device);
        }
        // (B, T, V)
        self.lm_head
            .forward(&self.norm.forward(&self.hidden(ids, cache)?)?)
    }

    fn prefill(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<()> {
        let (b, _) = check_ids(ids, self.cfg.vocab_size, "Llama")?;
        if b > 0 {
            self.hidden(ids, cache)?;
        }
        Ok(())
    }

    fn prefill_last(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Llama")?;
        if b == 0 {
            return Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device);
        }
        let last = self.hidden(ids, cache)?.narrow(1, t - 1, 1)?.contiguous()?;
        self.lm_head.forward(&self.norm.forward(&last)?)?.squeeze(1)
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
