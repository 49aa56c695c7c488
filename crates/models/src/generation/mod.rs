//! Generation that callers can steer, over any model that steps a cache to
//! next-token logits ([`StepModel`]).
//!
//! - [`generate`]: greedy decoding, seeded sampling and beam search, batched,
//!   with the model's cache, and every [`LogitsProcessor`] the caller lists
//!   applied to every row at every step (HF transformers' `generate`).
//! - Processors: [`Temperature`], [`TopK`], [`TopP`], [`RepetitionPenalty`],
//!   [`MinLength`], [`MaxLength`], [`ForcedBos`], [`ForcedEos`],
//!   [`PrefixAllowedTokens`] (HF's `prefix_allowed_tokens_fn`), and
//!   [`TokenConstraint`]: the output must match a regular-expression-like
//!   [`Pattern`].

mod beam;
mod constraint;
mod parse;
mod pattern;
mod processors;
mod rng;
mod search;
mod step;

pub use constraint::TokenConstraint;
pub use pattern::Pattern;
pub use processors::{
    ForcedBos, ForcedEos, LogitsProcessor, MaxLength, MinLength, PrefixAllowedTokens, RepetitionPenalty,
    StepContext, Temperature, TopK, TopP,
};
pub use search::{
    generate, generate_from, generate_streaming, generate_streaming_in, Chosen, Decoding, GenerateConfig,
    Generated,
};
pub use step::StepModel;

// The pieces of a search that a scheduler stepping many sequences at once
// ([`crate::decoder::Batcher`]) runs row by row.
pub(crate) use rng::SplitMix64;
pub(crate) use search::{apply, draw, greedy_pick, log_probs};
