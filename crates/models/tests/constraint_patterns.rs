//! The pattern compiler and the allowed-token automaton, checked against an
//! independent reference: random expression trees are written out as
//! patterns, and the automaton's verdict on random strings must equal a
//! direct set-of-positions matcher over the tree. Random byte soup must
//! compile or be refused, never panic. Following the allowed tokens always
//! ends in a match within the length budget.

use anyhow::Result;
use multihead_models::generation::{Pattern, TokenConstraint};

/// xorshift64*: a fixed stream, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// An expression tree, the reference's view of a pattern.
#[derive(Debug, Clone)]
enum Re {
    Lit(char),
    /// `[..]` or `[^..]` over these characters.
    Class(Vec<char>, bool),
    Any,
    Concat(Vec<Re>),
    Alt(Vec<Re>),
    Repeat(Box<Re>, u32, Option<u32>),
}

/// Characters patterns use: the vocabulary's, and `c`, which it lacks.
const CHARS: [char; 5] = ['a', 'b', '1', '-', 'c'];

fn random_re(rng: &mut Rng, depth: usize) -> Re {
    let leaf = depth == 0 || rng.below(3) == 0;
    if leaf {
        return match rng.below(6) {
            0 => Re::Any,
            1 => {
                let n = 1 + rng.below(3);
                Re::Class((0..n).map(|_| CHARS[rng.below(5)]).collect(), rng.below(4) == 0)
            }
            _ => Re::Lit(CHARS[rng.below(5)]),
        };
    }
    let kids = |rng: &mut Rng| (0..1 + rng.below(3)).map(|_| random_re(rng, depth - 1)).collect();
    match rng.below(3) {
        0 => Re::Concat(kids(rng)),
        1 => Re::Alt(kids(rng)),
        _ => {
            let min = rng.below(3) as u32;
            let max = match rng.below(3) {
                0 => None,
                _ => Some(min + rng.below(3) as u32),
            };
            Re::Repeat(Box::new(random_re(rng, depth - 1)), min, max)
        }
    }
}

fn write(re: &Re) -> String {
    let lit = |c: char| {
        if c == '-' {
            "\\-".to_string()
        } else {
            c.to_string()
        }
    };
    match re {
        Re::Lit(c) => lit(*c),
        Re::Any => ".".into(),
        Re::Class(cs, neg) => format!(
            "[{}{}]",
            if *neg { "^" } else { "" },
            cs.iter().map(|&c| lit(c)).collect::<String>()
        ),
        Re::Concat(v) => v.iter().map(|r| format!("(?:{})", write(r))).collect(),
        Re::Alt(v) => v.iter().map(write).collect::<Vec<_>>().join("|"),
        Re::Repeat(r, min, max) => {
            let q = match (min, max) {
                (0, Some(1)) => "?".to_string(),
                (0, None) => "*".to_string(),
                (1, None) => "+".to_string(),
                (m, None) => format!("{{{m},}}"),
                (m, Some(n)) if m == n => format!("{{{m}}}"),
                (m, Some(n)) => format!("{{{m},{n}}}"),
            };
            format!("(?:{}){q}", write(r))
        }
    }
}

/// The positions where a match of `re` starting at any of `from` can end.
fn ends(re: &Re, s: &[char], from: &[bool]) -> Vec<bool> {
    let n = s.len();
    let mut out = vec![false; n + 1];
    match re {
        Re::Lit(_) | Re::Any | Re::Class(..) => {
            for i in 0..n {
                let ok = match re {
                    Re::Lit(c) => s[i] == *c,
                    Re::Any => true,
                    Re::Class(cs, neg) => cs.contains(&s[i]) != *neg,
                    _ => false,
                };
                out[i + 1] = from[i] && ok;
            }
        }
        Re::Concat(v) => {
            out = from.to_vec();
            for r in v {
                out = ends(r, s, &out);
            }
        }
        Re::Alt(v) => {
            for r in v {
                for (o, e) in out.iter_mut().zip(ends(r, s, from)) {
                    *o |= e;
                }
            }
        }
        Re::Repeat(r, min, max) => {
            let mut cur = from.to_vec();
            for _ in 0..*min {
                cur = ends(r, s, &cur);
            }
            out = cur.clone();
            let extra = max.map_or(n + 1, |m| (m - min) as usize);
            for _ in 0..extra {
                cur = ends(r, s, &cur);
                let before = out.clone();
                for (o, &e) in out.iter_mut().zip(&cur) {
                    *o |= e;
                }
                if max.is_none() && out == before {
                    break;
                }
            }
        }
    }
    out
}

fn reference_matches(re: &Re, s: &str) -> bool {
    let chars: Vec<char> = s.chars().collect();
    let mut from = vec![false; chars.len() + 1];
    from[0] = true;
    ends(re, &chars, &from)[chars.len()]
}

