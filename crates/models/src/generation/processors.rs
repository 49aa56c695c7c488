//! Hooks that reshape next-token scores before a search picks from them:
//! HF transformers' `LogitsProcessor`s and `LogitsWarper`s
//! (`transformers/generation/logits_process.py`), and its
//! `prefix_allowed_tokens_fn`.
//!
//! Every processor sees the row's **log-probabilities** (the model's
//! log-softmax), as HF's beam search shows them to its processors, and edits
//! them in place: `-inf` forbids a token. A hypothesis's score is the sum of
//! the processed scores of its tokens, so a processor that only masks leaves
//! the score of a surviving hypothesis equal to its log-probability under
//! the model, mass spent on forbidden tokens included.

use candle::{bail, Result};

/// Where in the search a row's scores come from.
#[derive(Debug, Clone, Copy)]
pub struct StepContext<'a> {
    /// The source (batch item) this row decodes; beams and samples of one
    /// source share it.
    pub source: usize,
    /// Tokens generated so far in this row, without the start token.
    pub prefix: &'a [u32],
    /// Most tokens the search generates per row, the end token included.
    pub max_len: usize,
    /// What turns this row's log-probabilities back into the model's
    /// logits (their log-sum-exp): `logit = score + logit_offset` for a
    /// score no processor changed yet. A processor that is not the same on
    /// scores shifted by a constant (HF's repetition penalty divides
    /// positive logits) works on the logits.
    pub logit_offset: f32,
}

impl StepContext<'_> {
    /// Tokens this row may still generate, this step's and the end token
    /// included.
    pub fn remaining(&self) -> usize {
        self.max_len.saturating_sub(self.prefix.len())
    }
}

/// Edits one row's next-token scores given its prefix.
///
/// Implement it to steer generation; the search calls it for every live
/// row at every step, in the order the processors are listed.
pub trait LogitsProcessor {
    /// `scores`: `(vocab_size,)` log-probabilities (already edited by the
    /// processors listed before this one).
    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()>;

    /// Called once before decoding starts, with the model's vocabulary
    /// size and the search's `max_len`: refuse here what can never work
    /// (a token outside the vocabulary, a constraint no output can meet
    /// in time), so that the error comes before any decoding.
    fn check(&self, vocab_size: usize, max_len: usize) -> Result<()> {
        let _ = (vocab_size, max_len);
        Ok(())
    }
}

fn check_token(who: &str, token: u32, vocab_size: usize) -> Result<()> {
    if token as usize >= vocab_size {
        bail!("{who}: token {token} is outside the vocabulary of {vocab_size}")
    }
    Ok(())
}

/// Leaves only `token`, with score 0 (HF's forced-token processors).
fn force(scores: &mut [f32], token: u32, who: &str) -> Result<()> {
    if token as usize >= scores.len() {
        bail!(
            "{who}: token {token} is outside the vocabulary of {}",
            scores.len()
        )
    }
    scores.fill(f32::NEG_INFINITY);
    scores[token as usize] = 0.;
    Ok(())
}

/// Divides the scores by `t`: below 1 sharpens, above 1 flattens the
/// distribution sampling draws from (`softmax(log p / t)`).
///
/// A temperature so small that dividing the row's best score by it
/// overflows f32 (`1e-45`: every score becomes `-inf`) is an error at
/// that step, not a row left with no token to pick. HF's sampling fails
/// there too (`torch.multinomial` on NaN probabilities).
#[derive(Debug, Clone, Copy)]
pub struct Temperature(f32);

impl Temperature {
    /// `t` must be finite and > 0.
    pub fn new(t: f32) -> Result<Self> {
        if !(t.is_finite() && t > 0.) {
            bail!("temperature must be finite and > 0, found {t}")
        }
        Ok(Self(t))
    }
}

impl LogitsProcessor for Temperature {
    fn process(&self, _: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if best.is_finite() && !(best / self.0).is_finite() {
            bail!(
                "temperature {:?}: dividing the best score ({best}) by it overflows f32, \
                 which would forbid every token; use a larger temperature (or greedy decoding)",
                self.0
            )
        }
        scores.iter_mut().for_each(|s| *s /= self.0);
        Ok(())
    }
}

/// Keeps the `k` best tokens (and any tied with the `k`-th), as HF's
/// `TopKLogitsWarper`.
#[derive(Debug, Clone, Copy)]
pub struct TopK(usize);

impl TopK {
    /// `k` must be >= 1.
    pub fn new(k: usize) -> Result<Self> {
        if k == 0 {
            bail!("top-k must be >= 1")
        }
        Ok(Self(k))
    }
}

impl LogitsProcessor for TopK {
    fn process(&self, _: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if self.0 >= scores.len() {
            return Ok(());
        }
        let mut sorted = scores.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[self.0 - 1];
        scores
            .iter_mut()
            .filter(|s| **s < kth)
            .for_each(|s| *s = f32::NEG_INFINITY);
        Ok(())
    }
}

/// Nucleus sampling: keeps the fewest best tokens whose probabilities sum
/// to at least `p` (always the best one), as HF's `TopPLogitsWarper`.
#[derive(Debug, Clone, Copy)]
pub struct TopP(f32);

impl TopP {
    /// `p` must be in `(0, 1]`.
    pub fn new(p: f32) -> Result<Self> {
        if !(p > 0. && p <= 1.) {
            bail!("top-p must be in (0, 1], found {p}")
        }
        Ok(Self(p))
    }
}

impl LogitsProcessor for TopP {
    fn process(&self, _: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        let probs = softmax(scores);
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let mut total = 0f64;
        let mut kept = 0;
        for &i in &order {
            if kept > 0 && total >= f64::from(self.0) {
                scores[i] = f32::NEG_INFINITY;
            } else {
                total += f64::from(probs[i]);
                kept += 1;
            }
        }
        Ok(())
    }
}

