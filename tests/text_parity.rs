//! Where a folder's text once came out other than HF's, or a file could
//! bring the process down: checked against what HF transformers and its
//! Jinja2 environment answer (`tests/fixtures/text/parity.json`, written
//! by `scripts/make_parity_fixtures.py`), and properties (streamed text
//! equals the final text; hostile tokenizers and templates are errors).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use candle::Device;
use multihead::models::decoder::{
    ChatMessage, ChatTemplate, Finish, TemplateArgs, TextGenerator, TextTokenizer,
};
use multihead_test_support::{
    fixtures::fixture_dir,
    scratch_dir,
    text::{fixtures, folder_with, FOLDERS},
    tokens::ids,
};
use serde_json::Value;

fn parity() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("parity.json"),
    )?)?)
}

/// HF's repetition penalty: positive logits divided, negative multiplied,
/// over the prompt's ids and the generated ones.
#[test]
fn repetition_penalty_is_hf_s() -> Result<()> {
    let want = parity()?;
    let penalty = want["repetition_penalty"]["penalty"]
        .as_f64()
        .context("penalty")? as f32;
    for name in FOLDERS {
        let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
        let mut settings = g.settings();
        settings.repetition_penalty = Some(penalty);
        settings.max_new_tokens = 16;
        for case in want["repetition_penalty"]["folders"][name]
            .as_array()
            .context("cases")?
        {
            let prompt = case["prompt"].as_str().context("prompt")?;
            let out = g.generate(prompt, &settings, &mut |_| Ok(()))?;
            let mut got = out.ids.clone();
            if out.finish == Finish::Eos {
                // HF's new ids end with the end token it chose.
                got.push(*ids(&case["new_ids"]).last().context("end token")?);
            }
            assert_eq!(got, ids(&case["new_ids"]), "{name} {prompt:?}");
        }
    }
    Ok(())
}

/// `tokenizer(prompt)` neither truncates nor pads, whatever the file says.
#[test]
fn a_tokenizer_file_s_truncation_and_padding_are_off() -> Result<()> {
    let want = &parity()?["truncation_padding"];
    let json = serde_json::to_vec(&want["tokenizer_json"])?;
    let tok = TextTokenizer::from_json(&json, "tokenizer.json", None)?;
    let prompt = want["prompt"].as_str().context("prompt")?;
    assert_eq!(tok.encode(prompt)?, ids(&want["ids"]));
    Ok(())
}

/// `tojson` as Python's `json.dumps` with HF's arguments, Python's float
/// repr, Jinja's `int` and `float`, and `{% generation %}`.
#[test]
fn templates_render_as_hf_s_jinja_renders_them() -> Result<()> {
    let messages = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "yo"),
    ];
    for case in parity()?["templates"].as_array().context("templates")? {
        let source = case["template"].as_str().context("template")?;
        let t = ChatTemplate::new(source.to_string(), "t", BTreeMap::new())?;
        assert_eq!(
            t.render(&messages, false)?,
            case["text"].as_str().context("text")?,
            "{source}"
        );
    }
    Ok(())
}

/// Real models' chat templates (Gemma 2, Phi-3.5, SmolLM3: copies of
/// llama.cpp's `models/templates` in `tests/fixtures/chat_templates`) give
/// HF's text byte for byte over each conversation, with and without the
/// generation prompt and with SmolLM3's `enable_thinking` left to its
/// default or set; where HF's rendering raises (Gemma's system role, roles
/// that do not alternate), ours is an error carrying the template's message.
#[test]
fn real_chat_templates_render_as_hf_s() -> Result<()> {
    for t in parity()?["chat_templates"].as_array().context("chat_templates")? {
        let name = t["template"].as_str().context("template")?;
        let path = fixture_dir("chat_templates").join(name);
        let special: BTreeMap<String, String> = serde_json::from_value(t["special_tokens"].clone())?;
        let template = ChatTemplate::new(std::fs::read_to_string(&path)?, name, special)?;
        for (i, case) in t["cases"].as_array().context("cases")?.iter().enumerate() {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .context("messages")?
                .iter()
                .map(|m| -> Result<ChatMessage> {
                    Ok(ChatMessage::new(
                        m["role"].as_str().context("role")?,
                        m["content"].as_str().context("content")?,
                    ))
                })
                .collect::<Result<_>>()?;
            let add_generation_prompt = case["add_generation_prompt"].as_bool().context("flag")?;
            let args: TemplateArgs = serde_json::from_value(case["args"].clone())?;
            let got = template.render_with(&messages, add_generation_prompt, &args);
            match (&case["text"], &case["error"]) {
                (Value::String(want), _) => assert_eq!(&got?, want, "{name} case {i}"),
                (_, Value::String(error)) => {
                    let err = got.expect_err("HF's rendering raised").to_string();
                    assert!(
                        err.contains(name) && err.contains(error.as_str()),
                        "{name} case {i}: {err:?} does not carry {error:?}"
                    );
                }
                _ => anyhow::bail!("{name} case {i}: neither text nor error"),
            }
        }
    }
    Ok(())
}

