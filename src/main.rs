//! `multihead`: run the shipped models on real inputs.
//!
//! - `multihead vit [IMAGES…]`: classify images with a Vision Transformer.
//! - `multihead seq2seq [TEXT…]`: translate with the encoder–decoder.
//! - `multihead generate --model DIR|FILE.gguf [PROMPT…]`: continue text with a decoder folder or GGUF file.
//! - `multihead chat --model DIR|FILE.gguf|ORG/NAME`: a conversation, a line a turn.
//! - `multihead serve --model DIR|FILE.gguf|ORG/NAME`: OpenAI's HTTP API, concurrent requests batched.
//! - `multihead tokenize --model DIR|FILE.gguf [TEXT…]`: the ids and pieces a model's tokenizer gives.
//! - `multihead inspect FILE.safetensors|FILE.gguf`: what a checkpoint holds and is.

use clap::{Parser, Subcommand};

mod cli;

#[derive(Debug, Parser)]
#[command(
    name = "multihead",
    version,
    about = "Attention models on candle, proven against PyTorch"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Classify images with a Vision Transformer (default: the shipped digits model and samples).
    Vit(cli::vit::Args),
    /// Translate text with the transformer encoder–decoder (default: the shipped date normaliser).
    Seq2seq(cli::seq2seq::Args),
    /// Continue text with a decoder folder (GPT-2, Llama, Mistral, Qwen2, Qwen3), streamed.
    Generate(cli::generate::Args),
    /// Hold a conversation with a decoder: a line a turn (from a terminal or a pipe), replies streamed.
    Chat(cli::generate::Args),
    /// Serve OpenAI's HTTP API (chat and text completions, streamed or not) over a decoder, batching concurrent requests.
    Serve(cli::serve::Args),
    /// The ids and pieces a model's tokenizer gives for texts (a GGUF vocabulary-only file will do).
    Tokenize(cli::tokenize::Args),
    /// List a checkpoint's tensors, recognise its layout, check it against a config.
    Inspect(cli::inspect::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Vit(args) => cli::vit::run(args),
        Command::Seq2seq(args) => cli::seq2seq::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Chat(args) => cli::chat::run(args),
        Command::Serve(args) => cli::serve::run(args),
        Command::Tokenize(args) => cli::tokenize::run(args),
        Command::Inspect(args) => cli::inspect::run(args),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // `multihead inspect FILE | head -3`: the reader has all it wants.
        // Rust ignores SIGPIPE, so the write fails instead of killing the
        // process; end quietly and successfully, as `head` users expect.
        Err(e) if stdout_closed(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether `e` comes from writing to a standard output whose reader has
/// gone (the only writes that can fail with a broken pipe here: files are
/// written whole, and reading never breaks a pipe).
fn stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The error chain as one line. candle appends a captured backtrace to its
/// errors' messages when `RUST_BACKTRACE` is set, and some messages span
/// lines; a user-facing message keeps the first line of each cause.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let line = text.lines().next().unwrap_or_default().trim().to_string();
        // Some errors repeat their source's message in their own.
        if !line.is_empty() && !parts.last().is_some_and(|p| p.contains(&line)) {
            parts.push(line);
        }
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over every subcommand (argument ids,
    /// group ids, conflicts), which a debug build runs only for the
    /// subcommand a user calls and a release build never.
    #[test]
    fn every_subcommand_passes_clap_checks() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
