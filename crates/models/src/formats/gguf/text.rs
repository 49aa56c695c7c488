//! The text side of a GGUF file: the byte-level BPE tokenizer its
//! `tokenizer.ggml.*` metadata carries, rebuilt for the `tokenizers`
//! crate as HF's `tokenizer.json` would have it; its end tokens; its chat
//! template; and [`TextGenerator::from_gguf`], which holds them with the
//! model.

use std::collections::BTreeMap;
use std::path::Path;

use candle::{bail, Device, Result};
use serde_json::{json, Map, Value};

use super::spm::token_type::{CONTROL, USER_DEFINED};
use super::spm::SpmVocab;
use super::GgufFile;
use crate::checkpoint::LoadOptions;
use crate::decoder::{ChatTemplate, DecoderModel, HfGenerationConfig, TextGenerator, TextTokenizer};

/// GPT-2's split (the `tokenizers` crate's `ByteLevel` regex).
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split, as its `tokenizer.json` writes it.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: digits one by one.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's: Qwen2's with combining marks inside words.
const QWEN35_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek LLM's cased letters (its `tokenizer.json`'s class).
const DEEPSEEK_LLM_LETTERS: &str = r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";
/// DeepSeek LLM's punctuation.
const DEEPSEEK_LLM_PUNCT: &str = r"\s?[!-/:-~！-／：-～‘-‟\x{3000}-。]+";
/// [一-龥ࠀ-一가-\x{D7FF}]+ ideographs and Hangul, split from the rest by DeepSeek's models.
const DEEPSEEK_CJK: &str = r"[一-龥ࠀ-一가-\x{D7FF}]+";

/// A byte-level BPE's pre-tokenizer: each regex in turn cuts every piece
/// into its matches and the text between them (HF's `Split` with
/// `Isolated`, llama.cpp's `unicode_regex_split`), before GPT-2's bytes
/// to characters.
#[derive(Debug, Clone, Copy)]
struct Pre {
    /// The `tokenizer.ggml.pre` values, as llama.cpp names them
    /// (`src/llama-vocab.cpp`).
    names: &'static [&'static str],
    /// The regexes of llama.cpp's `llm_tokenizer_bpe` for it, as the
    /// models' `tokenizer.json` files write them.
    splits: &'static [&'static str],
    /// Text goes through NFC first (the models' `tokenizer.json`).
    nfc: bool,
    /// Whole words in the vocabulary skip the merges; a BOS token by
    /// default (llama.cpp's Llama 3 settings).
    llama3: bool,
}

/// The pre-tokenizers rebuilt.
const PRES: [Pre; 9] = [
    Pre {
        names: &["gpt-2", "mpt"],
        splits: &[GPT2_REGEX],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["llama3", "llama-v3", "llama-bpe", "falcon3"],
        splits: &[LLAMA3_REGEX],
        nfc: false,
        llama3: true,
    },
    Pre {
        names: &["qwen2", "deepseek-r1-qwen"],
        splits: &[QWEN2_REGEX],
        nfc: true,
        llama3: false,
    },
    Pre {
        names: &["qwen35"],
        splits: &[QWEN35_REGEX],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["deepseek-llm"],
        splits: &[
            r"[\r\n]",
            DEEPSEEK_LLM_LETTERS,
            DEEPSEEK_LLM_PUNCT,
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["deepseek-coder"],
        splits: &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["falcon"],
        splits: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]"],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["starcoder", "refact", "smollm"],
        splits: &[r"\p{N}", GPT2_REGEX],
        nfc: false,
        llama3: false,
    },
    Pre {
        names: &["command-r"],
        splits: &[r"\p{N}", GPT2_REGEX],
        nfc: true,
        llama3: false,
    },
];

/// The `tokenizer.ggml.pre` values rebuilt, as llama.cpp names them.
pub const GGUF_PRE_TOKENIZERS: [&str; 16] = [
    "gpt-2",
    "mpt",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "qwen2",
    "deepseek-r1-qwen",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "smollm",
    "command-r",
];

