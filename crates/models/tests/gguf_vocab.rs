//! The tokenizers GGUF files carry against llama.cpp's own tokenizer test
//! suite (`models/ggml-vocab-*.gguf` with their `.inp` texts and `.out`
//! ids, which llama.cpp's `tests/test-tokenizer-0.py` wrote with HF's
//! tokenizers and `test-tokenizer-0.cpp` checks llama.cpp against). The
//! vocabulary-only files of `tests/fixtures/gguf/vocab/` are checked
//! always; every other file of a supported kind where llama.cpp's
//! `models/` folder is on disk (`LLAMA_CPP_MODELS`, else the
//! `llama-cpp-python` sdist beside this checkout).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::quantized::gguf_file::{self, Value as GgufValue};
use multihead_models::checkpoint::GgufFile;
use multihead_models::decoder::{HfGenerationConfig, TextTokenizer};
use multihead_test_support::gguf::{vocab, vocab_cases};

/// The vocabularies committed (`tests/fixtures/gguf/vocab/README.md`).
const COMMITTED: [&str; 2] = ["llama-spm", "deepseek-coder"];

/// llama.cpp's test vocabularies this crate rebuilds: SentencePiece
/// (`llama-spm`, `phi-3`) and byte-level BPE by pre-tokenizer.
const SUPPORTED: [&str; 13] = [
    "llama-spm",
    "phi-3",
    "gpt-2",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
];

fn llama_cpp_models() -> PathBuf {
    match std::env::var_os("LLAMA_CPP_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/models"),
    }
}

/// Every text of `gguf` encodes (no BOS/EOS added, as the test suite
/// asks) to the `.out` ids, and the `.out` ids decode back to the text,
/// whole and streamed id by id (HF's `decode` gives each text back: the
/// prefixed space is stripped, byte tokens joined); the mismatches, if any.
fn check(gguf: &Path) -> Result<Vec<String>> {
    let file = GgufFile::read(gguf)?;
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    let mut wrong = Vec::new();
    for (text, want) in vocab_cases(gguf)? {
        let got = tokenizer.encode_plain(&text)?;
        if got != want {
            wrong.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        let back = tokenizer.decode(&want)?;
        if back != text {
            wrong.push(format!("{want:?}: decoded to {back:?}, want {text:?}"));
        }
        let mut stream = tokenizer.stream();
        let mut streamed = String::new();
        for &id in &want {
            streamed.extend(stream.push(id)?);
        }
        streamed.push_str(&stream.finish()?);
        if streamed != text {
            wrong.push(format!("{want:?}: streamed as {streamed:?}, want {text:?}"));
        }
    }
    Ok(wrong)
}

#[test]
fn committed_vocabularies_give_llama_cpps_ids() -> Result<()> {
    for name in COMMITTED {
        let wrong = check(&vocab(name))?;
        assert!(wrong.is_empty(), "{name}:\n{}", wrong.join("\n"));
    }
    Ok(())
}

#[test]
fn every_supported_llama_cpp_vocabulary_gives_its_ids() -> Result<()> {
    let dir = llama_cpp_models();
    if !dir.join("ggml-vocab-llama-spm.gguf").exists() {
        eprintln!(
            "skipped: llama.cpp's models/ folder is not at {} (set LLAMA_CPP_MODELS)",
            dir.display()
        );
        return Ok(());
    }
    let mut failed = Vec::new();
    for name in SUPPORTED {
        let wrong = check(&dir.join(format!("ggml-vocab-{name}.gguf")))?;
        if !wrong.is_empty() {
            failed.push(format!("{name}: {} wrong\n{}", wrong.len(), wrong.join("\n")));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    Ok(())
}

/// The committed SentencePiece vocabulary with its metadata edited, as a
/// GGUF file of its own (candle's writer), read back.
fn edited_spm(tag: &str, edit: impl FnOnce(&mut Vec<(String, GgufValue)>)) -> Result<GgufFile> {
    let src = vocab("llama-spm");
    let content = gguf_file::Content::read(&mut std::fs::File::open(&src)?)?;
    let mut meta: Vec<(String, GgufValue)> = content.metadata.into_iter().collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut meta);
    let mut bytes = Vec::new();
    let m: Vec<(&str, &GgufValue)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::io::Cursor::new(&mut bytes), &m, &[])?;
    Ok(GgufFile::from_bytes(bytes, &format!("vocab-{tag}.gguf"))?)
}

fn set(meta: &mut Vec<(String, GgufValue)>, key: &str, value: GgufValue) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), value));
}

