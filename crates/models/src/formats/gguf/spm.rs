//! SentencePiece vocabularies as a GGUF file carries them
//! (`tokenizer.ggml.model` = `llama`: Llama 2, Mistral, TinyLlama, Phi-3,
//! Gemma), encoded as llama.cpp encodes them (`llm_tokenizer_spm` and
//! `tokenize` in `src/llama-vocab.cpp`).
//!
//! The encoder is written here, not built from the `tokenizers` crate: the
//! file has scores, no merges, and llama.cpp merges, of the adjacent pairs
//! whose joined text is a token, the one whose token scores highest (the
//! leftmost on a tie). The crate's BPE applies merges by rank; a merge list
//! derived from the scores (as HF's GGUF converter derives it) ranks two
//! splits of one token (`▁a`+`b`, `▁`+`ab`) apart where llama.cpp ties
//! them, and Gemma's scores do not follow its merge order at all. Decoding
//! ([`SpmVocab::decode`]) is HF's Llama tokenizer's (`▁` as a space, byte
//! tokens joined, the space the encoder prepends removed), written here
//! too, so that the vocabulary is held once: a `tokenizers` model of it
//! would keep two hash maps of every token besides.

use std::cmp::Ordering;
use std::collections::hash_map::RandomState;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;

use candle::{bail, Result};

use super::GgufFile;

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub(super) mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
}

/// SentencePiece's word boundary, which stands for a space in tokens.
const SPACE: &str = "\u{2581}";

/// A token matched whole in the text before the merges.
#[derive(Debug, Clone)]
struct Special {
    text: String,
    id: u32,
    /// Control and unknown tokens are matched only where special tokens
    /// are parsed; user-defined ones always (llama.cpp's
    /// `tokenizer_st_partition`).
    control: bool,
    /// Spaces after the token are dropped (Phi-3's tokens, as llama.cpp
    /// marks them by the model's name).
    rstrip: bool,
}

/// A SentencePiece vocabulary and llama.cpp's way of encoding with it.
#[derive(Debug, Clone)]
pub(crate) struct SpmVocab {
    label: String,
    types: Vec<i64>,
    scores: Vec<f32>,
    /// The tokens' texts and each one's id.
    ids: Texts,
    /// The id of each byte's `<0xNN>` token (else of the byte as a
    /// one-character token), if the vocabulary has one.
    bytes: Vec<Option<u32>>,
    unk: Option<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    /// Longest first, then by id.
    specials: Vec<Special>,
}

/// The tokens' texts, one after another in one buffer, and a hash table of
/// their ids: beside its text, a token takes an end offset and a table
/// slot of a `u32`, where a `HashMap<String, u32>` would hold a `String`
/// of its own and a bucket for both.
#[derive(Debug, Clone)]
struct Texts {
    text: String,
    /// Token `id`'s text is `text[ends[id - 1]..ends[id]]` (from 0 for
    /// the first).
    ends: Vec<usize>,
    /// The ids, found by their texts' hashes.
    table: hashbrown::HashTable<u32>,
    hasher: RandomState,
}

impl Texts {
    fn with_capacity(n: usize) -> Self {
        Self {
            text: String::new(),
            ends: Vec::with_capacity(n),
            table: hashbrown::HashTable::with_capacity(n),
            hasher: RandomState::new(),
        }
    }

    /// Token `id`'s text.
    fn text(&self, id: u32) -> &str {
        text_in(&self.text, &self.ends, id)
    }

    /// The id of the token whose text is `piece`.
    fn get(&self, piece: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(piece);
        self.table.find(hash, |&id| self.text(id) == piece).copied()
    }

    /// Gives `piece` the next id; the id it has already, if it has one.
    fn push(&mut self, piece: &str) -> std::result::Result<(), u32> {
        if let Some(first) = self.get(piece) {
            return Err(first);
        }
        let id = self.ends.len() as u32;
        self.text.push_str(piece);
        self.ends.push(self.text.len());
        let (text, ends, hasher) = (&self.text, &self.ends, &self.hasher);
        self.table.insert_unique(hasher.hash_one(piece), id, |&i| {
            hasher.hash_one(text_in(text, ends, i))
        });
        Ok(())
    }
}

/// The text of token `id`, `t` in the file: llama.cpp names an empty
/// token by its id, so that every token has a text of its own.
fn token_text(id: usize, t: &str) -> std::borrow::Cow<'_, str> {
    if t.is_empty() {
        format!("[EMPTY_{id}]").into()
    } else {
        t.into()
    }
}

/// Token `id`'s text in [`Texts`]' `text` and `ends`.
fn text_in<'a>(text: &'a str, ends: &[usize], id: u32) -> &'a str {
    let id = id as usize;
    &text[id.checked_sub(1).map_or(0, |i| ends[i])..ends[id]]
}