/// A folder whose `bos_token` is only in `special_tokens_map.json`.
#[test]
fn special_tokens_map_json_gives_the_template_its_tokens() -> Result<()> {
    let want = &parity()?["special_tokens_map"];
    let dir = folder_with(
        scratch_dir!("llama2-sp-parity-special-tokens-map")?,
        "llama2-sp",
        |d| {
            std::fs::write(
                d.join("tokenizer_config.json"),
                serde_json::to_string(&want["tokenizer_config"])?,
            )?;
            std::fs::write(
                d.join("special_tokens_map.json"),
                serde_json::to_string(&want["special_tokens_map"])?,
            )?;
            Ok(())
        },
    )?;
    let t = ChatTemplate::from_folder(&dir)?.context("a template")?;
    let messages = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "yo"),
    ];
    assert_eq!(
        t.render(&messages, false)?,
        want["text"].as_str().context("text")?
    );
    Ok(())
}

/// Values nested past what Python prints (a `RecursionError` there) are an
/// error, on a 2 MiB thread as a server's workers have; what is left of
/// MiniJinja's recursion (`~`, `string`, dropping the value) runs on the
/// rendering's own stack.
#[test]
fn deeply_nested_values_are_errors_not_stack_overflows() -> Result<()> {
    let nest = |n: usize, tail: &str| {
        format!(
            "{{% set ns = namespace(x=[]) %}}{{% for i in range({n}) %}}{{% set ns.x = [ns.x] %}}{{% endfor %}}{tail}"
        )
    };
    let run = |source: String| -> Result<std::result::Result<String, String>> {
        let t = ChatTemplate::new(source, "deep.jinja", BTreeMap::new())?;
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || t.render(&[], false).map_err(|e| e.to_string()))?
            .join()
            .map_err(|_| anyhow::anyhow!("the rendering thread panicked"))
    };
    for tail in ["{{ ns.x }}", "{{ ns.x|tojson }}", "{{ ns.x|pprint }}"] {
        let err = run(nest(20_000, tail))?.expect_err(tail);
        assert!(
            err.contains("deep.jinja: the chat template failed") && err.contains("nested deeper than 256"),
            "{tail}: {err}"
        );
    }
    for tail in [
        "{{ (ns.x ~ '')|length }}",
        "{{ ns.x|string|length }}",
        "{{ ns.x|length }}",
    ] {
        let out = run(nest(50_000, tail))?;
        assert!(out.is_ok(), "{tail}: {out:?}");
    }
    // The deepest the fuel allows, then dropped.
    let more = "{% for i in range(99999) %}{% set ns.x = [ns.x] %}{% endfor %}";
    let out = run(nest(99_999, &more.repeat(2)))?;
    assert!(out.as_ref().is_err_and(|e| e.contains("fuel")), "{out:?}");
    Ok(())
}

fn llama3_tokenizer_with(normalizer: &str) -> Result<std::result::Result<TextTokenizer, String>> {
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("llama3/tokenizer.json"),
    )?)?;
    json["normalizer"] = serde_json::from_str(normalizer)?;
    Ok(
        TextTokenizer::from_json(&serde_json::to_vec(&json)?, "tokenizer.json", None)
            .map_err(|e| e.to_string()),
    )
}