/// Makes tokens already seen less likely (CTRL, Keskar et al. 2019; HF's
/// `RepetitionPenaltyLogitsProcessor`): a token's negative logit is
/// multiplied by `penalty`, a positive one divided by it. Seen are the
/// tokens generated so far and, with [`RepetitionPenalty::with_prompts`],
/// the source's prompt: HF's `input_ids`, which for a decoder-only model
/// start with the prompt.
///
/// The search hands processors log-probabilities; the penalty is applied
/// to the logits they come from ([`StepContext::logit_offset`]), since
/// dividing a log-probability (always negative) is another rule.
#[derive(Debug, Clone)]
pub struct RepetitionPenalty {
    penalty: f32,
    /// Each source's prompt, by [`StepContext::source`].
    prompts: Vec<Vec<u32>>,
}

impl RepetitionPenalty {
    /// `penalty` must be finite and > 0; 1 changes nothing, above 1
    /// discourages repeats.
    pub fn new(penalty: f32) -> Result<Self> {
        if !(penalty.is_finite() && penalty > 0.) {
            bail!("repetition penalty must be finite and > 0, found {penalty}")
        }
        Ok(Self {
            penalty,
            prompts: Vec::new(),
        })
    }

    /// The same, counting `prompts[source]`'s tokens as seen in every row
    /// of that source.
    pub fn with_prompts(mut self, prompts: Vec<Vec<u32>>) -> Self {
        self.prompts = prompts;
        self
    }
}

impl LogitsProcessor for RepetitionPenalty {
    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        let mut seen = vec![false; scores.len()];
        let prompt = self
            .prompts
            .get(ctx.source)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for &t in prompt.iter().chain(ctx.prefix) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        let offset = ctx.logit_offset;
        for (s, _) in scores.iter_mut().zip(&seen).filter(|(_, &seen)| seen) {
            let logit = *s + offset;
            let penalized = if logit < 0. {
                logit * self.penalty
            } else {
                logit / self.penalty
            };
            *s = penalized - offset;
        }
        Ok(())
    }
}

/// Forbids the end token before `min_len` tokens were generated.
#[derive(Debug, Clone, Copy)]
pub struct MinLength {
    /// Fewest tokens before the end token.
    pub min_len: usize,
    /// The end token.
    pub eos_id: u32,
}

impl LogitsProcessor for MinLength {
    fn check(&self, vocab_size: usize, _: usize) -> Result<()> {
        check_token("MinLength", self.eos_id, vocab_size)
    }

    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if ctx.prefix.len() < self.min_len {
            if let Some(s) = scores.get_mut(self.eos_id as usize) {
                *s = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// Forces the end token once `max_len` tokens were generated: a tighter
/// cap than the search's own, per call.
#[derive(Debug, Clone, Copy)]
pub struct MaxLength {
    /// Most tokens before the end token.
    pub max_len: usize,
    /// The end token.
    pub eos_id: u32,
}

impl LogitsProcessor for MaxLength {
    fn check(&self, vocab_size: usize, _: usize) -> Result<()> {
        check_token("MaxLength", self.eos_id, vocab_size)
    }

    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if ctx.prefix.len() >= self.max_len {
            force(scores, self.eos_id, "MaxLength")?;
        }
        Ok(())
    }
}

/// Forces `token` as the first generated token (HF's
/// `ForcedBOSTokenLogitsProcessor`: a language or task tag).
#[derive(Debug, Clone, Copy)]
pub struct ForcedBos(pub u32);

impl LogitsProcessor for ForcedBos {
    fn check(&self, vocab_size: usize, _: usize) -> Result<()> {
        check_token("ForcedBos", self.0, vocab_size)
    }

    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if ctx.prefix.is_empty() {
            force(scores, self.0, "ForcedBos")?;
        }
        Ok(())
    }
}

/// Forces the end token at the last step the search allows, so that every
/// output is finished rather than cut (HF's `ForcedEOSTokenLogitsProcessor`).
#[derive(Debug, Clone, Copy)]
pub struct ForcedEos(pub u32);

impl LogitsProcessor for ForcedEos {
    fn check(&self, vocab_size: usize, _: usize) -> Result<()> {
        check_token("ForcedEos", self.0, vocab_size)
    }

    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if ctx.remaining() <= 1 {
            force(scores, self.0, "ForcedEos")?;
        }
        Ok(())
    }
}

/// HF's `prefix_allowed_tokens_fn`: `f(source, prefix)` lists the tokens
/// allowed next; every other token is forbidden.
#[derive(Clone)]
pub struct PrefixAllowedTokens<F>(pub F);

impl<F> std::fmt::Debug for PrefixAllowedTokens<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrefixAllowedTokens(..)")
    }
}

impl<F: Fn(usize, &[u32]) -> Vec<u32>> LogitsProcessor for PrefixAllowedTokens<F> {
    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        let mut allowed = vec![false; scores.len()];
        for t in (self.0)(ctx.source, ctx.prefix) {
            match allowed.get_mut(t as usize) {
                Some(a) => *a = true,
                None => bail!(
                    "prefix_allowed_tokens: token {t} is outside the vocabulary of {}",
                    scores.len()
                ),
            }
        }
        for (s, _) in scores.iter_mut().zip(&allowed).filter(|(_, &a)| !a) {
            *s = f32::NEG_INFINITY;
        }
        Ok(())
    }
}

/// Probabilities of scores (a row of all `-inf` gives all zeros).
pub(crate) fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY || max.is_nan() {
        return vec![0.; scores.len()];
    }
    let e: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}
