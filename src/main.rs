//! `multihead`: run the shipped models on real inputs.
//!
//! - `multihead vit [IMAGES…]`: classify images with a Vision Transformer.
//! - `multihead seq2seq [TEXT…]`: translate with the encoder–decoder.

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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Vit(args) => cli::vit::run(args),
        Command::Seq2seq(args) => cli::seq2seq::run(args),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, no backtrace: the chain of contexts says what is wrong.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
