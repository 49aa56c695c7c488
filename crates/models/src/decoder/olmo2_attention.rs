//! OLMo 2's self-attention: q and k each RMS-normed over all heads'
//! features at once, before the split into heads, then rotated and
//! attended as Llama's. [`MultiheadAttention`]'s qk-norm works on one head
//! at a time, so this layer runs the same steps over the crate's
//! primitives: projection, norm, rotary, cache append, sdpa.
//!
//! Port of `Olmo2Attention` (`transformers/models/olmo2/modeling_olmo2.py`).

use candle::{Module, Result, Tensor};
use candle_nn::{linear_b, RmsNorm, VarBuilder};
#[cfg(doc)]
use multihead_attention::MultiheadAttention;
use multihead_attention::{
    scaled_dot_product_attention, Causal, KeyPaddingMask, KvCache, Mask, PackedLinear, Rotary, RotaryConfig,
};

use super::config::LlamaConfig;

/// `Olmo2Attention`, under `vb` = `self_attn`: `q_proj`, `k_proj`,
/// `v_proj`, `o_proj`, and `q_norm` (`num_heads * head_dim`), `k_norm`
/// (`num_kv_heads * head_dim`).
#[derive(Debug, Clone)]
pub(super) struct Olmo2Attention {
    q_proj: PackedLinear,
    k_proj: PackedLinear,
    v_proj: PackedLinear,
    o_proj: PackedLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rotary: Rotary,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Olmo2Attention {
    pub(super) fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let (e, hd, bias) = (cfg.hidden_size, cfg.head_width(), cfg.attention_bias);
        let (h, kvh) = (cfg.num_attention_heads, cfg.kv_heads());
        let proj = |i, o, name| PackedLinear::from_linear(linear_b(i, o, bias, vb.pp(name))?);
        let mut rotary = RotaryConfig::new(cfg.theta());
        rotary.scaling = cfg.rope_scaling;
        Ok(Self {
            q_proj: proj(e, h * hd, "q_proj")?,
            k_proj: proj(e, kvh * hd, "k_proj")?,
            v_proj: proj(e, kvh * hd, "v_proj")?,
            o_proj: proj(h * hd, e, "o_proj")?,
            q_norm: candle_nn::rms_norm(h * hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: candle_nn::rms_norm(kvh * hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            rotary: Rotary::new(&rotary, hd)?,
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: hd,
        })
    }

    /// Causal self-attention of `x` over `cache` and itself, appending its
    /// keys and values; rows left-padded as the cache says.
    ///
    /// # Shapes
    /// - `x`: `(B, T, E)`
    /// - returns `(B, T, E)`
    pub(super) fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kvh, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let offset = cache.len();
        // (B, T, H·hd), (B, T, Hkv·hd): normed across every head.
        let q = self.q_norm.forward(&self.q_proj.forward(x)?)?;
        let k = self.k_norm.forward(&self.k_proj.forward(x)?)?;
        let v = self.v_proj.forward(x)?;
        // (B, H, T, hd), (B, Hkv, T, hd), (B, Hkv, T, hd)
        let heads = |t_: Tensor, n| t_.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(q, h)?, heads(k, kvh)?, heads(v, kvh)?);
        let (q, k) = self
            .rotary
            .apply_qk(&q, &k, &cache.positions(b, t, x.device())?)?;
        // (B, Hkv, S, hd) each, S = offset + T
        let (k, v) = cache.append(&k, &v)?;
        let s = cache.len();
        let mut mask = Mask::causal(Causal::Offset(offset));
        if cache.left_padding().iter().any(|&p| p > 0) {
            let lengths: Vec<usize> = cache
                .left_padding()
                .iter()
                .map(|&p| s.saturating_sub(p))
                .collect();
            mask = mask.with_key_padding(KeyPaddingMask::from_lengths_left(&lengths, s, x.device())?);
        }
        // (B, H, T, hd) → (B, T, H·hd) → (B, T, E)
        let out = scaled_dot_product_attention(&q, &k, &v, &mask, None)?;
        self.o_proj
            .forward(&out.transpose(1, 2)?.reshape((b, t, h * hd))?)
    }
}
