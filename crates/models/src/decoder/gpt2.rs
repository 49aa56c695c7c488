//! GPT-2, as HF transformers' `GPT2LMHeadModel`
//! (`transformers/models/gpt2/modeling_gpt2.py`), on
//! [`MultiheadAttention`] with GPT-2's `Conv1D` layout.

use candle::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use multihead_attention::{
    LayerNorm, MhaConfig, MhaOptions, MultiheadAttention, PackOptions, PackedLinear, WeightLayout,
};

use super::config::{ties_in, Gpt2Config};
use super::llama::{check_ids, TokenEmbedding};
use super::{CausalLm, DecoderCache};
use crate::formats::safetensors::{Checkpoint, MinWeights};
use crate::mlp::{Activation, Mlp};

/// GPT-2's `Conv1D` `<name>.weight (in, out)` as a linear layer packed
/// as `pack` asks.
fn conv1d(in_dim: usize, out_dim: usize, pack: &PackOptions, vb: VarBuilder) -> Result<PackedLinear> {
    let w = vb.get((in_dim, out_dim), "weight")?;
    let b = vb.get(out_dim, "bias")?;
    PackedLinear::from_in_out_with(w, Some(b), pack)
}

/// `GPT2Block`: pre-norm attention and MLP, each added back.
#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: MultiheadAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn new(cfg: &Gpt2Config, layer: usize, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        let e = cfg.n_embd;
        let mut mha = MhaConfig::new(e, cfg.n_head);
        let mut scale = if cfg.scale_attn_weights {
            1. / ((e / cfg.n_head) as f64).sqrt()
        } else {
            1.
        };
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        mha = mha.with_scale(scale);
        let act = Activation::from_hf_name(&cfg.activation_function, "GPT-2 config")?;
        Ok(Self {
            ln_1: LayerNorm::new(e, cfg.layer_norm_epsilon, vb.pp("ln_1"))?,
            attn: MultiheadAttention::new_with_pack(&mha, &WeightLayout::gpt2(), pack, vb.pp("attn"))?,
            ln_2: LayerNorm::new(e, cfg.layer_norm_epsilon, vb.pp("ln_2"))?,
            mlp: Mlp::new(
                conv1d(e, cfg.n_inner(), pack, vb.pp("mlp.c_fc"))?,
                conv1d(cfg.n_inner(), e, pack, vb.pp("mlp.c_proj"))?,
                act,
            )?,
        })
    }

    /// `(B, T, E)` → `(B, T, E)`, appending to `cache`.
    fn forward(&self, x: &Tensor, cache: &mut multihead_attention::KvCache) -> Result<Tensor> {
        // Each residual add is fused into its branch's output projection.
        let opts = MhaOptions::new().with_residual(x.clone());
        let x = self
            .attn
            .forward_cached(&self.ln_1.forward(x)?, cache, &opts)?
            .output;
        self.mlp.forward_add(&self.ln_2.forward(&x)?, &x)
    }
}

/// GPT-2 with its language-model head.
#[derive(Debug, Clone)]
pub struct Gpt2 {
    wte: TokenEmbedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: PackedLinear,
    cfg: Gpt2Config,
    device: Device,
    /// The dtype its caches store keys and values in (`None`: f32).
    kv_dtype: Option<DType>,
}

impl Gpt2 {
    /// Builds the model from `vb` rooted where `wte`, `wpe`, `h.N` and
    /// `ln_f` live (`transformer` in a `GPT2LMHeadModel` checkpoint);
    /// `lm_head` is the head's own weight when the embeddings are untied.
    pub fn new(cfg: &Gpt2Config, vb: VarBuilder, lm_head: Option<Tensor>) -> Result<Self> {
        Self::new_with(cfg, &PackOptions::default(), vb, lm_head)
    }

