//! Greedy decoding, seeded sampling and (in `beam.rs`) beam search over any
//! [`StepModel`], each applying the caller's [`LogitsProcessor`]s to every
//! row at every step.

use candle::{bail, DType, Result, Tensor, D};
use serde::{Deserialize, Serialize};

use super::beam::beam;
use super::processors::{softmax, LogitsProcessor, StepContext};
use super::rng::SplitMix64;
use super::step::StepModel;

/// How the next token is picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decoding {
    /// The best processed score.
    Greedy,
    /// Drawn from the softmax of the processed scores; `seed` fixes every
    /// draw. Each output has its own stream, keyed to its source's index
    /// in the caller's whole list ([`GenerateConfig::first_source`] plus
    /// its place in the call) and its sample number, so the result does
    /// not depend on how a list of sources is split into batches.
    Sample {
        /// The seed of the draws.
        seed: u64,
    },
    /// Beam search with this many hypotheses per source.
    Beam {
        /// Hypotheses kept per source, >= 1.
        beams: usize,
    },
}

/// What [`generate`] does: HF's `GenerationConfig`, reduced to what the
/// search itself needs (processors are passed beside it). Checked by
/// [`GenerateConfig::validate`] before every search.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateConfig {
    /// Most tokens generated per row, the end token included; no search runs
    /// longer.
    pub max_len: usize,
    /// Token fed at the first step (`<bos>` for an encoder–decoder).
    pub start_id: u32,
    /// Token that ends a row.
    pub eos_id: u32,
    /// More tokens that end a row, as `eos_id` does (Llama 3's
    /// `<|eot_id|>` beside `<|end_of_text|>`; HF's list-valued
    /// `eos_token_id`).
    #[serde(default)]
    pub extra_eos_ids: Vec<u32>,
    /// No token ends a row: every row runs to `max_len` (a model whose
    /// folder names no end token, as HF's `generate` does then).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Token fed to rows that have ended, while others run on.
    pub pad_id: u32,
    /// Greedy, sampling or beam search.
    pub decoding: Decoding,
    /// Outputs per source: 1 for greedy; samples drawn for
    /// [`Decoding::Sample`]; best beams kept (at most `beams`) for
    /// [`Decoding::Beam`].
    pub num_return: usize,
    /// The index, in the caller's whole list of sources, of this call's
    /// first source: sampling streams are keyed to `first_source + i`, so
    /// a list decoded in several batches samples as it would in one.
    #[serde(default)]
    pub first_source: usize,
}

impl Default for GenerateConfig {
    /// Greedy decoding of one output per source, at most 20 tokens (HF's
    /// `max_length`), every special id 0: name the model's ids,
    /// `GenerateConfig { max_len: 10, start_id: 0, eos_id: 1, pad_id: 0, ..GenerateConfig::default() }`.
    fn default() -> Self {
        Self {
            max_len: 20,
            start_id: 0,
            eos_id: 0,
            extra_eos_ids: Vec::new(),
            ignore_eos: false,
            pad_id: 0,
            decoding: Decoding::Greedy,
            num_return: 1,
            first_source: 0,
        }
    }
}

