//! Scaled dot-product attention, the one function every attention path in
//! this crate ends in.
//!
//! Port of PyTorch's `F.scaled_dot_product_attention` math reference
//! (`aten/src/ATen/native/transformers/attention.cpp`,
//! `_scaled_dot_product_attention_math`), with two deliberate differences:
//! f16/bf16 scores are softmaxed in f32, and a query row whose keys are all
//! masked returns zeros where PyTorch returns NaN.

use candle::{bail, DType, Result, Tensor, D};

use crate::mask::Mask;

/// `softmax(q kᵀ · scale + mask) v` on `(batch, heads, seq, head_dim)`
/// tensors.
///
/// # Shapes
/// - `q`: `(batch, heads, q_len, head_dim)`
/// - `k`: `(batch, kv_heads, kv_len, head_dim)`
/// - `v`: `(batch, kv_heads, kv_len, v_head_dim)`
/// - returns `(batch, heads, q_len, v_head_dim)`
///
/// `heads` must be a multiple of `kv_heads` (grouped-query attention;
/// `kv_heads == heads` is ordinary multi-head attention, `kv_heads == 1`
/// multi-query). `scale` defaults to `1 / sqrt(head_dim)`.
///
/// A query whose keys are all masked gets an all-zero output row (PyTorch
/// gives NaN). For f16 and bf16 inputs the scores are computed and
/// softmaxed in f32; the output is in the input dtype.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
) -> Result<Tensor> {
    Ok(sdpa_reference(q, k, v, mask, scale, None)?.0)
}

/// [`scaled_dot_product_attention`] that also returns the attention
/// weights, `(batch, heads, q_len, kv_len)`, in the input dtype.
pub fn scaled_dot_product_attention_with_weights(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    sdpa_reference(q, k, v, mask, scale, None)
}

/// The dims `(batch, heads, q_len, kv_len, kv_heads)` of a valid call, or an
/// error that names the mismatch.
pub(crate) fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            bail!(
                "sdpa: {name} must be 4-D (batch, heads, seq, head_dim), found shape {:?}",
                t.dims()
            )
        }
    }
    let (b, h, l, d) = q.dims4()?;
    let (kb, kh, s, kd) = k.dims4()?;
    let (vb, vh, vs, _) = v.dims4()?;
    if kb != b || vb != b {
        bail!("sdpa: batch sizes differ: q {b}, k {kb}, v {vb}")
    }
    if kd != d {
        bail!("sdpa: head_dim of k ({kd}) differs from q ({d})")
    }
    if vh != kh {
        bail!("sdpa: k has {kh} heads but v has {vh}")
    }
    if vs != s {
        bail!("sdpa: k has {s} keys but v has {vs} values")
    }
    if kh == 0 || h % kh != 0 {
        bail!("sdpa: q heads ({h}) must be a multiple of k/v heads ({kh})")
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "sdpa: dtypes differ: q {:?}, k {:?}, v {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    Ok((b, h, l, s, kh))
}

/// Repeats each of `kv_heads` heads `heads / kv_heads` times along dim 1.
pub(crate) fn repeat_kv(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kh, s, d) = x.dims4()?;
    if kh == heads {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?
        .broadcast_as((b, kh, heads / kh, s, d))?
        .reshape((b, heads, s, d))
}

/// Softmax over the last dim in f32, where a row of all `-inf` gives zeros
/// instead of NaN.
pub(crate) fn masked_softmax_last_dim(scores: &Tensor) -> Result<Tensor> {
    // A fully masked row has max -inf; clamping the max to the lowest finite
    // f32 keeps `s - max` at -inf there, so its exps are 0, not NaN.
    let max = scores.max_keepdim(D::Minus1)?.clamp(f32::MIN, f32::INFINITY)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    // A row with any unmasked key has a sum >= 1 (its max contributes
    // exp(0)); only fully masked rows are lifted from 0, and their exps are 0.
    let sum = e
        .sum_keepdim(D::Minus1)?
        .clamp(f32::MIN_POSITIVE, f32::INFINITY)?;
    e.broadcast_div(&sum)
}

/// The reference path: materialises the `(q_len, kv_len)` scores. Applies
/// dropout with probability `dropout` to the weights when given. Returns
/// the output and the weights.
pub(crate) fn sdpa_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
    dropout: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, l, s, _) = check_qkv(q, k, v)?;
    let head_dim = q.dim(3)?;
    let scale = scale.unwrap_or(1. / (head_dim as f64).sqrt());
    let k = repeat_kv(k, h)?;
    let v = repeat_kv(v, h)?;
    // (B, H, L, S), in f32: f16 products overflow past 65504 and half
    // precision loses the small differences the softmax amplifies.
    let scores = (q.to_dtype(DType::F32)?.matmul(&k.to_dtype(DType::F32)?.t()?)? * scale)?;
    let scores = match mask.to_bias((b, h, l, s), q.device())? {
        Some(bias) => scores.broadcast_add(&bias)?,
        None => scores,
    };
    let mut weights = masked_softmax_last_dim(&scores)?;
    if let Some(p) = dropout.filter(|&p| p > 0.) {
        weights = candle_nn::ops::dropout(&weights, p)?;
    }
    let weights = weights.to_dtype(v.dtype())?;
    // (B, H, L, Dv)
    let out = weights.matmul(&v.contiguous()?)?;
    Ok((out, weights))
}
