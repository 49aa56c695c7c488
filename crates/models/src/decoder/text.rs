//! The text side of a decoder folder as HF transformers saves it:
//! `tokenizer.json` (through the `tokenizers` crate, whatever its model
//! type), `tokenizer_config.json`'s decoding options, and a stream that
//! turns tokens into text as they are generated.

use std::path::Path;

use candle::{bail, Result};
use serde_json::Value;

use super::tokenizer_bounds::{guard, normalizer_growth, MAX_NORMALIZED_BYTES};
use crate::formats::files::{read_bytes, read_text, MAX_CONFIG_BYTES};
use crate::formats::gguf::{byte_of, SpmVocab};
use crate::vit::folder::json::parse_object;

/// Largest `tokenizer.json` read, in bytes (Llama 3's is 9 MB, Qwen2's
/// 7 MB, Gemma's 34 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// A folder's tokenizer: HF's fast tokenizer, encoding a prompt as
/// `tokenizer(prompt)` does (the post-processor's special tokens, such as
/// Llama's `<|begin_of_text|>`, included) and decoding as
/// `tokenizer.decode(ids, skip_special_tokens=True)` does.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Inner,
    label: String,
    /// `clean_up_tokenization_spaces`: " ." → ".", " n't" → "n't", ...
    clean_up: bool,
    /// Ids of byte-fallback tokens (`<0x41>`, SentencePiece style), sorted:
    /// a run of them decodes as one group of bytes, so their text is not
    /// final until a token of another kind follows.
    byte_tokens: Vec<u32>,
    /// Whether the decoder is GPT-2's byte-level one: tokens are bytes
    /// written as characters ([`TextTokenizer::token_bytes`]).
    byte_level: bool,
    /// Most bytes the normalizer makes of one byte of text.
    growth: f64,
    /// Ids decoding does not skip, sorted: every token's but the special
    /// ones' (an id with no token, past the vocabulary or in a hand-edited
    /// one's holes, is skipped too).
    decoded: Vec<u32>,
}

/// An id's token: its text and, for an added token, whether it is
/// special ([`TextTokenizer::tokens`]).
type TokenLookup<'a> = Box<dyn Fn(u32) -> Option<(String, Option<bool>)> + 'a>;

/// What encodes and decodes.
#[derive(Clone)]
enum Inner {
    /// HF's fast tokenizer, from a `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
    /// A GGUF file's SentencePiece vocabulary: encoded as llama.cpp
    /// encodes it, decoded as HF's Llama tokenizer decodes ([`SpmVocab`]).
    Spm(std::sync::Arc<SpmVocab>),
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("label", &self.label)
            .field("vocab_size", &self.vocab_size())
            .field("clean_up", &self.clean_up)
            .finish()
    }
}

impl TextTokenizer {
    /// Reads `dir/tokenizer.json` and, if present, `dir/tokenizer_config.json`.
    pub fn from_folder(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Reads the `tokenizer.json` file `path` and, if present, the
    /// `tokenizer_config.json` beside it.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = read_bytes(path, "tokenizer", MAX_TOKENIZER_BYTES)?;
        let config = path.with_file_name("tokenizer_config.json");
        let config = if config.exists() {
            Some((
                read_text(&config, "tokenizer config", MAX_CONFIG_BYTES)?,
                config.display().to_string(),
            ))
        } else {
            None
        };
        Self::from_json(
            &bytes,
            &path.display().to_string(),
            config.as_ref().map(|(t, l)| (t.as_str(), l.as_str())),
        )
    }