/// A piece of the text between special tokens, or a special token.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl SpmVocab {
    /// The vocabulary `tokenizer.ggml.*` describes, with llama.cpp's
    /// defaults for what the file leaves out: BOS 1, EOS 2 and unknown 0
    /// (where the vocabulary has them), a BOS added and no EOS, a space
    /// prefixed.
    pub(crate) fn from_gguf(file: &GgufFile, tokens: &[&str]) -> Result<Self> {
        let label = file.label();
        let n = tokens.len();
        if n == 0 {
            bail!("GGUF file '{label}': tokenizer.ggml.tokens is empty")
        }
        if u32::try_from(n).is_err() {
            bail!("GGUF file '{label}': tokenizer.ggml.tokens has {n} tokens, more than a u32 id holds")
        }
        let types = match file.integers("tokenizer.ggml.token_type")? {
            Some(t) if t.len() != n => bail!(
                "GGUF file '{label}': tokenizer.ggml.token_type has {} entries for {n} tokens",
                t.len()
            ),
            Some(t) => t,
            None => vec![token_type::NORMAL; n],
        };
        let scores = match file.floats("tokenizer.ggml.scores")? {
            Some(s) if s.len() != n => bail!(
                "GGUF file '{label}': tokenizer.ggml.scores has {} entries for {n} tokens",
                s.len()
            ),
            Some(s) => {
                if let Some(i) = s.iter().position(|x| x.is_nan()) {
                    bail!("GGUF file '{label}': tokenizer.ggml.scores[{i}] is NaN")
                }
                s
            }
            None => vec![0.; n],
        };
        let mut ids = Texts::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            let t = token_text(id, t);
            if let Err(first) = ids.push(&t) {
                bail!(
                    "GGUF file '{label}': tokenizer.ggml.tokens has '{}' twice (ids {first} and {id}); llama.cpp refuses such a vocabulary",
                    t.escape_debug()
                )
            }
        }
        let byte_token = |b: u8| {
            ids.get(&format!("<0x{b:02X}>")).or_else(|| {
                b.is_ascii()
                    .then(|| ids.get(&char::from(b).to_string()))
                    .flatten()
            })
        };
        let bytes = (0..=255u8).map(byte_token).collect();
        let id = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            match file.usize(&format!("tokenizer.ggml.{key}_token_id"))? {
                Some(id) if id < n => Ok(Some(id as u32)),
                Some(id) => bail!(
                    "GGUF file '{label}': metadata 'tokenizer.ggml.{key}_token_id' is {id}, past the {n} tokens of tokenizer.ggml.tokens"
                ),
                None => Ok(default.filter(|&d| (d as usize) < n)),
            }
        };
        let unk = id("unknown", Some(0))?;
        let bos = id("bos", Some(1))?;
        let eos = id("eos", Some(2))?;
        let add_bos = file.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(true);
        let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        for (add, id, what) in [(add_bos, bos, "bos"), (add_eos, eos, "eos")] {
            if add && id.is_none() {
                bail!("GGUF file '{label}': tokenizer.ggml.add_{what}_token is true but there is no tokenizer.ggml.{what}_token_id")
            }
        }
        let add_space_prefix = file.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        let name = file
            .string("general.name")
            .ok()
            .flatten()
            .unwrap_or_default()
            .to_lowercase();
        let phi3 = name.contains("phi-3") || name.contains("phi3");
        let mut specials: Vec<Special> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &t))| {
                matches!(
                    t,
                    token_type::CONTROL | token_type::USER_DEFINED | token_type::UNKNOWN
                )
            })
            .map(|(id, (text, &t))| Special {
                text: token_text(id, text).into_owned(),
                id: id as u32,
                control: t != token_type::USER_DEFINED,
                // llama.cpp's attributes for Phi-3 (`load` in llama-vocab.cpp).
                rstrip: phi3 && !matches!(*text, "<unk>" | "<s>" | "<|endoftext|>"),
            })
            .collect();
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        Ok(Self {
            label: label.to_string(),
            types,
            scores,
            ids,
            bytes,
            unk,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix,
            specials,
        })
    }

    /// The ids of `text`: with `add_special`, the BOS and EOS the file asks
    /// for; with `parse_special`, control tokens written in the text
    /// (`<s>`) become their ids (user-defined ones always do).
    pub(crate) fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut prev_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    let mut escaped = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        escaped.push_str(SPACE);
                    }
                    escaped.push_str(&t.replace(' ', SPACE));
                    self.merge(&escaped, &mut out)?;
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// `text` cut around the special tokens it holds, the longest token
    /// first (llama.cpp's `tokenizer_st_partition`).
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(text));
        for special in self.specials.iter().filter(|s| parse_special || !s.control) {
            let mut next = Vec::with_capacity(fragments.len());
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(special.text.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(special.id));
                    rest = &rest[at + special.text.len()..];
                    if special.rstrip {
                        // C's isspace: space, \t, \n, \v, \f, \r.
                        rest = rest.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` over `text` (its
    /// spaces already `▁`): one symbol per character; while some adjacent
    /// pair joins into a token, the pair whose token scores highest (the
    /// leftmost of equals) is merged; each symbol left is its token, or
    /// its bytes' tokens.
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        #[derive(Clone, Copy)]
        struct Symbol {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let count = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = i.checked_sub(1);
            s.next = (i + 1 < count).then_some(i + 1);
        }
        let mut queue = BinaryHeap::new();
        let bigram = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
            let (l, r) = (symbols[left?], symbols[right?]);
            let size = l.len + r.len;
            let id = self.ids.get(&text[l.start..l.start + size])?;
            Some(Bigram {
                score: self.scores[id as usize],
                left: left?,
                right: right?,
                size,
            })
        };
        for i in 1..count {
            queue.extend(bigram(&symbols, Some(i - 1), Some(i)));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // A pair one of whose symbols merged since it was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            symbols[b.left].len = b.size;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            queue.extend(bigram(&symbols, l.prev, Some(b.left)));
            queue.extend(bigram(&symbols, Some(b.left), r.next));
        }
        // Every merged symbol is a token (a pair is queued only if it is
        // one), so llama.cpp's `resegment` only ever splits a lone
        // character the vocabulary lacks into its bytes.
        let mut at = (count > 0).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        match self.bytes[b as usize].or(self.unk) {
                            Some(id) => out.push(id),
                            None => bail!(
                                "{}: the text holds {:?}, which the vocabulary has no token for, no byte token <0x{b:02X}> and no unknown token",
                                self.label,
                                piece
                            ),
                        }
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }

    /// Tokens in the vocabulary.
    pub(crate) fn len(&self) -> usize {
        self.types.len()
    }

    /// Token `id`'s text and, for the tokens the `tokenizers` crate would
    /// hold as added ones, whether it is special: `Some(true)` for control
    /// and unknown tokens, `Some(false)` for user-defined ones, `None` for
    /// the others; `None` past the vocabulary.
    pub(crate) fn token(&self, id: u32) -> Option<(&str, Option<bool>)> {
        let added = match *self.types.get(id as usize)? {
            token_type::CONTROL | token_type::UNKNOWN => Some(true),
            token_type::USER_DEFINED => Some(false),
            _ => None,
        };
        Some((self.ids.text(id), added))
    }

    /// The id of the token whose text is `piece`.
    pub(crate) fn token_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece)
    }

    /// The text of `ids` as HF's Llama tokenizer decodes them with
    /// `skip_special_tokens=True` (its `tokenizer.json`'s decoders
    /// `Replace("▁", " ")`, `ByteFallback`, `Fuse` and, where the encoder
    /// prefixes a space, `Strip(" ", 1, 0)`): special tokens and ids past
    /// the vocabulary skipped, `▁` a space, a run of byte tokens
    /// (`<0xE6>`) its bytes where they are UTF-8, else a U+FFFD for each,
    /// and one leading space removed.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        let flush = |out: &mut String, bytes: &mut Vec<u8>| match String::from_utf8(std::mem::take(bytes)) {
            Ok(text) => out.push_str(&text),
            Err(e) => out.extend(std::iter::repeat_n('\u{FFFD}', e.as_bytes().len())),
        };
        for &id in ids {
            let Some((text, added)) = self.token(id) else {
                continue;
            };
            if added == Some(true) {
                continue;
            }
            match byte_of(text) {
                Some(b) => bytes.push(b),
                None => {
                    flush(&mut out, &mut bytes);
                    out.push_str(&text.replace(SPACE, " "));
                }
            }
        }
        flush(&mut out, &mut bytes);
        if self.add_space_prefix && out.starts_with(' ') {
            out.remove(0);
        }
        out
    }
}

/// The byte a byte token's text (`<0xE6>`) stands for, as HF's
/// `ByteFallback` reads it.
pub(crate) fn byte_of(text: &str) -> Option<u8> {
    (text.len() == 6 && text.starts_with("<0x") && text.ends_with('>'))
        .then(|| u8::from_str_radix(&text[3..5], 16).ok())
        .flatten()
}

/// A pair of adjacent symbols whose joined text is a token.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

/// The heap's order: the highest score first, then the leftmost pair
/// (llama.cpp's `llm_bigram_spm::comparator`). Scores are never NaN.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}
