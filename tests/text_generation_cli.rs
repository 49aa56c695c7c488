//! `multihead generate` and `inspect` on the text fixtures (`tests/fixtures/text`,
//! written by `scripts/make_text_fixtures.py`): HF's text and ids in text
//! and JSON mode and through `--chat`, a half-precision cache, and
//! `inspect` on the decoder folders.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use multihead_test_support::{
    cli::assert_one_line_error,
    fixtures::fixture_dir,
    multihead, scratch_dir,
    text::{expected, fixtures, folder_with, FOLDERS},
    tokens::ids,
};
use serde_json::Value;

#[test]
fn the_cli_prints_hf_s_text_and_json() -> Result<()> {
    let want = expected()?;
    for name in FOLDERS {
        let dir = fixtures().join(name);
        let all = want[name]["cases"].as_array().context("cases")?;
        let cases: Vec<&Value> = all.iter().filter(|c| c["chat"] == false).collect();
        let prompts: Vec<&str> = cases.iter().filter_map(|c| c["prompt"].as_str()).collect();
        let texts: Vec<&str> = cases.iter().filter_map(|c| c["text"].as_str()).collect();
        // Text mode, prompts from standard input: one continuation a line.
        let out = multihead!(
            &["generate", "--model", dir.to_str().context("path")?],
            &(prompts.join("\n") + "\n")
        )?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        let stdout = String::from_utf8(out.stdout)?;
        assert_eq!(
            stdout,
            texts.iter().map(|t| format!("{t}\n")).collect::<String>(),
            "{name}"
        );
        assert!(err.contains("loaded") && err.contains("tokens/s"), "{err}");
        // JSON mode, prompts as arguments.
        let mut args = vec![
            "generate",
            "--format",
            "json",
            "--model",
            dir.to_str().context("path")?,
        ];
        args.extend(&prompts);
        let out = multihead!(&args)?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got: Value = serde_json::from_slice(&out.stdout)?;
        let got = got.as_array().context("an array")?;
        assert_eq!(got.len(), cases.len());
        for (g, c) in got.iter().zip(&cases) {
            assert_eq!(g["prompt"], c["prompt"]);
            assert_eq!(g["text"], c["text"]);
            assert_eq!(
                g["prompt_tokens"].as_u64(),
                Some(ids(&c["prompt_ids"]).len() as u64)
            );
            let finish = if c["ended_on"].is_null() { "length" } else { "eos" };
            assert_eq!(g["finish"], finish, "{name} {}", c["prompt"]);
        }
        // --chat: the prompt as a user's message, through the template.
        let Some(chat) = all.iter().find(|c| c["chat"] == true) else {
            continue;
        };
        let out = multihead!(&[
            "generate",
            "--chat",
            "--model",
            dir.to_str().context("path")?,
            chat["prompt"].as_str().context("prompt")?,
        ])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(
            String::from_utf8(out.stdout)?,
            format!("{}\n", chat["text"].as_str().context("text")?)
        );
    }
    Ok(())
}

