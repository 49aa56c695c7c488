//! `multihead seq2seq` (in progress).

use anyhow::{bail, Result};

/// Arguments of `multihead seq2seq`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> Result<()> {
    bail!("'seq2seq' is not built yet")
}
