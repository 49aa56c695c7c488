//! Constrained decoding: a [`Pattern`] lifted from characters to the
//! tokens of a vocabulary, used as a [`LogitsProcessor`] that allows only
//! the tokens after which the output can still match within the length
//! budget.

use std::collections::VecDeque;

use candle::{bail, Result};

use super::pattern::Pattern;
use super::processors::{LogitsProcessor, StepContext};

/// No transition.
const DEAD: u32 = u32::MAX;
/// Most entries of the state × token table (64 MiB of `u32`): a big
/// vocabulary times a big automaton is refused rather than allocated.
const MAX_TABLE: usize = 16 << 20;

/// An allowed-token automaton: which tokens may follow a prefix so that the
/// output can still match a pattern.
///
/// Built from a [`Pattern`] and the vocabulary's token texts; only states
/// from which some token sequence reaches a match are kept, so a search
/// that follows [`TokenConstraint::allowed`] never paints itself into a
/// corner, and (with [`StepContext::max_len`]) never runs out of length
/// before the match is complete.
#[derive(Debug, Clone)]
pub struct TokenConstraint {
    pattern: String,
    vocab_size: usize,
    eos_id: u32,
    /// `next[state * vocab_size + token]`: the state after the token, or
    /// [`DEAD`] (dead, special or empty token, or a state that cannot
    /// reach a match).
    next: Vec<u32>,
    accept: Vec<bool>,
    /// Fewest tokens from each state to a match (0 when accepting).
    dist: Vec<u32>,
}

