//! A decoder's step of causal self-attention over a [`KvCache`]: the five
//! steps of HF's `LlamaAttention.forward` and candle-transformers'
//! `CausalSelfAttention::forward`, in one function. The PyTorch-only
//! options of the module (`add_bias_kv`, `add_zero_attn`, sequence-first
//! input) are refused, and an unbatched input made batch-first, before
//! the first step.

use candle::{bail, Result, Tensor};

use super::batching::Batching;
use super::MultiheadAttention;
use crate::cache::KvCache;
use crate::mask::Causal;
use crate::options::{MhaOptions, MhaOutput, SeqLayout};

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
        let (call, x, opts) = self.decoder_call(x, opts)?;
        // (B, T, E)
        let (b, t) = self.check_query(&x)?;

        // 1. q, k and v in one projection, as heads: (B, H, T, hd),
        //    (B, Hkv, T, hd), (B, Hkv, T, hd).
        let (q, k, v) = self.in_proj.self_attention_heads(&x, self.cfg.num_heads)?;

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

        // 4. Attention, causal from `offset` on, the cache's left padding
        //    as key padding, the config's window, ALiBi and cap joined:
        //    (B, H, T, hd).
        let mut mask = opts.mask.clone().with_causal(Causal::Offset(offset));
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
        let (heads, weights) = self.attention(&q, &k, &v, &mask, 0, &opts)?;

        // 5. Heads merged and projected out, the residual added in the
        //    projection's tiles: (B, T, E).
        let out = self.project_out(&heads, opts.residual.as_ref())?;
        call.output((out, weights))
    }

    /// `x` and `opts` batch-first for [`Self::forward_cached`], or the
    /// reason the call cannot be a decoder step.
    fn decoder_call(&self, x: &Tensor, opts: &MhaOptions) -> Result<(Batching, Tensor, MhaOptions)> {
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
        let call = Batching::new(unbatched, SeqLayout::BatchFirst);
        Ok((call, call.input(x)?, call.options(opts)?))
    }
}
