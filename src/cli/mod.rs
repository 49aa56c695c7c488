//! The binary's subcommands, one module each.

pub mod inspect;
pub mod seq2seq;
pub mod vit;