impl TokenConstraint {
    /// Lifts `pattern` to a vocabulary: `tokens[id]` is the text token `id`
    /// stands for, `None` for special tokens (which are never allowed;
    /// `eos_id` is allowed exactly where the output so far matches).
    ///
    /// Refuses a pattern that no sequence of these tokens can match (it
    /// needs characters the vocabulary lacks, say).
    pub fn new(pattern: &Pattern, tokens: &[Option<String>], eos_id: u32) -> Result<Self> {
        let v = tokens.len();
        if eos_id as usize >= v {
            bail!("TokenConstraint: eos_id {eos_id} is outside the vocabulary of {v}")
        }
        let mut alphabet: Vec<char> = tokens.iter().flatten().flat_map(|t| t.chars()).collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let dfa = pattern.dfa(&alphabet)?;
        // The token graph over the states reachable from the start.
        let mut index = vec![DEAD; dfa.len()];
        let mut order = vec![0usize];
        index[0] = 0;
        let mut next: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            if (i + 1).saturating_mul(v) > MAX_TABLE {
                bail!(
                    "pattern {} is too large for a vocabulary of {v} tokens: its token automaton would exceed {MAX_TABLE} entries",
                    pattern.shown()
                )
            }
            let s = order[i];
            for (id, tok) in tokens.iter().enumerate() {
                let to = match tok {
                    Some(t) if !t.is_empty() && id as u32 != eos_id => dfa.walk(s, t),
                    _ => None,
                };
                next.push(match to {
                    None => DEAD,
                    Some(to) => {
                        if index[to] == DEAD {
                            index[to] = order.len() as u32;
                            order.push(to);
                        }
                        index[to]
                    }
                });
            }
            i += 1;
        }
        let n = order.len();
        let accept: Vec<bool> = order.iter().map(|&s| dfa.is_accepting(s)).collect();
        // Fewest tokens to a match: breadth-first from the accepting states
        // along reversed edges.
        let mut rev: Vec<Vec<u32>> = vec![Vec::new(); n];
        for s in 0..n {
            for &to in &next[s * v..(s + 1) * v] {
                if to != DEAD {
                    rev[to as usize].push(s as u32);
                }
            }
        }
        let mut dist = vec![u32::MAX; n];
        let mut queue: VecDeque<usize> = (0..n).filter(|&s| accept[s]).collect();
        for &s in &queue {
            dist[s] = 0;
        }
        while let Some(s) = queue.pop_front() {
            for &p in &rev[s] {
                if dist[p as usize] == u32::MAX {
                    dist[p as usize] = dist[s] + 1;
                    queue.push_back(p as usize);
                }
            }
        }
        if dist[0] == u32::MAX {
            bail!(
                "pattern {} conflicts with the vocabulary: no sequence of its {v} tokens matches it",
                pattern.shown()
            )
        }
        // Edges into states that cannot reach a match are dead ends.
        for to in next.iter_mut() {
            if *to != DEAD && dist[*to as usize] == u32::MAX {
                *to = DEAD;
            }
        }
        Ok(Self {
            pattern: pattern.as_str().to_string(),
            vocab_size: v,
            eos_id,
            next,
            accept,
            dist,
        })
    }

    /// Compiles `pattern` and lifts it to `tokens` in one go.
    pub fn from_pattern(pattern: &str, tokens: &[Option<String>], eos_id: u32) -> Result<Self> {
        Self::new(&Pattern::new(pattern)?, tokens, eos_id)
    }

    /// The pattern as written.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Fewest tokens of any match, the end token not counted.
    pub fn min_tokens(&self) -> usize {
        self.dist[0] as usize
    }

    /// Refuses a length budget too short for any match: the shortest match
    /// and the end token must fit in `max_len` tokens.
    pub fn check_max_len(&self, max_len: usize) -> Result<()> {
        if self.min_tokens() + 1 > max_len {
            bail!(
                "pattern {} needs at least {} tokens and the end token, but at most {max_len} are generated",
                super::parse::shown(&self.pattern),
                self.min_tokens()
            )
        }
        Ok(())
    }

    /// The state after `prefix`, `None` once it cannot match any more.
    fn state(&self, prefix: &[u32]) -> Option<usize> {
        let mut s = 0usize;
        for &t in prefix {
            if t as usize >= self.vocab_size {
                return None;
            }
            match self.next[s * self.vocab_size + t as usize] {
                DEAD => return None,
                to => s = to as usize,
            }
        }
        Some(s)
    }

    /// Whether the whole of `tokens` matches the pattern.
    pub fn matches(&self, tokens: &[u32]) -> bool {
        self.state(tokens).is_some_and(|s| self.accept[s])
    }

    /// Tokens allowed after `prefix` when `remaining` tokens (this one and
    /// the end token included) may still be generated: a token is allowed
    /// when a match can still be completed in time after it; `eos_id` when
    /// `prefix` matches.
    pub fn allowed(&self, prefix: &[u32], remaining: usize) -> Vec<u32> {
        let Some(s) = self.state(prefix) else {
            return Vec::new();
        };
        let mut out: Vec<u32> = (0..self.vocab_size as u32)
            .filter(|&t| match self.next[s * self.vocab_size + t as usize] {
                DEAD => false,
                // The token, the rest of the shortest match, the end token.
                to => self.dist[to as usize] as usize + 2 <= remaining,
            })
            .collect();
        if self.accept[s] && remaining >= 1 {
            out.push(self.eos_id);
            out.sort_unstable();
        }
        out
    }
}

impl LogitsProcessor for TokenConstraint {
    fn process(&self, ctx: &StepContext<'_>, scores: &mut [f32]) -> Result<()> {
        if scores.len() != self.vocab_size {
            bail!(
                "TokenConstraint for {:?}: scores have {} entries but the vocabulary has {}",
                self.pattern,
                scores.len(),
                self.vocab_size
            )
        }
        let mut keep = vec![false; scores.len()];
        for t in self.allowed(ctx.prefix, ctx.remaining()) {
            keep[t as usize] = true;
        }
        for (s, _) in scores.iter_mut().zip(&keep).filter(|(_, &k)| !k) {
            *s = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn check(&self, vocab_size: usize, max_len: usize) -> Result<()> {
        if vocab_size != self.vocab_size {
            bail!(
                "TokenConstraint for {:?} was built for {} tokens but the model has {vocab_size}",
                self.pattern,
                self.vocab_size
            )
        }
        self.check_max_len(max_len)
    }
}
