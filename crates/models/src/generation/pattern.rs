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

use candle::{bail, Result};

/// Deepest nesting of groups.
const MAX_DEPTH: usize = 64;
/// Largest count in `{m,n}`.
const MAX_REPEAT: u32 = 1000;
/// Most NFA states a pattern may compile to.
const MAX_NFA_STATES: usize = 10_000;
/// Most DFA states the subset construction may build.
const MAX_DFA_STATES: usize = 4_096;
/// Most NFA-state visits the subset construction may make.
const MAX_WORK: usize = 20_000_000;

/// A set of characters: ranges, possibly complemented.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CharSet {
    ranges: Vec<(char, char)>,
    negated: bool,
}

impl CharSet {
    fn one(c: char) -> Self {
        Self {
            ranges: vec![(c, c)],
            negated: false,
        }
    }

    fn contains(&self, c: char) -> bool {
        self.ranges.iter().any(|&(a, b)| a <= c && c <= b) != self.negated
    }
}

fn digit() -> Vec<(char, char)> {
    vec![('0', '9')]
}

fn word() -> Vec<(char, char)> {
    vec![('0', '9'), ('A', 'Z'), ('_', '_'), ('a', 'z')]
}

fn space() -> Vec<(char, char)> {
    vec![('\t', '\r'), (' ', ' ')]
}

#[derive(Debug, Clone)]
enum Node {
    Empty,
    Set(CharSet),
    Concat(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

struct Parser<'a> {
    chars: Vec<char>,
    pos: usize,
    src: &'a str,
}

impl Parser<'_> {
    fn err<T>(&self, what: &str) -> Result<T> {
        bail!("pattern {:?}: {what} at character {}", self.src, self.pos)
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn alt(&mut self, depth: usize) -> Result<Node> {
        if depth > MAX_DEPTH {
            return self.err(&format!("groups nested deeper than {MAX_DEPTH}"));
        }
        let mut branches = vec![self.concat(depth)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            branches.push(self.concat(depth)?);
        }
        Ok(if branches.len() == 1 {
            branches.remove(0)
        } else {
            Node::Alt(branches)
        })
    }

    fn concat(&mut self, depth: usize) -> Result<Node> {
        let mut items = Vec::new();
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            let atom = self.atom(depth)?;
            items.push(self.quantified(atom)?);
        }
        Ok(match items.len() {
            0 => Node::Empty,
            1 => items.remove(0),
            _ => Node::Concat(items),
        })
    }