/// `--kv-dtype bf16|f16` keeps the cache in half precision (its logits
/// are checked against HF's in `decoders_hf.rs`): the CLI takes the flag,
/// generates from every folder, and refuses a dtype it has no cache for.
#[test]
fn the_cli_keeps_the_cache_in_half_precision() -> Result<()> {
    for name in FOLDERS {
        let dir = fixtures().join(name);
        for kv in ["bf16", "f16"] {
            let out = multihead!(&[
                "generate",
                "--format",
                "json",
                "--kv-dtype",
                kv,
                "--model",
                dir.to_str().context("path")?,
                "Hello",
            ])?;
            assert!(
                out.status.success(),
                "{name} {kv}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let got: Value = serde_json::from_slice(&out.stdout)?;
            assert!(
                got[0]["new_tokens"].as_u64().is_some_and(|n| n > 0),
                "{name} {kv}: {got}"
            );
        }
    }
    let dir = fixtures().join(FOLDERS[0]);
    let out = multihead!(&[
        "generate",
        "--kv-dtype",
        "q8_0",
        "--model",
        dir.to_str().context("path")?,
        "Hello",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("q8_0") && err.contains("bf16"),
        "{err}"
    );
    Ok(())
}

/// `multihead generate … | head -c 10`: a reader that goes away ends the
/// command quietly with status 0, as it ends every other command, whether
/// the first write to find no reader is a streamed piece of text, the
/// echoed prompt or the JSON at the end.
#[test]
fn a_closed_pipe_ends_generate_quietly() -> Result<()> {
    let dir = fixtures().join(FOLDERS[0]);
    let model = dir.to_str().context("path")?;
    for args in [
        &["generate", "--model", model, "--max-new-tokens", "8", "Hello"][..],
        &["generate", "--model", model, "--echo", "Hello"],
        &["generate", "--model", model, "--format", "json", "Hello"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
            .args(args)
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        // Closed before the model is loaded: the first write finds no reader.
        drop(child.stdout.take());
        let out = child.wait_with_output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("error") && !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
    Ok(())
}

/// On a terminal, standard output and standard error share one screen:
/// with both going to one file, each prompt's timings start a line of
/// their own instead of trailing its text.
#[test]
fn the_timings_start_a_line_of_their_own() -> Result<()> {
    let dir = fixtures().join(FOLDERS[0]);
    let path = scratch_dir!("timings")?.join("one-screen.txt");
    let screen = std::fs::File::create(&path)?;
    let status = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args([
            "generate",
            "--model",
            dir.to_str().context("path")?,
            "Hello",
            "The",
        ])
        .stdin(Stdio::null())
        .stdout(screen.try_clone()?)
        .stderr(screen)
        .status()?;
    let text = std::fs::read_to_string(&path)?;
    assert!(status.success(), "{text}");
    let timings: Vec<&str> = text.lines().filter(|l| l.contains("tokens/s")).collect();
    assert_eq!(timings.len(), 2, "{text}");
    for line in timings {
        assert!(
            line.starts_with("prompt "),
            "timings after the text: {line:?} in\n{text}"
        );
    }
    Ok(())
}

#[test]
fn inspect_recognises_decoders_and_checks_their_config() -> Result<()> {
    let decoders = fixture_dir("decoders");
    for (folder, family) in [
        ("gpt2", "gpt2: vocab 128, hidden 64, layers 2, MLP 256"),
        ("llama", "llama: vocab 128, hidden 64, layers 2, MLP 128"),
        ("mistral", "llama: vocab 128"),
        ("qwen2", "qwen2: vocab 128"),
        (
            "qwen3",
            "qwen3: vocab 128, hidden 64, layers 2, MLP 128, heads 4, kv heads 2",
        ),
    ] {
        let out = multihead!(&["inspect", decoders.join(folder).to_str().context("path")?])?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{folder}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for want in [
            "layout: HF transformers decoder",
            family,
            "HF transformers decoder config",
            "every tensor matches",
        ] {
            assert!(stdout.contains(want), "{folder}: no {want:?} in\n{stdout}");
        }
    }
    // A config one key/value head off: the mis-shaped projections, named.
    let dir = scratch_dir!("inspect-kv")?;
    let src = decoders.join("llama");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors"))?;
    let text = std::fs::read_to_string(src.join("config.json"))?;
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"),
    )?;
    let out = multihead!(&["inspect", dir.to_str().context("path")?])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("k_proj.weight") && text.contains("[64, 64]") && text.contains("[32, 64]"),
        "{text}"
    );
    Ok(())
}

/// A conversation from a file (`--messages`), template arguments
/// (`--template-arg`), one JSON object a line (`--format jsonl`),
/// `--threads`, and `--temperature 0` as greedy decoding: each gives what
/// the library (or the plain greedy run) gives.
#[test]
fn generate_takes_conversations_template_args_jsonl_and_threads() -> Result<()> {
    use multihead::models::decoder::{ChatMessage, TemplateArgs, TextGenerator};
    let dir = folder_with(scratch_dir!("llama3-cli-template-args")?, "llama3", |d| {
        // Llama 3's template, with a line only `enable_thinking=false` adds.
        let path = d.join("chat_template.jinja");
        let source = std::fs::read_to_string(&path)?;
        Ok(std::fs::write(
            path,
            format!("{{% if enable_thinking is defined and not enable_thinking %}}/no_think {{% endif %}}{source}"),
        )?)
    })?;
    let model = dir.to_str().context("path")?;
    let conversation = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hello world"),
        ChatMessage::new("assistant", "Hi."),
        ChatMessage::new("user", "héllo again"),
    ];
    let file = dir.join("conversation.json");
    std::fs::write(&file, serde_json::to_string(&conversation)?)?;
    let g = TextGenerator::from_folder(&dir, &candle::Device::Cpu)?;
    let args = TemplateArgs::from([("enable_thinking".to_string(), Value::Bool(false))]);
    for (extra, args) in [
        (vec![], TemplateArgs::new()),
        (vec!["--template-arg", "enable_thinking=false"], args),
    ] {
        let want = g.generate_chat_with(&conversation, &args, &g.settings(), &mut |_| Ok(()))?;
        let mut cli = vec![
            "generate",
            "--model",
            model,
            "--messages",
            file.to_str().context("path")?,
        ];
        cli.extend(["--format", "jsonl", "--threads", "1"]);
        cli.extend(extra);
        let out = multihead!(&cli)?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<Value> = String::from_utf8(out.stdout)?
            .lines()
            .map(serde_json::from_str)
            .collect::<serde_json::Result<_>>()?;
        assert_eq!(lines.len(), 1);
        assert_eq!(ids(&lines[0]["tokens"]), want.ids);
        assert_eq!(lines[0]["prompt_tokens"], want.prompt_ids.len());
        assert_eq!(lines[0]["messages"][3]["content"], "héllo again");
    }
    // The argument reaches the template: the prompt grows by its line.
    let plain = g.generate_chat(&conversation, &g.settings(), &mut |_| Ok(()))?;
    let thinking = g.generate_chat_with(
        &conversation,
        &TemplateArgs::from([("enable_thinking".to_string(), Value::Bool(false))]),
        &g.settings(),
        &mut |_| Ok(()),
    )?;
    assert!(thinking.prompt_ids.len() > plain.prompt_ids.len());
    // `--temperature 0` is `--greedy`, one JSON line a prompt.
    let run = |flag: &str| -> Result<Vec<Value>> {
        let out = multihead!(&[
            "generate",
            "--model",
            model,
            "--format",
            "jsonl",
            flag,
            "Hello world",
            "a",
        ])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8(out.stdout)?
            .lines()
            .map(serde_json::from_str)
            .collect::<serde_json::Result<_>>()?)
    };
    let (zero, greedy) = (run("--temperature=0")?, run("--greedy")?);
    assert_eq!(zero.len(), 2);
    assert_eq!(
        zero.iter().map(|l| &l["tokens"]).collect::<Vec<_>>(),
        greedy.iter().map(|l| &l["tokens"]).collect::<Vec<_>>()
    );
    // A file that is not a conversation names the entry.
    std::fs::write(&file, r#"[{"role": "user", "content": ["parts"]}]"#)?;
    let out = multihead!(&[
        "generate",
        "--model",
        model,
        "--messages",
        file.to_str().context("path")?,
    ])?;
    assert_one_line_error(&out, &["conversation.json: messages[0].content must be a string"]);
    Ok(())
}

/// `--model ORG/NAME[@REVISION]` finds the model in the local Hugging Face
/// cache, laid out as `huggingface_hub` downloads (snapshot files are
/// links into `blobs/`), with no network: the same text as the folder.
#[cfg(unix)]
#[test]
fn a_hub_name_loads_from_the_local_cache() -> Result<()> {
    let home = scratch_dir!("hf-home")?;
    let repo = home.join("hub").join("models--acme--tiny-llama");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(repo.join("blobs"))?;
    std::fs::create_dir_all(repo.join("refs"))?;
    std::fs::write(repo.join("refs").join("main"), commit)?;
    for entry in std::fs::read_dir(fixtures().join("llama3"))? {
        let entry = entry?;
        let blob = repo.join("blobs").join(entry.file_name());
        std::fs::copy(entry.path(), &blob)?;
        std::os::unix::fs::symlink(
            Path::new("../../blobs").join(entry.file_name()),
            snapshot.join(entry.file_name()),
        )?;
    }
    let run = |model: &str| -> Result<std::process::Output> {
        Ok(Command::new(env!("CARGO_BIN_EXE_multihead"))
            .args(["generate", "--model", model, "Hello world"])
            .env("HF_HOME", &home)
            .env_remove("HF_HUB_CACHE")
            .env_remove("HUGGINGFACE_HUB_CACHE")
            // Never the network, even in a build with `hub-download`.
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::null())
            .output()?)
    };
    let folder = run(fixtures().join("llama3").to_str().context("path")?)?;
    assert!(folder.status.success());
    for spec in ["acme/tiny-llama", &format!("acme/tiny-llama@{commit}")] {
        let out = run(spec)?;
        assert!(
            out.status.success(),
            "{spec}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout, folder.stdout, "{spec}");
    }
    let out = run("acme/other")?;
    let why = if cfg!(feature = "hub-download") {
        "HF_HUB_OFFLINE is set, so nothing is downloaded"
    } else {
        "a multihead built with `--features hub-download`"
    };
    assert_one_line_error(&out, &["'acme/other'", "hf-home/hub' has no acme/other", why]);
    let out = run("acme/tiny-llama@v2")?;
    assert_one_line_error(&out, &["has acme/tiny-llama but no revision 'v2'"]);
    Ok(())
}