impl GenerateConfig {
    /// Greedy decoding of one output per source.
    #[deprecated(
        note = "name the values: GenerateConfig { max_len, start_id, eos_id, pad_id, ..GenerateConfig::default() }"
    )]
    pub fn greedy(max_len: usize, start_id: u32, eos_id: u32, pad_id: u32) -> Self {
        Self {
            max_len,
            start_id,
            eos_id,
            pad_id,
            ..Self::default()
        }
    }

    /// The same, for a batch whose first source is `first_source` in the
    /// caller's list (see [`GenerateConfig::first_source`]).
    pub fn with_first_source(mut self, first_source: usize) -> Self {
        self.first_source = first_source;
        self
    }

    /// The same, with `ids` ending a row too (beside `eos_id`).
    pub fn with_extra_eos(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.extra_eos_ids.extend(ids);
        self
    }

    /// Whether `token` ends a row.
    pub fn is_eos(&self, token: u32) -> bool {
        !self.ignore_eos && (token == self.eos_id || self.extra_eos_ids.contains(&token))
    }

    /// The same, decoding with `decoding`.
    pub fn with_decoding(mut self, decoding: Decoding) -> Self {
        self.decoding = decoding;
        self
    }

    /// The same, returning `n` outputs per source.
    pub fn with_num_return(mut self, n: usize) -> Self {
        self.num_return = n;
        self
    }

    /// Checks the values against each other and a vocabulary size.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if self.max_len == 0 {
            bail!("generate: max_len must be >= 1")
        }
        if self.num_return == 0 {
            bail!("generate: num_return must be >= 1")
        }
        let named = [
            ("start_id", self.start_id),
            ("eos_id", self.eos_id),
            ("pad_id", self.pad_id),
        ];
        let extra = self.extra_eos_ids.iter().map(|&id| ("extra_eos_ids", id));
        for (name, id) in named.into_iter().chain(extra) {
            if id as usize >= vocab_size {
                bail!("generate: {name} ({id}) must be < the vocabulary size ({vocab_size})")
            }
        }
        match self.decoding {
            Decoding::Greedy if self.num_return != 1 => bail!(
                "generate: greedy decoding has one output per source, but num_return is {} (sample or use beams)",
                self.num_return
            ),
            Decoding::Beam { beams: 0 } => bail!("generate: beams must be >= 1"),
            Decoding::Beam { beams } if self.num_return > beams => bail!(
                "generate: num_return ({}) cannot exceed the number of beams ({beams})",
                self.num_return
            ),
            _ => Ok(()),
        }
    }
}

/// One output of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Output ids, without the start and end tokens.
    pub tokens: Vec<u32>,
    /// Sum of the processed log-probabilities of the tokens and of the end
    /// token; with processors that only mask, the model's log-probability.
    pub score: f32,
    /// Whether the row ended with the end token (rather than being cut at
    /// `max_len`, or left with no allowed token).
    pub finished: bool,
}

/// Generates from `model` over `cache`, which holds `batch` sources.
///
/// Returns, per source, up to `num_return` outputs, best first for beam
/// search, in draw order for sampling. Beam search returns fewer (none at
/// all) when the processors leave fewer hypotheses alive.
pub fn generate<M: StepModel>(
    model: &M,
    cache: M::Cache,
    batch: usize,
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
) -> Result<Vec<Vec<Generated>>> {
    generate_from(model, cache, &vec![cfg.start_id; batch], cfg, processors)
}

/// [`generate`] where each source's first fed token is its own: for a
/// decoder-only model, the last token of each prompt, whose earlier tokens
/// are already in `cache` (`first.len()` sources). `cfg.start_id` is not
/// fed.
pub fn generate_from<M: StepModel>(
    model: &M,
    cache: M::Cache,
    first: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
) -> Result<Vec<Vec<Generated>>> {
    if !checked(model, first, cfg, processors)? {
        return Ok(Vec::new());
    }
    match cfg.decoding {
        Decoding::Beam { beams } => beam(model, cache, first, beams, cfg, processors),
        Decoding::Greedy | Decoding::Sample { .. } => {
            let mut cache = cache;
            rowwise(model, &mut cache, first, cfg, processors, &mut |_| Ok(true))
        }
    }
}

/// A token [`generate_streaming`] has just chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen {
    /// The source (index in this call) whose output it extends.
    pub source: usize,
    /// Which of the source's `num_return` outputs.
    pub sample: usize,
    /// The token; end tokens are not reported.
    pub token: u32,
}

/// [`generate_from`] for greedy decoding and sampling, calling `on_token`
/// with every token as soon as it is chosen (to stream text while the rest
/// is generated). `on_token` answers whether its row goes on: `false` ends
/// the row there, not `finished` (a stop string, say); an error stops the
/// search. Beam search is refused: its tokens are only known at the end.
pub fn generate_streaming<M: StepModel>(
    model: &M,
    cache: M::Cache,
    first: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
    on_token: &mut dyn FnMut(Chosen) -> Result<bool>,
) -> Result<Vec<Vec<Generated>>> {
    let mut cache = cache;
    generate_streaming_in(model, &mut cache, first, cfg, processors, on_token)
}

/// [`generate_streaming`] on a cache the caller keeps: afterwards it holds
/// every token fed (each output's tokens but its last, which was chosen
/// and not fed), so a conversation can go on from it.
pub fn generate_streaming_in<M: StepModel>(
    model: &M,
    cache: &mut M::Cache,
    first: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
    on_token: &mut dyn FnMut(Chosen) -> Result<bool>,
) -> Result<Vec<Vec<Generated>>> {
    if let Decoding::Beam { .. } = cfg.decoding {
        bail!("generate_streaming: beam search cannot stream (its tokens are chosen at the end)")
    }
    if !checked(model, first, cfg, processors)? {
        return Ok(Vec::new());
    }
    rowwise(model, cache, first, cfg, processors, on_token)
}

