//! Models built on [`multihead_attention`]: the Vision Transformer and a
//! transformer encoder–decoder, loading PyTorch-exported safetensors.

pub mod transformer;
pub mod vit;
