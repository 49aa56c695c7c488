//! Text in, text out, against HF transformers: decoder folders with a
//! tokenizer and a generation config (`tests/fixtures/text`, written by
//! `scripts/make_text_fixtures.py`) continue every prompt with HF's ids
//! and HF's `decode(new_ids, skip_special_tokens=True)` text, through the
//! library (the CLI's text and JSON modes: `text_generation_cli.rs`);
//! streamed pieces add up to the same text; chat templates render as HF's;
//! stop strings, constraints and token bytes hold through the library and
//! `generate`'s flags; bad folders are refused by file and field.

use std::path::Path;

use anyhow::{Context, Result};
use candle::Device;
use multihead::models::decoder::{
    ChatMessage, ChatTemplate, DecoderModel, Finish, HfGenerationConfig, TextGenerator, TextTokenizer,
};
use multihead_test_support::{
    fixtures::fixture_dir,
    multihead, scratch_dir,
    text::{expected, fixtures, folder_with, FOLDERS},
    tokens::ids,
};
use serde_json::Value;

#[test]
fn every_prompt_continues_as_hf_continues_it() -> Result<()> {
    let want = expected()?;
    for name in FOLDERS {
        let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
        let settings = g.settings();
        assert_eq!(settings.max_new_tokens, 16, "{name}: the folder's max_new_tokens");
        for case in want[name]["cases"].as_array().context("cases")? {
            let prompt = case["prompt"].as_str().context("prompt")?;
            let mut pieces = Vec::new();
            let mut on_text = |p: &str| {
                pieces.push(p.to_string());
                Ok(())
            };
            // A chat case is the prompt as a user's message.
            let out = if case["chat"] == true {
                g.generate_chat(&[ChatMessage::new("user", prompt)], &settings, &mut on_text)?
            } else {
                g.generate(prompt, &settings, &mut on_text)?
            };
            assert_eq!(
                out.prompt_ids,
                ids(&case["prompt_ids"]),
                "{name} {prompt:?}: prompt ids"
            );
            // HF's new ids end with the end token when one was chosen.
            let mut hf = ids(&case["new_ids"]);
            let ended = !case["ended_on"].is_null();
            if ended {
                hf.pop();
            }
            assert_eq!(out.ids, hf, "{name} {prompt:?}: generated ids");
            assert_eq!(out.finish == Finish::Eos, ended, "{name} {prompt:?}: finish");
            assert_eq!(
                out.text,
                case["text"].as_str().context("text")?,
                "{name} {prompt:?}"
            );
            assert_eq!(pieces.concat(), out.text, "{name} {prompt:?}: streamed pieces");
        }
    }
    Ok(())
}

#[test]
fn one_generator_serves_threads_as_it_serves_one_caller() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let settings = g.settings();
    let prompts = ["Hello world", "a", "日本語のテキスト", "The cat sat on the mat."];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| Ok(g.generate(p, &settings, &mut |_| Ok(()))?.ids))
        .collect::<Result<_>>()?;
    let together: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| g.generate(p, &settings, &mut |_| Ok(())).map(|o| o.ids)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("thread panicked"))?
                    .map_err(anyhow::Error::from)
            })
            .collect::<Result<_>>()
    })?;
    assert_eq!(together, alone);
    Ok(())
}

