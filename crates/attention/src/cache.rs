//! Keys and values kept across calls: the cache of a decoder's
//! self-attention, which [`crate::MultiheadAttention::forward_cached`]
//! steps through.
//!
//! Like candle-nn's `kv_cache::Cache`, keys and values live in a
//! preallocated buffer written in place with `slice_set`; unlike it, the
//! buffer grows (doubling, in whole chunks) instead of failing when full,
//! rows can be reordered for beam search, and each row may start after
//! some left padding. [`DecoderCache`] holds one per layer of a model.

use candle::{bail, DType, Device, Result, Tensor};

use crate::mask::KeyPaddingMask;

/// Keys and values of the positions a decoder has seen, per layer.
///
/// Holds `(batch, num_kv_heads, capacity, head_dim)` buffers for keys and
/// values, of which the first [`KvCache::len`] positions are filled;
/// [`KvCache::keys`] and [`KvCache::values`] are views of them (strided
/// along the position dim, which the CPU kernel reads in place). A step
/// appends with one in-place copy of the new positions; when full, the
/// buffer grows to twice its size (at least the next multiple of `chunk`)
/// with one copy, so appending `n` positions costs O(n) copies overall.
///
/// The buffers hold the keys and values in their own dtype, or in the one
/// [`KvCache::with_dtype`] names: a bf16 or f16 cache beside an f32 model
/// halves the cache's memory, and the CPU kernel reads it in place (no f32
/// copy).
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// The dtype keys and values are stored in; `None`: as they come.
    dtype: Option<DType>,
    len: usize,
    chunk: usize,
    /// The positions the cache is expected to hold at most
    /// ([`KvCache::expect_at_most`]); 0: unknown.
    bound: usize,
    /// Per row, how many leading positions are padding (left padding of
    /// batched prompts); empty when no row is padded.
    starts: Vec<usize>,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new(256)
    }
}

impl KvCache {
    /// An empty cache that allocates in multiples of `chunk` positions
    /// (at least 1).
    pub fn new(chunk: usize) -> Self {
        Self {
            k: None,
            v: None,
            dtype: None,
            len: 0,
            chunk: chunk.max(1),
            bound: 0,
            starts: Vec::new(),
        }
    }

    /// An empty cache for rows whose first `starts[b]` positions will be
    /// left padding: those keys are hidden from every query, and positions
    /// (for rotary embeddings) count from each row's first real token, as
    /// HF's `generate` counts them from the attention mask. The first
    /// [`KvCache::append`] must feed at least the padding positions (a
    /// left-padded prompt does); one that feeds fewer is an error.
    pub fn with_left_padding(chunk: usize, starts: Vec<usize>) -> Self {
        Self {
            starts,
            ..Self::new(chunk)
        }
    }

    /// The cache with keys and values stored in `dtype` (rounded as they
    /// are appended), whatever the model computes in.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// Tells the cache it will hold at most `positions` positions (a
    /// generation that knows its prompt and its most new tokens): growth
    /// stops there instead of rounding up to whole chunks or doubling, so
    /// the buffers are no larger than the run needs. A later append past
    /// it grows as without it. 0 forgets the bound.
    pub fn expect_at_most(&mut self, positions: usize) {
        self.bound = positions;
    }