/// Checks a search before its first step: the config, every processor and
/// the first tokens against the model's vocabulary. `false` when there is
/// no source (no output, on every decoding).
fn checked<M: StepModel>(
    model: &M,
    first: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
) -> Result<bool> {
    cfg.validate(model.vocab_size())?;
    for p in processors {
        p.check(model.vocab_size(), cfg.max_len)?;
    }
    if let Some(&t) = first.iter().find(|&&t| t as usize >= model.vocab_size()) {
        bail!(
            "generate: first token {t} must be < the vocabulary size ({})",
            model.vocab_size()
        )
    }
    Ok(!first.is_empty())
}

/// The log-probabilities of the next token, `(rows, vocab)`, on the host,
/// at decoding step `step` (0 for the first generated token). A row of
/// logits holding NaN or `+inf`, or no finite value, is an error naming
/// the step and the row: no token can be chosen from it, and ending the
/// row quietly would pass a broken model off as an empty answer (`-inf`
/// alone forbids a token, as a processor would). Beside them, each row's
/// log-sum-exp ([`StepContext::logit_offset`]) and the logits themselves
/// ([`greedy_pick`]).
pub(super) fn next_log_probs<M: StepModel>(
    model: &M,
    fed: Vec<u32>,
    cache: &mut M::Cache,
    step: usize,
) -> Result<StepScores> {
    let n = fed.len();
    let tokens = Tensor::from_vec(fed, (n, 1), model.device())?;
    let logits = model.step(&tokens, cache)?;
    let (rows, v) = logits.dims2()?;
    if rows != n || v != model.vocab_size() {
        bail!(
            "generate: the model's step returned logits {:?}, expected ({n}, {})",
            logits.dims(),
            model.vocab_size()
        )
    }
    log_probs(&logits, step)
}

/// A decoding step's log-probabilities, `(rows, vocab)`, each row's
/// log-sum-exp, and the logits they come from.
pub(crate) type StepScores = (Vec<Vec<f32>>, Vec<f32>, Vec<Vec<f32>>);

/// [`next_log_probs`] of logits a model gave, `(rows, vocab)`.
pub(crate) fn log_probs(logits: &Tensor, step: usize) -> Result<StepScores> {
    let logits = logits.to_dtype(DType::F32)?;
    let host: Vec<Vec<f32>> = logits.to_vec2()?;
    for (r, row) in host.iter().enumerate() {
        if let Some(why) = unusable(row) {
            bail!(
                "generate: step {step}: the model's logits for row {r} are not usable ({why}): \
                 its weights or config overflow f32"
            )
        }
    }
    let log_probs: Vec<Vec<f32>> = candle_nn::ops::log_softmax(&logits, D::Minus1)?.to_vec2()?;
    // logit - log p is the same for every token; the best token's is the
    // most precise (its log p is nearest 0).
    let offsets = host
        .iter()
        .zip(&log_probs)
        .map(|(l, p)| argmax(l).map_or(0., |i| l[i] - p[i]))
        .collect();
    Ok((log_probs, offsets, host))
}

/// Why no token can be chosen from a row of logits: NaN, `+inf`, or
/// nothing finite (`-inf` alone forbids a token, as a processor would);
/// `None` when the row is usable.
fn unusable(row: &[f32]) -> Option<String> {
    let nan = row.iter().filter(|x| x.is_nan()).count();
    let inf = row.iter().filter(|&&x| x == f32::INFINITY).count();
    let finite = row.iter().filter(|x| x.is_finite()).count();
    (nan + inf > 0 || finite == 0).then(|| format!("{nan} NaN, {inf} +inf, {finite} finite of {}", row.len()))
}

pub(crate) fn apply(
    processors: &[&dyn LogitsProcessor],
    ctx: &StepContext<'_>,
    scores: &mut [f32],
) -> Result<()> {
    for p in processors {
        p.process(ctx, scores)?;
    }
    Ok(())
}

/// The first index of the largest score, or `None` when all are `-inf` or
/// NaN.
pub(crate) fn argmax(scores: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &s) in scores.iter().enumerate() {
        if s > f32::NEG_INFINITY && best.is_none_or(|(_, b)| s > b) {
            best = Some((i, s));
        }
    }
    best.map(|(i, _)| i)
}

