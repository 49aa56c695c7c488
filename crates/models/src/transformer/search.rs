//! Greedy and beam search over a [`Seq2Seq`] model.

use candle::{bail, DType, Device, Result, Tensor, D};

use super::cache::Seq2SeqCache;
use super::seq2seq::Seq2Seq;
use crate::generation::{generate, Decoding, GenerateConfig, Generated, LogitsProcessor, StepModel};

/// Whether decoding keeps the decoder's keys and values between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Feed one token per step through a [`super::Seq2SeqCache`].
    #[default]
    Use,
    /// Re-run the decoder over the whole prefix at every step (the
    /// reference the cache must equal, and the baseline it is timed against).
    Recompute,
}

/// One finished (or cut at `max_tgt_len`) output of beam search.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    /// Output ids, without `bos_id` and `eos_id`.
    pub tokens: Vec<u32>,
    /// Sum of the log-probabilities of the tokens and of the end token.
    pub score: f32,
}

/// Greedy output with the cross-attention behind each token.
#[derive(Debug, Clone)]
pub struct Attended {
    /// Output ids, without `bos_id` and `eos_id`.
    pub tokens: Vec<u32>,
    /// Cross-attention (averaged over heads and layers) of each step whose
    /// token was kept: `(tokens.len(), src_len)`.
    pub attention: Tensor,
}

fn argmax_last(logits: &Tensor) -> Result<Vec<u32>> {
    // (B, V): the logits of the last position.
    let last = logits.narrow(1, logits.dim(1)? - 1, 1)?.squeeze(1)?;
    last.to_dtype(DType::F32)?.argmax(D::Minus1)?.to_vec1()
}

impl Seq2Seq {
    /// Greedy decoding of a batch of right-padded sources: the most likely
    /// token at each step, until `eos_id` or `max_tgt_len` tokens.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    /// - returns `batch` id lists, without `bos_id` and `eos_id`
    pub fn greedy(&self, src: &Tensor, cache: CacheMode) -> Result<Vec<Vec<u32>>> {
        let cfg = self.config();
        let (b, _) = src.dims2()?;
        if b == 0 {
            // No source, no output, as on every decoding path.
            return Ok(Vec::new());
        }
        let enc = self.encode(src)?;
        let dev = src.device();
        let mut out = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let mut next = Tensor::full(cfg.bos_id, (b, 1), dev)?;
        let mut cached = match cache {
            CacheMode::Use => Some(self.start(&enc)?),
            CacheMode::Recompute => None,
        };
        let mut prefix = next.clone();
        for _ in 0..cfg.max_tgt_len {
            let logits = match &mut cached {
                Some(c) => self.step(&next, c)?,
                None => self.decode_full(&prefix, &enc)?,
            };
            let ids = argmax_last(&logits)?;
            for (i, &id) in ids.iter().enumerate() {
                if done[i] {
                    continue;
                }
                if id == cfg.eos_id {
                    done[i] = true;
                } else {
                    out[i].push(id);
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
            next = Tensor::from_vec(ids, (b, 1), dev)?;
            if cached.is_none() {
                prefix = Tensor::cat(&[&prefix, &next], 1)?;
            }
        }
        Ok(out)
    }

    /// Greedy decoding of one source, keeping the cross-attention of each
    /// step: the alignment picture.
    ///
    /// # Shapes
    /// - `src`: `(1, src_len)`, `u32`
    pub fn greedy_with_attention(&self, src: &Tensor) -> Result<Attended> {
        let cfg = self.config();
        let (b, _) = src.dims2()?;
        if b != 1 {
            bail!("Seq2Seq::greedy_with_attention: expected one source, found a batch of {b}")
        }
        let enc = self.encode(src)?;
        let mut cache = self.start(&enc)?;
        let mut next = Tensor::full(cfg.bos_id, (1, 1), src.device())?;
        let (mut tokens, mut rows) = (Vec::new(), Vec::new());
        for _ in 0..cfg.max_tgt_len {
            let (logits, attn) = self.step_with_attention(&next, &mut cache)?;
            let id = argmax_last(&logits)?[0];
            if id == cfg.eos_id {
                break;
            }
            tokens.push(id);
            // (1, 1, S) -> (S)
            rows.push(attn.flatten_all()?);
            next = Tensor::full(id, (1, 1), src.device())?;
        }
        let attention = if rows.is_empty() {
            Tensor::zeros((0, src.dim(1)?), DType::F32, src.device())?
        } else {
            Tensor::stack(&rows, 0)?
        };
        Ok(Attended { tokens, attention })
    }

    /// Beam search with `beam` hypotheses per source; returns the best
    /// finished one per source, by total log-probability (no length
    /// penalty). `beam = 1` is greedy decoding. [`Seq2Seq::generate`] with
    /// no processors.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    pub fn beam_search(&self, src: &Tensor, beam: usize) -> Result<Vec<Hypothesis>> {
        if beam == 0 {
            bail!("Seq2Seq::beam_search: beam must be >= 1")
        }
        let cfg = self
            .generation_config()
            .with_decoding(Decoding::Beam { beams: beam });
        Ok(self
            .generate(src, &cfg, &[])?
            .into_iter()
            .map(|hyps| match hyps.into_iter().next() {
                Some(h) => Hypothesis {
                    tokens: h.tokens,
                    score: h.score,
                },
                None => Hypothesis {
                    tokens: Vec::new(),
                    score: f32::NEG_INFINITY,
                },
            })
            .collect())
    }

    /// Greedy decoding with the model's special tokens and `max_tgt_len`:
    /// the [`GenerateConfig`] to start from.
    pub fn generation_config(&self) -> GenerateConfig {
        let c = self.config();
        GenerateConfig::greedy(c.max_tgt_len, c.bos_id, c.eos_id, c.pad_id)
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
        // (B, new_len, V) -> the last position's (B, V).
        let logits = Seq2Seq::step(self, tokens, cache)?;
        logits.narrow(1, logits.dim(1)? - 1, 1)?.squeeze(1)
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
