//! The binary's subcommands, one module each.

pub mod chat;
pub mod generate;
mod heatmap;
mod input;
pub mod inspect;
pub mod model_files;
mod output;
pub mod seq2seq;
pub mod serve;
pub mod tokenize;
pub mod vit;
