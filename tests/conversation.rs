//! A conversation held turn after turn ([`Conversation`]) keeps its cache
//! between turns and still gives, at every turn, what a fresh
//! `generate_chat` over the whole history gives (which gives HF's reply:
//! `text_generation.rs`); and `multihead chat` reads turns from a pipe.

use anyhow::{Context, Result};
use candle::Device;
use multihead::models::decoder::{ChatMessage, TextGenerator};
use multihead_test_support::{
    multihead, scratch_dir,
    text::{fixtures, folder_with},
    tokens::ids,
};

const TURNS: [&str; 3] = ["Hello world", "héllo again, 日本語?", "and once more"];

#[test]
fn each_reply_is_a_fresh_generate_chat_over_the_history() -> Result<()> {
    let (name, turns) = ("llama3", &TURNS[..]);
    let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
    let settings = g.settings();
    let mut conversation = g.conversation();
    conversation.push(ChatMessage::new("system", "Be brief."));
    let mut history = vec![ChatMessage::new("system", "Be brief.")];
    let mut cached = 0;
    for turn in turns {
        conversation.push(ChatMessage::new("user", *turn));
        history.push(ChatMessage::new("user", *turn));
        let mut pieces = String::new();
        let reply = conversation.reply(&settings, &mut |p| {
            pieces.push_str(p);
            Ok(())
        })?;
        let fresh = g.generate_chat(&history, &settings, &mut |_| Ok(()))?;
        assert_eq!(reply.ids, fresh.ids, "{name} {turn:?}");
        assert_eq!(pieces, fresh.text, "{name} {turn:?}: streamed");
        history.push(ChatMessage::new("assistant", fresh.text));
        assert_eq!(conversation.messages(), history.as_slice());
        // The cache grows with the history instead of starting over.
        assert!(conversation.cached_tokens() > cached, "{name} {turn:?}");
        cached = conversation.cached_tokens();
    }
    conversation.reset();
    assert_eq!(conversation.cached_tokens(), 0);
    conversation.push(ChatMessage::new("user", turns[0]));
    let again = conversation.reply(&settings, &mut |_| Ok(()))?;
    let fresh = g.generate_chat(&[ChatMessage::new("user", turns[0])], &settings, &mut |_| Ok(()))?;
    assert_eq!(again.ids, fresh.ids, "{name}: after /reset");
    Ok(())
}

/// HF's greedy replies turn after turn (`tests/fixtures/text/parity.json`,
/// `scripts/make_parity_fixtures.py`: each to `apply_chat_template` over the
/// conversation so far, HF's own replies appended) are the conversation's.
#[test]
fn each_reply_is_hf_s_reply_to_the_conversation_so_far() -> Result<()> {
    let parity: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("parity.json"))?)?;
    let want = &parity["conversation"];
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let mut settings = g.settings();
    settings.min_new_tokens = want["min_new_tokens"].as_u64().context("min_new_tokens")? as usize;
    let mut conversation = g.conversation();
    conversation.push(ChatMessage::new(
        "system",
        want["system"].as_str().context("system")?,
    ));
    for turn in want["turns"].as_array().context("turns")? {
        conversation.push(ChatMessage::new("user", turn["user"].as_str().context("user")?));
        let reply = conversation.reply(&settings, &mut |_| Ok(()))?;
        // HF's new ids end with the end token it chose.
        let mut hf = ids(&turn["new_ids"]);
        hf.pop();
        assert_eq!(reply.ids, hf, "{}", turn["user"]);
        assert_eq!(reply.text, turn["text"].as_str().context("text")?);
    }
    Ok(())
}

/// A conversation past the context (GPT-2's 128 positions, which the
/// random fixture's first reply, re-tokenized, nearly fills) is refused
/// with both numbers; taking the turn back, the conversation goes on.
#[test]
fn a_full_context_is_an_error_and_the_turn_can_be_taken_back() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("gpt2-bpe"), &Device::Cpu)?;
    let settings = g.settings();
    let mut conversation = g.conversation();
    conversation.push(ChatMessage::new("system", "Be brief."));
    conversation.push(ChatMessage::new("user", "Hi"));
    conversation.reply(&settings, &mut |_| Ok(()))?;
    conversation.push(ChatMessage::new("user", "ok"));
    let err = conversation
        .reply(&settings, &mut |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokens long but the model's context holds 128"),
        "{err}"
    );
    assert_eq!(conversation.messages().len(), 4);
    assert_eq!(conversation.pop(), Some(ChatMessage::new("user", "ok")));
    conversation.reset();
    conversation.push(ChatMessage::new("user", "ok"));
    let reply = conversation.reply(&settings, &mut |_| Ok(()))?;
    let fresh = g.generate_chat(&[ChatMessage::new("user", "ok")], &settings, &mut |_| Ok(()))?;
    assert_eq!(reply.ids, fresh.ids);
    Ok(())
}

/// `multihead chat` with turns on a pipe: one reply a line, each the
/// library's reply to the conversation so far; `/reset` starts over and
/// `/quit` ends it.
#[test]
fn the_chat_command_reads_turns_from_a_pipe() -> Result<()> {
    let dir = fixtures().join("llama3");
    let g = TextGenerator::from_folder(&dir, &Device::Cpu)?;
    let settings = g.settings();
    let mut conversation = g.conversation();
    let mut want = String::new();
    for turn in &TURNS[..2] {
        conversation.push(ChatMessage::new("user", *turn));
        want += &conversation.reply(&settings, &mut |_| Ok(()))?.text;
        want += "\n";
    }
    conversation.reset();
    conversation.push(ChatMessage::new("user", TURNS[2]));
    want += &conversation.reply(&settings, &mut |_| Ok(()))?.text;
    want += "\n";
    let input = format!(
        "{}\n\n{}\n/reset\n{}\n/quit\nnot read\n",
        TURNS[0], TURNS[1], TURNS[2]
    );
    let out = multihead!(&["chat", "--model", dir.to_str().context("path")?], &input)?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout)?, want);
    Ok(())
}

/// Ctrl-C (SIGINT) while a reply streams stops the reply, not the
/// program: the next line is read, and `/quit` ends it with status 0.
#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_reply_not_the_chat() -> Result<()> {
    use std::io::{Read, Write};
    use std::process::{Command, Stdio};
    // No end token: the reply would run to 65,536 tokens.
    let dir = folder_with(scratch_dir!("llama3-chat-ctrl-c")?, "llama3", |d| {
        Ok(std::fs::write(
            d.join("generation_config.json"),
            r#"{"max_new_tokens": 65536}"#,
        )?)
    })?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(["chat", "--model", dir.to_str().context("path")?])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(b"Hello world\n")?;
    stdin.flush()?;
    // Once the reply streams, interrupt it.
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first)?;
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()?;
    assert!(kill.success());
    stdin.write_all(b"/quit\n")?;
    drop(stdin);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest)?;
    let out = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("[stopped]"), "{stderr}");
    Ok(())
}
