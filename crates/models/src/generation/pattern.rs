//! A small regular-expression language for output constraints, compiled to
//! a Thompson NFA (`Pattern`) and, over a given alphabet, to a DFA by subset
//! construction (`CharDfa`).
//!
//! Syntax: literals; `.` (any character); `\d \w \s` and `\D \W \S`;
//! `\n \t`; any other non-alphanumeric character escaped with `\`;
//! classes `[0-9a-f_]`, `[^...]` (with `\d \w \s` inside); groups `(..)`
//! and `(?:..)`; alternation `|`; quantifiers `? * +`, `{n}`, `{m,n}`,
//! `{m,}`. A pattern always matches the whole output, so `^` and `$` are
//! refused rather than silently ignored.
//!
//! Every stage is bounded (nesting, repetition counts, NFA and DFA sizes,
//! and the work of the subset construction), so any string compiles or is
//! refused quickly, never panics and never hangs: see the fuzz target
//! `fuzz/fuzz_targets/pattern.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use candle::{bail, Result};

use super::parse::{parse, shown, CharSet, Node};

/// Most NFA states a pattern may compile to.
const MAX_NFA_STATES: usize = 10_000;
/// Most DFA states the subset construction may build.
const MAX_DFA_STATES: usize = 4_096;
/// Most NFA-state visits the subset construction may make.
const MAX_WORK: usize = 20_000_000;

/// One NFA state: ε-moves and at most one character move.
#[derive(Debug, Clone, Default)]
struct NState {
    eps: Vec<usize>,
    on: Option<(usize, usize)>,
}

/// A parsed pattern, compiled to an NFA; `Pattern::dfa` specialises it
/// to an alphabet.
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    sets: Vec<Arc<CharSet>>,
    states: Vec<NState>,
    start: usize,
    accept: usize,
}

impl Pattern {
    /// Parses and compiles `pattern`, or says what is wrong and where.
    pub fn new(pattern: &str) -> Result<Self> {
        let node = parse(pattern)?;
        let mut pat = Self {
            source: pattern.to_string(),
            sets: Vec::new(),
            states: Vec::new(),
            start: 0,
            accept: 0,
        };
        let (s, e) = pat.compile(&node)?;
        pat.start = s;
        pat.accept = e;
        Ok(pat)
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    fn state(&mut self) -> Result<usize> {
        if self.states.len() >= MAX_NFA_STATES {
            bail!(
                "pattern {} is too large: it compiles to more than {MAX_NFA_STATES} states (lower its repetition counts)",
                shown(&self.source)
            )
        }
        self.states.push(NState::default());
        Ok(self.states.len() - 1)
    }

    /// Thompson's construction: a fragment with one entry and one exit.
    fn compile(&mut self, node: &Node) -> Result<(usize, usize)> {
        let (s, e) = (self.state()?, self.state()?);
        match node {
            Node::Empty => self.states[s].eps.push(e),
            Node::Set(set) => {
                self.sets.push(set.clone());
                self.states[s].on = Some((self.sets.len() - 1, e));
            }
            Node::Concat(items) => {
                let mut at = s;
                for item in items {
                    let (a, b) = self.compile(item)?;
                    self.states[at].eps.push(a);
                    at = b;
                }
                self.states[at].eps.push(e);
            }
            Node::Alt(branches) => {
                for b in branches {
                    let (x, y) = self.compile(b)?;
                    self.states[s].eps.push(x);
                    self.states[y].eps.push(e);
                }
            }
            Node::Repeat(inner, min, max) => {
                let mut at = s;
                for _ in 0..*min {
                    let (a, b) = self.compile(inner)?;
                    self.states[at].eps.push(a);
                    at = b;
                }
                match max {
                    None => {
                        // Kleene star after the required copies.
                        let (a, b) = self.compile(inner)?;
                        self.states[at].eps.extend([a, e]);
                        self.states[b].eps.extend([a, e]);
                    }
                    Some(max) => {
                        // Each optional copy may be skipped to the exit.
                        for _ in *min..*max {
                            let (a, b) = self.compile(inner)?;
                            self.states[at].eps.extend([a, e]);
                            at = b;
                        }
                        self.states[at].eps.push(e);
                    }
                }
            }
        }
        Ok((s, e))
    }

    fn closure(&self, seeds: impl IntoIterator<Item = usize>, work: &mut usize) -> Result<Vec<usize>> {
        let mut seen = vec![false; self.states.len()];
        let mut stack: Vec<usize> = seeds.into_iter().collect();
        let mut out = Vec::new();
        while let Some(s) = stack.pop() {
            if std::mem::replace(&mut seen[s], true) {
                continue;
            }
            *work += 1;
            out.push(s);
            stack.extend(self.states[s].eps.iter().copied());
        }
        if *work > MAX_WORK {
            bail!("pattern {} is too complex to compile", shown(&self.source))
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The DFA of the pattern over `alphabet` (characters outside it never
    /// occur, so they are left out).
    pub(crate) fn dfa(&self, alphabet: &[char]) -> Result<CharDfa> {
        let mut work = 0;
        let start = self.closure([self.start], &mut work)?;
        let mut ids: HashMap<Vec<usize>, usize> = HashMap::from([(start.clone(), 0)]);
        let mut sets = vec![start];
        let mut trans: Vec<Vec<Option<usize>>> = Vec::new();
        let mut accept = Vec::new();
        let mut i = 0;
        while i < sets.len() {
            accept.push(sets[i].binary_search(&self.accept).is_ok());
            let mut row = Vec::with_capacity(alphabet.len());
            for &c in alphabet {
                let moved: Vec<usize> = sets[i]
                    .iter()
                    .filter_map(|&s| match self.states[s].on {
                        Some((set, to)) if self.sets[set].contains(c) => Some(to),
                        _ => None,
                    })
                    .collect();
                work += sets[i].len();
                if moved.is_empty() {
                    row.push(None);
                    continue;
                }
                let next = self.closure(moved, &mut work)?;
                let id = match ids.get(&next) {
                    Some(&id) => id,
                    None => {
                        if sets.len() >= MAX_DFA_STATES {
                            bail!(
                                "pattern {} is too large: its automaton needs more than {MAX_DFA_STATES} states",
                                shown(&self.source)
                            )
                        }
                        ids.insert(next.clone(), sets.len());
                        sets.push(next);
                        sets.len() - 1
                    }
                };
                row.push(Some(id));
            }
            trans.push(row);
            i += 1;
        }
        Ok(CharDfa {
            alphabet: alphabet.to_vec(),
            trans,
            accept,
        })
    }
}

/// A DFA over a fixed alphabet; state 0 is the start, a missing transition
/// is the dead state.
#[derive(Debug, Clone)]
pub(crate) struct CharDfa {
    /// Sorted, distinct.
    alphabet: Vec<char>,
    trans: Vec<Vec<Option<usize>>>,
    accept: Vec<bool>,
}

impl CharDfa {
    pub(crate) fn is_accepting(&self, state: usize) -> bool {
        self.accept[state]
    }

    /// The state after reading `text` from `state`, `None` when dead.
    pub(crate) fn walk(&self, mut state: usize, text: &str) -> Option<usize> {
        for c in text.chars() {
            let a = self.alphabet.binary_search(&c).ok()?;
            state = self.trans[state][a]?;
        }
        Some(state)
    }
}
