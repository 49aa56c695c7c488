//! Character vocabularies: the `vocab.json` that `scripts/train_dates.py`
//! writes.

use candle::Result;
use serde::{Deserialize, Serialize};

/// Source and target characters by id. An entry longer than one character
/// (`<pad>`, `<bos>`, `<eos>`) is a special token: never produced by
/// [`CharVocab::encode`], skipped by [`CharVocab::decode`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CharVocab {
    /// Source entries; id = index.
    pub src: Vec<String>,
    /// Target entries; id = index.
    pub tgt: Vec<String>,
}

fn single_char(s: &str) -> Option<char> {
    let mut it = s.chars();
    match (it.next(), it.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

impl CharVocab {
    /// Parses `vocab.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| candle::Error::Msg(format!("vocab.json: {e}")))
    }

    /// Source ids of `text`, one per character, or an error naming the
    /// first character the vocabulary lacks and its position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(
                |(pos, c)| match self.src.iter().position(|s| single_char(s) == Some(c)) {
                    Some(id) => Ok(id as u32),
                    // A plain message, no backtrace: this is the user's
                    // input, not a bug.
                    None => Err(candle::Error::Msg(format!(
                        "character {c:?} (U+{:04X}) at position {pos} is not in the model's vocabulary",
                        c as u32
                    ))),
                },
            )
            .collect()
    }

    /// The text of target ids; special tokens and unknown ids are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .filter_map(|&i| self.tgt.get(i as usize).and_then(|s| single_char(s)))
            .collect()
    }

    /// The id of a special source entry such as `<dmy>`, if the
    /// vocabulary has it.
    pub fn src_special(&self, name: &str) -> Option<u32> {
        if single_char(name).is_some() {
            return None;
        }
        self.src.iter().position(|s| s == name).map(|i| i as u32)
    }

    /// Each target id's text, `None` for special tokens: what
    /// [`crate::generation::TokenConstraint::new`] reads.
    pub fn tgt_tokens(&self) -> Vec<Option<String>> {
        self.tgt
            .iter()
            .map(|s| single_char(s).map(String::from))
            .collect()
    }

    /// The source entry of an id, for labels (`?` when out of range).
    pub fn src_token(&self, id: u32) -> &str {
        self.src.get(id as usize).map_or("?", String::as_str)
    }
}
