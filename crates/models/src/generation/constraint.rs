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
/// Most bytes a regex's DFA may take while it is built and once built.
const MAX_REGEX_DFA_BYTES: usize = 16 << 20;

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
        let mut alphabet: Vec<char> = tokens.iter().flatten().flat_map(|t| t.chars()).collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        let dfa = pattern.dfa(&alphabet)?;
        Self::lift(
            pattern.as_str(),
            tokens.len(),
            eos_id,
            0usize,
            |s, id| match &tokens[id] {
                Some(t) if !t.is_empty() => dfa.walk(s, t),
                _ => None,
            },
            |s| dfa.is_accepting(s),
        )
    }

    /// Lifts a regular expression over bytes to a vocabulary of byte
    /// strings (a byte-level BPE's tokens are partial UTF-8 as often as
    /// not): `tokens[id]` is the bytes token `id` decodes to, `None` for
    /// special tokens, and the whole output must match `regex` (the
    /// `regex` crate's syntax, anchored at both ends, over UTF-8). The
    /// automaton is `regex-automata`'s dense DFA, its size capped.
    pub fn from_regex_bytes(regex: &str, tokens: &[Option<Vec<u8>>], eos_id: u32) -> Result<Self> {
        use regex_automata::dfa::{dense, Automaton, StartKind};
        use regex_automata::util::start;
        use regex_automata::{Anchored, MatchKind};
        let max = super::parse::MAX_PATTERN_CHARS;
        if regex.chars().take(max + 1).count() > max {
            bail!(
                "regex {} is too long: more than {max} characters",
                super::parse::shown(regex)
            )
        }
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    // Every match, not the leftmost-first one: `no`
                    // matching first must not end `none`'s path.
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(MAX_REGEX_DFA_BYTES))
                    .determinize_size_limit(Some(MAX_REGEX_DFA_BYTES)),
            )
            .build(regex)
            .map_err(|e| regex_error(regex, &e))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| regex_error(regex, &e))?;
        let live = |s| !dfa.is_dead_state(s) && !dfa.is_quit_state(s);
        Self::lift(
            regex,
            tokens.len(),
            eos_id,
            start,
            |s, id| match &tokens[id] {
                Some(bytes) if !bytes.is_empty() => {
                    let mut s = s;
                    for &b in bytes {
                        s = dfa.next_state(s, b);
                        if !live(s) {
                            return None;
                        }
                    }
                    Some(s)
                }
                _ => None,
            },
            |s| dfa.is_match_state(dfa.next_eoi_state(s)),
        )
    }

    /// The token automaton of a character or byte automaton whose states
    /// are `S`, from `start`: `walk(s, id)` is the state after token `id`
    /// (`None`: dead, special or empty), `accepting(s)` whether the output
    /// may end there. `shown` names the pattern in errors.
    fn lift<S: Copy + Eq + std::hash::Hash>(
        shown: &str,
        v: usize,
        eos_id: u32,
        start: S,
        walk: impl Fn(S, usize) -> Option<S>,
        accepting: impl Fn(S) -> bool,
    ) -> Result<Self> {
        if eos_id as usize >= v {
            bail!("TokenConstraint: eos_id {eos_id} is outside the vocabulary of {v}")
        }
        let shown_pattern = super::parse::shown(shown);
        // The token graph over the states reachable from the start.
        let mut index: std::collections::HashMap<S, u32> = std::collections::HashMap::from([(start, 0)]);
        let mut order = vec![start];
        let mut next: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            if (i + 1).saturating_mul(v) > MAX_TABLE {
                bail!(
                    "pattern {shown_pattern} is too large for a vocabulary of {v} tokens: its token automaton would exceed {MAX_TABLE} entries"
                )
            }
            let s = order[i];
            for id in 0..v {
                let to = if id as u32 == eos_id { None } else { walk(s, id) };
                next.push(match to {
                    None => DEAD,
                    Some(to) => *index.entry(to).or_insert_with(|| {
                        order.push(to);
                        order.len() as u32 - 1
                    }),
                });
            }
            i += 1;
        }
        let n = order.len();
        let accept: Vec<bool> = order.iter().map(|&s| accepting(s)).collect();
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
            bail!("pattern {shown_pattern} conflicts with the vocabulary: no sequence of its {v} tokens matches it")
        }
        // Edges into states that cannot reach a match are dead ends.
        for to in next.iter_mut() {
            if *to != DEAD && dist[*to as usize] == u32::MAX {
                *to = DEAD;
            }
        }
        Ok(Self {
            pattern: shown.to_string(),
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

/// A regex's build error in one line: the error and its causes (the
/// parser's, with the position), newlines folded.
fn regex_error(regex: &str, e: &dyn std::error::Error) -> candle::Error {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    candle::Error::Msg(format!("regex {}: {text}", super::parse::shown(regex)))
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

#[cfg(test)]
mod tests {
    use super::TokenConstraint;

    /// Over byte tokens that split a character (`日` is E6 97 A5), the
    /// regex follows the bytes: `日` is reachable whole or in parts, a
    /// part alone never matches, and the end token comes only after a
    /// match.
    #[test]
    fn byte_tokens_may_split_characters() -> candle::Result<()> {
        // 0: end, 1: E6, 2: 97 A5, 3: 日, 4: "a", 5: special.
        let tokens = vec![
            Some(Vec::new()),
            Some(vec![0xE6]),
            Some(vec![0x97, 0xA5]),
            Some("日".as_bytes().to_vec()),
            Some(b"a".to_vec()),
            None,
        ];
        let c = TokenConstraint::from_regex_bytes("日a?", &tokens, 0)?;
        assert_eq!(c.allowed(&[], 5), vec![1, 3]);
        assert_eq!(c.allowed(&[1], 5), vec![2]);
        assert_eq!(c.allowed(&[1, 2], 5), vec![0, 4]);
        assert!(c.matches(&[1, 2]) && c.matches(&[3, 4]) && !c.matches(&[1]));
        assert_eq!(c.min_tokens(), 1);
        // Whole-output matching: an alternative that matches first does not
        // cut off a longer one.
        let words = vec![Some(Vec::new()), Some(b"no".to_vec()), Some(b"ne".to_vec())];
        let c = TokenConstraint::from_regex_bytes("no|none", &words, 0)?;
        assert_eq!(c.allowed(&[1], 5), vec![0, 2]);
        assert!(c.matches(&[1]) && c.matches(&[1, 2]));
        // Bytes that are no character can never match.
        let err = TokenConstraint::from_regex_bytes("é", &tokens, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("conflicts with the vocabulary"), "{err}");
        Ok(())
    }
}
