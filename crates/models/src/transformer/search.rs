//! Greedy and beam search over a [`Seq2Seq`] model, all through
//! [`generate`]: the model is a [`StepModel`] over its [`Seq2SeqCache`];
//! decoding without the cache and decoding that keeps the cross-attention
//! are two more step models around it.

use std::cell::RefCell;

use candle::{bail, DType, Device, Result, Tensor};

use super::cache::{select_padding_rows, Seq2SeqCache};
use super::seq2seq::{Encoded, Seq2Seq};
use crate::generation::{generate, Decoding, GenerateConfig, Generated, LogitsProcessor, StepModel};

/// Whether decoding keeps the decoder's keys and values between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Feed one token per step through a [`Seq2SeqCache`].
    #[default]
    Use,
    /// Re-run the decoder over the whole prefix at every step (the
    /// reference the cache must equal, and the baseline it is timed against).
    Recompute,
}

/// Deprecated alias of [`Generated`], what [`Seq2Seq::beam_search`]
/// returns.
#[deprecated(note = "use multihead_models::generation::Generated")]
pub type Hypothesis = Generated;

/// Greedy output with the cross-attention behind each token.
#[derive(Debug, Clone)]
pub struct Attended {
    /// Output ids, without `bos_id` and `eos_id`.
    pub tokens: Vec<u32>,
    /// Cross-attention (averaged over heads and layers) of each step whose
    /// token was kept: `(tokens.len(), src_len)`.
    pub attention: Tensor,
}

/// The logits of the last position: `(B, T, V)` -> `(B, V)`.
fn last_position(logits: &Tensor) -> Result<Tensor> {
    logits.narrow(1, logits.dim(1)? - 1, 1)?.squeeze(1)
}

/// The first output of each source's list (greedy decoding has one), its
/// tokens; none where the search left none.
fn first_tokens(outputs: Vec<Vec<Generated>>) -> Vec<Vec<u32>> {
    outputs
        .into_iter()
        .map(|outs| outs.into_iter().next().map(|g| g.tokens).unwrap_or_default())
        .collect()
}

impl Seq2Seq {
    /// Greedy decoding of a batch of right-padded sources: the most likely
    /// token at each step, until `eos_id` or `max_tgt_len` tokens.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    /// - returns `batch` id lists, without `bos_id` and `eos_id`
    pub fn greedy(&self, src: &Tensor, cache: CacheMode) -> Result<Vec<Vec<u32>>> {
        let cfg = self.generation_config();
        let outputs = match cache {
            CacheMode::Use => self.generate(src, &cfg, &[])?,
            CacheMode::Recompute => {
                let (b, _) = src.dims2()?;
                if b == 0 {
                    // No source, no output, as on every decoding path.
                    return Ok(Vec::new());
                }
                let state = Prefix {
                    enc: self.encode(src)?,
                    tokens: None,
                };
                generate(&Recomputing(self), state, b, &cfg, &[])?
            }
        };
        Ok(first_tokens(outputs))
    }

    /// Greedy decoding of one source, keeping the cross-attention of each
    /// step: the alignment picture.
    ///
    /// # Shapes
    /// - `src`: `(1, src_len)`, `u32`
    pub fn greedy_with_attention(&self, src: &Tensor) -> Result<Attended> {
        let (b, src_len) = src.dims2()?;
        if b != 1 {
            bail!("Seq2Seq::greedy_with_attention: expected one source, found a batch of {b}")
        }
        let model = Attending {
            model: self,
            rows: RefCell::new(Vec::new()),
        };
        let cache = self.start(&self.encode(src)?)?;
        let outputs = generate(&model, cache, 1, &self.generation_config(), &[])?;
        let tokens = first_tokens(outputs).into_iter().next().unwrap_or_default();
        // Step `i` chose token `i`; the step that chose the end token, if
        // any, is dropped.
        let mut rows = model.rows.into_inner();
        rows.truncate(tokens.len());
        let attention = if rows.is_empty() {
            Tensor::zeros((0, src_len), DType::F32, src.device())?
        } else {
            Tensor::stack(&rows, 0)?
        };
        Ok(Attended { tokens, attention })
    }

