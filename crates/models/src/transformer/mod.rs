//! The transformer encoder–decoder of "Attention Is All You Need", loading
//! PyTorch `nn.Transformer` state dicts by their own names, with cached
//! incremental decoding, greedy and beam search.
//!
//! - [`Transformer`], [`TransformerEncoder`], [`TransformerDecoder`],
//!   [`TransformerEncoderLayer`], [`TransformerDecoderLayer`]: PyTorch's
//!   modules of the same names (eval mode), pre- or post-norm, ReLU or GELU,
//!   with every mask `nn.Transformer.forward` takes ([`TransformerMasks`]).
//! - [`Seq2SeqCache`]: per-layer self-attention keys/values (a
//!   [`crate::decoder::DecoderCache`]) and the
//!   cross-attention keys/values of the memory, projected once.
//! - [`Seq2Seq`]: embeddings + positions + `nn.Transformer` + output
//!   projection, the model `multihead seq2seq` ships, with
//!   [`Seq2Seq::greedy`] and [`Seq2Seq::beam_search`].

mod cache;
mod config;
mod layer;
mod model;
mod search;
mod seq2seq;
mod vocab;

pub use crate::mlp::Activation;
pub use cache::{DecoderStep, Seq2SeqCache};

/// Deprecated alias of [`Seq2SeqCache`].
#[deprecated(note = "use Seq2SeqCache (decoder::DecoderCache is the decoder-only cache it holds)")]
pub type DecoderCache = Seq2SeqCache;
pub use config::TransformerConfig;
pub use layer::{TransformerDecoderLayer, TransformerEncoderLayer};
pub use model::{FinalNorm, Transformer, TransformerDecoder, TransformerEncoder, TransformerMasks};
#[allow(deprecated)]
pub use search::Hypothesis;
pub use search::{Attended, CacheMode};
pub use seq2seq::{sinusoidal_positions, Encoded, Seq2Seq, Seq2SeqConfig, MAX_COMPUTED_POSITIONS};
pub use vocab::CharVocab;
