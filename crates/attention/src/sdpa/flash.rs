//! `candle-flash-attn` dispatch; compiled only with the `flash-attn` feature.

use candle::{Result, Tensor};

use super::Call;
use crate::mask::Mask;

#[cfg(feature = "flash-attn")]
pub(super) fn refusal(call: &Call, mask: &Mask) -> Option<String> {
    use candle::DType;
    let (q, l, s, d, dv) = (call.q, call.q_len, call.kv_len, call.head_dim, call.v_head_dim);
    if dv != d {
        return Some(format!("needs v's head_dim ({dv}) equal to q's ({d})"));
    }
    if !q.device().is_cuda() {
        return Some("needs a CUDA device".into());
    }
    if !matches!(q.dtype(), DType::F16 | DType::BF16) {
        return Some(format!("needs f16 or bf16, found {:?}", q.dtype()));
    }
    if d > 256 || d % 8 != 0 {
        return Some(format!("needs head_dim a multiple of 8 up to 256, found {d}"));
    }
    if mask.key_padding.is_some() || mask.attn.is_some() {
        return Some("takes no mask tensor, only a causal rule".into());
    }
    // flash-attn aligns its causal mask to the bottom right.
    match mask.causal {
        None => None,
        Some(c) if c.offset(l, s) == s as isize - l as isize => None,
        Some(c) => Some(format!(
            "its causal rule is bottom-right aligned, {c:?} is not for q_len {l}, kv_len {s}"
        )),
    }
}

#[cfg(feature = "flash-attn")]
pub(super) fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: f64) -> Result<Tensor> {
    // flash-attn takes (batch, seq, heads, head_dim).
    let t = |x: &Tensor| x.transpose(1, 2)?.contiguous();
    let out = candle_flash_attn::flash_attn(&t(q)?, &t(k)?, &t(v)?, scale as f32, mask.causal.is_some())?;
    out.transpose(1, 2)
}

#[cfg(not(feature = "flash-attn"))]
pub(super) fn refusal(_: &Call, _: &Mask) -> Option<String> {
    Some("built without the `flash-attn` feature".into())
}

#[cfg(not(feature = "flash-attn"))]
pub(super) fn sdpa(_: &Tensor, _: &Tensor, _: &Tensor, _: &Mask, _: f64) -> Result<Tensor> {
    candle::bail!("sdpa: built without the `flash-attn` feature")
}