    /// Beam search with `beam` hypotheses per source; returns the best
    /// finished one per source, by total log-probability (no length
    /// penalty); an empty one scored `-inf` where none is left. `beam = 1`
    /// is greedy decoding. [`Seq2Seq::generate`] with no processors.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    pub fn beam_search(&self, src: &Tensor, beam: usize) -> Result<Vec<Generated>> {
        if beam == 0 {
            bail!("Seq2Seq::beam_search: beam must be >= 1")
        }
        let cfg = self
            .generation_config()
            .with_decoding(Decoding::Beam { beams: beam });
        Ok(self
            .generate(src, &cfg, &[])?
            .into_iter()
            .map(|hyps| {
                hyps.into_iter().next().unwrap_or(Generated {
                    tokens: Vec::new(),
                    score: f32::NEG_INFINITY,
                    finished: false,
                })
            })
            .collect())
    }

    /// Greedy decoding with the model's special tokens and `max_tgt_len`:
    /// the [`GenerateConfig`] to start from.
    pub fn generation_config(&self) -> GenerateConfig {
        let c = self.config();
        GenerateConfig {
            max_len: c.max_tgt_len,
            start_id: c.bos_id,
            eos_id: c.eos_id,
            pad_id: c.pad_id,
            ..GenerateConfig::default()
        }
    }

    /// Encodes `src` and runs [`generate`] over the cached decoder:
    /// greedy, sampling or beam search as `cfg` says, every processor
    /// applied to every row at every step.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    /// - returns `batch` lists of outputs
    pub fn generate(
        &self,
        src: &Tensor,
        cfg: &GenerateConfig,
        processors: &[&dyn LogitsProcessor],
    ) -> Result<Vec<Vec<Generated>>> {
        let (b, _) = src.dims2()?;
        if b == 0 {
            // No source, no output, as on every decoding path.
            return Ok(Vec::new());
        }
        let cache = self.start(&self.encode(src)?)?;
        generate(self, cache, b, cfg, processors)
    }
}

/// Cached decoding: one target token per row and step.
impl StepModel for Seq2Seq {
    type Cache = Seq2SeqCache;

    fn step(&self, tokens: &Tensor, cache: &mut Seq2SeqCache) -> Result<Tensor> {
        last_position(&Seq2Seq::step(self, tokens, cache)?)
    }

    fn select_rows(&self, cache: &mut Seq2SeqCache, rows: &Tensor) -> Result<()> {
        cache.select_rows(rows)
    }

    fn vocab_size(&self) -> usize {
        self.config().tgt_vocab_size
    }

    fn device(&self) -> &Device {
        Seq2Seq::device(self)
    }
}

/// Cached decoding that keeps each step's cross-attention (averaged over
/// heads and layers), for one source: `(src_len)` per step.
struct Attending<'a> {
    model: &'a Seq2Seq,
    rows: RefCell<Vec<Tensor>>,
}

impl StepModel for Attending<'_> {
    type Cache = Seq2SeqCache;

    fn step(&self, tokens: &Tensor, cache: &mut Seq2SeqCache) -> Result<Tensor> {
        let (logits, attn) = self.model.step_with_attention(tokens, cache)?;
        // (1, 1, S) -> (S)
        self.rows.borrow_mut().push(attn.flatten_all()?);
        last_position(&logits)
    }

    fn select_rows(&self, cache: &mut Seq2SeqCache, rows: &Tensor) -> Result<()> {
        cache.select_rows(rows)
    }

    fn vocab_size(&self) -> usize {
        self.model.config().tgt_vocab_size
    }

    fn device(&self) -> &Device {
        self.model.device()
    }
}

/// Decoding without a cache: the decoder re-run over the whole prefix at
/// every step ([`CacheMode::Recompute`]).
struct Recomputing<'a>(&'a Seq2Seq);

/// The state [`Recomputing`] steps: the encoded sources and every target
/// token fed so far, `(batch, len)` (`None` before the first).
struct Prefix {
    enc: Encoded,
    tokens: Option<Tensor>,
}

impl StepModel for Recomputing<'_> {
    type Cache = Prefix;

    fn step(&self, tokens: &Tensor, state: &mut Prefix) -> Result<Tensor> {
        let prefix = match &state.tokens {
            Some(prefix) => Tensor::cat(&[prefix, tokens], 1)?,
            None => tokens.clone(),
        };
        let logits = self.0.decode_full(&prefix, &state.enc)?;
        state.tokens = Some(prefix);
        last_position(&logits)
    }

    fn select_rows(&self, state: &mut Prefix, rows: &Tensor) -> Result<()> {
        let pick = |t: &Tensor| t.contiguous()?.index_select(rows, 0);
        state.enc = Encoded {
            memory: pick(&state.enc.memory)?,
            padding: select_padding_rows(&state.enc.padding, rows)?,
        };
        state.tokens = state.tokens.as_ref().map(pick).transpose()?;
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.0.config().tgt_vocab_size
    }

    fn device(&self) -> &Device {
        self.0.device()
    }
}
