//! Keys and values kept across calls: the cache of a decoder's
//! self-attention and the one call that steps through it
//! ([`MultiheadAttention::forward_cached`]), and attention over keys and
//! values projected once ([`MultiheadAttention::project_kv`],
//! [`MultiheadAttention::forward_projected`]: a fixed encoder memory).
//!
//! Like candle-nn's `kv_cache::Cache`, keys and values live in a
//! preallocated buffer written in place with `slice_set`; unlike it, the
//! buffer grows (doubling, in whole chunks) instead of failing when full,
//! rows can be reordered for beam search, and each row may start after
//! some left padding.

use candle::{bail, DType, Device, IndexOp, Result, Tensor};

use crate::mask::{Causal, KeyPaddingMask};
use crate::mha::MultiheadAttention;
use crate::options::{MhaOptions, MhaOutput, SeqLayout};

/// Keys and values of the positions a decoder has seen, per layer.
///
/// Holds `(batch, num_kv_heads, capacity, head_dim)` buffers for keys and
/// values, of which the first [`KvCache::len`] positions are filled;
/// [`KvCache::keys`] and [`KvCache::values`] are views of them (strided
/// along the position dim, which the CPU kernel reads in place). A step
/// appends with one in-place copy of the new positions; when full, the
/// buffer grows to twice its size (at least the next multiple of `chunk`)
/// with one copy, so appending `n` positions costs O(n) copies overall.
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    chunk: usize,
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
            len: 0,
            chunk: chunk.max(1),
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

    /// Appends `k` and `v` after the positions held and returns every
    /// position's keys and values (views of the buffers).
    ///
    /// # Shapes
    /// - `k`, `v`: `(batch, num_kv_heads, new, head_dim)` each
    /// - returns `(batch, num_kv_heads, len + new, head_dim)` each
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
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
        self.len = need;
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
    fn padding_mask(&self, kv_len: usize, device: &Device) -> Result<Option<KeyPaddingMask>> {
        if self.starts.iter().all(|&s| s == 0) {
            return Ok(None);
        }
        let lengths: Vec<usize> = self.starts.iter().map(|&s| kv_len.saturating_sub(s)).collect();
        KeyPaddingMask::from_lengths_left(&lengths, kv_len, device).map(Some)
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

impl MultiheadAttention {
    /// Projects keys and values and splits them into heads, for reuse across
    /// calls: cross-attention over a fixed encoder memory, or a decoder's
    /// self-attention cache (append along dim 2).
    ///
    /// # Shapes
    /// - `key`: `(batch, kv_len, kdim)`, `value`: `(batch, kv_len, vdim)`
    /// - returns `k`, `v`: `(batch, num_kv_heads, kv_len, head_dim)` each,
    ///   contiguous (after qk-norm on `k` when configured)
    ///
    /// No position encoding is applied: with rotary embeddings configured,
    /// use [`MultiheadAttention::forward_cached`], which places each key.
    pub fn project_kv(&self, key: &Tensor, value: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check_no_extra_keys("project_kv")?;
        if self.rotary.is_some() {
            bail!(
                "MultiheadAttention::project_kv: rotary embeddings need each key's position; \
                 use forward_cached with a KvCache"
            )
        }
        if key.rank() != 3 || value.rank() != 3 {
            bail!(
                "MultiheadAttention::project_kv: key and value must be 3-D (batch, kv_len, features), found {:?} and {:?}",
                key.dims(),
                value.dims()
            )
        }
        let (kb, s, ke) = key.dims3()?;
        let (vb, vs, ve) = value.dims3()?;
        if (ke, ve) != (self.cfg.kdim(), self.cfg.vdim()) {
            bail!(
                "MultiheadAttention::project_kv: key/value have {ke}/{ve} features, expected kdim {} / vdim {}",
                self.cfg.kdim(),
                self.cfg.vdim()
            )
        }
        if (kb, s) != (vb, vs) {
            bail!(
                "MultiheadAttention::project_kv: key is {:?} but value is {:?}",
                key.dims(),
                value.dims()
            )
        }
        let (k, v) = self.in_proj.forward_kv(key, value)?;
        let kvh = self.cfg.kv_heads();
        // Contiguous, so that caches which copy in place (candle-nn's
        // `KvCache`, `slice_set`) take them as they are.
        Ok((
            self.norm_k(&self.split_heads(&k, kvh)?)?.contiguous()?,
            self.split_heads(&v, kvh)?.contiguous()?,
        ))
    }

    /// Attention of `query` over keys and values already projected by
    /// [`MultiheadAttention::project_kv`], batch-first.
    ///
    /// # Shapes
    /// - `query`: `(batch, q_len, embed_dim)`, or unbatched `(q_len, embed_dim)`
    /// - `k`, `v`: `(batch, num_kv_heads, kv_len, head_dim)`, or unbatched
    ///   `(num_kv_heads, kv_len, head_dim)`
    /// - output: the query's shape; weights as `opts.need_weights` says.
    ///
    /// `opts.layout` must be batch-first. For a decoder step over a cache
    /// holding earlier positions, use [`MultiheadAttention::forward_cached`],
    /// or pass `Mask::causal(Causal::BottomRight)`.
    pub fn forward_projected(
        &self,
        query: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        self.check_no_extra_keys("forward_projected")?;
        if self.rotary.is_some() {
            bail!(
                "MultiheadAttention::forward_projected: rotary embeddings need each query's position; \
                 use forward_cached with a KvCache"
            )
        }
        if opts.layout != SeqLayout::BatchFirst {
            bail!(
                "MultiheadAttention::forward_projected: takes batch-first inputs only, found {:?}",
                opts.layout
            )
        }
        let unbatched = match (query.rank(), k.rank(), v.rank()) {
            (3, 4, 4) => false,
            (2, 3, 3) => true,
            _ => bail!(
                "MultiheadAttention::forward_projected: expected query (batch, q_len, embed_dim) with k, v \
                 (batch, kv_heads, kv_len, head_dim), or all unbatched; found query {:?}, k {:?}, v {:?}",
                query.dims(),
                k.dims(),
                v.dims()
            ),
        };
        let batch = |t: &Tensor| if unbatched { t.unsqueeze(0) } else { Ok(t.clone()) };
        let (query, k, v) = (batch(query)?, batch(k)?, batch(v)?);
        let opts = &opts.map_residual(batch)?;
        let (b, l) = self.check_query(&query)?;
        let expected = (b, self.cfg.kv_heads(), self.cfg.head_dim());
        for (name, t) in [("k", &k), ("v", &v)] {
            let (tb, th, _, thd) = t.dims4()?;
            if (tb, th, thd) != expected {
                bail!(
                    "MultiheadAttention::forward_projected: {name} is {:?}, expected (batch, kv_heads, kv_len, head_dim) with {expected:?}",
                    t.dims()
                )
            }
        }
        if k.dim(2)? != v.dim(2)? || k.dim(2)? == 0 {
            bail!(
                "MultiheadAttention::forward_projected: k has {} positions and v {} (equal and > 0 needed)",
                k.dim(2)?,
                v.dim(2)?
            )
        }
        let mask = self.with_config_rules(&opts.mask);
        mask.validate(b, self.cfg.num_heads, l, k.dim(2)?)?;
        let q = self.in_proj.forward_q(&query)?;
        let q = self.norm_q(&self.split_heads(&q, self.cfg.num_heads)?)?;
        let (output, weights) = self.attend(&q, &k, &v, &mask, 0, opts)?;
        Ok(if unbatched {
            MhaOutput {
                output: output.squeeze(0)?,
                weights: weights.map(|w| w.squeeze(0)).transpose()?,
            }
        } else {
            MhaOutput { output, weights }
        })
    }

    /// One decoder step of causal self-attention over `cache`: projects
    /// `x` once, applies qk-norm and the rotary embedding at the positions
    /// the cache gives, appends the keys and values, and attends causally
    /// with the cache length as offset (plus the config's sliding window
    /// and ALiBi, the cache's left padding, and `opts.mask`'s key padding
    /// or attention mask over all `len + new` keys, if any).
    ///
    /// Prefill of any length, chunked prefill and single-token decoding
    /// are this same call, and equal the full causal pass.
    ///
    /// # Shapes
    /// - `x`: `(batch, new, embed_dim)`, or unbatched `(new, embed_dim)`
    /// - output: the shape of `x`; weights over all `len + new` keys
    pub fn forward_cached(&self, x: &Tensor, cache: &mut KvCache, opts: &MhaOptions) -> Result<MhaOutput> {
        self.check_no_extra_keys("forward_cached")?;
        if opts.layout != SeqLayout::BatchFirst {
            bail!(
                "MultiheadAttention::forward_cached: takes batch-first inputs only, found {:?}",
                opts.layout
            )
        }
        if opts.mask.causal.is_some() {
            bail!(
                "MultiheadAttention::forward_cached: the causal rule comes from the cache (offset = cache length); \
                 leave opts.mask.causal unset"
            )
        }
        let unbatched = match x.rank() {
            3 => false,
            2 => true,
            _ => bail!(
                "MultiheadAttention::forward_cached: x must be (batch, new, embed_dim) or (new, embed_dim), found {:?}",
                x.dims()
            ),
        };
        let x = if unbatched { x.unsqueeze(0)? } else { x.clone() };
        let opts = &opts.map_residual(|r| if unbatched { r.unsqueeze(0) } else { Ok(r.clone()) })?;
        let (b, t) = self.check_query(&x)?;
        let (h, kvh) = (self.cfg.num_heads, self.cfg.kv_heads());
        let offset = cache.len();
        // (B, H, T, hd), (B, Hkv, T, hd), (B, Hkv, T, hd)
        let (q, k, v) = match self.in_proj.self_attention_heads(&x, &x, &x, h)? {
            Some(heads) => heads,
            None => {
                let (q, k, v) = self.in_proj.forward(&x, &x, &x)?;
                (
                    self.split_heads(&q, h)?,
                    self.split_heads(&k, kvh)?,
                    self.split_heads(&v, kvh)?,
                )
            }
        };
        let (mut q, mut k) = (self.norm_q(&q)?, self.norm_k(&k)?);
        if let Some(rotary) = &self.rotary {
            let pos = cache.positions(b, t, x.device())?;
            (q, k) = rotary.apply_qk(&q, &k, &pos)?;
        }
        let (k, v) = cache.append(&k, &v)?;
        let s = cache.len();
        let mut mask = self
            .with_config_rules(&opts.mask)
            .with_causal(Causal::Offset(offset));
        if let Some(pad) = cache.padding_mask(s, x.device())? {
            if mask.key_padding.is_some() {
                bail!(
                    "MultiheadAttention::forward_cached: the cache tracks left padding; \
                     a key padding mask in opts would conflict with it"
                )
            }
            mask.key_padding = Some(pad);
        }
        mask.validate(b, h, t, s)?;
        let (out, weights) = self.attend(&q, &k, &v, &mask, 0, opts)?;
        Ok(if unbatched {
            MhaOutput {
                output: out.squeeze(0)?,
                weights: weights.map(|w| w.i(0)).transpose()?,
            }
        } else {
            MhaOutput { output: out, weights }
        })
    }
}