    fn number(&mut self) -> Result<Option<u32>> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        if self.pos == start {
            return Ok(None);
        }
        let text: String = self.chars[start..self.pos].iter().collect();
        match text.parse::<u32>() {
            Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
            _ => self.err(&format!("repetition count {text} above {MAX_REPEAT}")),
        }
    }

    fn quantified(&mut self, atom: Node) -> Result<Node> {
        let (min, max) = match self.peek() {
            Some('?') => (0, Some(1)),
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('{') => {
                self.pos += 1;
                let Some(min) = self.number()? else {
                    return self.err("expected a count after '{'");
                };
                let max = if self.peek() == Some(',') {
                    self.pos += 1;
                    self.number()?
                } else {
                    Some(min)
                };
                if self.peek() != Some('}') {
                    return self.err("expected '}' to close the repetition");
                }
                if let Some(max) = max {
                    if max < min {
                        return self.err(&format!(
                            "repetition {{{min},{max}}} has its maximum below its minimum"
                        ));
                    }
                }
                (min, max)
            }
            _ => return Ok(atom),
        };
        self.pos += 1;
        if matches!(self.peek(), Some('?' | '*' | '+' | '{')) {
            return self.err("a quantifier cannot follow a quantifier (wrap the first in a group)");
        }
        Ok(Node::Repeat(Box::new(atom), min, max))
    }

    fn escape(&mut self, in_class: bool) -> Result<Vec<(char, char)>> {
        // After the backslash; returns the ranges (complemented classes are
        // only allowed outside brackets, see `atom`).
        let Some(c) = self.peek() else {
            return self.err("the pattern ends with a lone '\\'");
        };
        self.pos += 1;
        Ok(match c {
            'd' => digit(),
            'w' => word(),
            's' => space(),
            'n' => vec![('\n', '\n')],
            't' => vec![('\t', '\t')],
            'D' | 'W' | 'S' if in_class => {
                self.pos -= 1;
                return self.err("\\D, \\W and \\S are not supported inside [...]");
            }
            c if c.is_alphanumeric() => {
                self.pos -= 1;
                return self.err(&format!("unknown escape \\{c}"));
            }
            c => vec![(c, c)],
        })
    }

    fn class(&mut self) -> Result<Node> {
        // After '['.
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            let Some(c) = self.peek() else {
                return self.err("unclosed '['");
            };
            self.pos += 1;
            let lo = match c {
                ']' => break,
                '\\' => {
                    let r = self.escape(true)?;
                    if r.len() != 1 || r[0].0 != r[0].1 {
                        ranges.extend(r);
                        continue;
                    }
                    r[0].0
                }
                '[' => return self.err("'[' inside a class must be escaped"),
                c => c,
            };
            // A range `lo-hi`, unless '-' is last.
            if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&c| c != ']') {
                self.pos += 1;
                let hi = match self.peek() {
                    Some('\\') => {
                        self.pos += 1;
                        let r = self.escape(true)?;
                        if r.len() != 1 || r[0].0 != r[0].1 {
                            return self.err("a class like \\d cannot end a range");
                        }
                        r[0].0
                    }
                    Some(c) => {
                        self.pos += 1;
                        c
                    }
                    None => return self.err("unclosed '['"),
                };
                if hi < lo {
                    return self.err(&format!("range {lo}-{hi} is reversed"));
                }
                ranges.push((lo, hi));
            } else {
                ranges.push((lo, lo));
            }
        }
        if ranges.is_empty() {
            return self.err("empty class []");
        }
        Ok(Node::Set(CharSet { ranges, negated }))
    }

    fn atom(&mut self, depth: usize) -> Result<Node> {
        let Some(c) = self.peek() else {
            return self.err("unexpected end");
        };
        self.pos += 1;
        match c {
            '(' => {
                if self.peek() == Some('?') {
                    if self.chars.get(self.pos + 1) == Some(&':') {
                        self.pos += 2;
                    } else {
                        return self.err("only (?:...) groups are supported");
                    }
                }
                let inner = self.alt(depth + 1)?;
                if self.peek() != Some(')') {
                    return self.err("unclosed '('");
                }
                self.pos += 1;
                Ok(inner)
            }
            '[' => self.class(),
            '.' => Ok(Node::Set(CharSet {
                ranges: Vec::new(),
                negated: true,
            })),
            '\\' => {
                let neg = matches!(self.peek(), Some('D' | 'W' | 'S'));
                if neg {
                    let c = self.peek().map(|c| c.to_ascii_lowercase());
                    self.pos += 1;
                    let ranges = match c {
                        Some('d') => digit(),
                        Some('w') => word(),
                        _ => space(),
                    };
                    return Ok(Node::Set(CharSet {
                        ranges,
                        negated: true,
                    }));
                }
                let ranges = self.escape(false)?;
                Ok(Node::Set(CharSet {
                    ranges,
                    negated: false,
                }))
            }
            '?' | '*' | '+' | '{' => {
                self.pos -= 1;
                self.err(&format!("nothing to repeat before '{c}'"))
            }
            '^' | '$' => {
                self.pos -= 1;
                self.err("anchors are not supported: a pattern always matches the whole output")
            }
            ']' | '}' => {
                self.pos -= 1;
                self.err(&format!("unmatched '{c}' (escape it as \\{c})"))
            }
            c => Ok(Node::Set(CharSet::one(c))),
        }
    }
}

/// One NFA state: ε-moves and at most one character move.
#[derive(Debug, Clone, Default)]
struct NState {
    eps: Vec<usize>,
    on: Option<(usize, usize)>,
}

/// A parsed pattern, compiled to an NFA; [`Pattern::dfa`] specialises it
/// to an alphabet.
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    sets: Vec<CharSet>,
    states: Vec<NState>,
    start: usize,
    accept: usize,
}

impl Pattern {
    /// Parses and compiles `pattern`, or says what is wrong and where.
    pub fn new(pattern: &str) -> Result<Self> {
        let mut p = Parser {
            chars: pattern.chars().collect(),
            pos: 0,
            src: pattern,
        };
        let node = p.alt(0)?;
        if p.pos != p.chars.len() {
            // Only a ')' stops the top level early.
            return p.err("unmatched ')'");
        }
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
                "pattern {:?} is too large: it compiles to more than {MAX_NFA_STATES} states (lower its repetition counts)",
                self.source
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
            bail!("pattern {:?} is too complex to compile", self.source)
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
                                "pattern {:?} is too large: its automaton needs more than {MAX_DFA_STATES} states",
                                self.source
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
    pub(crate) fn len(&self) -> usize {
        self.trans.len()
    }

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
