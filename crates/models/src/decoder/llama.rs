//! Llama (and Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3), as HF
//! transformers' `LlamaForCausalLM`
//! (`transformers/models/llama/modeling_llama.py`), on
//! [`MultiheadAttention`] with grouped-query heads and rotary positions.
//! The relatives differ in a few options of [`LlamaConfig`]: biases, qk
//! norms (per head, or over all heads as in
//! `transformers/models/olmo2/modeling_olmo2.py`, whose norms also follow
//! each branch rather than lead it), layers without rotary, fused
//! projections, partial rotary and LongRoPE
//! (`transformers/models/phi3/modeling_phi3.py`).
//!
//! One forward pass, token ids to logits, reads in five files: this one
//! (the token table, each layer's norms, attention call and gated MLP, the
//! final norm and the head), then the attention crate's `mha/steps.rs`
//! (`MultiheadAttention::forward_cached`: fused qkv → qk-norm and rotary →
//! cache append → sdpa → o_proj), `rotary.rs` (the rotation), `cache.rs`
//! (the keys and values kept) and `sdpa.rs` (the attention, on the CPU the
//! tiled kernel of `multihead_kernels::attention`).

use candle::{bail, DType, Device, Module, Result, Tensor, D};
use candle_nn::{linear_b, Linear, VarBuilder};
use multihead_attention::{
    gelu_tanh_mul, is_broadcast, silu_mul, KvCache, MhaConfig, MhaOptions, MultiheadAttention, NormKind,
    PackFormat, PackOptions, PackedLinear, PositionEncoding, RmsNorm, RotaryConfig, WeightLayout,
};

use super::config::{ties_in, LlamaConfig, NormPlacement, Projections, QkNorm};
use super::{CausalLm, DecoderCache};
use crate::formats::gguf::{GgufNames, NamePair};
use crate::formats::safetensors::{Checkpoint, MinWeights};
use crate::mlp::{check_widths, Activation};

/// Rows an inference call runs through a [`GatedMlp`] at a time: `(float
/// weights, quantized weights)`. Its hidden activations
/// (`[gate | up]` and their product: three times the hidden width a row)
/// are a prefill's largest buffers; in blocks of rows they take a few MB
/// whatever the prompt's length, as llama.cpp's micro-batches bound them,
/// where a 4096-token prompt's would take hundreds. Each block streams the
/// weights again: the packed float tiles reuse a panel over up to 96 rows
/// and take the longer blocks; the quantized kernels reuse unpacked
/// blocks over 8, and their blocks' activations stay in the caches.
const MLP_ROWS: (usize, usize) = (256, 128);

/// Llama's MLP (`LlamaMLP`), `down(silu(gate(x)) * up(x))` (SwiGLU;
/// Gemma's is the same with the tanh GELU, GeGLU; `Phi3MLP` stores gate
/// and up as one `gate_up_proj`, the gate's rows first): gate and up
/// projected at once to `[gate | up]` where their weights can be joined,
/// the residual add fused into `down`'s write-out.
#[derive(Debug, Clone)]
pub(crate) struct GatedMlp {
    /// `(2 * hidden, in)`, the gate's rows first; `(hidden, in)` where
    /// `gate` is kept apart.
    up: PackedLinear,
    /// The gate where gate and up cannot be one projection (see
    /// [`GatedMlp::new`]).
    gate: Option<PackedLinear>,
    /// `(out, hidden)`.
    down: PackedLinear,
    activation: Activation,
}

impl GatedMlp {
    /// `residual + down(act(gate(x)) * up(x))`.
    ///
    /// # Shapes
    /// - `xs`: `(..., in)`, `residual`: `(..., out)`
    /// - returns `(..., out)`
    pub(crate) fn forward_add(&self, xs: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.by_rows(xs, Some(residual))
    }