    /// Parses `tokenizer.json` bytes (`label` names the file in errors),
    /// with `tokenizer_config.json`'s text and label if there is one.
    pub fn from_json(bytes: &[u8], label: &str, config: Option<(&str, &str)>) -> Result<Self> {
        // Only the normalizer is read here (the vocabulary is skipped, not
        // built twice): it is bounded before the crate sees the file.
        #[derive(serde::Deserialize)]
        struct Normalizer {
            #[serde(default)]
            normalizer: Value,
        }
        let head: Normalizer = serde_json::from_slice(bytes).map_err(|e| {
            candle::Error::Msg(format!("{label}: not a tokenizer HF's tokenizers can read: {e}"))
        })?;
        let growth = normalizer_growth(&head.normalizer, label)?;
        let mut inner = guard(label, "not a tokenizer HF's tokenizers can read", || {
            tokenizers::Tokenizer::from_bytes(bytes)
        })?;
        // HF's `tokenizer(prompt)` neither truncates nor pads unless asked
        // (`truncation=`, `padding=`), whatever the file says: a fine-tuned
        // repo's `truncation` would cut the prompt, its `padding` append
        // end tokens.
        inner
            .with_truncation(None)
            .map_err(|e| candle::Error::Msg(format!("{label}: cannot switch truncation off: {e}")))?;
        inner.with_padding(None);
        // A file whose post-processor or model cannot encode at all (the
        // crate panics on a template naming a token it lacks) is refused
        // here, naming the file, not at every prompt.
        guard(label, "cannot encode a text", || inner.encode("a", true))?;
        let mut clean_up = false;
        if let Some((text, config_label)) = config {
            let map = parse_object(text, config_label)?;
            clean_up = match map.get("clean_up_tokenization_spaces") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => bail!(
                    "{config_label}: field 'clean_up_tokenization_spaces' must be true or false, found {other}"
                ),
            };
        }
        // By id, as the decoder sees them: a file may give two tokens one
        // id, and the decoder then reads only one of them.
        let mut byte_tokens: Vec<u32> = inner
            .get_vocab(true)
            .into_values()
            .filter(|&id| inner.id_to_token(id).is_some_and(|t| byte_of(&t).is_some()))
            .collect();
        byte_tokens.sort_unstable();
        byte_tokens.dedup();
        let added = inner.get_added_tokens_decoder();
        let mut decoded: Vec<u32> = inner
            .get_vocab(true)
            .into_values()
            .filter(|id| !added.get(id).is_some_and(|t| t.special))
            .collect();
        decoded.sort_unstable();
        decoded.dedup();
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|json| json.contains("\"ByteLevel\""));
        Ok(Self {
            inner: Inner::Hf(Box::new(inner)),
            label: label.to_string(),
            clean_up,
            byte_tokens,
            byte_level,
            growth,
            decoded,
        })
    }

    /// The tokenizer of a GGUF file's SentencePiece vocabulary (`label`
    /// names it in errors).
    pub(crate) fn from_spm(spm: SpmVocab, label: &str) -> Self {
        let ids = || 0..spm.len() as u32;
        let byte_tokens = ids()
            .filter(|&id| spm.token(id).is_some_and(|(t, _)| byte_of(t).is_some()))
            .collect();
        let decoded = ids()
            .filter(|&id| spm.token(id).is_some_and(|(_, added)| added != Some(true)))
            .collect();
        Self {
            inner: Inner::Spm(std::sync::Arc::new(spm)),
            label: label.to_string(),
            clean_up: false,
            byte_tokens,
            byte_level: false,
            // The encoder writes each space as `▁` (3 bytes) and may
            // prefix one.
            growth: 3.,
            decoded,
        }
    }

    /// The file it was read from.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Tokens the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Hf(t) => t.get_vocab_size(true),
            Inner::Spm(spm) => spm.len(),
        }
    }

    /// The id of `token` (a special token's text, say), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf(t) => t.token_to_id(token),
            Inner::Spm(spm) => spm.token_id(token),
        }
    }

    /// The ids of `text`, with the special tokens the tokenizer adds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// The ids of `text` alone, no special tokens added: a rendered chat
    /// template writes its own (`apply_chat_template` tokenizes so).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let most = text.len() as f64 * self.growth;
        if most > MAX_NORMALIZED_BYTES as f64 {
            bail!(
                "{}: its normalizer may make up to {most:.0} bytes of this {}-byte text, over the limit of {MAX_NORMALIZED_BYTES}",
                self.label,
                text.len()
            )
        }
        match &self.inner {
            // Written special tokens are read as tokens, as the `tokenizers`
            // crate reads added tokens.
            Inner::Spm(spm) => spm.encode(text, add_special_tokens, true),
            Inner::Hf(t) => {
                let enc = guard(&self.label, "cannot encode the text", || {
                    t.encode(text, add_special_tokens)
                })?;
                Ok(enc.get_ids().to_vec())
            }
        }
    }

    /// The text of `ids` without special tokens; ids the tokenizer does
    /// not know (a model's padded vocabulary) are skipped, as HF skips
    /// them. Bytes that are not UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let text = self.decode_raw(ids)?;
        Ok(if self.clean_up { clean_up(&text) } else { text })
    }

    /// [`TextTokenizer::decode`] before the clean-up.
    fn decode_raw(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => guard(&self.label, "cannot decode", || t.decode(ids, true)),
            Inner::Spm(spm) => Ok(spm.decode(ids)),
        }
    }

    /// A lookup of each id's token: its text and, for an added token,
    /// whether it is special (`None` for a token of the model's own
    /// vocabulary); `None` for an id with no token.
    fn tokens(&self) -> TokenLookup<'_> {
        match &self.inner {
            Inner::Hf(t) => {
                let added = t.get_added_tokens_decoder();
                Box::new(move |id| match added.get(&id) {
                    Some(a) => Some((a.content.clone(), Some(a.special))),
                    None => t.id_to_token(id).map(|token| (token, None)),
                })
            }
            Inner::Spm(spm) => Box::new(|id| spm.token(id).map(|(text, added)| (text.to_string(), added))),
        }
    }

    /// The bytes each of the first `n` ids stands for in decoded text,
    /// for constraints over byte strings
    /// ([`crate::generation::TokenConstraint::from_regex_bytes`]): a
    /// byte-level BPE's token through GPT-2's byte-to-character map (often
    /// part of a UTF-8 character), a byte-fallback token (`<0xE6>`) its
    /// byte, other tokens their text with SentencePiece's `▁` as a space.
    /// `None` for special tokens and ids past the tokenizer (a padded
    /// embedding's), which a constraint never allows.
    pub fn token_bytes(&self, n: usize) -> Vec<Option<Vec<u8>>> {
        let unicode_to_byte = gpt2_unicode_to_byte();
        let tokens = self.tokens();
        (0..n as u32)
            .map(|id| {
                let (token, added) = tokens(id)?;
                if let Some(special) = added {
                    return (!special).then(|| token.into_bytes());
                }
                if self.is_byte_token(id) {
                    return byte_of(&token).map(|b| vec![b]);
                }
                if self.byte_level {
                    token.chars().map(|c| unicode_to_byte.get(&c).copied()).collect()
                } else {
                    Some(token.replace('\u{2581}', " ").into_bytes())
                }
            })
            .collect()
    }

    /// Each id's piece, as llama.cpp's `llama-tokenize` shows it: an
    /// added or special token its text (`<s>`), a byte-fallback token its
    /// name (`<0xE6>`), a byte-level BPE's token its bytes (often part of
    /// a UTF-8 character: U+FFFD then), others their text with
    /// SentencePiece's `▁` as a space; `None` for an id with no token.
    pub fn pieces(&self, ids: &[u32]) -> Vec<Option<String>> {
        let unicode_to_byte = gpt2_unicode_to_byte();
        let tokens = self.tokens();
        ids.iter()
            .map(|&id| {
                let (token, added) = tokens(id)?;
                if added.is_some() {
                    return Some(token);
                }
                if self.is_byte_token(id) {
                    return Some(token);
                }
                Some(if self.byte_level {
                    let bytes: Vec<u8> = token
                        .chars()
                        .map(|c| unicode_to_byte.get(&c).copied().unwrap_or(b'?'))
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                } else {
                    token.replace('\u{2581}', " ")
                })
            })
            .collect()
    }

    /// Whether decoding skips `id`: a special token, or an id with no
    /// token.
    fn is_skipped(&self, id: u32) -> bool {
        self.decoded.binary_search(&id).is_err()
    }

    /// Whether `id` is a byte-fallback token (`<0xE6>`).
    fn is_byte_token(&self, id: u32) -> bool {
        self.byte_tokens.binary_search(&id).is_ok()
    }

    /// A stream that turns ids into text as they come.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: Vec::new(),
            shown: String::new(),
            held: String::new(),
        }
    }
}