/// A `Replace` whose pattern is empty (the tokenizers crate panics on it
/// with a byte-level tokenizer) and normalizers nested to grow a prompt
/// past any use are refused when the file is read, naming the field.
#[test]
fn hostile_normalizers_are_refused_by_field() -> Result<()> {
    for pattern in [r#"{"String": ""}"#, r#"{"Regex": "x*"}"#] {
        let err = llama3_tokenizer_with(&format!(
            r#"{{"type": "Replace", "pattern": {pattern}, "content": "y"}}"#
        ))?
        .expect_err(pattern);
        assert!(
            err.contains("tokenizer.json: field 'normalizer.pattern' matches the empty string"),
            "{err}"
        );
    }
    let tenfold = r#"{"type": "Replace", "pattern": {"String": "a"}, "content": "aaaaaaaaaa"}"#;
    let nested = format!(
        r#"{{"type": "Sequence", "normalizers": [{tenfold}, {{"type": "Sequence", "normalizers": [{tenfold}, {tenfold}, {tenfold}]}}]}}"#
    );
    let err = llama3_tokenizer_with(&nested)?.expect_err("nested");
    assert!(
        err.contains("tokenizer.json: field 'normalizer' can make 10000 bytes"),
        "{err}"
    );
    // Twice tenfold is a real normalizer: it loads, and a prompt it would
    // grow past the limit is refused before the tokenizer sees it.
    let tok = llama3_tokenizer_with(&format!(
        r#"{{"type": "Sequence", "normalizers": [{tenfold}, {tenfold}]}}"#
    ))?
    .map_err(anyhow::Error::msg)?;
    assert_eq!(tok.decode(&tok.encode_plain("a")?)?, "a".repeat(100));
    let err = tok.encode(&"a".repeat(1 << 20)).unwrap_err().to_string();
    assert!(
        err.contains("its normalizer may make up to 104857600 bytes"),
        "{err}"
    );
    Ok(())
}

/// A post-processor whose template names a special token it does not
/// define (the tokenizers crate panics on every encode)
/// is refused when the file is read, naming it.
#[test]
fn a_tokenizer_that_cannot_encode_is_refused_when_read() -> Result<()> {
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("llama3/tokenizer.json"),
    )?)?;
    json["post_processor"]["single"][0]["SpecialToken"]["id"] = Value::from("<|missing|>");
    let err = TextTokenizer::from_json(&serde_json::to_vec(&json)?, "tokenizer.json", None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json: cannot encode a text: the tokenizers crate panicked on this file"),
        "{err}"
    );
    Ok(())
}

/// A normalizer that inflates a prompt past the model's context: refused
/// with both numbers, a rotary model's `max_position_embeddings` (256)
/// being its context.
#[test]
fn a_prompt_is_bounded_by_a_rotary_model_s_positions() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    assert_eq!(g.context(), Some(256));
    let err = g
        .generate(&"the cat ".repeat(200), &g.settings(), &mut |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokens long but the model's context holds 256"),
        "{err}"
    );
    Ok(())
}

/// The stream's pieces add up to the final text for long runs of any ids
/// (its window restarts many times), with HF's clean-up on, and with byte
/// runs broken by skipped special tokens.
#[test]
fn streamed_text_equals_the_final_text() -> Result<()> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as u32
    };
    for (name, clean_up) in [
        ("gpt2-bpe", false),
        ("gpt2-bpe", true),
        ("llama3", false),
        ("llama2-sp", false),
        ("llama2-sp", true),
    ] {
        let dir = folder_with(
            scratch_dir!(format!("{name}-parity-stream-{clean_up}"))?,
            name,
            |d| {
                let path = d.join("tokenizer_config.json");
                let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
                config["clean_up_tokenization_spaces"] = Value::Bool(clean_up);
                Ok(std::fs::write(path, config.to_string())?)
            },
        )?;
        let tok = TextTokenizer::from_folder(&dir)?;
        let texts = [
            "Hello , world . I do n't know , she 's here ' s it ' m",
            "a 🙂 b é 日本 . ?",
        ];
        let mut runs: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| tok.encode_plain(t))
            .collect::<candle::Result<_>>()?;
        for _ in 0..20 {
            runs.push((0..300).map(|_| next(tok.vocab_size())).collect());
        }
        // A byte-fallback character split by a skipped special token.
        if name == "llama2-sp" {
            let e = tok.encode_plain("é")?;
            let eos = tok.token_id("</s>").context("</s>")?;
            runs.push([&e[..1], &[eos], &e[1..], &tok.encode_plain(" ok")?].concat());
        }
        for ids in runs {
            check_stream(&tok, &ids, &format!("{name} clean_up {clean_up}"))?;
        }
    }
    // Ids with no token (a vocabulary with holes:
    // `<0x61>` removed) are skipped by decoding, so a byte run goes on
    // through them, as through special tokens.
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(
        fixtures().join("llama2-sp/tokenizer.json"),
    )?)?;
    let hole = json["model"]["vocab"]
        .as_object_mut()
        .context("vocab")?
        .remove("<0x61>")
        .context("<0x61>")?;
    let tok = TextTokenizer::from_json(&serde_json::to_vec(&json)?, "holes.json", None)?;
    let byte = |b: u32| b + 3; // `<0xXX>` follow `<unk>`, `<s>`, `</s>`.
    let hole = hole.as_u64().context("id")? as u32;
    let ids = [byte(0x23), hole, byte(0x21), hole, byte(0xEB), byte(0x21)];
    assert_eq!(tok.decode(&ids)?, "\u{FFFD}".repeat(4));
    check_stream(&tok, &ids, "holes")
}