    /// `down(act(gate(x)) * up(x))`.
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.by_rows(xs, None)
    }

    /// The MLP (plus `residual`) over `xs`, in blocks of at most
    /// [`MLP_ROWS`] rows where the call does not track gradients (a
    /// block's narrows and the join would be nodes of the graph).
    fn by_rows(&self, xs: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let block = |x: &Tensor, residual: Option<&Tensor>| match residual {
            Some(r) => self.down.forward_add(&self.hidden(x)?, r),
            None => self.down.forward(&self.hidden(x)?),
        };
        let width = xs.dim(D::Minus1)?;
        let rows = xs.elem_count() / width.max(1);
        let mlp_rows = self.block_rows();
        if xs.track_op() || residual.is_some_and(Tensor::track_op) || rows <= mlp_rows {
            return block(xs, residual);
        }
        let x = xs.reshape((rows, width))?;
        let residual = residual.map(|r| r.reshape((rows, ()))).transpose()?;
        // Blocks of equal length, not a short last one.
        let len = rows.div_ceil(rows.div_ceil(mlp_rows));
        let parts = (0..rows)
            .step_by(len)
            .map(|r0| {
                let n = len.min(rows - r0);
                let r = residual.as_ref().map(|r| r.narrow(0, r0, n)).transpose()?;
                block(&x.narrow(0, r0, n)?, r.as_ref())
            })
            .collect::<Result<Vec<_>>>()?;
        let out = Tensor::cat(&parts, 0)?;
        let mut dims = xs.dims().to_vec();
        *dims.last_mut().expect("xs has a last dimension") = out.dim(1)?;
        out.reshape(dims)
    }

    /// The rows of an inference call's block ([`MLP_ROWS`] for its
    /// weights).
    fn block_rows(&self) -> usize {
        match self.down.is_quantized() {
            false => MLP_ROWS.0,
            true => MLP_ROWS.1,
        }
    }

    /// `act(gate(x)) * up(x)`: `(..., hidden)`.
    fn hidden(&self, xs: &Tensor) -> Result<Tensor> {
        match (&self.gate, self.activation) {
            // One projection to `[gate | up]`, then the gated activation
            // over its halves.
            (None, act) => act.apply(&self.up.forward(xs)?),
            // Kept apart (variables): one op each way over both.
            (Some(gate), Activation::GeGlu) => gelu_tanh_mul(&gate.forward(xs)?, &self.up.forward(xs)?),
            (Some(gate), _) => silu_mul(&gate.forward(xs)?, &self.up.forward(xs)?),
        }
    }

    /// The gated MLP over one projection `gate_up` to `[gate | up]`
    /// (Phi-3's `gate_up_proj`).
    pub(crate) fn fused(gate_up: PackedLinear, down: PackedLinear, activation: Activation) -> Result<Self> {
        if !activation.is_gated() {
            bail!("Mlp::gated: {activation:?} is not a gated activation")
        }
        check_widths(&gate_up, &down, activation)?;
        Ok(Self {
            up: gate_up,
            gate: None,
            down,
            activation,
        })
    }

    /// The gated MLP from the two linears a checkpoint stores, packed as
    /// `pack` asks: joined into one projection where both are plain
    /// tensors (or a GGUF file's blocks in one format); kept apart where
    /// they are variables, which a joined copy would leave behind as they
    /// train, or the pre-flight's broadcast placeholders (a full-size copy
    /// for nothing).
    pub(crate) fn new(
        gate: Linear,
        up: Linear,
        down: PackedLinear,
        activation: Activation,
        pack: &PackOptions,
    ) -> Result<Self> {
        if !activation.is_gated() {
            bail!("Mlp::gated: {activation:?} is not a gated activation")
        }
        let apart = |gate: PackedLinear, up: PackedLinear, down: PackedLinear| -> Result<Self> {
            // Checked as an ungated MLP: up's width is down's input.
            check_widths(&up, &down, Activation::Silu)?;
            Ok(Self {
                up,
                gate: Some(gate),
                down,
                activation,
            })
        };
        let plain = |l: &Linear| {
            !l.weight().is_variable()
                && !is_broadcast(l.weight())
                && l.bias().is_none_or(|b| !b.is_variable())
        };
        // A GGUF file's blocks, lent to the layers (`LentBlocks`): joined
        // where both are in one format, kept apart otherwise.
        if pack.is_lent(gate.weight()) && pack.is_lent(up.weight()) {
            let (gate, up) = (
                PackedLinear::from_linear_with(gate, pack)?,
                PackedLinear::from_linear_with(up, pack)?,
            );
            if gate.joins_with(&up) {
                return Self::fused(PackedLinear::cat_with(vec![gate, up], pack)?, down, activation);
            }
            return apart(gate, up, down);
        }
        if !(plain(&gate) && plain(&up)) {
            let gate = PackedLinear::from_linear_with(gate, pack)?;
            return apart(gate, PackedLinear::from_linear_with(up, pack)?, down);
        }
        if gate.bias().is_some() != up.bias().is_some() {
            bail!("Mlp: the gate and up projections must both have a bias or neither")
        }
        let gate_up = if pack.format() != PackFormat::AsStored {
            // Each quantized, its tensors dropped, before the two are
            // joined: no copy of the fused weight in f32 (3.8 times its
            // Q8_0 size) beside them while a model loads. As stored, one
            // fused tensor packed at once leaves the heap less fragmented
            // than two parts and their join.
            let gate = PackedLinear::from_linear_with(gate, pack)?;
            PackedLinear::cat_with(vec![gate, PackedLinear::from_linear_with(up, pack)?], pack)?
        } else {
            let bias = match (gate.bias(), up.bias()) {
                (Some(g), Some(u)) => Some(Tensor::cat(&[g, u], 0)?),
                _ => None,
            };
            PackedLinear::with_options(Tensor::cat(&[gate.weight(), up.weight()], 0)?, bias, pack)?
        };
        Self::fused(gate_up, down, activation)
    }

    /// The activation.
    pub(crate) fn activation(&self) -> Activation {
        self.activation
    }

    /// Whether gate and up are two projections.
    #[cfg(test)]
    pub(crate) fn gate_apart(&self) -> bool {
        self.gate.is_some()
    }

    /// The same MLP with its outputs scaled per channel by `gamma`, folded
    /// into `down`'s weights, where they can be.
    pub(crate) fn with_output_scale(&self, gamma: &Tensor) -> Result<Option<Self>> {
        Ok(self
            .down
            .scaled_outputs(gamma)?
            .map(|down| Self { down, ..self.clone() }))
    }
}

