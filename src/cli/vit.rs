//! `multihead vit` (in progress).

use anyhow::{bail, Result};

/// Arguments of `multihead vit`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the command.
pub fn run(_args: Args) -> Result<()> {
    bail!("'vit' is not built yet")
}