    /// [`Gpt2::new`], every linear layer packed as `pack` asks (the format,
    /// the instruction set).
    pub fn new_with(
        cfg: &Gpt2Config,
        pack: &PackOptions,
        vb: VarBuilder,
        lm_head: Option<Tensor>,
    ) -> Result<Self> {
        let e = cfg.n_embd;
        // The embedding and the head first: a tied table is packed and its
        // unpacked copy dropped before the blocks take their memory.
        let wte = candle_nn::embedding(cfg.vocab_size, e, vb.pp("wte"))?;
        let (wte, lm_head) = TokenEmbedding::with_head(wte, lm_head, pack)?;
        let wpe = candle_nn::embedding(cfg.n_positions, e, vb.pp("wpe"))?;
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::new(cfg, i, pack, vb.pp(format!("h.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(e, cfg.layer_norm_epsilon, vb.pp("ln_f"))?;
        Ok(Self {
            lm_head,
            wte,
            wpe,
            blocks,
            ln_f,
            cfg: cfg.clone(),
            device: vb.device().clone(),
            kv_dtype: None,
        })
    }

    /// Builds the model from a `GPT2LMHeadModel` (names under
    /// `transformer.`) or `GPT2Model` (bare names) checkpoint, after the
    /// pre-flight check. The causal-mask buffers older exports carry
    /// (`h.N.attn.bias`, `h.N.attn.masked_bias`) are ignored, and so is a
    /// tied model's `lm_head.weight` equal to `wte`; a different one is the
    /// head's own weight, as in HF transformers.
    pub fn load(cfg: &Gpt2Config, ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        // A config far larger than the file is refused as it is recorded,
        // before anything of its size is built.
        ckpt.load_bounded("Gpt2Config", DType::F32, device, Self::builder(cfg, ckpt))
    }

    /// What builds the model from a `VarBuilder` over `ckpt`'s names, its
    /// layers packed as the options ask (for [`Checkpoint::load_with`] and
    /// its pre-flight).
    pub(crate) fn builder<'a>(
        cfg: &'a Gpt2Config,
        ckpt: &Checkpoint,
    ) -> impl Fn(VarBuilder, &PackOptions) -> Result<Self> + 'a {
        let prefix = if ckpt.info("transformer.wte.weight").is_some() {
            "transformer."
        } else {
            ""
        };
        let buffers: Vec<(String, Vec<usize>)> = ckpt
            .tensors()
            .iter()
            .filter(|t| t.name.ends_with(".attn.bias") || t.name.ends_with(".attn.masked_bias"))
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let tied = ties_in(cfg.tie_word_embeddings, ckpt, &format!("{prefix}wte.weight"));
        let in_file = ckpt.info("lm_head.weight").is_some();
        move |vb, pack| {
            // Asked for, so the pre-flight counts them as used; never read.
            for (name, shape) in &buffers {
                vb.get(shape.as_slice(), name)?;
            }
            // A tied copy of `wte` is asked for too, so that the pre-flight
            // counts it as used and checks its shape; it is read once and
            // dropped.
            let head = (!tied || in_file)
                .then(|| vb.get((cfg.vocab_size, cfg.n_embd), "lm_head.weight"))
                .transpose()?
                .filter(|_| !tied);
            let root = if prefix.is_empty() {
                vb.clone()
            } else {
                vb.pp("transformer")
            };
            Self::new_with(cfg, pack, root, head)
        }
    }

    /// The model, its caches storing keys and values in `dtype` (`None`:
    /// f32, as computed): a bf16 or f16 cache takes half the memory, and
    /// the CPU attention reads it in place.
    pub fn with_kv_dtype(mut self, dtype: Option<DType>) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// The config.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// The last block's output for `ids` (checked, `b > 0`), `(B, T, E)`,
    /// appending them to `cache`.
    fn hidden(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        // Learned positions: each row's count from its first real token.
        let pos = cache.positions(b, t, &self.device)?;
        let last = pos.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
        if last >= self.cfg.n_positions {
            bail!(
                "Gpt2: position {last} is past the context of {} positions (n_positions)",
                self.cfg.n_positions
            )
        }
        let mut x =
            (self.wte.forward(ids, &self.lm_head)? + self.wpe.forward(&pos)?.to_dtype(DType::F32)?)?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, cache.layer(i)?)?;
        }
        Ok(x)
    }
}

impl Gpt2Config {
    /// The weights a model of this config asks for, counted from what
    /// [`Gpt2::new`] asks for (its head tied).
    #[deprecated(
        note = "a decoder's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    pub fn min_weights(&self) -> Result<MinWeights> {
        MinWeights::recorded("Gpt2Config", self.n_layer, |n, vb| {
            let cfg = Gpt2Config {
                n_layer: n,
                ..self.clone()
            };
            Gpt2::new(&cfg, vb, None)
        })
    }
}

impl CausalLm for Gpt2 {
    fn forward(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Gpt2")?;
        if b == 0 {
            return Tensor::zeros((0, t, self.cfg.vocab_size), DType::F32, &self.device);
        }
        // (B, T, V)
        self.lm_head
            .forward(&self.ln_f.forward(&self.hidden(ids, cache)?)?)
    }

    fn prefill(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<()> {
        let (b, _) = check_ids(ids, self.cfg.vocab_size, "Gpt2")?;
        if b > 0 {
            self.hidden(ids, cache)?;
        }
        Ok(())
    }

    fn prefill_last(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let (b, t) = check_ids(ids, self.cfg.vocab_size, "Gpt2")?;
        if b == 0 {
            return Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device);
        }
        let last = self.hidden(ids, cache)?.narrow(1, t - 1, 1)?.contiguous()?;
        self.lm_head.forward(&self.ln_f.forward(&last)?)?.squeeze(1)
    }

    fn new_cache(&self, left_padding: Vec<usize>) -> DecoderCache {
        DecoderCache::new(self.blocks.len(), left_padding).with_kv_dtype(self.kv_dtype)
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.cfg.n_positions)
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
