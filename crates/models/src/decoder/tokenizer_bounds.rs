//! A `tokenizer.json` is untrusted input to the `tokenizers` crate, which
//! panics on some files (a `Replace` normalizer whose pattern is empty)
//! and does whatever work a file asks (normalizers nested to grow a prompt
//! a thousandfold and more). Here its calls are fenced: panics come back
//! as errors naming the file, and the normalizer's growth is bounded
//! before any text goes through it.

use candle::{bail, Result};
use serde_json::Value;

/// Most bytes the normalizer may make of one text: the tokenizer's own
/// buffers take several times that.
pub(crate) const MAX_NORMALIZED_BYTES: usize = 64 << 20;

/// Most bytes a normalizer may make of one byte. Real ones stay near 10
/// (SentencePiece's `▁` prefix and spaces: 4 x 3; NFKC's worst character
/// 11); a file past this is refused when read.
const MAX_GROWTH: f64 = 4096.;

/// Normalizers nested deeper than this are refused (real files: 2).
const MAX_DEPTH: usize = 16;

/// Runs `f`, a call into the `tokenizers` crate on the file `label`:
/// its error becomes `"{label}: {failed}: {error}"`, and its panic an
/// error naming the file too.
pub(crate) fn guard<T>(label: &str, failed: &str, f: impl FnOnce() -> tokenizers::Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => bail!("{label}: {failed}: {e}"),
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            bail!("{label}: {failed}: the tokenizers crate panicked on this file: {why}")
        }
    }
}

/// The most bytes `normalizer` (the file's `normalizer` field) makes of
/// one byte of text, refusing a pattern that matches nothing (the
/// `tokenizers` crate panics on it) and growth past [`MAX_GROWTH`].
pub(crate) fn normalizer_growth(normalizer: &Value, label: &str) -> Result<f64> {
    let growth = growth(normalizer, "normalizer", 0, label)?;
    if growth > MAX_GROWTH {
        bail!(
            "{label}: field 'normalizer' can make {growth:.0} bytes of one byte of text, over the limit of {MAX_GROWTH}"
        )
    }
    Ok(growth)
}

fn growth(n: &Value, field: &str, depth: usize, label: &str) -> Result<f64> {
    if n.is_null() {
        return Ok(1.);
    }
    if depth > MAX_DEPTH {
        bail!("{label}: field '{field}' nests normalizers deeper than {MAX_DEPTH}")
    }
    let kind = n.get("type").and_then(Value::as_str).unwrap_or_default();
    let text = |key: &str| n.get(key).and_then(Value::as_str).unwrap_or_default();
    Ok(match kind {
        "Sequence" => {
            let parts = n.get("normalizers").and_then(Value::as_array);
            let mut total = 1f64;
            for (i, part) in parts.into_iter().flatten().enumerate() {
                total *= growth(part, &format!("{field}.normalizers[{i}]"), depth + 1, label)?;
                // Refused anyway past this; kept finite for the message.
                total = total.min(1e15);
            }
            total
        }
        "Replace" => {
            let pattern = n.get("pattern");
            let shortest = match pattern {
                Some(p) if p.get("String").is_some() => p["String"].as_str().map(str::len),
                Some(p) if p.get("Regex").is_some() => p["Regex"].as_str().map(shortest_match),
                _ => None,
            };
            match shortest {
                Some(0) => bail!(
                    "{label}: field '{field}.pattern' matches the empty string: a Replace needs something to replace"
                ),
                Some(m) => (text("content").len() as f64 / m as f64).max(1.),
                // Not a pattern the crate reads: it refuses the file itself.
                None => 1.,
            }
        }
        // Each piece of text between special tokens is prefixed: at worst
        // every byte is such a piece.
        "Prepend" => 1. + text("prepend").len() as f64,
        // Chinese characters spaced (3 bytes to 5), lowercase ('İ' to 'i̇').
        "BertNormalizer" | "Lowercase" => 3.,
        // Canonical forms: at most 4 characters for one (3 bytes to 8).
        "NFC" | "NFD" => 3.,
        // Compatibility forms: U+FDFA is 18 characters, 3 bytes to 33.
        "NFKC" | "NFKD" => 11.,
        // Each byte written as a character of one or two bytes.
        "ByteLevel" => 2.,
        "Precompiled" => precompiled_growth(text("precompiled_charsmap")),
        // Strip, StripAccents, Nmt only remove or replace one for one.
        _ => 1.,
    })
}

/// The fewest bytes `regex` can match (onig syntax, read as the `regex`
/// crate reads it; one the latter cannot read counts as 1 byte, the
/// shortest match but the empty one).
fn shortest_match(regex: &str) -> usize {
    regex_automata::util::syntax::parse(regex)
        .ok()
        .and_then(|hir| hir.properties().minimum_len())
        .unwrap_or(1)
}

/// SentencePiece's `precompiled_charsmap`: a trie of input strings, then
/// their replacements, each ended by a NUL. A replacement is made of at
/// least one byte of input, so its length bounds the growth.
fn precompiled_growth(base64: &str) -> f64 {
    let Ok(bytes) = base64::decode(base64) else {
        // Not base64: the crate refuses the file itself.
        return 1.;
    };
    let trie = bytes
        .get(..4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let replacements = bytes.get(4 + trie..).unwrap_or_default();
    let longest = replacements
        .split(|&b| b == 0)
        .map(<[u8]>::len)
        .max()
        .unwrap_or(0);
    longest.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_multiplies_through_sequences() {
        // Llama 2's: "▁" before the text, every " " made "▁" (1 byte to 3).
        let llama2: Value = serde_json::from_str(
            r#"{"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}"#,
        )
        .unwrap();
        assert_eq!(normalizer_growth(&llama2, "t").unwrap(), 4. * 3.);
        let nested = format!(
            r#"{{"type": "Sequence", "normalizers": [{}]}}"#,
            [r#"{"type": "Replace", "pattern": {"String": "a"}, "content": "aaaaaaaaaa"}"#; 5].join(",")
        );
        let err = normalizer_growth(&serde_json::from_str(&nested).unwrap(), "t.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.json: field 'normalizer' can make"), "{err}");
        let empty: Value =
            serde_json::from_str(r#"{"type": "Replace", "pattern": {"Regex": "x*"}, "content": "y"}"#)
                .unwrap();
        let err = normalizer_growth(&empty, "t.json").unwrap_err().to_string();
        assert!(
            err.contains("'normalizer.pattern' matches the empty string"),
            "{err}"
        );
    }
}
