//! Chat templates over random conversations: the input's first byte picks
//! a template (the committed fixtures' Llama 3 Instruct and ChatML ones, or
//! the input's own text up to a NUL), the rest is cut into messages whose
//! role and content it gives. Rendering must return text or an error,
//! never panic, overflow the stack or run unbounded (fuel, the rendering's
//! own stack, the depth bound on printed values).
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use multihead_models::decoder::{ChatMessage, ChatTemplate};

static LLAMA3: &str = include_str!("../../tests/fixtures/text/llama3/chat_template.jinja");
static CHATML: &str = include_str!("../../tests/fixtures/text/gpt2-bpe/chat_template.jinja");

fuzz_target!(
    init: {
        // The text side catches its dependencies' panics on untrusted input
        // at its boundary (the tokenizers crate's calls, MiniJinja's
        // rendering thread); libfuzzer-sys's hook would abort on those too.
        // A panic that escapes still aborts: it cannot unwind out of the
        // fuzzer's C entry point (FUZZ_SHOW_PANICS=1 prints every panic).
        std::panic::set_hook(Box::new(|info| {
            if std::env::var_os("FUZZ_SHOW_PANICS").is_some() {
                eprintln!("{info}");
            }
        }));
    },
    |data: &[u8]| {
        let Some((&which, rest)) = data.split_first() else {
            return;
        };
        let (source, rest) = match which % 3 {
            0 => (LLAMA3.to_string(), rest),
            1 => (CHATML.to_string(), rest),
            _ => {
                let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
                (
                    String::from_utf8_lossy(&rest[..end]).into_owned(),
                    rest.get(end + 1..).unwrap_or_default(),
                )
            }
        };
        let special = BTreeMap::from([
            ("bos_token".to_string(), "<|begin_of_text|>".to_string()),
            ("eos_token".to_string(), "<|eot_id|>".to_string()),
        ]);
        let Ok(template) = ChatTemplate::new(source, "chat_template.jinja", special) else {
            return;
        };
        let roles = ["system", "user", "assistant", "tool", ""];
        let messages: Vec<ChatMessage> = rest
            .split(|&b| b == 0xFF)
            .take(64)
            .filter_map(|m| m.split_first())
            .map(|(&r, content)| {
                ChatMessage::new(
                    roles[usize::from(r) % roles.len()],
                    String::from_utf8_lossy(content),
                )
            })
            .collect();
        let _ = template.render(&messages, which & 0x80 != 0);
    }
);