/// HF's `clean_up_tokenization` (`tokenization_utils_base.py`): spaces
/// before punctuation and English contractions removed.
fn clean_up(text: &str) -> String {
    CLEAN_UP
        .iter()
        .fold(text.to_string(), |t, (from, to)| t.replace(from, to))
}

/// HF's `clean_up_tokenization` replacements, in its order.
const CLEAN_UP: [(&str, &str); 10] = [
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
];

/// Where `text` can be cut so that the clean-up of the two parts is the
/// clean-up of the whole: before its last space, unless that space ends a
/// `" ' "` (every pattern starts with a space, and only `" ' "` holds
/// another). The word after it waits for the next space, as HF's
/// `TextStreamer` prints only up to the last space.
fn clean_up_cut(text: &str) -> usize {
    text.rmatch_indices(' ')
        .map(|(i, _)| i)
        .find(|&i| !text[..i].ends_with(" '"))
        .unwrap_or(0)
}

/// Generated ids turned into text as they come: each call gives the text
/// that became final, never half a UTF-8 character (a token that ends in
/// the middle of one waits for the next), and the pieces, with
/// [`TextStream::finish`]'s, concatenate to [`TextTokenizer::decode`] of
/// all the ids.
///
/// The work per id is constant: only a window of the last few ids is
/// decoded, the first of them standing for the text already given out
/// (decoding the new ids alone would lose the space or the bytes a token
/// shares with the one before it: SentencePiece strips a leading space,
/// byte-level BPE splits characters). The window restarts from its last
/// id whenever all of its text is final, as the `tokenizers` crate's
/// `DecodeStream` and TGI's incremental detokenizer do. The clean-up
/// (`clean_up_tokenization_spaces`) runs over the final text up to its
/// last space, so a space is never given out that the clean-up of the
/// whole text removes (`" ."`).
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    /// The window: the ids from the last restart on.
    ids: Vec<u32>,
    /// The window's text given out so far (its first id's text counts as
    /// given out: it was, before the restart).
    shown: String,
    /// Final text the clean-up holds back: from the last space on, it may
    /// become a pattern (`" n"` of `" n't"`).
    held: String,
}

