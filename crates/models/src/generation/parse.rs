//! The syntax of constraint patterns (see [`super::pattern`]): a
//! recursive-descent parser from the pattern text to an expression tree.

use std::sync::Arc;

use candle::{bail, Result};

/// Longest pattern, in characters: real constraints are tens of
/// characters; every later stage's work grows with the length.
pub(super) const MAX_PATTERN_CHARS: usize = 4096;
/// Characters of a pattern quoted in an error message.
const SHOWN_CHARS: usize = 60;
/// Deepest nesting of groups.
const MAX_DEPTH: usize = 64;
/// Largest count in `{m,n}`.
const MAX_REPEAT: u32 = 1000;

/// `pattern` quoted for an error message, cut after [`SHOWN_CHARS`]
/// characters: an error never repeats a huge pattern whole.
pub(super) fn shown(pattern: &str) -> String {
    let n = pattern.chars().count();
    if n <= SHOWN_CHARS {
        format!("{pattern:?}")
    } else {
        let head: String = pattern.chars().take(SHOWN_CHARS).collect();
        format!("{head:?}… ({n} characters)")
    }
}

/// A set of characters: sorted, disjoint ranges, possibly complemented.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CharSet {
    ranges: Vec<(char, char)>,
    negated: bool,
}

impl CharSet {
    /// The set of `ranges` (in any order, overlapping or not), or of
    /// every character outside them when `negated`.
    fn new(mut ranges: Vec<(char, char)>, negated: bool) -> Self {
        ranges.sort_unstable();
        let mut merged: Vec<(char, char)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some((_, end)) if a <= *end || char::from_u32(*end as u32 + 1) == Some(a) => {
                    *end = (*end).max(b)
                }
                _ => merged.push((a, b)),
            }
        }
        Self {
            ranges: merged,
            negated,
        }
    }

    fn one(c: char) -> Self {
        Self::new(vec![(c, c)], false)
    }

    /// Membership by binary search over the ranges: a class of thousands
    /// of characters costs a dozen comparisons a lookup.
    pub(super) fn contains(&self, c: char) -> bool {
        let i = self.ranges.partition_point(|&(a, _)| a <= c);
        (i > 0 && c <= self.ranges[i - 1].1) != self.negated
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
pub(super) enum Node {
    Empty,
    Set(Arc<CharSet>),
    Concat(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

pub(super) struct Parser<'a> {
    chars: Vec<char>,
    pos: usize,
    src: &'a str,
}

impl Parser<'_> {
    fn err<T>(&self, what: &str) -> Result<T> {
        bail!("pattern {}: {what} at character {}", shown(self.src), self.pos)
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
        Ok(Node::Set(Arc::new(CharSet::new(ranges, negated))))
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
            '.' => Ok(Node::Set(Arc::new(CharSet::new(Vec::new(), true)))),
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
                    return Ok(Node::Set(Arc::new(CharSet::new(ranges, true))));
                }
                let ranges = self.escape(false)?;
                Ok(Node::Set(Arc::new(CharSet::new(ranges, false))))
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
            c => Ok(Node::Set(Arc::new(CharSet::one(c)))),
        }
    }
}

/// Parses a whole pattern.
pub(super) fn parse(pattern: &str) -> Result<Node> {
    // Counting stops one past the limit: a huge pattern is not walked whole.
    let n = pattern.chars().take(MAX_PATTERN_CHARS + 1).count();
    if n > MAX_PATTERN_CHARS {
        bail!(
            "pattern {} is too long: more than {MAX_PATTERN_CHARS} characters",
            shown(pattern)
        )
    }
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
    Ok(node)
}