/// `<pad> <eos> a b 1 -` and two two-character tokens.
fn vocab() -> Vec<Option<String>> {
    let mut v = vec![None, None];
    v.extend(["a", "b", "1", "-", "ab", "1-"].map(|s| Some(s.to_string())));
    v
}
const EOS: u32 = 1;

/// Single-character token ids of `s` (all of its characters are in the
/// vocabulary).
fn ids(s: &str) -> Vec<u32> {
    s.chars()
        .map(|c| match c {
            'a' => 2,
            'b' => 3,
            '1' => 4,
            _ => 5,
        })
        .collect()
}

#[test]
fn the_automaton_agrees_with_a_reference_matcher_on_random_patterns() -> Result<()> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let vocab = vocab();
    let (mut compiled, mut conflicts, mut matched) = (0, 0, 0);
    for _ in 0..400 {
        let re = random_re(&mut rng, 3);
        let pattern = write(&re);
        let p = Pattern::new(&pattern).map_err(|e| anyhow::anyhow!("{pattern}: {e}"))?;
        // Strings over the vocabulary's characters, short and long.
        let samples: Vec<String> = (0..60)
            .map(|_| (0..rng.below(7)).map(|_| CHARS[rng.below(4)]).collect())
            .collect();
        match TokenConstraint::new(&p, &vocab, EOS) {
            Ok(c) => {
                compiled += 1;
                for s in &samples {
                    let want = reference_matches(&re, s);
                    assert_eq!(c.matches(&ids(s)), want, "pattern {pattern:?} on {s:?}");
                    matched += usize::from(want);
                }
            }
            Err(e) => {
                // Refused: then no string of the vocabulary's characters
                // matches.
                assert!(
                    e.to_string().contains("conflicts with the vocabulary"),
                    "{pattern}: {e}"
                );
                for s in &samples {
                    assert!(
                        !reference_matches(&re, s),
                        "{pattern:?} refused but matches {s:?}"
                    );
                }
                conflicts += 1;
            }
        }
    }
    // The generator exercises both outcomes and real matches.
    assert!(
        compiled > 100 && conflicts > 5 && matched > 500,
        "{compiled} {conflicts} {matched}"
    );
    Ok(())
}

#[test]
fn following_the_allowed_tokens_always_ends_in_a_match() -> Result<()> {
    let mut rng = Rng(42);
    let vocab = vocab();
    let max_len = 9;
    let mut walks = 0;
    for _ in 0..300 {
        let re = random_re(&mut rng, 3);
        let Ok(c) = TokenConstraint::from_pattern(&write(&re), &vocab, EOS) else {
            continue;
        };
        if c.check_max_len(max_len).is_err() {
            continue;
        }
        for _ in 0..20 {
            let mut prefix = Vec::new();
            loop {
                let allowed = c.allowed(&prefix, max_len - prefix.len());
                assert!(!allowed.is_empty(), "{:?} stuck after {prefix:?}", c.pattern());
                let t = allowed[rng.below(allowed.len())];
                if t == EOS {
                    break;
                }
                prefix.push(t);
                assert!(prefix.len() < max_len, "{:?} ran past max_len", c.pattern());
            }
            assert!(
                c.matches(&prefix),
                "{:?} ended without a match: {prefix:?}",
                c.pattern()
            );
            walks += 1;
        }
    }
    assert!(walks > 1000, "{walks}");
    Ok(())
}

#[test]
fn any_string_compiles_or_is_refused_without_panicking() {
    let mut rng = Rng(7);
    let atoms = [
        "a", "b", "1", "-", "(", ")", "(?:", "[", "]", "^", "$", "|", "*", "+", "?", "{", "}", ",", "\\",
        "\\d", "\\w", "\\D", ".", "2", "9", "{2}", "{1,3}", "{999}", "{3,1}", "[a-", "é", "\u{0}",
    ];
    let vocab = vocab();
    // MULTIHEAD_PATTERN_SOUP=N runs N strings instead (a longer hunt, like
    // the fuzz target's, without nightly).
    let n = std::env::var("MULTIHEAD_PATTERN_SOUP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    for _ in 0..n {
        let s: String = (0..rng.below(14))
            .map(|_| atoms[rng.below(atoms.len())])
            .collect();
        if let Ok(p) = Pattern::new(&s) {
            let _ = TokenConstraint::new(&p, &vocab, EOS);
        }
    }
}

