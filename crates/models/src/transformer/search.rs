//! Greedy and beam search over a [`Seq2Seq`] model.

use candle::{bail, DType, Result, Tensor, D};
use multihead_attention::KeyPaddingMask;

use super::seq2seq::{Encoded, Seq2Seq};

/// Whether decoding keeps the decoder's keys and values between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCache {
    /// Feed one token per step through a [`super::DecoderCache`].
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
    pub fn greedy(&self, src: &Tensor, cache: KvCache) -> Result<Vec<Vec<u32>>> {
        let cfg = self.config();
        let enc = self.encode(src)?;
        let b = src.dim(0)?;
        let dev = src.device();
        let mut out = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let mut next = Tensor::full(cfg.bos_id, (b, 1), dev)?;
        let mut cached = match cache {
            KvCache::Use => Some(self.start(&enc)?),
            KvCache::Recompute => None,
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
    /// penalty). `beam = 1` is greedy decoding.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    pub fn beam_search(&self, src: &Tensor, beam: usize) -> Result<Vec<Hypothesis>> {
        if beam == 0 {
            bail!("Seq2Seq::beam_search: beam must be >= 1")
        }
        let cfg = self.config();
        let (b, _) = src.dims2()?;
        let dev = src.device();
        let enc = self.encode(src)?;
        // Every source repeated `beam` times: (B * K, ...).
        let rows: Vec<u32> = (0..b as u32).flat_map(|i| std::iter::repeat_n(i, beam)).collect();
        let rows = Tensor::new(rows.as_slice(), dev)?;
        let enc = Encoded {
            memory: enc.memory.contiguous()?.index_select(&rows, 0)?,
            padding: match enc.padding {
                KeyPaddingMask::PadWhereTrue(t) => KeyPaddingMask::PadWhereTrue(t.index_select(&rows, 0)?),
                KeyPaddingMask::Additive(t) => KeyPaddingMask::Additive(t.index_select(&rows, 0)?),
            },
        };
        let mut cache = self.start(&enc)?;
        // Only the first beam of each source is live at the start, so the
        // first step's top `beam` tokens become distinct hypotheses.
        let mut beams: Vec<Beam> = (0..b * beam)
            .map(|i| Beam {
                tokens: Vec::new(),
                score: if i % beam == 0 { 0. } else { f32::NEG_INFINITY },
                done: false,
            })
            .collect();
        let mut next = Tensor::full(cfg.bos_id, (b * beam, 1), dev)?;
        for _ in 0..cfg.max_tgt_len {
            let logits = self.step(&next, &mut cache)?;
            let logp: Vec<Vec<f32>> =
                candle_nn::ops::log_softmax(&logits.squeeze(1)?.to_dtype(DType::F32)?, D::Minus1)?
                    .to_vec2()?;
            let mut new_beams = Vec::with_capacity(b * beam);
            let mut parents = Vec::with_capacity(b * beam);
            for g in 0..b {
                let mut cands: Vec<(f32, usize, Option<u32>)> = Vec::new();
                for p in g * beam..(g + 1) * beam {
                    let bm = &beams[p];
                    if bm.score == f32::NEG_INFINITY {
                        continue;
                    }
                    if bm.done {
                        cands.push((bm.score, p, None));
                    } else {
                        cands.extend(
                            logp[p]
                                .iter()
                                .enumerate()
                                .map(|(v, &lp)| (bm.score + lp, p, Some(v as u32))),
                        );
                    }
                }
                // Stable: among equal scores the earlier beam and the lower
                // id win, as in greedy's argmax.
                cands.sort_by(|a, b| b.0.total_cmp(&a.0));
                cands.truncate(beam);
                for j in 0..beam {
                    let Some(&(score, p, tok)) = cands.get(j) else {
                        // Fewer candidates than beams (tiny vocabularies):
                        // a dead beam that never wins.
                        new_beams.push(Beam {
                            tokens: Vec::new(),
                            score: f32::NEG_INFINITY,
                            done: true,
                        });
                        parents.push((g * beam) as u32);
                        continue;
                    };
                    let mut bm = Beam {
                        tokens: beams[p].tokens.clone(),
                        score,
                        done: beams[p].done,
                    };
                    match tok {
                        Some(t) if t == cfg.eos_id => bm.done = true,
                        Some(t) => bm.tokens.push(t),
                        None => {}
                    }
                    new_beams.push(bm);
                    parents.push(p as u32);
                }
            }
            beams = new_beams;
            if beams.iter().all(|bm| bm.done) {
                break;
            }
            cache.select_rows(&Tensor::new(parents.as_slice(), dev)?)?;
            let fed: Vec<u32> = beams
                .iter()
                .map(|bm| match (bm.done, bm.tokens.last()) {
                    (true, _) => cfg.pad_id,
                    (false, Some(&t)) => t,
                    (false, None) => cfg.bos_id,
                })
                .collect();
            next = Tensor::from_vec(fed, (b * beam, 1), dev)?;
        }
        let best = beams
            .chunks(beam)
            .map(|group| {
                // Finished hypotheses first, then the best score.
                let bm = group
                    .iter()
                    .max_by(|x, y| {
                        (x.done, x.score)
                            .partial_cmp(&(y.done, y.score))
                            .unwrap_or(std::cmp::Ordering::Equal)
                    })
                    .map(|bm| Hypothesis {
                        tokens: bm.tokens.clone(),
                        score: bm.score,
                    });
                bm.unwrap_or(Hypothesis {
                    tokens: Vec::new(),
                    score: f32::NEG_INFINITY,
                })
            })
            .collect();
        Ok(best)
    }
}

#[derive(Debug, Clone)]
struct Beam {
    tokens: Vec<u32>,
    score: f32,
    done: bool,
}