#[test]
fn chat_templates_render_as_apply_chat_template() -> Result<()> {
    let want = expected()?;
    for name in ["gpt2-bpe", "llama3"] {
        let dir = fixtures().join(name);
        let template = ChatTemplate::from_folder(&dir)?.context("a chat template")?;
        let tok = TextTokenizer::from_folder(&dir)?;
        for chat in want[name]["chats"].as_array().context("chats")? {
            let messages: Vec<ChatMessage> = chat["messages"]
                .as_array()
                .context("messages")?
                .iter()
                .map(|m| {
                    ChatMessage::new(
                        m["role"].as_str().unwrap_or(""),
                        m["content"].as_str().unwrap_or(""),
                    )
                })
                .collect();
            let add = chat["add_generation_prompt"] == true;
            let text = template.render(&messages, add)?;
            assert_eq!(
                text,
                chat["text"].as_str().context("text")?,
                "{name} {messages:?}"
            );
            assert_eq!(tok.encode_plain(&text)?, ids(&chat["ids"]), "{name} {messages:?}");
        }
    }
    // The ChatML fixture refuses an unknown role through raise_exception.
    let template = ChatTemplate::from_folder(&fixtures().join("gpt2-bpe"))?.context("template")?;
    let err = template
        .render(&[ChatMessage::new("tool", "x")], true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template") && err.contains("Unknown role: tool"),
        "{err}"
    );
    // A folder without a template says so for --chat.
    let dir = fixtures().join("llama2-sp");
    assert!(ChatTemplate::from_folder(&dir)?.is_none());
    let out = multihead!(&[
        "generate",
        "--chat",
        "--model",
        dir.to_str().context("path")?,
        "hi",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has no chat template"),
        "{err}"
    );
    Ok(())
}

fn load_error(dir: &Path) -> String {
    match TextGenerator::from_folder(dir, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_folders_name_the_file_and_field() -> Result<()> {
    // (tag, file written into a copy of the llama3 folder, its text, the error).
    let cases = [
        (
            "tokenizer-json",
            "tokenizer.json",
            "{\"not\": \"a tokenizer\"}",
            "tokenizer.json: not a tokenizer",
        ),
        (
            "nan-temperature",
            "generation_config.json",
            "{\"temperature\": NaN, \"do_sample\": true}",
            "generation_config.json: not valid JSON",
        ),
        (
            "negative-temperature",
            "generation_config.json",
            "{\"temperature\": -1}",
            "field 'temperature' must be a finite number >= 0",
        ),
        (
            "eos-outside",
            "generation_config.json",
            "{\"eos_token_id\": [1, 4000]}",
            "field 'eos_token_id' is 4000, outside the model's vocabulary of 384",
        ),
        (
            "eos-string",
            "generation_config.json",
            "{\"eos_token_id\": \"4\"}",
            "field 'eos_token_id' must hold token ids",
        ),
        (
            "top-p",
            "generation_config.json",
            "{\"top_p\": 1.5}",
            "field 'top_p' must be a number in [0, 1]",
        ),
        (
            "cleanup-type",
            "tokenizer_config.json",
            "{\"clean_up_tokenization_spaces\": \"yes\"}",
            "'clean_up_tokenization_spaces' must be true or false",
        ),
    ];
    for (tag, file, text, needle) in cases {
        let dir = folder_with(scratch_dir!(format!("llama3-{tag}"))?, "llama3", |d| {
            Ok(std::fs::write(d.join(file), text)?)
        })?;
        let err = load_error(&dir);
        assert!(err.contains(needle), "{tag}: {err}");
    }
    // A tokenizer larger than the model's embedding (HF's rule: ids past
    // the tokenizer are allowed, past the embedding refused): the
    // 384-token tokenizer over the 128-token Llama fixture.
    let model = DecoderModel::from_folder(&fixture_dir("decoders").join("llama"), &Device::Cpu)?;
    let tok = TextTokenizer::from_folder(&fixtures().join("gpt2-bpe"))?;
    let err = TextGenerator::new(model, tok, HfGenerationConfig::default(), "mixed")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer has 384 tokens but the model's embedding only 128"),
        "{err}"
    );
    // A prompt longer than GPT-2's 128 positions is refused with both numbers.
    let g = TextGenerator::from_folder(&fixtures().join("gpt2-bpe"), &Device::Cpu)?;
    let long = "the cat ".repeat(80);
    let err = g
        .generate(&long, &g.settings(), &mut |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokens long but the model's context holds 128"),
        "{err}"
    );
    Ok(())
}

#[test]
fn the_stream_never_splits_a_character() -> Result<()> {
    // Byte-level BPE, and byte fallback (where a run of byte tokens is one
    // group until a token of another kind follows).
    for (name, want) in [("gpt2-bpe", "a🙂b é"), ("llama2-sp", "a🙂b é")] {
        let tok = TextTokenizer::from_folder(&fixtures().join(name))?;
        let ids = tok.encode("a🙂b é")?;
        // Some token holds only part of a character.
        assert!(
            ids.iter()
                .any(|&id| tok.decode(&[id]).is_ok_and(|t| t.contains('\u{FFFD}'))),
            "{name}"
        );
        let mut stream = tok.stream();
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.extend(stream.push(id)?);
        }
        pieces.push(stream.finish()?);
        assert_eq!(pieces.concat(), want, "{name}");
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "{name}: {pieces:?}"
        );
    }
    let cfg = HfGenerationConfig::from_folder(&fixtures().join("llama3"))?;
    assert_eq!(cfg.eos_token_ids, [1, 4]);
    // Without generation_config.json the end tokens come from config.json,
    // as HF's GenerationConfig.from_model_config takes them.
    let dir = folder_with(scratch_dir!("llama3-no-generation-config")?, "llama3", |d| {
        Ok(std::fs::remove_file(d.join("generation_config.json"))?)
    })?;
    let cfg = HfGenerationConfig::from_folder(&dir)?;
    assert_eq!(
        (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_new_tokens),
        (vec![1, 4], Some(0), None)
    );
    Ok(())
}

/// HF's `stop_strings`: generation stops at the token that completes the
/// string, which the text keeps; through the library and `--stop`.
#[test]
fn stop_strings_stop_where_hf_stops() -> Result<()> {
    let want = expected()?;
    for name in FOLDERS {
        let case = &want[name]["stop"];
        let (prompt, stop) = (
            case["prompt"].as_str().context("prompt")?,
            case["stop"].as_str().context("stop")?,
        );
        let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
        let mut settings = g.settings();
        settings.stop_strings = vec![stop.to_string()];
        let out = g.generate(prompt, &settings, &mut |_| Ok(()))?;
        assert_eq!(out.ids, ids(&case["new_ids"]), "{name} {stop:?}");
        assert_eq!(out.text, case["text"].as_str().context("text")?, "{name}");
        assert_eq!(out.finish, Finish::Stop, "{name}");
        let dir = fixtures().join(name);
        let out = multihead!(&[
            "generate",
            "--format",
            "json",
            "--stop",
            stop,
            "--model",
            dir.to_str().context("path")?,
            prompt,
        ])?;
        let got: Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(got[0]["finish"], "stop", "{name}");
        assert_eq!(got[0]["text"], case["text"], "{name}");
    }
    Ok(())
}

