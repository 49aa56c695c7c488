//! Models built on [`multihead_attention`]: the Vision Transformer and a
//! transformer encoder–decoder, loading PyTorch-exported safetensors.
//!
//! Input from strangers goes through [`checkpoint`] (weights) and
//! `image_input` (images, feature `image`); [`inspect`] describes a
//! checkpoint.

pub mod checkpoint;
pub mod dates;
pub mod decoder;
pub mod files;
pub mod generation;
#[cfg(feature = "image")]
pub mod image_input;
pub mod inspect;
pub mod transformer;
pub mod vit;