fn mlp(cfg: &LlamaConfig, pack: &PackOptions, vb: VarBuilder) -> Result<GatedMlp> {
    let (e, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
    let down = PackedLinear::from_linear_with(linear_b(i, e, bias, vb.pp("down_proj"))?, pack)?;
    match cfg.projections {
        Projections::Separate => {
            let gate = linear_b(e, i, bias, vb.pp("gate_proj"))?;
            let up = linear_b(e, i, bias, vb.pp("up_proj"))?;
            GatedMlp::new(gate, up, down, Activation::SwiGlu, pack)
        }
        Projections::Fused => {
            let gate_up = linear_b(e, 2 * i, bias, vb.pp("gate_up_proj"))?;
            GatedMlp::fused(
                PackedLinear::from_linear_with(gate_up, pack)?,
                down,
                Activation::SwiGlu,
            )
        }
    }
}

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
    mlp: GatedMlp,
}

impl Layer {
    /// Layer `index` of the model `cfg` describes, its linears packed as
    /// `pack` asks.
    fn new(cfg: &LlamaConfig, index: usize, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        let e = cfg.hidden_size;
        let norm = |name: &str| RmsNorm::new(e, cfg.rms_norm_eps, vb.pp(name));
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
            self_attn: mha(cfg, index, pack, vb.pp("self_attn"))?,
            mlp: mlp(cfg, pack, vb.pp("mlp"))?,
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
/// `vb` = `self_attn`, its projections packed as `pack` asks.
fn mha(cfg: &LlamaConfig, index: usize, pack: &PackOptions, vb: VarBuilder) -> Result<MultiheadAttention> {
    let mut rotary = RotaryConfig::new(cfg.theta());
    rotary.scaling = cfg.rope_scaling.clone();
    rotary.dims = cfg.rotary_dims;
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
    let layout = match cfg.projections {
        Projections::Separate => WeightLayout::llama(),
        // `Phi3Attention.qkv_proj`: q's rows, then k's, then v's.
        Projections::Fused => WeightLayout::FusedQkv {
            qkv: "qkv_proj".into(),
            proj: "o_proj".into(),
        },
    };
    MultiheadAttention::new_with_pack(&mha, &layout, pack, vb)
}

/// Llama with its language-model head.
/// A decoder's token embedding: its own table, or the rows of the output
/// projection it is tied to (`tie_word_embeddings`), so that a tied model
/// holds the table once, packed for the projection.
#[derive(Debug, Clone)]
pub(crate) enum TokenEmbedding {
    Own(candle_nn::Embedding),
    /// A table in a ggml block format (a GGUF file's, lent to the layer:
    /// `multihead_attention::LentBlocks`), its rows dequantized as they
    /// are looked up.
    Blocks(PackedLinear),
    TiedToHead,
}

impl TokenEmbedding {
    /// `embedding` as the table of a model whose output projection is
    /// `head` when `tied`, the projection (and a table lent as blocks)
    /// packed as `pack` asks: returns the embedding and the projection.
    pub(crate) fn with_head(
        embedding: candle_nn::Embedding,
        head: Option<Tensor>,
        pack: &PackOptions,
    ) -> Result<(Self, PackedLinear)> {
        let own = |embedding: candle_nn::Embedding| -> Result<Self> {
            Ok(match pack.is_lent(embedding.embeddings()) {
                true => Self::Blocks(PackedLinear::with_options(
                    embedding.embeddings().clone(),
                    None,
                    pack,
                )?),
                false => Self::Own(embedding),
            })
        };
        Ok(match head {
            Some(head) => (own(embedding)?, PackedLinear::with_options(head, None, pack)?),
            None => (
                Self::TiedToHead,
                PackedLinear::with_options(embedding.embeddings().clone(), None, pack)?,
            ),
        })
    }

    /// `(B, T)` ids to `(B, T, E)` f32 (a half-precision table's rows
    /// widened).
    pub(crate) fn forward(&self, ids: &Tensor, head: &PackedLinear) -> Result<Tensor> {
        match self {
            Self::Own(e) => candle::Module::forward(e, ids)?.to_dtype(DType::F32),
            Self::Blocks(table) => table.embed(ids),
            Self::TiedToHead => head.embed(ids)?.to_dtype(DType::F32),
        }
    }
}

/// Checks `(batch, new)` `u32` ids against the vocabulary.
pub(crate) fn check_ids(ids: &Tensor, vocab_size: usize, what: &str) -> Result<(usize, usize)> {
    let (b, t) = match ids.dims() {
        &[b, t] if t > 0 => (b, t),
        dims => bail!("{what}: ids must be (batch, new) with new > 0, found {dims:?}"),
    };
    if ids.dtype() != candle::DType::U32 {
        bail!("{what}: ids must be u32, found {:?}", ids.dtype())
    }
    if b == 0 {
        return Ok((b, t));
    }
    let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
    if max as usize >= vocab_size {
        bail!("{what}: token id {max} is out of the vocabulary ({vocab_size} tokens)")
    }
    Ok((b, t))
}

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
        Self::new_with(cfg, &PackOptions::default(), vb)
    }

