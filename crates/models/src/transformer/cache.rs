//! Incremental decoding: a per-layer key/value cache for the decoder's
//! self-attention, and the cross-attention keys/values of the encoder
//! memory, projected once and reused at every step.
//!
//! A step feeds only the new target positions. Each layer projects their
//! keys and values, appends them to its cache along the sequence dim, and
//! lets the new queries attend over the whole cache with the causal rule
//! anchored after the cached positions ([`multihead_attention::MultiheadAttention::forward_cached`]):
//! query `i` of `new_len` sees the `past_len + i + 1` first keys, exactly the keys the
//! full causal pass shows it. Everything else in a layer is position-wise,
//! so the step's outputs equal the rows of the full pass.

use candle::{bail, Result, Tensor};
use multihead_attention::{KeyPaddingMask, Mask, NeedWeights, SeqLayout};

use super::layer::ProjectedKv;
use super::model::TransformerDecoder;
use crate::decoder::DecoderCache;

/// The state of incremental encoder–decoder decoding for a batch of
/// sequences: the decoder's self-attention cache, and the encoder memory
/// its cross-attention reads. Made by [`TransformerDecoder::start`],
/// advanced by [`TransformerDecoder::step`].
#[derive(Debug, Clone)]
pub struct Seq2SeqCache {
    /// Per layer: the projected encoder memory, `(batch, heads, src_len,
    /// head_dim)`.
    memory: Vec<ProjectedKv>,
    /// Per layer: the self-attention keys and values of every position fed
    /// so far, `(batch, heads, len, head_dim)`, grown in place.
    self_attn: DecoderCache,
    /// Which memory positions are padding, `(batch, src_len)`.
    memory_key_padding: Option<KeyPaddingMask>,
    /// Target positions fed so far (kept apart from `self_attn`'s, which a
    /// decoder without layers does not count).
    len: usize,
    batch: usize,
}

impl Seq2SeqCache {
    /// Number of target positions fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position was fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of sequences decoded in parallel.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Keeps the batch rows `rows` (a `u32` tensor of row indices, which
    /// may repeat), in that order: the reordering beam search needs after
    /// each step.
    ///
    /// # Shapes
    /// - `rows`: `(new_batch,)`
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        let n = rows.dims1()?;
        // Projected heads may be strided views; index_select needs contiguous.
        let pick = |t: &Tensor| t.contiguous()?.index_select(rows, 0);
        for kv in self.memory.iter_mut() {
            *kv = ProjectedKv {
                k: pick(&kv.k)?,
                v: pick(&kv.v)?,
            };
        }
        self.self_attn.select_rows(rows)?;
        self.memory_key_padding = self
            .memory_key_padding
            .as_ref()
            .map(|kp| select_padding_rows(kp, rows))
            .transpose()?;
        self.batch = n;
        Ok(())
    }

    fn memory_mask(&self) -> Mask {
        match &self.memory_key_padding {
            Some(kp) => Mask::new().with_key_padding(kp.clone()),
            None => Mask::new(),
        }
    }
}

/// Rows `rows` (`u32`, may repeat) of a `(batch, src_len)` padding mask.
pub(crate) fn select_padding_rows(kp: &KeyPaddingMask, rows: &Tensor) -> Result<KeyPaddingMask> {
    let pick = |t: &Tensor| t.contiguous()?.index_select(rows, 0);
    Ok(match kp {
        KeyPaddingMask::PadWhereTrue(t) => KeyPaddingMask::PadWhereTrue(pick(t)?),
        KeyPaddingMask::Additive(t) => KeyPaddingMask::Additive(pick(t)?),
    })
}

/// What [`TransformerDecoder::step_with_weights`] returns.
#[derive(Debug, Clone)]
pub struct DecoderStep {
    /// Decoder output for the new positions, in the input's layout.
    pub output: Tensor,
    /// Per layer: cross-attention weights averaged over heads,
    /// `(batch, new_len, src_len)`.
    pub cross_attention: Vec<Tensor>,
}