/// llama-spm as llama.cpp runs a prompt (`add_special`, `parse_special`):
/// the BOS it adds by default (`tokenizer.ggml.add_bos_token`) before
/// the `.out` ids, the EOS where `add_eos_token` asks; a written `<s>` is
/// the BOS token, the text after it prefixed with a space as at the start
/// (llama.cpp's `is_prev_special`). Without `add_space_prefix` no `▁`
/// starts the text, and decoding keeps a leading space.
#[test]
fn spm_special_tokens_and_space_prefix() -> Result<()> {
    let path = vocab("llama-spm");
    let cases = vocab_cases(&path)?;
    let (text, ids) = cases
        .iter()
        .find(|(t, _)| t == "Hello world")
        .context("Hello world")?;
    // ▁Hello ▁world, as the .out file says.
    assert_eq!(ids, &[15043, 3186]);
    let t = TextTokenizer::from_gguf(&GgufFile::read(&path)?)?;
    assert_eq!(t.encode(text)?, [1, 15043, 3186]);
    assert_eq!(t.encode("<s>Hello world</s>")?, [1, 1, 15043, 3186, 2]);
    assert_eq!(t.decode(&[1, 15043, 3186, 2])?, "Hello world");

    let eos = edited_spm("eos", |m| {
        set(m, "tokenizer.ggml.add_eos_token", GgufValue::Bool(true))
    })?;
    assert_eq!(TextTokenizer::from_gguf(&eos)?.encode(text)?, [1, 15043, 3186, 2]);

    let bare = edited_spm("no-prefix", |m| {
        set(m, "tokenizer.ggml.add_space_prefix", GgufValue::Bool(false))
    })?;
    let t = TextTokenizer::from_gguf(&bare)?;
    // "Hello" (id 10994) with no ▁; " world" is ▁world either way.
    assert_eq!(t.token_id("Hello"), Some(10994));
    assert_eq!(t.encode_plain(text)?, [10994, 3186]);
    assert_eq!(t.decode(&[3186])?, " world");
    Ok(())
}

/// Generation stops where llama.cpp stops: at the end token the file
/// names, else at a SentencePiece vocabulary's default EOS (2), the one
/// its encoder uses too.
#[test]
fn spm_default_end_token_stops_generation() -> Result<()> {
    let named = HfGenerationConfig::from_gguf(&GgufFile::read(&vocab("llama-spm"))?)?;
    let bare = edited_spm("no-ids", |m| {
        m.retain(|(k, _)| k != "tokenizer.ggml.eos_token_id" && k != "tokenizer.ggml.bos_token_id")
    })?;
    let defaults = HfGenerationConfig::from_gguf(&bare)?;
    assert_eq!(defaults.eos_token_ids, [2]);
    assert_eq!(defaults.bos_token_id, Some(1));
    assert_eq!(named.eos_token_ids, defaults.eos_token_ids);
    // The encoder's EOS is the same token.
    let eos = edited_spm("no-ids-add-eos", |m| {
        m.retain(|(k, _)| k != "tokenizer.ggml.eos_token_id");
        set(m, "tokenizer.ggml.add_eos_token", GgufValue::Bool(true));
    })?;
    assert_eq!(
        TextTokenizer::from_gguf(&eos)?.encode("Hello world")?.last(),
        Some(&2)
    );
    Ok(())
}

/// A SentencePiece vocabulary is untrusted metadata: counts that disagree,
/// a NaN score, a token given twice and ids past the vocabulary are
/// refused naming the file and the field, never a panic.
#[test]
fn bad_spm_metadata_is_refused_by_name() -> Result<()> {
    let cases: Vec<(&str, MetaEdit, &[&str])> = vec![
        (
            "types",
            Box::new(|m| {
                set(
                    m,
                    "tokenizer.ggml.token_type",
                    GgufValue::Array(vec![GgufValue::I32(1)]),
                )
            }),
            &["tokenizer.ggml.token_type", "1 entries for 32000 tokens"],
        ),
        (
            "scores",
            Box::new(|m| {
                set(
                    m,
                    "tokenizer.ggml.scores",
                    GgufValue::Array(vec![GgufValue::F32(0.); 3]),
                )
            }),
            &["tokenizer.ggml.scores", "3 entries"],
        ),
        (
            "nan",
            Box::new(|m| {
                set(
                    m,
                    "tokenizer.ggml.scores",
                    GgufValue::Array(vec![GgufValue::F32(f32::NAN); 32000]),
                )
            }),
            &["tokenizer.ggml.scores[0] is NaN"],
        ),
        (
            "twice",
            Box::new(|m| {
                let mut tokens: Vec<GgufValue> =
                    (0..32000).map(|i| GgufValue::String(format!("t{i}"))).collect();
                tokens[7] = GgufValue::String("t3".into());
                set(m, "tokenizer.ggml.tokens", GgufValue::Array(tokens))
            }),
            &["'t3' twice", "ids 3 and 7"],
        ),
        (
            "bos",
            Box::new(|m| set(m, "tokenizer.ggml.bos_token_id", GgufValue::U32(99999))),
            &["tokenizer.ggml.bos_token_id", "99999"],
        ),
        (
            "strings",
            Box::new(|m| set(m, "tokenizer.ggml.scores", GgufValue::String("no".into()))),
            &["tokenizer.ggml.scores", "an array of numbers"],
        ),
    ];
    for (tag, edit, needles) in cases {
        let file = edited_spm(tag, edit)?;
        let msg = TextTokenizer::from_gguf(&file).expect_err(tag).to_string();
        for n in needles.iter().chain(&[file.label()]) {
            assert!(msg.contains(n), "{tag}: {msg:?} does not mention {n:?}");
        }
    }
    Ok(())
}