    /// [`Llama::new`], every linear layer packed as `pack` asks (the
    /// format, the instruction set, a GGUF file's lent blocks).
    pub fn new_with(cfg: &LlamaConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
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
        let (embed_tokens, lm_head) = TokenEmbedding::with_head(embed_tokens, head, pack)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, pack, m.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(e, cfg.rms_norm_eps, m.pp("norm"))?;
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
        let cfg = LlamaConfig {
            tie_word_embeddings: ties_in(cfg.tie_word_embeddings, ckpt, "model.embed_tokens.weight"),
            ..cfg.clone()
        };
        // A config far larger than the file is refused as it is recorded,
        // before anything of its size is built.
        ckpt.load_bounded("LlamaConfig", DType::F32, device, |vb, pack| {
            Self::new_with(&cfg, pack, vb)
        })
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
        self.check_rope_regime(ids.dim(1)?, cache)?;
        let mut x = self.embed_tokens.forward(ids, &self.lm_head)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, cache.layer(i)?)?;
        }
        Ok(x)
    }
}

impl Llama {
    /// Where the rotary frequencies depend on how far a call reaches
    /// (LongRoPE), refuses a call whose `new` positions would be rotated
    /// with other frequencies than those `cache` holds, and marks the
    /// cache with the call's.
    ///
    /// HF picks the set per forward call from `max(position_ids) + 1`;
    /// when cached generation first passes
    /// `original_max_position_embeddings`,
    /// `Phi3ForCausalLM.prepare_inputs_for_generation` drops the cache and
    /// recomputes the whole sequence with `long_factor`. This crate does
    /// not keep the tokens to recompute, so such a call is an error rather
    /// than a silent mix of the two sets: a prompt longer than the
    /// original context runs with `long_factor` throughout, as in HF.
    fn check_rope_regime(&self, new: usize, cache: &mut DecoderCache) -> Result<()> {
        let Some(after) = self.cfg.rope_scaling.as_ref().and_then(|s| s.switch_after()) else {
            return Ok(());
        };
        let reach = cache.reach(new);
        let long = reach > after;
        if !cache.is_empty() && cache.long_rope() != long {
            let (held, now) = match long {
                true => ("short_factor", "long_factor"),
                false => ("long_factor", "short_factor"),
            };
            bail!(
                "Llama: this call reaches position {reach}, {} original_max_position_embeddings ({after}), so LongRoPE \
                 would rotate it with {now}, but the {} positions the cache holds were rotated with {held}. HF \
                 transformers recomputes the whole sequence with the new factors here \
                 (Phi3ForCausalLM.prepare_inputs_for_generation), which this crate does not: feed the whole sequence \
                 again as one prompt on a new cache",
                if long { "past" } else { "within" },
                cache.len()
            )
        }
        cache.set_long_rope(long);
        Ok(())
    }
}

