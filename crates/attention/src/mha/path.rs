//! The steps of the path every [`MultiheadAttention`] entry point shares:
//! the mask joined to the config's rules, the heads projected, normed and
//! split, and the attention itself.

use candle::{bail, DType, Result, Tensor};
use candle_nn::Module;

use super::MultiheadAttention;
use crate::config::PositionEncoding;
use crate::mask::{Alibi, Mask};
use crate::options::{MhaOptions, NeedWeights};
use crate::sdpa::{sdpa_dispatch, sdpa_reference, AttnPath};

impl MultiheadAttention {
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
    /// where configured; self-attention in one fused projection.
    pub(super) fn project_heads(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (h, kvh) = (self.cfg.num_heads, self.cfg.kv_heads());
        let (q, k, v) = match self.in_proj.self_attention_heads(query, key, value, h)? {
            Some(heads) => heads,
            None => {
                let (q, k, v) = self.in_proj.forward(query, key, value)?;
                (
                    self.split_heads(&q, h)?,
                    self.split_heads(&k, kvh)?,
                    self.split_heads(&v, kvh)?,
                )
            }
        };
        Ok((self.norm_q(&q)?, self.norm_k(&k)?, v))
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

    /// Heads `(B, H, L, hd)`, `(B, H, S, hd)` → output projection of the
    /// merged attention `(B, L, E)` (plus `opts.residual`, batch-first
    /// here), and the weights asked for. Weights and
    /// dropout need the reference path; otherwise `opts.path` decides. The
    /// last `appended` keys lie outside `mask`.
    pub(super) fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Mask,
        appended: usize,
        opts: &MhaOptions,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, _, l, _) = q.dims4()?;
        let dropout = (opts.train && self.cfg.dropout > 0.).then_some(self.cfg.dropout);
        // (B, H, L, hd), (B, H, L, S)
        let (out, weights) = if opts.need_weights == NeedWeights::No && dropout.is_none() {
            (
                sdpa_dispatch(q, k, v, mask, appended, self.cfg.scale, opts.path, None)?,
                None,
            )
        } else {
            if !matches!(opts.path, AttnPath::Auto | AttnPath::Reference) {
                bail!(
                    "MultiheadAttention: the {:?} path returns no attention weights and applies no dropout; \
                     use AttnPath::Auto or AttnPath::Reference",
                    opts.path
                )
            }
            let (out, weights) = sdpa_reference(q, k, v, mask, appended, self.cfg.scale, dropout)?;
            (out, Some(weights))
        };
        // (B, L, E)
        let out = out.transpose(1, 2)?.reshape((b, l, self.cfg.q_dim()))?;
        let out = match &opts.residual {
            Some(residual) => self.out_proj.forward_add(&out, residual)?,
            None => self.out_proj.forward(&out)?,
        };
        let weights = match (opts.need_weights, weights) {
            (NeedWeights::PerHead, w) => w,
            (NeedWeights::Averaged, Some(w)) => Some(average_heads(&w)?),
            _ => None,
        };
        Ok((out, weights))
    }
}

/// Mean over the head dim of `(B, H, L, S)`, computed in f32.
fn average_heads(weights: &Tensor) -> Result<Tensor> {
    let dtype = weights.dtype();
    weights.to_dtype(DType::F32)?.mean(1)?.to_dtype(dtype)
}
