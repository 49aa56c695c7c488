//! Models built on [`multihead_attention`]: the Vision Transformer, a
//! transformer encoder–decoder and decoder-only language models (GPT-2,
//! Llama, Mistral, Qwen2, Qwen3, with their tokenizers, chat templates and
//! generation configs: [`decoder`]), loading PyTorch-exported safetensors.
//!
//! Input from strangers goes through [`files`] (bounded reads of regular
//! files), [`checkpoint`] (weights) and `image_input` (images, feature
//! `image`); [`inspect`] describes a checkpoint.

pub mod checkpoint;
pub mod dates;
pub mod decoder;
pub mod files;
pub mod generation;
#[cfg(feature = "image")]
pub mod image_input;
pub mod inspect;
pub mod mlp;
pub mod transformer;
pub mod vit;

/// The crate README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
