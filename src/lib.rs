//! `multihead`: multi-head attention for candle, proven against PyTorch.
//!
//! This facade re-exports the workspace crates:
//! - [`attention`] ([`multihead_attention`]): `MultiheadAttention` and
//!   `scaled_dot_product_attention`;
//! - [`models`] ([`multihead_models`]): models built on it.

pub use multihead_attention as attention;
pub use multihead_models as models;
