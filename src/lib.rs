//! `multihead`: multi-head attention for candle, proven against PyTorch.
//!
//! This facade re-exports the workspace crates:
//! - [`attention`] ([`multihead_attention`]): `MultiheadAttention` and
//!   `scaled_dot_product_attention`;
//! - [`models`] ([`multihead_models`]): models built on it;
//! - [`kernels`] ([`multihead_kernels`]): the CPU kernels both run on
//!   (`PackedLinear`, `LayerNorm` and the activations are also at
//!   [`attention`]).
//!
//! The default feature `cli` is the `multihead` binary's (clap, indicatif,
//! font8x8, serde_json, image); depend with `default-features = false` for
//! the library alone, and add the feature `image` for
//! `models::image_input`.

pub use multihead_attention as attention;
pub use multihead_kernels as kernels;
pub use multihead_models as models;
