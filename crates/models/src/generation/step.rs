//! What a model must offer to be decoded by [`super::generate`]: one step
//! of "feed the last tokens through a cache, get next-token logits".

use candle::{Device, Result, Tensor};

/// A model decoded one position at a time over a cache it owns the layout
/// of: an encoder–decoder over its cross-attention memory
/// ([`crate::transformer::Seq2Seq`]), or a decoder-only model over its
/// key/value cache.
///
/// The search code never looks inside the cache; it only feeds tokens and
/// reorders rows (beam search keeps the cache of the parent beam).
pub trait StepModel {
    /// Per-row decoding state, `batch` rows.
    type Cache;

    /// Feeds one new token per row and returns the logits of the next one.
    ///
    /// # Shapes
    /// - `tokens`: `(batch, 1)`, `u32`
    /// - returns `(batch, vocab_size)`, any float dtype
    fn step(&self, tokens: &Tensor, cache: &mut Self::Cache) -> Result<Tensor>;

    /// Keeps the cache rows `rows` (which may repeat), in that order.
    ///
    /// # Shapes
    /// - `rows`: `(new_batch,)`, `u32`
    fn select_rows(&self, cache: &mut Self::Cache, rows: &Tensor) -> Result<()>;

    /// Size of the output vocabulary: the width of [`StepModel::step`]'s logits.
    fn vocab_size(&self) -> usize;

    /// Where the model's tensors live.
    fn device(&self) -> &Device;
}
