//! The steps of attention. First a decoder's step of causal
//! self-attention over a [`KvCache`], [`MultiheadAttention::forward_cached`]:
//! the five steps of HF's `LlamaAttention.forward` and
//! candle-transformers' `CausalSelfAttention::forward` in one function,
//! the PyTorch-only options of the module (`add_bias_kv`,
//! `add_zero_attn`, sequence-first input) refused, and an unbatched input
//! made batch-first, before its first step. Then the steps every entry
//! point shares: the mask joined to the config's rules, the heads
//! projected, normed and split, the attention, the output projection.

use candle::{bail, DType, Result, Tensor};
use candle_nn::Module;
use multihead_kernels::PackedLinear;

use super::batching::Batching;
use super::MultiheadAttention;
use crate::cache::KvCache;
use crate::config::PositionEncoding;
use crate::mask::{Alibi, Causal, Mask};
use crate::options::{MhaOptions, MhaOutput, NeedWeights, SeqLayout};
use crate::projection::InKind;
use crate::sdpa::{dropout, sdpa_dispatch, sdpa_reference, sdpa_train_merged, AttnPath};

/// q `(B, H, L, hd)`, k and v `(B, Hkv, S, hd)`, and the self-attention
/// projection `(B, L, (H + 2 Hkv) · hd)` they are views of, where they are.
pub(super) type Heads = (Tensor, Tensor, Tensor, Option<Tensor>);

impl MultiheadAttention {
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
        // The PyTorch-only options first: extra keys, sequence-first input
        // and a causal rule of the call's own are refused; an unbatched
        // input is a batch of one.
        self.check_decoder_call(x, opts)?;
        if x.rank() == 2 {
            return self.forward_cached_unbatched(x, cache, opts);
        }
        // (B, T, E)
        let (b, t) = self.check_query(x)?;

        // 1. q, k and v in one projection, as heads: (B, H, T, hd),
        //    (B, Hkv, T, hd), (B, Hkv, T, hd).
        let (q, k, v, _) = self.self_attention_heads(x)?;

        // 2. qk-norm where configured, then the rotary embedding at the
        //    positions the cache gives (after its left padding).
        let (mut q, mut k) = (self.norm_q(&q)?, self.norm_k(&k)?);
        if let Some(rotary) = &self.rotary {
            (q, k) = rotary.apply_qk(&q, &k, &cache.positions(b, t, x.device())?)?;
        }

        // 3. Appended to the cache: every key and value so far,
        //    (B, Hkv, S, hd) with S = offset + T.
        let offset = cache.len();
        let (k, v) = cache.append(&k, &v)?;

        // 4. The mask: causal from `offset` on, the cache's left padding
        //    as key padding, the config's window, ALiBi and cap joined.
        let mut mask = Mask {
            causal: Some(Causal::Offset(offset)),
            ..opts.mask.clone()
        };
        if let Some(pad) = cache.padding_mask(cache.len(), x.device())? {
            if mask.key_padding.is_some() {
                bail!(
                    "MultiheadAttention::forward_cached: the cache tracks left padding; \
                     a key padding mask in opts would conflict with it"
                )
            }
            mask.key_padding = Some(pad);
        }
        let mask = self.mask_for(&mask, b, t, cache.len())?;

