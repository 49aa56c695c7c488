//! Models built on [`multihead_attention`]: the Vision Transformer, a
//! transformer encoder–decoder and decoder-only language models (GPT-2,
//! Llama, Mistral, Qwen2, Qwen3, with their tokenizers, chat templates and
//! generation configs: [`decoder`]), loading PyTorch-exported safetensors.
//!
//! Input from strangers goes through [`formats`]: bounded reads of
//! regular files, safetensors and GGUF weights, images (feature `image`),
//! and the report `inspect` prints for a weights file. [`checkpoint`]
//! finds a model's files and says how they load.

pub mod checkpoint;
pub mod dates;
pub mod decoder;
pub mod formats;
pub mod generation;
pub mod mlp;
pub mod transformer;
pub mod vit;

/// Bounded reads of regular files: [`formats::files`].
pub use formats::files;
/// Images decoded under size limits: [`formats::image_input`].
#[cfg(feature = "image")]
pub use formats::image_input;
/// What a weights file is: [`formats::inspect`].
pub use formats::inspect;

/// The crate README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