impl TransformerDecoder {
    /// Starts incremental decoding over `memory`: projects it for every
    /// layer's cross-attention, once. `memory_key_padding` is PyTorch's
    /// `memory_key_padding_mask`.
    ///
    /// # Shapes
    /// - `memory`: `(batch, src_len, d_model)` when `batch_first`, else
    ///   `(src_len, batch, d_model)`
    /// - `memory_key_padding`: `(batch, src_len)`
    pub fn start(&self, memory: &Tensor, memory_key_padding: Option<KeyPaddingMask>) -> Result<Seq2SeqCache> {
        if memory.rank() != 3 {
            bail!(
                "TransformerDecoder::start: memory must be 3-D (batched), found {:?}",
                memory.dims()
            )
        }
        let memory = self.to_batch_first(memory)?;
        let batch = memory.dim(0)?;
        let projected = self
            .layers
            .iter()
            .map(|l| l.project_memory(&memory))
            .collect::<Result<_>>()?;
        Ok(Seq2SeqCache {
            memory: projected,
            // A target is short: buffers grow by 64 positions.
            self_attn: DecoderCache::with_chunk(self.layers.len(), 64, Vec::new()),
            memory_key_padding,
            len: 0,
            batch,
        })
    }

    /// Feeds the next target positions and returns the decoder output for
    /// them; equal to the matching rows of [`TransformerDecoder::forward`]
    /// with a causal `tgt_mask` over everything fed so far.
    ///
    /// # Shapes
    /// - `tgt`: `(batch, new_len, d_model)` when `batch_first`, else
    ///   `(new_len, batch, d_model)`; usually `new_len = 1`
    /// - returns the same shape
    pub fn step(&self, tgt: &Tensor, cache: &mut Seq2SeqCache) -> Result<Tensor> {
        Ok(self.step_inner(tgt, cache, NeedWeights::No)?.output)
    }

    /// [`TransformerDecoder::step`] that also returns each layer's
    /// cross-attention weights (averaged over heads).
    pub fn step_with_weights(&self, tgt: &Tensor, cache: &mut Seq2SeqCache) -> Result<DecoderStep> {
        self.step_inner(tgt, cache, NeedWeights::Averaged)
    }

    fn step_inner(
        &self,
        tgt: &Tensor,
        cache: &mut Seq2SeqCache,
        need_weights: NeedWeights,
    ) -> Result<DecoderStep> {
        if tgt.rank() != 3 {
            bail!(
                "TransformerDecoder::step: tgt must be 3-D (batched), found {:?}",
                tgt.dims()
            )
        }
        let mut x = self.to_batch_first(tgt)?;
        let (b, new_len, _) = x.dims3()?;
        if b != cache.batch {
            bail!(
                "TransformerDecoder::step: tgt has batch {b} but the cache holds {}",
                cache.batch
            )
        }
        let memory_mask = cache.memory_mask();
        let mut cross_attention = Vec::new();
        for ((layer, memory), kv) in self
            .layers
            .iter()
            .zip(&cache.memory)
            .zip(cache.self_attn.layers_mut())
        {
            let (out, w) = layer.forward_step(&x, kv, memory, &memory_mask, need_weights)?;
            x = out;
            cross_attention.extend(w);
        }
        cache.len += new_len;
        let out = self.apply_norm(x)?;
        let output = match self.cfg.layout() {
            SeqLayout::BatchFirst => out,
            SeqLayout::SeqFirst => out.transpose(0, 1)?,
        };
        Ok(DecoderStep {
            output,
            cross_attention,
        })
    }

    fn to_batch_first(&self, t: &Tensor) -> Result<Tensor> {
        match self.cfg.layout() {
            SeqLayout::BatchFirst => Ok(t.clone()),
            SeqLayout::SeqFirst => t.transpose(0, 1)?.contiguous(),
        }
    }
}