/// Each token's bytes ([`TextTokenizer::token_bytes`]) are what the
/// tokenizers crate decodes it to, wherever that decode is whole UTF-8
/// (byte-level tokens that are part of a character decode to U+FFFD there,
/// and are checked through the runs they form below); special tokens have
/// none, and ids past the tokenizer have none.
#[test]
fn token_bytes_are_what_the_tokenizer_decodes() -> Result<()> {
    for name in ["gpt2-bpe", "llama2-sp", "llama3"] {
        let tok = TextTokenizer::from_folder(&fixtures().join(name))?;
        let n = tok.vocab_size();
        let bytes = tok.token_bytes(n + 3);
        assert!(
            bytes[n..].iter().all(Option::is_none),
            "{name}: ids past the tokenizer"
        );
        let mut checked = 0;
        for (id, b) in bytes[..n].iter().enumerate() {
            let Some(b) = b else { continue };
            let Ok(text) = std::str::from_utf8(b) else {
                continue;
            };
            // A SentencePiece decoder drops the space of a word's first
            // token at the start of a text: compare after one.
            let decoded = tok.decode(&[id as u32])?;
            assert!(
                decoded == text || decoded == text.trim_start_matches(' '),
                "{name}: token {id}: {decoded:?} against {text:?}"
            );
            checked += 1;
        }
        assert!(checked > n / 2, "{name}: only {checked} of {n} tokens checked");
    }
    // The byte-level vocabulary splits multi-byte characters across tokens:
    // their bytes join into the characters.
    let tok = TextTokenizer::from_folder(&fixtures().join("gpt2-bpe"))?;
    let ids = tok.encode_plain("中文字符 한국어 ミ")?;
    let bytes = tok.token_bytes(tok.vocab_size());
    let joined: Vec<u8> = ids
        .iter()
        .flat_map(|&i| bytes[i as usize].clone().unwrap_or_default())
        .collect();
    assert_eq!(String::from_utf8(joined)?, "中文字符 한국어 ミ");
    assert!(ids
        .iter()
        .any(|&i| std::str::from_utf8(bytes[i as usize].as_deref().unwrap_or(b"")).is_err()));
    Ok(())
}

/// Whether a constrained output is what its regex allows.
type Check<'a> = &'a dyn Fn(&str) -> bool;

/// A regex constraint over real vocabularies (byte-level BPE, SentencePiece
/// with byte fallback): greedy continuations of random models match a date
/// pattern, one of several words, and a CJK string whose characters the
/// byte-level tokens split, each ending with the end token; through the
/// library and the binary.
#[test]
fn constrained_continuations_match_their_regex() -> Result<()> {
    let is_date = |t: &str| {
        t.len() == 10
            && t.bytes().enumerate().all(|(i, b)| match i {
                4 | 7 => b == b'-',
                _ => b.is_ascii_digit(),
            })
    };
    for name in ["gpt2-bpe", "llama2-sp", "llama3"] {
        let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
        let mut settings = g.settings();
        settings.sampling = None;
        settings.max_new_tokens = 24;
        let cases: [(&str, Check); 3] = [
            ("[0-9]{4}-[0-9]{2}-[0-9]{2}", &is_date),
            ("(yes|no|maybe)", &|t: &str| ["yes", "no", "maybe"].contains(&t)),
            ("日本語|한국어", &|t: &str| t == "日本語" || t == "한국어"),
        ];
        for (regex, ok) in cases {
            settings.constraint = Some(regex.to_string());
            let out = g.generate("The answer is", &settings, &mut |_| Ok(()))?;
            assert!(ok(&out.text), "{name} {regex}: {:?}", out.text);
            assert_eq!(out.finish, Finish::Eos, "{name} {regex}");
        }
    }
    let out = multihead!(&[
        "generate",
        "--model",
        &fixtures().join("gpt2-bpe").display().to_string(),
        "--constraint",
        "[0-9]{4}-[0-9]{2}-[0-9]{2}",
        "The date is",
    ])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout)?;
    assert!(is_date(text.trim_end_matches('\n')), "{text:?}");
    // A regex that does not parse, or that cannot fit the tokens left, is
    // one line naming it.
    for (regex, says) in [("(", "regex \"(\""), ("[0-9]{40}", "needs at least 40 tokens")] {
        let out = multihead!(&[
            "generate",
            "--model",
            &fixtures().join("gpt2-bpe").display().to_string(),
            "--max-new-tokens",
            "5",
            "--constraint",
            regex,
            "x",
        ])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !stderr.contains("panicked"),
            "{regex}: {stderr}"
        );
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(says),
            "{regex}: {stderr}"
        );
    }
    Ok(())
}