/// Ids a window holds before it restarts (when its text is final).
const STREAM_WINDOW: usize = 8;

impl TextStream<'_> {
    /// Adds `id`; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        // A trailing run of byte-fallback tokens decodes as one group,
        // which the next byte can still turn into U+FFFDs: not final yet.
        // Special tokens (and unknown ids) are skipped before decoding, so
        // the run goes on through them.
        let run = self
            .ids
            .iter()
            .rev()
            .take_while(|&&id| self.tokenizer.is_byte_token(id) || self.tokenizer.is_skipped(id))
            .count();
        let text = self.tokenizer.decode_raw(&self.ids[..self.ids.len() - run])?;
        // A trailing U+FFFD may be a character still being spelled out.
        let stable = text.trim_end_matches('\u{FFFD}');
        let settled = run == 0 && stable.len() == text.len();
        let piece = self.take(stable);
        if settled && self.ids.len() >= STREAM_WINDOW && self.shown == text {
            self.restart()?;
        }
        Ok(piece.and_then(|p| self.clean(p, false)))
    }

    /// A new window from the last id that is not a special token (those
    /// are skipped before decoding, so they add nothing anywhere), if its
    /// text alone is not empty: a window starting with SentencePiece's
    /// `▁` alone (stripped to nothing) would lose its space.
    fn restart(&mut self) -> Result<()> {
        let Some(i) = self.ids.iter().rposition(|&id| !self.tokenizer.is_skipped(id)) else {
            // Nothing but special tokens: the next token's text is the first.
            self.ids.clear();
            self.shown.clear();
            return Ok(());
        };
        let alone = self.tokenizer.decode_raw(&self.ids[i..=i])?;
        if !alone.is_empty() {
            self.ids.drain(..i);
            self.ids.truncate(1);
            self.shown = alone;
        }
        Ok(())
    }

    /// The rest of the text once generation ended (a trailing U+FFFD
    /// stays: its bytes never completed a character).
    pub fn finish(mut self) -> Result<String> {
        let text = self.tokenizer.decode_raw(&self.ids)?;
        let piece = self.take(&text).unwrap_or_default();
        Ok(self.clean(piece, true).unwrap_or_default())
    }

    /// The text decoded but not given out yet: what a stop string may
    /// already be found in.
    pub fn pending(&self) -> Result<String> {
        let text = self.tokenizer.decode_raw(&self.ids)?;
        let rest = text
            .get(self.shown.len()..)
            .filter(|_| text.starts_with(self.shown.as_str()));
        Ok(format!("{}{}", self.held, rest.unwrap_or_default()))
    }

    /// What `text` (the window's) adds to the window's text given out.
    /// Decoding more ids only appends for the tokenizers HF ships; should
    /// one rewrite what was given out, the piece starts where the two
    /// agree.
    fn take(&mut self, text: &str) -> Option<String> {
        let common = if text.starts_with(self.shown.as_str()) {
            self.shown.len()
        } else {
            text.char_indices()
                .zip(self.shown.chars())
                .take_while(|((_, a), b)| a == b)
                .last()
                .map_or(0, |((i, a), _)| i + a.len_utf8())
        };
        if text.len() <= common {
            return None;
        }
        let piece = text[common..].to_string();
        self.shown = text.to_string();
        Some(piece)
    }

    /// `piece` of final text through the clean-up; `last` when no text
    /// follows.
    fn clean(&mut self, piece: String, last: bool) -> Option<String> {
        if !self.tokenizer.clean_up {
            return (!piece.is_empty()).then_some(piece);
        }
        self.held.push_str(&piece);
        let ready = if last {
            self.held.len()
        } else {
            clean_up_cut(&self.held)
        };
        let out = clean_up(&self.held[..ready]);
        self.held.drain(..ready);
        (!out.is_empty()).then_some(out)
    }
}

/// GPT-2's byte-level alphabet read backwards: the printable bytes stand
/// for themselves, the others for the characters from U+0100 on, in order
/// (`bytes_to_unicode` in GPT-2's `encoder.py`).
fn gpt2_unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap_or(char::REPLACEMENT_CHARACTER)
            };
            (c, b)
        })
        .collect()
}