    /// The dtype keys and values are stored in, where one was named.
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffers hold before they must grow.
    pub fn capacity(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[2])
    }

    /// Per row, how many leading positions are padding (empty: none).
    pub fn left_padding(&self) -> &[usize] {
        &self.starts
    }

    /// Keys held, `(batch, num_kv_heads, len, head_dim)`; `None` when empty.
    pub fn keys(&self) -> Result<Option<Tensor>> {
        self.filled(&self.k)
    }

    /// Values held, `(batch, num_kv_heads, len, head_dim)`; `None` when
    /// empty.
    pub fn values(&self) -> Result<Option<Tensor>> {
        self.filled(&self.v)
    }

    fn filled(&self, t: &Option<Tensor>) -> Result<Option<Tensor>> {
        match t {
            Some(t) if self.len > 0 => Ok(Some(t.narrow(2, 0, self.len)?)),
            _ => Ok(None),
        }
    }

    /// Forgets the positions from `len` on (speculative decoding, or
    /// rewinding a shared prompt); the buffers stay allocated.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forgets every position, keeping the buffers and the left padding.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Keeps rows `rows` (which may repeat), in that order: beam search
    /// keeps the parents of the surviving hypotheses.
    ///
    /// # Shapes
    /// - `rows`: `(new_batch,)`, `u32`
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        let idx = rows.to_vec1::<u32>()?;
        if let Some(k) = &self.k {
            let batch = k.dims()[0];
            if let Some(&r) = idx.iter().find(|&&r| r as usize >= batch) {
                bail!("KvCache::select_rows: row {r} out of range for a batch of {batch}")
            }
        }
        let pick = |t: &Tensor| t.index_select(rows, 0);
        self.k = self.k.as_ref().map(pick).transpose()?;
        self.v = self.v.as_ref().map(pick).transpose()?;
        if !self.starts.is_empty() {
            let mut starts = Vec::with_capacity(idx.len());
            for &r in &idx {
                match self.starts.get(r as usize) {
                    Some(&s) => starts.push(s),
                    None => bail!(
                        "KvCache::select_rows: row {r} out of range for {} padded rows",
                        self.starts.len()
                    ),
                }
            }
            self.starts = starts;
        }
        Ok(())
    }

    /// Appends the rows of `other` after this cache's, aligned at their
    /// ends: the shorter side gets more left padding, so every row keeps
    /// its own positions and sees only its own keys. Continuous batching
    /// joins a request prefilled alone to the batch this way. An empty
    /// cache (no row yet) becomes `other`.
    ///
    /// # Shapes
    /// - self `(b1, h, len1, d)`, `other` `(b2, h, len2, d)` →
    ///   `(b1 + b2, h, max(len1, len2), d)`
    pub fn join_rows(&mut self, other: &KvCache) -> Result<()> {
        let (Some(k), Some(v)) = (&self.k, &self.v) else {
            let chunk = self.chunk;
            *self = other.clone();
            self.chunk = chunk;
            return Ok(());
        };
        let (Some(ok), Some(ov)) = (&other.k, &other.v) else {
            bail!("KvCache::join_rows: the cache to join holds no rows")
        };
        let (b1, h, _, d) = k.dims4()?;
        let (b2, oh, _, od) = ok.dims4()?;
        let (vd, ovd) = (v.dim(3)?, ov.dim(3)?);
        if (h, d, vd) != (oh, od, ovd) || k.dtype() != ok.dtype() {
            bail!(
                "KvCache::join_rows: (kv_heads, head_dim, v_head_dim) {:?} of {:?} beside {:?} of {:?}",
                (h, d, vd),
                k.dtype(),
                (oh, od, ovd),
                ok.dtype()
            )
        }
        let len = self.len.max(other.len);
        let cap = (len + 1).next_multiple_of(self.chunk);
        let aligned = |t: &Tensor, held: usize, width: usize| -> Result<Tensor> {
            let rows = t.dim(0)?;
            let mut parts = Vec::with_capacity(3);
            if len > held {
                parts.push(Tensor::zeros(
                    (rows, h, len - held, width),
                    t.dtype(),
                    t.device(),
                )?);
            }
            if held > 0 {
                parts.push(t.narrow(2, 0, held)?);
            }
            parts.push(Tensor::zeros((rows, h, cap - len, width), t.dtype(), t.device())?);
            Tensor::cat(&parts, 2)
        };
        let k = Tensor::cat(&[aligned(k, self.len, d)?, aligned(ok, other.len, d)?], 0)?;
        let v = Tensor::cat(&[aligned(v, self.len, vd)?, aligned(ov, other.len, vd)?], 0)?;
        let start = |c: &KvCache, row: usize| c.starts.get(row).copied().unwrap_or(0) + len - c.len;
        let starts: Vec<usize> = (0..b1)
            .map(|r| start(self, r))
            .chain((0..b2).map(|r| start(other, r)))
            .collect();
        self.k = Some(k);
        self.v = Some(v);
        self.len = len;
        self.starts = starts;
        Ok(())
    }

    /// Drops the leading positions that are padding in every row (left
    /// behind when the longest rows of a batch leave it), so that no step
    /// reads them again. Copies the buffers when there is any to drop.
    pub fn trim_padding(&mut self) -> Result<()> {
        let common = self.starts.iter().copied().min().unwrap_or(0).min(self.len);
        if common == 0 {
            return Ok(());
        }
        let len = self.len - common;
        let cap = (len + 1).next_multiple_of(self.chunk);
        let shift = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            t.as_ref()
                .map(|t| {
                    let (b, h, _, d) = t.dims4()?;
                    let tail = Tensor::zeros((b, h, cap - len, d), t.dtype(), t.device())?;
                    Tensor::cat(&[t.narrow(2, common, len)?, tail], 2)
                })
                .transpose()
        };
        self.k = shift(&self.k)?;
        self.v = shift(&self.v)?;
        self.len = len;
        self.starts.iter_mut().for_each(|s| *s -= common);
        Ok(())
    }

    /// Appends `k` and `v` after the positions held (in the cache's dtype
    /// where it has one) and returns every position's keys and values
    /// (views of the buffers). Where `k` or `v` tracks gradients, the new
    /// positions come back as `k` and `v` themselves, so that gradients
    /// reach the projections that made them; the positions held before take
    /// none from this call.
    ///
    /// # Shapes
    /// - `k`, `v`: `(batch, num_kv_heads, new, head_dim)` each
    /// - returns `(batch, num_kv_heads, len + new, head_dim)` each
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let stored;
        let (k, v) = match self.dtype {
            Some(dtype) => {
                stored = (k.to_dtype(dtype)?, v.to_dtype(dtype)?);
                (&stored.0, &stored.1)
            }
            None => (k, v),
        };
        let (b, h, t, d) = k.dims4()?;
        let (vb, vh, vt, vd) = v.dims4()?;
        if (vb, vh, vt) != (b, h, t) {
            bail!("KvCache::append: k is {:?} but v is {:?}", k.dims(), v.dims())
        }
        if let Some(held) = &self.k {
            let (hb, hh, _, hd) = held.dims4()?;
            let hvd = self.v.as_ref().map_or(Ok(vd), |v| v.dim(3))?;
            if (hb, hh, hd, hvd) != (b, h, d, vd) || held.dtype() != k.dtype() {
                bail!(
                    "KvCache::append: the cache holds (batch, kv_heads, head_dim, v_head_dim) = {:?} of {:?}, \
                     the new keys and values are {:?} of {:?}",
                    (hb, hh, hd, hvd),
                    held.dtype(),
                    (b, h, d, vd),
                    k.dtype()
                )
            }
        }
        if !self.starts.is_empty() && self.starts.len() != b {
            bail!(
                "KvCache::append: the cache has left padding for {} rows, the batch has {b}",
                self.starts.len()
            )
        }
        let need = self.len + t;
        if let Some((row, &pad)) = self.starts.iter().enumerate().find(|(_, &s)| s > need) {
            bail!(
                "KvCache::append: row {row} has {pad} positions of left padding but only {need} positions \
                 have been fed: the padding must be fed with the first call (the left-padded prompt)"
            )
        }
        if need > self.capacity() {
            let cap = need.next_multiple_of(self.chunk).max(2 * self.capacity());
            let cap = if need <= self.bound {
                cap.min(self.bound)
            } else {
                cap
            };
            self.k = Some(grow(
                self.k.as_ref(),
                self.len,
                (b, h, cap, d),
                k.dtype(),
                k.device(),
            )?);
            self.v = Some(grow(
                self.v.as_ref(),
                self.len,
                (b, h, cap, vd),
                v.dtype(),
                v.device(),
            )?);
        }
        let (bk, bv) = match (&self.k, &self.v) {
            (Some(bk), Some(bv)) => (bk, bv),
            _ => bail!("KvCache::append: buffers missing after growth"),
        };
        if t > 0 {
            bk.slice_set(&k.contiguous()?, 2, self.len)?;
            bv.slice_set(&v.contiguous()?, 2, self.len)?;
        }
        let held = self.len;
        self.len = need;
        if k.track_op() || v.track_op() {
            // Training: the buffers' copy takes no gradient, so the new
            // keys and values go out as the tensors themselves, after the
            // positions held before (which take none from this call).
            if held == 0 {
                return Ok((k.clone(), v.clone()));
            }
            return Ok((
                Tensor::cat(&[&bk.narrow(2, 0, held)?, k], 2)?,
                Tensor::cat(&[&bv.narrow(2, 0, held)?, v], 2)?,
            ));
        }
        Ok((bk.narrow(2, 0, need)?, bv.narrow(2, 0, need)?))
    }

    /// `(batch, new)` `u32`: the positions of the next `new` tokens,
    /// counted from each row's first real token.
    pub fn positions(&self, batch: usize, new: usize, device: &Device) -> Result<Tensor> {
        let data: Vec<u32> = (0..batch)
            .flat_map(|r| {
                let start = self.starts.get(r).copied().unwrap_or(0);
                (self.len..self.len + new).map(move |p| p.saturating_sub(start) as u32)
            })
            .collect();
        Tensor::from_vec(data, (batch, new), device)
    }

    /// The key padding mask over `kv_len` positions from the left padding;
    /// `None` when no row is padded.
    pub(crate) fn padding_mask(&self, kv_len: usize, device: &Device) -> Result<Option<KeyPaddingMask>> {
        if self.starts.iter().all(|&s| s == 0) {
            return Ok(None);
        }
        let lengths: Vec<usize> = self.starts.iter().map(|&s| kv_len.saturating_sub(s)).collect();
        KeyPaddingMask::from_lengths_left(&lengths, kv_len, device).map(Some)
    }
}