impl Pre {
    fn of(name: &str) -> Option<Self> {
        PRES.into_iter().find(|p| p.names.contains(&name))
    }

    fn pre_tokenizer(self) -> Value {
        let mut steps: Vec<Value> = self
            .splits
            .iter()
            .map(|regex| {
                json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
            })
            .collect();
        steps.push(
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
        );
        json!({"type": "Sequence", "pretokenizers": steps})
    }
}

/// The error for a file whose tokenizer is not rebuilt.
fn needs_tokenizer(label: &str, why: &str) -> candle::Error {
    candle::Error::Msg(format!(
        "GGUF file '{label}': {why}; pass the model's tokenizer.json with --tokenizer \
         (TextGenerator::from_gguf's `tokenizer`)"
    ))
}

/// The token whose id `key` names, if the file names one.
fn token_id(file: &GgufFile, key: &str, tokens: usize) -> Result<Option<u32>> {
    match file.usize(key)? {
        None => Ok(None),
        Some(id) if id < tokens => Ok(Some(id as u32)),
        Some(id) => bail!(
            "GGUF file '{}': metadata '{key}' is {id}, past the {tokens} tokens of tokenizer.ggml.tokens",
            file.label()
        ),
    }
}

impl TextTokenizer {
    /// The tokenizer a GGUF file carries: a SentencePiece vocabulary
    /// (`tokenizer.ggml.model` `llama`), encoded as llama.cpp encodes it
    /// (scores, token types, byte fallback, `add_space_prefix`), or a
    /// byte-level BPE (`gpt2`) with a pre-tokenizer of
    /// [`GGUF_PRE_TOKENIZERS`], rebuilt as HF's `tokenizer.json` has it.
    /// BOS/EOS are added where `tokenizer.ggml.add_bos_token` /
    /// `add_eos_token` say. Another model, another pre-tokenizer or a
    /// tokenizer the `tokenizers` crate cannot build is refused with an
    /// error that names it and asks for the tokenizer.json.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let label = file.label();
        let model = match file.string("tokenizer.ggml.model")? {
            Some(m) => m,
            None => {
                return Err(needs_tokenizer(
                    label,
                    "it carries no tokenizer (no tokenizer.ggml.model)",
                ))
            }
        };
        match model {
            "gpt2" => {}
            "llama" => return Self::from_gguf_spm(file),
            other => {
                return Err(needs_tokenizer(
                    label,
                    &format!(
                        "tokenizer.ggml.model '{}' is not rebuilt (only SentencePiece, 'llama', and byte-level BPE, 'gpt2')",
                        other.escape_debug()
                    ),
                ))
            }
        }
        let pre = match file.string("tokenizer.ggml.pre")? {
            Some(name) => Pre::of(name).ok_or_else(|| {
                needs_tokenizer(
                    label,
                    &format!(
                        "tokenizer.ggml.pre '{}' is not one whose pre-tokenizer is rebuilt ({})",
                        name.escape_debug(),
                        GGUF_PRE_TOKENIZERS.join(", ")
                    ),
                )
            })?,
            None => {
                return Err(needs_tokenizer(
                    label,
                    "it names no pre-tokenizer (tokenizer.ggml.pre)",
                ))
            }
        };
        let Some(tokens) = file.strings("tokenizer.ggml.tokens")? else {
            return Err(needs_tokenizer(label, "it has no tokenizer.ggml.tokens"));
        };
        let Some(merges) = file.strings("tokenizer.ggml.merges")? else {
            return Err(needs_tokenizer(label, "its BPE has no tokenizer.ggml.merges"));
        };
        let types = file.integers("tokenizer.ggml.token_type")?;
        if let Some(t) = &types {
            if t.len() != tokens.len() {
                bail!(
                    "GGUF file '{label}': tokenizer.ggml.token_type has {} entries for {} tokens",
                    t.len(),
                    tokens.len()
                )
            }
        }
        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, &token) in tokens.iter().enumerate() {
            // A repeated token keeps its first id, as a vocabulary can only
            // map it to one.
            if vocab.contains_key(token) {
                continue;
            }
            vocab.insert(token.to_string(), json!(id));
            let kind = types.as_ref().map_or(1, |t| t[id]);
            if kind == CONTROL || kind == USER_DEFINED {
                added.push(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": kind == CONTROL,
                }));
            }
        }
        let n = tokens.len();
        let bos = token_id(file, "tokenizer.ggml.bos_token_id", n)?;
        let eos = token_id(file, "tokenizer.ggml.eos_token_id", n)?;
        let add_bos = file.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(pre.llama3);
        let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let mut ends = Vec::new();
        for (add, id, what) in [(add_bos, bos, "bos"), (add_eos, eos, "eos")] {
            match (add, id) {
                (false, _) => ends.push(None),
                (true, Some(id)) => ends.push(Some(tokens[id as usize])),
                (true, None) => bail!(
                    "GGUF file '{label}': tokenizer.ggml.add_{what}_token is true but there is no tokenizer.ggml.{what}_token_id"
                ),
            }
        }
        let post_processor = if ends.iter().all(Option::is_none) {
            Value::Null
        } else {
            let special = |t: &str| json!({"SpecialToken": {"id": t, "type_id": 0}});
            let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
            let (first, last) = (ends[0], ends[1]);
            let mut single: Vec<Value> = first.map(special).into_iter().collect();
            single.push(seq("A", 0));
            single.extend(last.map(special));
            let mut pair = single.clone();
            pair.extend(first.map(special));
            pair.push(seq("B", 1));
            pair.extend(last.map(special));
            let mut specials = Map::new();
            for (t, id) in [(first, bos), (last, eos)] {
                if let (Some(t), Some(id)) = (t, id) {
                    specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
                }
            }
            json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": if pre.nfc { json!({"type": "NFC"}) } else { Value::Null },
            "pre_tokenizer": pre.pre_tokenizer(),
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": pre.llama3, "vocab": vocab, "merges": merges,
            },
        });
        let bytes = serde_json::to_vec(&tokenizer)
            .map_err(|e| candle::Error::Msg(format!("GGUF file '{label}': tokenizer: {e}")))?;
        Self::from_json(&bytes, &format!("{label} (tokenizer.ggml.*)"), None).map_err(|e| {
            // The tokenizers crate's message may quote a token of the file.
            let e = e.to_string();
            needs_tokenizer(
                label,
                &format!("its tokenizer could not be built: {}", e.escape_debug()),
            )
        })
    }

    /// [`TextTokenizer::from_gguf`] for a SentencePiece vocabulary
    /// ([`SpmVocab`] encodes and decodes).
    fn from_gguf_spm(file: &GgufFile) -> Result<Self> {
        let label = file.label();
        let Some(tokens) = file.strings("tokenizer.ggml.tokens")? else {
            return Err(needs_tokenizer(label, "it has no tokenizer.ggml.tokens"));
        };
        let spm = SpmVocab::from_gguf(file, &tokens)?;
        Ok(Self::from_spm(spm, &format!("{label} (tokenizer.ggml.*)")))
    }
}

