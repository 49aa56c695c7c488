//! Any string handed to the constraint-pattern compiler, or to the regex
//! constraint over byte tokens, compiles or is refused with an error: no
//! panic, no hang (every stage is bounded), and a compiled automaton never
//! offers a token that leads nowhere.

#![no_main]

use libfuzzer_sys::fuzz_target;
use multihead_models::generation::{Pattern, TokenConstraint};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The same text as a regex over byte tokens, some of them part of a
    // character.
    let bytes: Vec<Option<Vec<u8>>> = [&b""[..], b"0", b"1", b"-", b"20", b"\xE6", b"\x97\xA5", "\u{65e5}".as_bytes()]
        .iter()
        .map(|b| Some(b.to_vec()))
        .collect();
    if let Ok(c) = TokenConstraint::from_regex_bytes(text, &bytes, 0) {
        walk(&c, 0);
    }
    let Ok(pattern) = Pattern::new(text) else {
        return;
    };
    // The date model's target vocabulary, plus a two-character token.
    let mut vocab: Vec<Option<String>> = vec![None, None, None];
    vocab.extend("0123456789-".chars().map(|c| Some(c.to_string())));
    vocab.push(Some("20".to_string()));
    if let Ok(c) = TokenConstraint::new(&pattern, &vocab, 2) {
        walk(&c, 2);
    }
});

/// Walks the automaton, always taking the first allowed token: it must end
/// in a match within the budget whenever the budget fits.
fn walk(c: &TokenConstraint, eos: u32) {
    let max_len = 16;
    if c.check_max_len(max_len).is_err() {
        return;
    }
    let mut prefix = Vec::new();
    loop {
        let allowed = c.allowed(&prefix, max_len - prefix.len());
        assert!(!allowed.is_empty(), "stuck after {prefix:?}");
        if allowed[0] == eos {
            break;
        }
        prefix.push(allowed[0]);
        assert!(prefix.len() < max_len, "ran past max_len");
    }
    assert!(c.matches(&prefix));
}