type MetaEdit = Box<dyn FnOnce(&mut Vec<(String, GgufValue)>)>;

/// A byte-level BPE whose pre-tokenizer is not rebuilt is refused naming
/// it.
#[test]
fn an_unknown_pre_tokenizer_is_named() -> Result<()> {
    let src = vocab("deepseek-coder");
    let content = gguf_file::Content::read(&mut std::fs::File::open(&src)?)?;
    let mut meta: Vec<(String, GgufValue)> = content.metadata.into_iter().collect();
    set(
        &mut meta,
        "tokenizer.ggml.pre",
        GgufValue::String("chatglm-bpe".into()),
    );
    let mut bytes = Vec::new();
    let m: Vec<(&str, &GgufValue)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::io::Cursor::new(&mut bytes), &m, &[])?;
    let file = GgufFile::from_bytes(bytes, "pre.gguf")?;
    let msg = TextTokenizer::from_gguf(&file).expect_err("refused").to_string();
    for n in [
        "pre.gguf",
        "tokenizer.ggml.pre 'chatglm-bpe'",
        "deepseek-coder",
        "--tokenizer",
    ] {
        assert!(msg.contains(n), "{msg:?} does not mention {n:?}");
    }
    Ok(())
}

/// HF's Llama `tokenizer.json` of a SentencePiece vocabulary, as its fast
/// tokenizer (`LlamaTokenizerFast`) holds one: a BPE model of the tokens
/// with byte fallback, control and unknown tokens as special added
/// tokens, user-defined ones as plain added tokens, and the decoders
/// `Replace("▁", " ")`, `ByteFallback`, `Fuse` and, where the encoder
/// prefixes a space, `Strip(" ", 1, 0)`.
fn hf_llama_tokenizer(tokens: &[String], types: &[i32], space_prefix: bool) -> Result<tokenizers::Tokenizer> {
    use serde_json::json;
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, (token, &kind)) in tokens.iter().zip(types).enumerate() {
        vocab.insert(token.clone(), json!(id));
        // llama.cpp's token types: 2 unknown, 3 control, 4 user-defined.
        if matches!(kind, 2..=4) {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": kind != 4,
            }));
        }
    }
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": [],
        },
    });
    tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&file)?).map_err(|e| anyhow::anyhow!("{e}"))
}

/// A SentencePiece vocabulary decodes as the `tokenizers` crate decodes
/// HF's Llama tokenizer of it ([`hf_llama_tokenizer`]), whole and
/// streamed: random runs of ids mixing special tokens, byte tokens that
/// are and are not UTF-8 and ids past the vocabulary, with and without
/// `add_space_prefix`.
#[test]
fn spm_decodes_as_hf_s_llama_tokenizer() -> Result<()> {
    let content = gguf_file::Content::read(&mut std::fs::File::open(vocab("llama-spm"))?)?;
    let array = |key: &str| match content.metadata.get(key) {
        Some(GgufValue::Array(a)) => Ok(a.clone()),
        _ => anyhow::bail!("{key} is not an array"),
    };
    let tokens: Vec<String> = array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| Ok(v.to_string()?.clone()))
        .collect::<Result<_>>()?;
    let types: Vec<i32> = array("tokenizer.ggml.token_type")?
        .iter()
        .map(|v| Ok(v.to_i32()?))
        .collect::<Result<_>>()?;
    let n = tokens.len() as u32;
    let byte0 = tokens.iter().position(|t| t == "<0x00>").context("no <0x00>")? as u32;
    let mut seed = 7u64;
    let mut next = |below: u32| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) % u64::from(below)) as u32
    };
    let runs: Vec<Vec<u32>> = (0..3000)
        .map(|_| {
            let len = 1 + next(10);
            (0..len)
                .map(|_| match next(8) {
                    // Control and unknown tokens, bytes (UTF-8 lead and
                    // continuation bytes among them), ids past the end.
                    0 => next(3),
                    1..=3 => byte0 + next(256),
                    4 => n + next(4),
                    _ => next(n),
                })
                .collect()
        })
        .collect();
    for space_prefix in [true, false] {
        let file = edited_spm(&format!("space-prefix-{space_prefix}"), |m| {
            set(
                m,
                "tokenizer.ggml.add_space_prefix",
                GgufValue::Bool(space_prefix),
            )
        })?;
        let ours = TextTokenizer::from_gguf(&file)?;
        let hf = hf_llama_tokenizer(&tokens, &types, space_prefix)?;
        for ids in &runs {
            let want = hf.decode(ids, true).map_err(|e| anyhow::anyhow!("{e}"))?;
            assert_eq!(
                ours.decode(ids)?,
                want,
                "ids {ids:?}, add_space_prefix {space_prefix}"
            );
            let mut stream = ours.stream();
            let mut streamed = String::new();
            for &id in ids {
                streamed.extend(stream.push(id)?);
            }
            streamed.push_str(&stream.finish()?);
            assert_eq!(
                streamed, want,
                "streamed ids {ids:?}, add_space_prefix {space_prefix}"
            );
        }
    }
    Ok(())
}