/// The self-attention keys and values of every layer, sharing one length
/// and the rows' left padding: the whole state of a decoder-only model, and
/// the self-attention part of an encoder–decoder's.
#[derive(Debug, Clone)]
pub struct DecoderCache {
    layers: Vec<KvCache>,
    /// Whether the positions held were rotated with LongRoPE's long
    /// factors (a call that reached past the original context), which a
    /// model must not mix with short ones.
    long_rope: bool,
}

impl DecoderCache {
    /// Empty caches for `n_layers` layers; `left_padding[b]` leading
    /// positions of row `b` will be padding (empty: none).
    pub fn new(n_layers: usize, left_padding: Vec<usize>) -> Self {
        Self::with_chunk(n_layers, 256, left_padding)
    }

    /// The caches with keys and values stored in `dtype` (`None`: as the
    /// model computes them, f32): [`KvCache::with_dtype`].
    pub fn with_kv_dtype(mut self, dtype: Option<DType>) -> Self {
        if let Some(dtype) = dtype {
            self.layers = self.layers.into_iter().map(|c| c.with_dtype(dtype)).collect();
        }
        self
    }

    /// [`DecoderCache::new`] whose buffers grow by `chunk` positions at a
    /// time ([`KvCache::with_left_padding`]).
    pub fn with_chunk(n_layers: usize, chunk: usize, left_padding: Vec<usize>) -> Self {
        Self {
            layers: (0..n_layers)
                .map(|_| KvCache::with_left_padding(chunk, left_padding.clone()))
                .collect(),
            long_rope: false,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// [`KvCache::expect_at_most`] for every layer.
    pub fn expect_at_most(&mut self, positions: usize) {
        for layer in &mut self.layers {
            layer.expect_at_most(positions);
        }
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the positions from `len` on, in every layer.
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|c| c.truncate(len));
        if self.is_empty() {
            self.long_rope = false;
        }
    }

    /// `max(position) + 1` over the rows once `new` more positions are
    /// fed: how far the longest row reaches, counted from its first real
    /// token (HF's `max(position_ids) + 1`).
    pub fn reach(&self, new: usize) -> usize {
        let Some(c) = self.layers.first() else {
            return new;
        };
        let start = c.left_padding().iter().copied().min().unwrap_or(0);
        (c.len() + new).saturating_sub(start)
    }

    /// Whether the positions held were rotated with LongRoPE's long
    /// factors ([`crate::RopeScaling`]), which a model must not mix with
    /// short ones.
    pub fn long_rope(&self) -> bool {
        self.long_rope
    }

    /// Marks the positions held as rotated with LongRoPE's long factors,
    /// or not.
    pub fn set_long_rope(&mut self, long: bool) {
        self.long_rope = long;
    }

    /// Keeps rows `rows` (`u32`, may repeat), in that order, in every layer.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        self.layers.iter_mut().try_for_each(|c| c.select_rows(rows))
    }

