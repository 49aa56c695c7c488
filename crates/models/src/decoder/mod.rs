//! Decoder-only language models on [`multihead_attention`]: GPT-2 and
//! Llama and its relatives (Mistral-style sliding windows too, Phi-3's
//! fused projections and LongRoPE), loading the folders HF
//! transformers' `save_pretrained` writes, decoded through the shared
//! [`crate::generation`] API.
//!
//! Every attention layer is a [`MultiheadAttention`] stepping a
//! [`KvCache`](multihead_attention::KvCache) through
//! [`MultiheadAttention::forward_cached`]: a prompt, a chunk of one, or a
//! single new token is the same call.
//!
//! ```no_run
//! use multihead_models::decoder::{generate_from_prompts, DecoderModel};
//! use multihead_models::generation::GenerateConfig;
//! # fn main() -> candle::Result<()> {
//! let model = DecoderModel::from_folder("tests/fixtures/decoders/llama".as_ref(), &candle::Device::Cpu)?;
//! let cfg = GenerateConfig {
//!     max_len: 10,
//!     start_id: 0,
//!     eos_id: 1,
//!     pad_id: 0,
//!     ..GenerateConfig::default()
//! };
//! let out = generate_from_prompts(&model, &[vec![5, 6, 7], vec![8, 9]], 0, &cfg, &[])?;
//! println!("{:?}", out[0][0].tokens);
//! # Ok(()) }
//! ```

mod batch;
mod chat;
pub(crate) mod config;
mod conversation;
pub(crate) mod families;
mod gemma;
mod generation_config;
mod gpt2;
mod jinja_py;
mod llama;
mod pipeline;
mod prompts;
mod text;
mod tokenizer_bounds;

use std::path::Path;

use candle::{bail, DType, Device, Result, Tensor};
pub use multihead_attention::DecoderCache;
#[cfg(doc)]
use multihead_attention::MultiheadAttention;
use multihead_attention::PackOptions;

use crate::checkpoint::{LoadOptions, LoadProgress, ModelFiles, WeightDtype};
use crate::formats::preflight::{wanted_within, Wanted};
use crate::formats::safetensors::Checkpoint;
use crate::generation::StepModel;

pub use crate::formats::gguf::{GGUF_ARCHITECTURES, GGUF_PRE_TOKENIZERS};
pub use batch::{BatchEvent, BatchRequest, BatchSink, Batcher, DEFAULT_PREFILL_CHUNK};
pub use chat::{ChatMessage, ChatTemplate, TemplateArgs};
pub use config::{
    Gpt2Config, HfDecoderConfig, LlamaConfig, NormPlacement, Projections, QkNorm, HF_DECODER_TYPES,
};
pub use conversation::Conversation;
pub use gemma::{Gemma, GemmaConfig, GemmaFamily, LayerKind, Rope, GEMMA_TYPES};
pub use generation_config::HfGenerationConfig;
pub use gpt2::Gpt2;
pub(crate) use llama::GatedMlp;
pub use llama::Llama;
pub use pipeline::{Finish, GenerationSettings, Sampling, TextGenerator, TextOutput, DEFAULT_MAX_NEW_TOKENS};
pub use prompts::{generate_from_prompts, generate_from_prompts_streaming, left_pad};
pub use text::{TextStream, TextTokenizer, MAX_TOKENIZER_BYTES};

