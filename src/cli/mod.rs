//! The binary's subcommands, one module each.

mod heatmap;
pub mod inspect;
pub mod model_files;
mod output;
pub mod seq2seq;
pub mod vit;