/// `ids` streamed piece by piece add up to their decoded text.
fn check_stream(tok: &TextTokenizer, ids: &[u32], what: &str) -> Result<()> {
    let mut stream = tok.stream();
    let mut pieces = Vec::new();
    for &id in ids {
        pieces.extend(stream.push(id)?);
    }
    pieces.push(stream.finish()?);
    assert_eq!(pieces.concat(), tok.decode(ids)?, "{what}: {ids:?}");
    Ok(())
}

/// `generation_config.json` values HF accepts: a greedy folder's
/// `temperature: 0`, `top_p: 0`, `top_k: -1`, an empty stop string.
#[test]
fn generation_configs_hf_accepts_load() -> Result<()> {
    let plain = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let want = plain.generate("Hello world", &plain.settings(), &mut |_| Ok(()))?;
    for (tag, config) in [
        (
            "greedy-zero",
            r#"{"eos_token_id": [1, 4], "max_new_tokens": 16, "temperature": 0, "do_sample": false, "top_p": 0, "top_k": -1}"#,
        ),
        (
            "sample-zero",
            r#"{"eos_token_id": [1, 4], "max_new_tokens": 16, "temperature": 0, "do_sample": true}"#,
        ),
        (
            "empty-stop",
            r#"{"eos_token_id": [1, 4], "max_new_tokens": 16, "stop_strings": ""}"#,
        ),
    ] {
        let dir = folder_with(scratch_dir!(format!("llama3-parity-{tag}"))?, "llama3", |d| {
            Ok(std::fs::write(d.join("generation_config.json"), config)?)
        })?;
        let g = TextGenerator::from_folder(&dir, &Device::Cpu)?;
        assert!(g.settings().sampling.is_none(), "{tag}: temperature 0 is greedy");
        let out = g.generate("Hello world", &g.settings(), &mut |_| Ok(()))?;
        assert_eq!(out.ids, want.ids, "{tag}");
    }
    // Sampling with top_p 0 keeps only the best token: greedy's answer.
    let dir = folder_with(scratch_dir!("llama3-parity-top-p-zero")?, "llama3", |d| {
        Ok(std::fs::write(
            d.join("generation_config.json"),
            r#"{"eos_token_id": [1, 4], "max_new_tokens": 16, "do_sample": true, "top_p": 0}"#,
        )?)
    })?;
    let g = TextGenerator::from_folder(&dir, &Device::Cpu)?;
    assert_eq!(
        g.generate("Hello world", &g.settings(), &mut |_| Ok(()))?.ids,
        want.ids
    );
    Ok(())
}

/// A template that cannot be used (named templates without `default`) or
/// one with HF's `{% generation %}` tag: the folder loads and continues
/// prompts; a conversation gets the first's error, the second renders.
#[test]
fn an_unusable_chat_template_fails_only_the_conversation() -> Result<()> {
    let named = folder_with(scratch_dir!("llama3-parity-named-templates")?, "llama3", |d| {
        let path = d.join("tokenizer_config.json");
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        config["chat_template"] = serde_json::json!([{"name": "tool_use", "template": "{{ messages }}"}]);
        std::fs::remove_file(d.join("chat_template.jinja"))?;
        Ok(std::fs::write(path, config.to_string())?)
    })?;
    let g = TextGenerator::from_folder(&named, &Device::Cpu)?;
    g.generate("Hello world", &g.settings(), &mut |_| Ok(()))?;
    let err = g
        .generate_chat(&[ChatMessage::new("user", "hi")], &g.settings(), &mut |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer_config.json: field 'chat_template' lists templates but none named 'default'"),
        "{err}"
    );
    let tagged = folder_with(scratch_dir!("llama3-parity-generation-tag")?, "llama3", |d| {
        let path = d.join("chat_template.jinja");
        let source = std::fs::read_to_string(&path)?.replace(
            "{{ message['content'] | trim }}",
            "{% generation %}{{ message['content'] | trim }}{% endgeneration %}",
        );
        Ok(std::fs::write(path, source)?)
    })?;
    let plain = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let g = TextGenerator::from_folder(&tagged, &Device::Cpu)?;
    let messages = [ChatMessage::new("user", "hi")];
    assert_eq!(
        g.chat_template().context("template")?.render(&messages, true)?,
        plain
            .chat_template()
            .context("template")?
            .render(&messages, true)?
    );
    Ok(())
}