#[test]
fn refusals_say_what_is_wrong() {
    let vocab = vocab();
    for (pattern, needle) in [
        ("(a", "unclosed '('"),
        ("a)", "unmatched ')'"),
        ("[a-", "unclosed '['"),
        ("[]", "empty class"),
        ("[b-a]", "reversed"),
        ("a{3,1}", "maximum below its minimum"),
        ("a{1001}", "above 1000"),
        ("*a", "nothing to repeat"),
        ("a**", "cannot follow a quantifier"),
        ("^a$", "anchors"),
        ("\\q", "unknown escape"),
        ("(?=a)", "only (?:...)"),
        ("(?:(?:a{1000}){1000}){1000}", "too large"),
        ("c", "conflicts with the vocabulary"),
        ("a|c+", ""),
    ] {
        let got = TokenConstraint::from_pattern(pattern, &vocab, EOS);
        check(pattern, needle, got);
    }
    // 70 nested groups: past the nesting limit of 64.
    let deep = format!("{}a{}", "(".repeat(70), ")".repeat(70));
    check(
        &deep,
        "nested deeper",
        TokenConstraint::from_pattern(&deep, &vocab, EOS),
    );

    fn check(pattern: &str, needle: &str, got: candle::Result<TokenConstraint>) {
        match (needle, got) {
            // "a|c+": c is missing, but "a" still matches: accepted.
            ("", g) => assert!(g.is_ok(), "{pattern}: {:?}", g.err()),
            (needle, Ok(_)) => panic!("{pattern:?} accepted, expected {needle:?}"),
            (needle, Err(e)) => {
                let e = e.to_string();
                assert!(e.contains(needle), "{pattern:?}: expected {needle:?} in {e:?}");
                assert!(e.contains("pattern"), "{e}");
            }
        }
    }
}

#[test]
fn multi_character_tokens_follow_the_pattern() -> Result<()> {
    let c = TokenConstraint::from_pattern("ab1-", &vocab(), EOS)?;
    // "ab" (6) then "1-" (7): two tokens for four characters.
    assert_eq!(c.min_tokens(), 2);
    assert!(c.matches(&[6, 7]) && c.matches(&[2, 3, 4, 5]) && c.matches(&[6, 4, 5]));
    assert!(!c.matches(&[6]) && !c.matches(&[7, 6]));
    // Three tokens left (two and the end): only "ab" can start.
    assert_eq!(c.allowed(&[], 3), [6]);
    Ok(())
}

#[test]
fn a_big_vocabulary_times_a_big_automaton_is_refused_not_allocated() {
    // 69,904 tokens (every string of 1 to 4 letters a-p) and a pattern of
    // 4,000 letters: 4,001 states × 69,904 tokens is 280 M table entries,
    // past the 16 M limit.
    let letters: Vec<char> = ('a'..='p').collect();
    let mut vocab: Vec<Option<String>> = vec![None];
    let mut layer = vec![String::new()];
    for _ in 0..4 {
        layer = layer
            .iter()
            .flat_map(|p| letters.iter().map(move |c| format!("{p}{c}")))
            .collect();
        vocab.extend(layer.iter().cloned().map(Some));
    }
    assert_eq!(vocab.len(), 69_905);
    let err = TokenConstraint::from_pattern("(?:[a-p]{1000}){4}", &vocab, 0)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("too large for a vocabulary")),
        "{err:?}"
    );
}

/// A 50-million-character pattern is refused before it is parsed, with an
/// error that quotes only its start; a class of thousands of characters
/// repeated costs binary searches, not scans.
/// The first line of the error `res` must hold (candle appends a
/// backtrace to it under `RUST_BACKTRACE`).
fn first_error_line<T: std::fmt::Debug>(res: candle::Result<T>) -> String {
    let err = res.expect_err("accepted").to_string();
    err.lines().next().unwrap_or_default().to_string()
}

#[test]
fn huge_patterns_and_classes_are_bounded() -> Result<()> {
    let huge = "a".repeat(50_000_000);
    let err = first_error_line(Pattern::new(&huge));
    assert!(err.contains("too long: more than 4096 characters"), "{err}");
    assert!(err.len() < 300, "{} bytes of error: {err}", err.len());
    // An error deep in a long pattern quotes its start only.
    let err = first_error_line(Pattern::new(&format!("{}(", "b".repeat(4000))));
    assert!(err.contains("(4001 characters)") && err.len() < 300, "{err}");

    // 20,000 one-character CJK tokens; a class of 4,000 of them, 200 times.
    let cjk: Vec<char> = (0x4E00u32..0x4E00 + 20_000).filter_map(char::from_u32).collect();
    let mut tokens: Vec<Option<String>> = vec![None];
    tokens.extend(cjk.iter().map(|c| Some(c.to_string())));
    let class: String = cjk[..4000].iter().collect();
    let c = TokenConstraint::from_pattern(&format!("[{class}]{{200}}"), &tokens, 0)?;
    assert_eq!(c.min_tokens(), 200);
    let too_big: String = cjk.iter().collect();
    let err = first_error_line(TokenConstraint::from_pattern(
        &format!("[{too_big}]{{200}}"),
        &tokens,
        0,
    ));
    assert!(err.contains("too long") && err.len() < 400, "{err}");
    Ok(())
}