    /// Appends `other`'s rows after these, aligned at their ends
    /// ([`KvCache::join_rows`]): a sequence prefilled alone joins a batch
    /// that decodes together.
    pub fn join_rows(&mut self, other: &DecoderCache) -> Result<()> {
        if other.layers.len() != self.layers.len() {
            bail!(
                "DecoderCache::join_rows: a cache of {} layers beside one of {}",
                other.layers.len(),
                self.layers.len()
            )
        }
        if self.is_empty() {
            self.long_rope = other.long_rope;
        } else if !other.is_empty() && other.long_rope != self.long_rope {
            bail!(
                "DecoderCache::join_rows: one cache's positions were rotated with LongRoPE's long factors and the \
                 other's with its short ones (past and within original_max_position_embeddings); they cannot \
                 decode as one batch"
            )
        }
        self.layers
            .iter_mut()
            .zip(&other.layers)
            .try_for_each(|(c, o)| c.join_rows(o))
    }

    /// Drops the leading positions that every row holds as padding
    /// ([`KvCache::trim_padding`]).
    pub fn trim_padding(&mut self) -> Result<()> {
        self.layers.iter_mut().try_for_each(KvCache::trim_padding)
    }

    /// `(batch, new)` `u32` positions of the next `new` tokens, counted
    /// from each row's first real token.
    pub fn positions(&self, batch: usize, new: usize, device: &Device) -> Result<Tensor> {
        match self.layers.first() {
            Some(c) => c.positions(batch, new, device),
            None => KvCache::new(1).positions(batch, new, device),
        }
    }