        // 5. Attention under it, its heads (B, H, T, hd) merged and
        //    projected out, the residual added in the projection's tiles:
        //    (B, T, E).
        let (output, weights) = self.attend(&q, &k, &v, None, &mask, 0, opts)?;
        Ok(MhaOutput { output, weights })
    }

    /// Self-attention's heads of `x` `(B, T, E)`: q `(B, H, T, hd)` and
    /// k, v `(B, Hkv, T, hd)`. Through the fused weight, one matmul whose
    /// output `(B, T, (H + 2 Hkv) · hd)` the heads view without copies, and
    /// which comes back beside them.
    fn self_attention_heads(&self, x: &Tensor) -> Result<Heads> {
        let (b, t, _) = x.dims3()?;
        let (h, kvh, hd) = (self.cfg.num_heads, self.cfg.kv_heads(), self.cfg.head_dim());
        match &self.in_proj.kind {
            InKind::Fused(fused) => {
                // (B, T, (H + 2 Hkv) · hd), viewed as (B, T, H + 2 Hkv, hd)
                let packed = fused.forward(x)?;
                let qkv = packed.reshape((b, t, h + 2 * kvh, hd))?;
                let heads = |from: usize, n: usize| qkv.narrow(2, from, n)?.transpose(1, 2);
                let (q, k, v) = (heads(0, h)?, heads(h, kvh)?, heads(h + kvh, kvh)?);
                Ok((q, k, v, Some(packed)))
            }
            InKind::Separate { q, k, v } => {
                let heads =
                    |p: &PackedLinear, n: usize| p.forward(x)?.reshape((b, t, n, hd))?.transpose(1, 2);
                Ok((heads(q, h)?, heads(k, kvh)?, heads(v, kvh)?, None))
            }
        }
    }

    /// The reason `x` and `opts` cannot be a decoder step, if any.
    fn check_decoder_call(&self, x: &Tensor, opts: &MhaOptions) -> Result<()> {
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
        if !matches!(x.rank(), 2 | 3) {
            bail!(
                "MultiheadAttention::forward_cached: x must be (batch, new, embed_dim) or (new, embed_dim), found {:?}",
                x.dims()
            )
        }
        Ok(())
    }

    /// [`Self::forward_cached`] of an unbatched `(new, embed_dim)` input,
    /// as a batch of one.
    fn forward_cached_unbatched(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        let call = Batching::new(true, SeqLayout::BatchFirst);
        let MhaOutput { output, weights } =
            self.forward_cached(&call.input(x)?, cache, &call.options(opts)?)?;
        call.output((output, weights))
    }

    /// `mask` with the config's sliding window, ALiBi and soft-capping,
    /// checked against `(batch, heads, q_len, kv_len)`: the mask every
    /// entry point attends with. A module's window, ALiBi and cap are
    /// configured in its [`MhaConfig`](crate::config::MhaConfig) only
    /// (`sliding_window`, [`PositionEncoding::Alibi`], `softcap`); a call's
    /// mask that sets one is refused, so that none can be set in two places
    /// that disagree.
    pub(super) fn mask_for(&self, mask: &Mask, batch: usize, q_len: usize, kv_len: usize) -> Result<Mask> {
        if mask.window.is_some() {
            bail!(
                "MultiheadAttention: a sliding window is configured in MhaConfig::sliding_window, \
                 not in the call's Mask (Mask::with_window is for scaled_dot_product_attention)"
            )
        }
        if mask.alibi.is_some() {
            bail!(
                "MultiheadAttention: ALiBi is configured in MhaConfig::position (PositionEncoding::Alibi), \
                 not in the call's Mask (Mask::with_alibi is for scaled_dot_product_attention)"
            )
        }
        if mask.softcap.is_some() {
            bail!(
                "MultiheadAttention: soft-capping is configured in MhaConfig::softcap, \
                 not in the call's Mask (Mask::with_softcap is for scaled_dot_product_attention)"
            )
        }
        let mut mask = mask.clone();
        mask.window = self.cfg.sliding_window;
        mask.softcap = self.cfg.softcap;
        if self.cfg.position == PositionEncoding::Alibi {
            mask.alibi = Some(Alibi::new(self.cfg.num_heads));
        }
        mask.validate(batch, self.cfg.num_heads, q_len, kv_len)?;
        Ok(mask)
    }

    /// The heads of `(B, L, E)`, `(B, S, kdim)`, `(B, S, vdim)`:
    /// `(B, H, L, hd)`, `(B, Hkv, S, hd)`, `(B, Hkv, S, hd)`, qk-normed
    /// where configured; self-attention in one fused projection, which
    /// comes back beside them where they are its views as they stand.
    pub(super) fn project_heads(&self, query: &Tensor, key: &Tensor, value: &Tensor) -> Result<Heads> {
        let (h, kvh) = (self.cfg.num_heads, self.cfg.kv_heads());
        let (q, k, v, packed) = if query.id() == key.id() && key.id() == value.id() {
            self.self_attention_heads(query)?
        } else {
            let (q, k, v) = self.in_proj.forward(query, key, value)?;
            (
                self.split_heads(&q, h)?,
                self.split_heads(&k, kvh)?,
                self.split_heads(&v, kvh)?,
                None,
            )
        };
        let packed = packed.filter(|_| self.qk_norm.is_none());
        Ok((self.norm_q(&q)?, self.norm_k(&k)?, v, packed))
    }

    /// `(B, L)` of a `(B, L, E)` query, or an error naming the wrong size.
    pub(super) fn check_query(&self, query: &Tensor) -> Result<(usize, usize)> {
        let (b, l, qe) = query.dims3()?;
        if l == 0 {
            bail!("MultiheadAttention: query is an empty sequence (q_len 0)")
        }
        if qe != self.cfg.embed_dim {
            bail!(
                "MultiheadAttention: query has {qe} features, expected embed_dim {}",
                self.cfg.embed_dim
            )
        }
        Ok((b, l))
    }

    pub(super) fn check_no_extra_keys(&self, what: &str) -> Result<()> {
        if self.cfg.add_bias_kv || self.cfg.add_zero_attn {
            bail!("MultiheadAttention::{what}: not supported with add_bias_kv or add_zero_attn")
        }
        Ok(())
    }

    /// `(B, T, heads * hd)` → `(B, heads, T, hd)`, a view where `t` is
    /// contiguous.
    pub(super) fn split_heads(&self, t: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t_len, _) = t.dims3()?;
        t.reshape((b, t_len, heads, self.cfg.head_dim()))?.transpose(1, 2)
    }

    pub(super) fn norm_q(&self, q: &Tensor) -> Result<Tensor> {
        match &self.qk_norm {
            Some((qn, _)) => qn.forward(q),
            None => Ok(q.clone()),
        }
    }

    pub(super) fn norm_k(&self, k: &Tensor) -> Result<Tensor> {
        match &self.qk_norm {
            Some((_, kn)) => kn.forward(k),
            None => Ok(k.clone()),
        }
    }

    /// Attention of heads `(B, H, L, hd)` over `(B, Hkv, S, hd)`: the
    /// output heads `(B, H, L, hd)` and the weights `opts` asks for.
    /// Weights need the reference path; otherwise `opts.path` decides
    /// (dropout on the reference or CPU path). The last `appended` keys lie
    /// outside `mask`.
    pub(super) fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Mask,
        appended: usize,
        opts: &MhaOptions,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dropout = self.dropout(opts);
        if opts.need_weights == NeedWeights::No {
            let drawn = dropout::next(dropout)?;
            let out = sdpa_dispatch(q, k, v, mask, appended, self.cfg.scale, opts.path, None, drawn)?;
            return Ok((out, None));
        }
        if !matches!(opts.path, AttnPath::Auto | AttnPath::Reference) {
            bail!(
                "MultiheadAttention: the {:?} path returns no attention weights; use AttnPath::Auto or \
                 AttnPath::Reference",
                opts.path
            )
        }
        // (B, H, L, hd), (B, H, L, S)
        let (out, weights) = sdpa_reference(q, k, v, mask, appended, self.cfg.scale, dropout)?;
        let weights = match opts.need_weights {
            NeedWeights::PerHead => Some(weights),
            NeedWeights::Averaged => Some(average_heads(&weights)?),
            NeedWeights::No => None,
        };
        Ok((out, weights))
    }

    /// The dropout rate on the attention weights a call applies, if any.
    fn dropout(&self, opts: &MhaOptions) -> Option<f32> {
        (opts.train && self.cfg.dropout > 0.).then_some(self.cfg.dropout)
    }

    /// Heads `(B, H, L, hd)` merged and projected out: `(B, L, E)`, plus
    /// `residual` (batch-first) where given, added in the projection's
    /// tiles.
    pub(super) fn project_out(&self, heads: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let (b, _, l, _) = heads.dims4()?;
        self.project_merged(
            &heads.transpose(1, 2)?.reshape((b, l, self.cfg.q_dim()))?,
            residual,
        )
    }

    /// [`Self::project_out`] of heads already merged, `(B, L, H · hd)`.
    fn project_merged(&self, merged: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        match residual {
            Some(residual) => self.out_proj.forward_add(merged, residual),
            None => self.out_proj.forward(merged),
        }
    }

    /// [`Self::attention`], then [`Self::project_out`]: what the PyTorch
    /// entry points return.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        packed: Option<&Tensor>,
        mask: &Mask,
        appended: usize,
        opts: &MhaOptions,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if opts.need_weights == NeedWeights::No {
            // Training on the fused path: the heads come merged, with no
            // view for candle's backward to pad and sum.
            let drawn = dropout::next(self.dropout(opts))?;
            let merged =
                sdpa_train_merged(q, k, v, packed, mask, appended, self.cfg.scale, opts.path, drawn)?;
            if let Some(merged) = merged {
                return Ok((self.project_merged(&merged, opts.residual.as_ref())?, None));
            }
        }
        let (heads, weights) = self.attention(q, k, v, mask, appended, opts)?;
        Ok((self.project_out(&heads, opts.residual.as_ref())?, weights))
    }
}

/// Mean over the head dim of `(B, H, L, S)`, computed in f32.
fn average_heads(weights: &Tensor) -> Result<Tensor> {
    let dtype = weights.dtype();
    weights.to_dtype(DType::F32)?.mean(1)?.to_dtype(dtype)
}