/// Greedy decoding's token: the first index of the largest score, but
/// where several tokens share it, the one of the largest logit (the first
/// of those): HF's greedy search takes the argmax of the (processed)
/// logits, and two logits a few ulps apart can round to one
/// log-probability, `l − logsumexp` having a coarser ulp than `l` where
/// the logits are small beside their log-sum-exp. The model's logits break
/// the tie: HF's choice wherever no processor changed the tied tokens'
/// scores. `None` as [`argmax`].
pub(crate) fn greedy_pick(scores: &[f32], logits: &[f32]) -> Option<usize> {
    let best = argmax(scores)?;
    let mut pick = best;
    for (i, (&s, &l)) in scores.iter().zip(logits).enumerate().skip(best + 1) {
        if s == scores[best] && l > logits[pick] {
            pick = i;
        }
    }
    Some(pick)
}

/// A token drawn from the softmax of `scores`.
pub(crate) fn draw(scores: &[f32], rng: &mut SplitMix64) -> Option<usize> {
    let probs = softmax(scores);
    let u = rng.next_f64();
    let mut acc = 0f64;
    let mut last = None;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0. {
            acc += f64::from(p);
            last = Some(i);
            if u < acc {
                return Some(i);
            }
        }
    }
    // Rounding left the cumulative sum just under `u`: the last possible one.
    last
}

/// Greedy decoding and sampling: each row on its own.
fn rowwise<M: StepModel>(
    model: &M,
    cache: &mut M::Cache,
    first: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
    on_token: &mut dyn FnMut(Chosen) -> Result<bool>,
) -> Result<Vec<Vec<Generated>>> {
    let batch = first.len();
    let n = cfg.num_return;
    if n > 1 {
        let rows: Vec<u32> = (0..batch as u32)
            .flat_map(|i| std::iter::repeat_n(i, n))
            .collect();
        model.select_rows(cache, &Tensor::new(rows.as_slice(), model.device())?)?;
    }
    let rows = batch * n;
    let mut rngs: Vec<SplitMix64> = match cfg.decoding {
        Decoding::Sample { seed } => (0..rows)
            .map(|r| {
                // Source `first_source + r / n`, sample `r % n`.
                let key = (cfg.first_source as u64)
                    .wrapping_mul(n as u64)
                    .wrapping_add(r as u64);
                SplitMix64::for_row(seed, key)
            })
            .collect(),
        _ => Vec::new(),
    };
    let mut out: Vec<Generated> = (0..rows)
        .map(|_| Generated {
            tokens: Vec::new(),
            score: 0.,
            finished: false,
        })
        .collect();
    let mut done = vec![false; rows];
    let mut fed: Vec<u32> = (0..rows).map(|r| first[r / n]).collect();
    for step in 0..cfg.max_len {
        let (mut scores, offsets, logits) = next_log_probs(model, fed.clone(), cache, step)?;
        for (r, row) in scores.iter_mut().enumerate() {
            if done[r] {
                fed[r] = cfg.pad_id;
                continue;
            }
            let ctx = StepContext {
                source: r / n,
                prefix: &out[r].tokens,
                max_len: cfg.max_len,
                logit_offset: offsets[r],
            };
            apply(processors, &ctx, row)?;
            let pick = match rngs.get_mut(r) {
                Some(rng) => draw(row, rng),
                None => greedy_pick(row, &logits[r]),
            };
            let Some(t) = pick else {
                // Every token forbidden: the row ends, unfinished.
                done[r] = true;
                fed[r] = cfg.pad_id;
                continue;
            };
            out[r].score += row[t];
            if cfg.is_eos(t as u32) {
                out[r].finished = true;
                done[r] = true;
                fed[r] = cfg.pad_id;
            } else {
                out[r].tokens.push(t as u32);
                fed[r] = t as u32;
                let go_on = on_token(Chosen {
                    source: r / n,
                    sample: r % n,
                    token: t as u32,
                })?;
                if !go_on {
                    done[r] = true;
                    fed[r] = cfg.pad_id;
                }
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    let mut grouped = Vec::with_capacity(batch);
    let mut it = out.into_iter();
    for _ in 0..batch {
        grouped.push(it.by_ref().take(n).collect());
    }
    Ok(grouped)
}
