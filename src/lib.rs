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
//! `models::formats::image_input`.

pub use multihead_attention as attention;
pub use multihead_kernels as kernels;
pub use multihead_models as models;

/// The README's and docs/'s Rust snippets, compiled and run as doctests
/// (`cargo test --doc`), so that every example a reader copies works as
/// written. Their paths are relative to this package's root, the doctests'
/// working directory.
#[cfg(doctest)]
mod snippets {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/vit.md")]
    struct Vit;
    #[doc = include_str!("../docs/seq2seq.md")]
    struct Seq2Seq;
    #[doc = include_str!("../docs/decoders.md")]
    struct Decoders;
    #[doc = include_str!("../docs/hydra.md")]
    struct Hydra;
    #[doc = include_str!("../docs/untrusted.md")]
    struct Untrusted;
    #[doc = include_str!("../docs/benchmarks.md")]
    struct Benchmarks;
}