/// One layer's attention and MLP under HF's names (after
/// `model.layers.N.`) beside those llama.cpp's `convert_hf_to_gguf.py`
/// writes (after `blk.N.`), as gguf-py's `tensor_mapping.py` pairs them;
/// Gemma's layers share them.
pub(super) const GGUF_LAYER: [NamePair; 16] = [
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.gate_proj.bias", "ffn_gate.bias"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.up_proj.bias", "ffn_up.bias"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("mlp.down_proj.bias", "ffn_down.bias"),
];

/// Phi-3's fused projections ([`Projections::Fused`]), ahead of
/// [`GGUF_LAYER`]: the converter's `ffn_up` holds the gate's rows, then
/// the up rows.
const GGUF_FUSED: [NamePair; 2] = [
    ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("mlp.gate_up_proj.weight", "ffn_up.weight"),
];

/// The block's norms, by where they sit ([`NormPlacement`]): HF's
/// `post_attention_layernorm` is the norm before the MLP in Llama
/// (`ffn_norm`) and the one after attention in OLMo 2
/// (`post_attention_norm`).
const GGUF_NORMS_PRE: [NamePair; 2] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
];
const GGUF_NORMS_POST: [NamePair; 2] = [
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
];

/// The tensors outside the layers, HF's names beside the converter's.
pub(super) const GGUF_TOP: [NamePair; 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

impl LlamaConfig {
    /// The names the model of this config gives its tensors in a GGUF
    /// file (what the GGUF loader reads them by): its projections and
    /// its norms' placement decide them.
    pub(crate) fn gguf_names(&self) -> GgufNames {
        let fused: &[NamePair] = match self.projections {
            Projections::Fused => &GGUF_FUSED,
            Projections::Separate => &[],
        };
        let norms = match self.norm_placement {
            NormPlacement::Pre => &GGUF_NORMS_PRE,
            NormPlacement::Post => &GGUF_NORMS_POST,
        };
        GgufNames {
            top: GGUF_TOP.to_vec(),
            layer: [fused, &GGUF_LAYER, norms].concat(),
        }
    }

    /// The weights a model of this config asks for, counted from what
    /// [`Llama::new`] asks for.
    #[deprecated(
        note = "a decoder's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    pub fn min_weights(&self) -> Result<MinWeights> {
        MinWeights::recorded("LlamaConfig", self.num_hidden_layers, |n, vb| {
            let cfg = LlamaConfig {
                num_hidden_layers: n,
                ..self.clone()
            };
            Llama::new(&cfg, vb)
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::families::{family_config, recorded, FAMILIES};
    use crate::decoder::HfDecoderConfig;

    const SIZES: &str = r#""vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2"#;

    /// A prompt longer than a block of rows runs through the MLP in
    /// blocks, each row's output (and the residual's add) equal to the
    /// whole call's bit for bit, in f32 and in Q8_0; a call that tracks
    /// gradients backpropagates to its input.
    #[test]
    fn the_mlp_in_blocks_of_rows_equals_it_whole() -> Result<()> {
        use multihead_attention::PackFormat;
        let dev = Device::Cpu;
        let (d, hidden) = (64, 96);
        let linear = |o: usize, i: usize| {
            Ok::<_, candle::Error>(Linear::new(Tensor::randn(0f32, 0.1, (o, i), &dev)?, None))
        };
        for format in [PackFormat::AsStored, PackFormat::Q8_0] {
            let pack = PackOptions::new().with_format(format);
            let mlp = GatedMlp::new(
                linear(hidden, d)?,
                linear(hidden, d)?,
                PackedLinear::from_linear_with(linear(d, hidden)?, &pack)?,
                Activation::SwiGlu,
                &pack,
            )?;
            let rows = mlp.block_rows();
            let x = Tensor::randn(0f32, 1., (2, rows + 3, d), &dev)?;
            let residual = Tensor::randn(0f32, 1., (2, rows + 3, d), &dev)?;
            let whole = mlp.down.forward_add(&mlp.hidden(&x)?, &residual)?;
            let blocks = mlp.forward_add(&x, &residual)?;
            assert_eq!(blocks.dims(), whole.dims(), "{format:?}");
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            assert_eq!(flat(&blocks)?, flat(&whole)?, "{format:?}");
            assert_eq!(
                flat(&mlp.forward(&x)?)?,
                flat(&mlp.down.forward(&mlp.hidden(&x)?)?)?,
                "{format:?}"
            );
        }
        let var = |o: usize, i: usize| -> Result<Linear> {
            Ok(Linear::new(
                candle::Var::randn(0f32, 0.1, (o, i), &dev)?.as_tensor().clone(),
                None,
            ))
        };
        let mlp = GatedMlp::new(
            var(hidden, d)?,
            var(hidden, d)?,
            PackedLinear::from_linear(var(d, hidden)?)?,
            Activation::SwiGlu,
            &PackOptions::new(),
        )?;
        let x = candle::Var::randn(0f32, 1., (1, MLP_ROWS.0 + 3, d), &dev)?;
        let grads = mlp.forward(x.as_tensor())?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some());
        Ok(())
    }

    /// Every tensor each family's constructor asks for has a GGUF name in
    /// its table, which maps back to it: the table and the constructor
    /// describe the same tensors. (A Gemma 2 file has no output
    /// projection: its model is always tied.)
    #[test]
    fn the_gguf_table_names_every_tensor_the_constructor_asks_for() -> Result<()> {
        for (family, options) in FAMILIES {
            for tied in [true, false].into_iter().filter(|&t| t || family != "gemma2") {
                let sizes = format!(r#"{SIZES}, "tie_word_embeddings": {tied}"#);
                let cfg = family_config(options, &sizes)?;
                let names = match &cfg {
                    HfDecoderConfig::Llama(c) => c.gguf_names(),
                    HfDecoderConfig::Gemma(c) => c.gguf_names(),
                    HfDecoderConfig::Gpt2(_) => unreachable!("not a family"),
                };
                for w in recorded(&cfg, &[])? {
                    let g = names.gguf_name(&w.name);
                    assert!(g.is_some(), "{family} {options}: {} has no GGUF name", w.name);
                    let back = g.as_deref().and_then(|g| names.hf_name(g));
                    assert_eq!(back.as_deref(), Some(w.name.as_str()), "{family} {options}");
                }
            }
        }
        Ok(())
    }

    /// The names that depend on the model: the norms' by their placement
    /// (gguf-py's map for `olmo2` against `llama`'s), Phi-3's fused
    /// projections.
    #[test]
    fn norms_and_fused_projections_are_named_by_the_config() -> Result<()> {
        let names = |model_type: &str| -> Result<GgufNames> {
            match family_config(&format!(r#""model_type": "{model_type}""#), SIZES)? {
                HfDecoderConfig::Llama(c) => Ok(c.gguf_names()),
                other => candle::bail!("not a Llama: {other:?}"),
            }
        };
        let (llama, olmo2, phi3) = (names("llama")?, names("olmo2")?, names("phi3")?);
        let post = "model.layers.3.post_attention_layernorm.weight";
        assert_eq!(llama.gguf_name(post).as_deref(), Some("blk.3.ffn_norm.weight"));
        assert_eq!(
            olmo2.gguf_name(post).as_deref(),
            Some("blk.3.post_attention_norm.weight")
        );
        assert_eq!(
            olmo2.hf_name("blk.3.post_ffw_norm.weight").as_deref(),
            Some("model.layers.3.post_feedforward_layernorm.weight")
        );
        assert_eq!(olmo2.hf_name("blk.3.ffn_norm.weight"), None);
        assert_eq!(olmo2.hf_name("blk.3.attn_norm.weight"), None);
        assert_eq!(llama.hf_name("blk.3.post_ffw_norm.weight"), None);
        assert_eq!(llama.hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        // Phi-3's `ffn_up` is the gate and up in one.
        for (hf, g) in [
            (
                "model.layers.1.self_attn.qkv_proj.weight",
                "blk.1.attn_qkv.weight",
            ),
            ("model.layers.0.mlp.gate_up_proj.weight", "blk.0.ffn_up.weight"),
        ] {
            assert_eq!(phi3.gguf_name(hf).as_deref(), Some(g));
            assert_eq!(phi3.hf_name(g).as_deref(), Some(hf));
        }
        assert_eq!(
            llama.hf_name("blk.0.ffn_up.weight").as_deref(),
            Some("model.layers.0.mlp.up_proj.weight")
        );
        assert_eq!(llama.hf_name("blk.0.attn_qkv.weight"), None);
        Ok(())
    }

    /// The deprecated count is what the constructor asks for, every layer
    /// multiplied out.
    #[test]
    #[allow(deprecated)]
    fn min_weights_counts_what_the_constructor_asks_for() -> Result<()> {
        let HfDecoderConfig::Llama(cfg) = family_config(r#""model_type": "qwen2""#, SIZES)? else {
            candle::bail!("not a Llama")
        };
        let all: usize = recorded(&HfDecoderConfig::Llama(cfg.clone()), &[])?
            .iter()
            .map(|w| w.shape.iter().product::<usize>())
            .sum();
        assert_eq!(cfg.min_weights()?.total(), all);
        let huge = LlamaConfig {
            num_hidden_layers: 1 << 24,
            ..cfg
        };
        assert!(huge.min_weights()?.total() > all << 20);
        Ok(())
    }
}