impl HfGenerationConfig {
    /// The end tokens a GGUF file names (`tokenizer.ggml.eos_token_id`,
    /// then `eot_token_id` and `eom_token_id`, where given: llama.cpp stops
    /// at each), its BOS and padding ids. A SentencePiece vocabulary
    /// (`tokenizer.ggml.model` = `llama`) that names no end or begin token
    /// has llama.cpp's: EOS 2 and BOS 1 (which its encoder adds too);
    /// HF's defaults otherwise.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let id = |key: &str| -> Result<Option<u32>> {
            file.usize(key)?
                .map(|id| {
                    u32::try_from(id).map_err(|_| {
                        candle::Error::Msg(format!(
                            "GGUF file '{}': metadata '{key}' is {id}, not a token id",
                            file.label()
                        ))
                    })
                })
                .transpose()
        };
        let mut eos_token_ids = Vec::new();
        for key in ["eos", "eot", "eom"] {
            if let Some(e) = id(&format!("tokenizer.ggml.{key}_token_id"))? {
                if !eos_token_ids.contains(&e) {
                    eos_token_ids.push(e);
                }
            }
        }
        let mut bos_token_id = id("tokenizer.ggml.bos_token_id")?;
        if file.string("tokenizer.ggml.model")? == Some("llama") {
            let tokens = file.strings("tokenizer.ggml.tokens")?.map_or(0, |t| t.len());
            if eos_token_ids.is_empty() && tokens > 2 {
                eos_token_ids.push(2);
            }
            if bos_token_id.is_none() && tokens > 1 {
                bos_token_id = Some(1);
            }
        }
        Ok(Self {
            eos_token_ids,
            bos_token_id,
            pad_token_id: id("tokenizer.ggml.padding_token_id")?,
            ..Self::default()
        })
    }
}

