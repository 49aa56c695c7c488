//! `multihead tokenize`: the ids and pieces a model's tokenizer gives for
//! texts, as llama.cpp's `llama-tokenize` shows them; from a folder's
//! tokenizer.json or the tokenizer a GGUF file carries (a vocabulary-only
//! file is enough).

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use multihead::models::checkpoint::resolve_model;
use multihead::models::decoder::{ChatMessage, ChatTemplate, TextTokenizer};
use multihead::models::formats::gguf::{is_gguf, GgufFile};
use serde_json::json;

/// Most bytes read from standard input as the one text.
const MAX_STDIN_BYTES: u64 = 64 << 20;

/// Arguments of `multihead tokenize`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Texts, tokenized one by one; without any, the whole of standard
    /// input is one text.
    pub texts: Vec<String>,
    /// The model folder (its tokenizer.json), a GGUF file (the tokenizer
    /// its metadata carries; one without tensors will do) or a hub name,
    /// `ORG/NAME[@REVISION]`, found in the local Hugging Face cache.
    #[arg(long, value_name = "DIR|FILE.gguf|ORG/NAME")]
    pub model: PathBuf,
    /// Leave out the special tokens the tokenizer adds (BOS, EOS).
    #[arg(long)]
    pub no_special: bool,
    /// Each text as a user's message rendered by the model's chat
    /// template (with the assistant's turn opened) before tokenizing.
    #[arg(long)]
    pub chat: bool,
    /// How the ids are written.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Output formats of `multihead tokenize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A line a token, `ID 'PIECE'`; a blank line between texts.
    Text,
    /// One JSON array, an object per text holding `ids` and `pieces`.
    Json,
}

pub fn run(args: Args) -> Result<()> {
    let model = resolve_model(&args.model)?;
    let (tokenizer, chat) = if is_gguf(&model) {
        let file = GgufFile::read(&model)?;
        let tokenizer = TextTokenizer::from_gguf(&file)?;
        let chat = if args.chat {
            ChatTemplate::from_gguf(&file)?
        } else {
            None
        };
        (tokenizer, chat)
    } else {
        let tokenizer = TextTokenizer::from_folder(&model)?;
        let chat = if args.chat {
            ChatTemplate::from_folder(&model)?
        } else {
            None
        };
        (tokenizer, chat)
    };
    if args.chat && chat.is_none() {
        bail!("--chat: '{}' has no chat template", model.display())
    }
    let texts = if args.texts.is_empty() {
        vec![read_stdin()?]
    } else {
        args.texts
    };
    let mut results = Vec::with_capacity(texts.len());
    for text in &texts {
        let ids = match &chat {
            Some(template) => {
                // The template writes the special tokens: as
                // `apply_chat_template(tokenize=True)`, none are added.
                let rendered = template.render(&[ChatMessage::new("user", text.as_str())], true)?;
                tokenizer.encode_plain(&rendered)?
            }
            None if args.no_special => tokenizer.encode_plain(text)?,
            None => tokenizer.encode(text)?,
        };
        let pieces = tokenizer.pieces(&ids);
        results.push((ids, pieces));
    }
    let mut out = std::io::stdout().lock();
    match args.format {
        Format::Json => {
            let array: Vec<_> = results
                .iter()
                .map(|(ids, pieces)| json!({"ids": ids, "pieces": pieces}))
                .collect();
            writeln!(out, "{}", serde_json::Value::Array(array))?;
        }
        Format::Text => {
            for (i, (ids, pieces)) in results.iter().enumerate() {
                if i > 0 {
                    writeln!(out)?;
                }
                for (id, piece) in ids.iter().zip(pieces) {
                    let piece = piece.as_deref().unwrap_or_default();
                    writeln!(out, "{id} '{}'", piece.escape_debug())?;
                }
            }
        }
    }
    out.flush()?;
    Ok(())
}

/// Standard input, whole, as one text.
fn read_stdin() -> Result<String> {
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_STDIN_BYTES + 1)
        .read_to_end(&mut bytes)
        .context("reading standard input")?;
    if bytes.len() as u64 > MAX_STDIN_BYTES {
        bail!("standard input is over the limit of {MAX_STDIN_BYTES} bytes")
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "standard input is not UTF-8 (at byte {})",
            e.utf8_error().valid_up_to()
        )
    })
}