    /// Every layer's cache, in order.
    pub fn layers_mut(&mut self) -> &mut [KvCache] {
        &mut self.layers
    }

    /// The cache of layer `i`.
    pub fn layer(&mut self, i: usize) -> Result<&mut KvCache> {
        let n = self.layers.len();
        match self.layers.get_mut(i) {
            Some(c) => Ok(c),
            None => bail!("DecoderCache: layer {i} of a cache for {n} layers"),
        }
    }
}

/// A `(b, h, cap, d)` buffer holding the first `len` positions of `old`.
fn grow(
    old: Option<&Tensor>,
    len: usize,
    shape: (usize, usize, usize, usize),
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let buf = Tensor::zeros(shape, dtype, device)?;
    if let Some(old) = old.filter(|_| len > 0) {
        buf.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(rows: usize, len: usize, base: f32) -> Result<KvCache> {
        let mut c = KvCache::new(4);
        let k = Tensor::arange(0f32, (rows * len * 2) as f32, &Device::Cpu)?.affine(1., base as f64)?;
        let k = k.reshape((rows, 1, len, 2))?;
        c.append(&k, &k)?;
        Ok(c)
    }

    #[test]
    fn joined_rows_keep_their_keys_positions_and_padding() -> Result<()> {
        let mut a = filled(1, 5, 0.)?;
        let b = filled(2, 3, 100.)?;
        a.join_rows(&b)?;
        assert_eq!(a.len(), 5);
        assert_eq!(a.left_padding(), &[0, 2, 2]);
        let keys = a.keys()?.unwrap();
        // Row 1 is b's row 0, after two positions of padding.
        let row1: Vec<f32> = keys.get(1)?.flatten_all()?.to_vec1()?;
        assert_eq!(row1, [0., 0., 0., 0., 100., 101., 102., 103., 104., 105.]);
        let row0: Vec<f32> = keys.get(0)?.flatten_all()?.to_vec1()?;
        assert_eq!(row0, (0..10).map(|x| x as f32).collect::<Vec<_>>());
        // Each row's next position counts its own tokens.
        let pos: Vec<Vec<u32>> = a.positions(3, 1, &Device::Cpu)?.to_vec2()?;
        assert_eq!(pos, [[5], [3], [3]]);
        // The longest row leaves: the padding all rows share goes.
        a.select_rows(&Tensor::new(&[1u32, 2], &Device::Cpu)?)?;
        a.trim_padding()?;
        assert_eq!((a.len(), a.left_padding()), (3, &[0usize, 0][..]));
        let row0: Vec<f32> = a.keys()?.unwrap().get(0)?.flatten_all()?.to_vec1()?;
        assert_eq!(row0, [100., 101., 102., 103., 104., 105.]);
        // An empty cache becomes the one joined.
        let mut empty = KvCache::new(4);
        empty.join_rows(&b)?;
        assert_eq!(
            (empty.len(), empty.keys()?.unwrap().dims()),
            (3, &[2usize, 1, 3, 2][..])
        );
        Ok(())
    }
}