impl ChatTemplate {
    /// The chat template a GGUF file carries (`tokenizer.chat_template`),
    /// with its BOS, EOS, unknown and padding tokens' text as `bos_token`,
    /// `eos_token`, `unk_token`, `pad_token`; `None` when it has none.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>> {
        let Some(source) = file.string("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let mut special = BTreeMap::new();
        if let Some(tokens) = file.strings("tokenizer.ggml.tokens")? {
            for (name, key) in [
                ("bos_token", "bos"),
                ("eos_token", "eos"),
                ("unk_token", "unknown"),
                ("pad_token", "padding"),
            ] {
                if let Some(id) = token_id(file, &format!("tokenizer.ggml.{key}_token_id"), tokens.len())? {
                    special.insert(name.to_string(), tokens[id as usize].to_string());
                }
            }
        }
        ChatTemplate::new(
            source.to_string(),
            &format!("{} (tokenizer.chat_template)", file.label()),
            special,
        )
        .map(Some)
    }
}

impl TextGenerator {
    /// A Llama-family GGUF file ready to continue text: the model
    /// ([`DecoderModel::from_gguf`], weight matrices in `opts.dtype`), the
    /// tokenizer the file carries ([`TextTokenizer::from_gguf`]) or, when
    /// given, the `tokenizer.json` file `tokenizer` (with the
    /// `tokenizer_config.json` beside it, if any), the file's end tokens
    /// ([`HfGenerationConfig::from_gguf`]) and chat template (else the one
    /// beside `tokenizer`). The tokenizer is read first, so a file whose
    /// tokenizer cannot be rebuilt is refused before its weights are read.
    pub fn from_gguf(
        path: &Path,
        tokenizer: Option<&Path>,
        device: &Device,
        opts: &LoadOptions,
    ) -> Result<Self> {
        Self::from_gguf_file(&GgufFile::read(path)?, tokenizer, device, opts)
    }

    /// [`TextGenerator::from_gguf`] from a file already read (to choose
    /// `opts.dtype` by [`GgufFile::weight_dtype`], say).
    pub fn from_gguf_file(
        file: &GgufFile,
        tokenizer: Option<&Path>,
        device: &Device,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let label = file.label().to_string();
        let (tokenizer, folder_chat) = match tokenizer {
            Some(t) => (
                TextTokenizer::from_file(t)?,
                ChatTemplate::from_folder(t.parent().unwrap_or(Path::new("."))),
            ),
            None => (TextTokenizer::from_gguf(file)?, Ok(None)),
        };
        let generation = HfGenerationConfig::from_gguf(file)?;
        // A template that cannot be used fails the conversations that ask
        // for it, not the file's load (as HF's apply_chat_template).
        let chat = match ChatTemplate::from_gguf(file) {
            Ok(None) => folder_chat,
            file_chat => file_chat,
        };
        let model = DecoderModel::from_gguf_file(file, device, opts)?;
        generation.check_ids(
            crate::decoder::CausalLm::vocab_size(&model),
            &format!("GGUF file '{label}' (tokenizer.ggml.*_token_id)"),
        )?;
        Ok(Self::new(model, tokenizer, generation, &label)?.with_chat_result(chat))
    }
}