/// A causal language model: token ids through a cache to next-token
/// logits. Every such model is a [`StepModel`], so [`crate::generation`]
/// decodes it.
pub trait CausalLm {
    /// Logits for every fed position, appending them to `cache`.
    ///
    /// # Shapes
    /// - `ids`: `(batch, new)`, `u32`
    /// - returns `(batch, new, vocab_size)`, f32
    fn forward(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor>;

    /// Appends `ids` to `cache` as [`CausalLm::forward`] does, without
    /// the logits: a prompt's chunks before its last, whose logits nobody
    /// reads ([`CausalLm::prefill_last`] takes the last). Models with a
    /// head to skip override it.
    fn prefill(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<()> {
        self.forward(ids, cache).map(drop)
    }

    /// Appends `ids` to `cache` as [`CausalLm::forward`] does and returns
    /// the logits of their last position alone, `(B, V)`: a whole prompt's
    /// prefill, whose last logits give the first new token. Models with a
    /// head to spare override it, running the head on that position only.
    fn prefill_last(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        let logits = self.forward(ids, cache)?;
        let t = logits.dim(1)?;
        logits.narrow(1, t - 1, 1)?.squeeze(1)
    }

    /// An empty cache for this model, rows left-padded as given.
    fn new_cache(&self, left_padding: Vec<usize>) -> DecoderCache;

    /// Size of the vocabulary.
    fn vocab_size(&self) -> usize;

    /// The most positions a row may hold (GPT-2's learned positions), or
    /// `None` where positions are not bounded (rotary ones extrapolate).
    fn max_positions(&self) -> Option<usize> {
        None
    }

    /// Where the model's tensors live.
    fn device(&self) -> &Device;
}

impl<M: CausalLm> StepModel for M {
    type Cache = DecoderCache;

    fn step(&self, tokens: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        CausalLm::forward(self, tokens, cache)?.squeeze(1)
    }

    fn select_rows(&self, cache: &mut DecoderCache, rows: &Tensor) -> Result<()> {
        cache.select_rows(rows)
    }

    fn vocab_size(&self) -> usize {
        CausalLm::vocab_size(self)
    }

    fn device(&self) -> &Device {
        CausalLm::device(self)
    }
}

/// A decoder loaded from a model folder, whichever architecture its
/// `config.json` names, or from a GGUF file ([`DecoderModel::from_gguf`]).
#[derive(Debug, Clone)]
pub enum DecoderModel {
    /// `model_type` `gpt2`.
    Gpt2(Gpt2),
    /// `model_type` `llama`, `mistral`, `qwen2`, `qwen3`, `smollm3`,
    /// `olmo2` or `phi3`.
    Llama(Llama),
    /// `model_type` `gemma2`, `gemma3_text` or `gemma3` (its text).
    Gemma(Gemma),
}

impl DecoderModel {
    /// Loads `dir/config.json` and the weights ([`ModelFiles::resolve`]:
    /// `model.safetensors`, the shards `model.safetensors.index.json`
    /// lists, or the one `*.safetensors` file; or a weights file, its
    /// config beside it) as HF transformers' `save_pretrained` writes
    /// them, through the checked loader (every missing, extra or
    /// mis-shaped tensor named at once).
    pub fn from_folder(dir: &Path, device: &Device) -> Result<Self> {
        Self::from_folder_with_progress(dir, device, None)
    }

    /// [`DecoderModel::from_folder`], telling `progress` how many of the
    /// weights' bytes were read.
    pub fn from_folder_with_progress(
        dir: &Path,
        device: &Device,
        progress: Option<LoadProgress>,
    ) -> Result<Self> {
        let opts = LoadOptions {
            progress,
            ..LoadOptions::default()
        };
        Self::from_folder_with(dir, device, &opts)
    }

    /// [`DecoderModel::from_folder`] with the weight matrices in
    /// `opts.dtype` (a bf16 folder loaded as bf16 keeps its weights as
    /// stored), telling `opts.progress` how far it got.
    pub fn from_folder_with(dir: &Path, device: &Device, opts: &LoadOptions) -> Result<Self> {
        if opts.dtype == WeightDtype::Ggml {
            bail!(
                "'{}': dtype ggml keeps the blocks a GGUF file stores; a folder's weights are floats (load them as f32, bf16, f16, q8_0 or q4_0)",
                dir.display()
            )
        }
        let files = ModelFiles::resolve(dir)?;
        let text = files.read_beside("config.json", "config")?;
        let cfg = HfDecoderConfig::from_json(&text, &files.beside("config.json").display().to_string())?;
        let ckpt = files
            .read()?
            .with_progress(opts.progress.clone())
            .with_weight_dtype(Some(opts.dtype));
        Ok(Self::from_checkpoint(&cfg, &ckpt, device)?.with_kv_dtype(opts.kv_dtype))
    }

    /// The model, its caches storing keys and values in `dtype` (`None`:
    /// f32, as computed).
    pub fn with_kv_dtype(self, dtype: Option<DType>) -> Self {
        match self {
            Self::Gpt2(m) => Self::Gpt2(m.with_kv_dtype(dtype)),
            Self::Llama(m) => Self::Llama(m.with_kv_dtype(dtype)),
            Self::Gemma(m) => Self::Gemma(m.with_kv_dtype(dtype)),
        }
    }

    /// The tensors the model `cfg` describes asks `ckpt` for, recorded
    /// within the file's [`Checkpoint::budget`] (a config whose sizes the
    /// file cannot hold is an error naming the tensor past it): what
    /// `multihead inspect` compares with the file.
    pub fn wanted_tensors(cfg: &HfDecoderConfig, ckpt: &Checkpoint) -> Result<Vec<Wanted>> {
        let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
        let budget = ckpt.budget(cfg.kind());
        match cfg {
            HfDecoderConfig::Gpt2(c) => {
                let build = Gpt2::builder(c, ckpt);
                wanted_within(&names, &budget, |vb| build(vb, &PackOptions::default()))
            }
            HfDecoderConfig::Llama(c) => wanted_within(&names, &budget, |vb| Llama::new(c, vb)),
            HfDecoderConfig::Gemma(c) => {
                let (text, prefix) = Gemma::text_checkpoint(ckpt);
                let names: Vec<&str> = text.tensors().iter().map(|t| t.name.as_str()).collect();
                wanted_within(&names, &text.budget(cfg.kind()), |vb| {
                    Gemma::new(c, gemma::at(vb, prefix))
                })
            }
        }
    }

    /// Builds the model `cfg` describes from `ckpt`.
    pub fn from_checkpoint(cfg: &HfDecoderConfig, ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        Ok(match cfg {
            HfDecoderConfig::Gpt2(c) => Self::Gpt2(Gpt2::load(c, ckpt, device)?),
            HfDecoderConfig::Llama(c) => Self::Llama(Llama::load(c, ckpt, device)?),
            HfDecoderConfig::Gemma(c) => Self::Gemma(Gemma::load(c, ckpt, device)?),
        })
    }
}

impl CausalLm for DecoderModel {
    fn forward(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        match self {
            Self::Gpt2(m) => m.forward(ids, cache),
            Self::Llama(m) => m.forward(ids, cache),
            Self::Gemma(m) => m.forward(ids, cache),
        }
    }

    fn prefill(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<()> {
        match self {
            Self::Gpt2(m) => m.prefill(ids, cache),
            Self::Llama(m) => m.prefill(ids, cache),
            Self::Gemma(m) => m.prefill(ids, cache),
        }
    }

    fn prefill_last(&self, ids: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        match self {
            Self::Gpt2(m) => m.prefill_last(ids, cache),
            Self::Llama(m) => m.prefill_last(ids, cache),
            Self::Gemma(m) => m.prefill_last(ids, cache),
        }
    }

    fn new_cache(&self, left_padding: Vec<usize>) -> DecoderCache {
        match self {
            Self::Gpt2(m) => m.new_cache(left_padding),
            Self::Llama(m) => m.new_cache(left_padding),
            Self::Gemma(m) => m.new_cache(left_padding),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2(m) => CausalLm::vocab_size(m),
            Self::Llama(m) => CausalLm::vocab_size(m),
            Self::Gemma(m) => CausalLm::vocab_size(m),
        }
    }

    fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Gpt2(m) => m.max_positions(),
            Self::Llama(m) => m.max_positions(),
            Self::Gemma(m) => m.max_positions(),
        }
    }

    fn device(&self) -> &Device {
        match self {
            Self::Gpt2(m) => CausalLm::device(m),
            Self::Llama(m) => CausalLm::device(m),
            Self::Gemma(m) => CausalLm::device(m),
        }
    }
}
