//! Multi-head attention for [candle](https://github.com/huggingface/candle),
//! faithful to PyTorch's `nn.MultiheadAttention` and
//! `F.scaled_dot_product_attention`.
//!
//! - [`MultiheadAttention`]: self-, causal and cross-attention with every
//!   option of PyTorch's module (`bias`, `add_bias_kv`, `add_zero_attn`,
//!   `kdim`/`vdim`, dropout), loading PyTorch's own weight layouts
//!   ([`WeightLayout`]: `in_proj_weight`, separate q/k/v/out linears,
//!   timm's fused `qkv`).
//! - Decoder self-attention: [`MultiheadAttention::forward_cached`] steps a
//!   [`KvCache`] (prefill, chunks and single tokens alike), with
//!   grouped-query heads, [`Rotary`] embeddings, [`Alibi`] and sliding
//!   windows ([`MhaConfig`], [`PositionEncoding`]); GPT-2's `Conv1D` and
//!   Llama's `q_proj`/`k_proj`/`v_proj`/`o_proj` layouts.
//! - [`scaled_dot_product_attention`]: the function every path ends in, on
//!   `(batch, heads, seq, head_dim)` tensors.
//! - [`HydraAttention`]: Hydra attention (Bolya et al., 2022), as many
//!   heads as features, O(N·D), on the same `qkv`/`proj` weights.
//! - [`Mask`]: causal rules, key padding and attention masks whose boolean
//!   polarity is part of their type.
//!
//! Differences from PyTorch, both deliberate: a query whose keys are all
//! masked returns zeros (PyTorch: NaN), and f16/bf16 scores are softmaxed in
//! f32. NaN and infinities propagate as in PyTorch, the same on every path,
//! except that a key the mask hides takes no part even when it is NaN.
//!
//! ```
//! use candle::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use multihead_attention::{Causal, Mask, MhaConfig, MhaOptions, MultiheadAttention, NeedWeights};
//!
//! # fn main() -> candle::Result<()> {
//! let dev = Device::Cpu;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let mha = MultiheadAttention::new(&MhaConfig::new(32, 4), vb)?;
//!
//! // Self-attention: (batch, seq, embed_dim) -> same.
//! let x = Tensor::randn(0f32, 1., (2, 5, 32), &dev)?;
//! assert_eq!(mha.forward(&x)?.dims(), &[2, 5, 32]);
//!
//! // Causal self-attention, returning the head-averaged weights.
//! let opts = MhaOptions::new()
//!     .with_mask(Mask::causal(Causal::TopLeft))
//!     .with_weights(NeedWeights::Averaged);
//! let out = mha.forward_attn(&x, &x, &x, &opts)?;
//! assert_eq!(out.weights.unwrap().dims(), &[2, 5, 5]);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod alibi;
mod cache;
mod config;
mod handover;
mod hydra;
mod layout;
mod mask;
mod mha;
mod options;
mod projection;
mod rotary;
mod sdpa;

/// The CPU building blocks the attention and the models run on, from
/// `multihead-kernels`.
pub use multihead_kernels::{
    cpu_isa, dequantize_row, gelu_tanh_and_mul, gelu_tanh_mul, is_broadcast, relu, silu_and_mul, silu_mul,
    BlockFormat, LayerNorm, LentBlocks, PackFormat, PackOptions, PackedLinear, RmsNorm,
};

pub use cache::{DecoderCache, KvCache};
pub use config::{MhaConfig, NormKind, PositionEncoding, RopeScaling, RotaryConfig, RotaryStyle};
pub use hydra::{hydra_attention, HydraAttention, HydraConfig};
pub use layout::{SeparateNames, WeightLayout};
pub use mask::{Alibi, AttnMask, Causal, KeyPaddingMask, Mask};
pub use mha::MultiheadAttention;
pub use options::{MhaOptions, MhaOutput, NeedWeights, SeqLayout};
pub use rotary::Rotary;
pub use sdpa::{
    scaled_dot_product_attention, scaled_dot_product_attention_dropout,
    scaled_dot_product_attention_tiled_on, scaled_dot_product_attention_via,
    scaled_dot_product_attention_with_weights, set_dropout_seed, AttnPath,
};

/// The crate README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
