//! candle's fused Metal kernel; compiled only with the `metal` feature.

use candle::{Result, Tensor};

use super::Call;
use crate::mask::Mask;

#[cfg(feature = "metal")]
pub(super) fn refusal(call: &Call, mask: &Mask) -> Option<String> {
    let (q, h, kh, l, s) = (call.q, call.heads, call.kv_heads, call.q_len, call.kv_len);
    let (d, dv) = (call.head_dim, call.v_head_dim);
    if dv != d || kh != h {
        return Some(format!(
            "needs v's head_dim ({dv}) equal to q's ({d}) and as many k/v heads ({kh}) as q heads ({h})"
        ));
    }
    if !q.device().is_metal() {
        return Some("needs a Metal device".into());
    }
    if ![32, 64, 72, 80, 96, 128, 256].contains(&d) {
        return Some(format!(
            "needs head_dim in 32, 64, 72, 80, 96, 128, 256, found {d}"
        ));
    }
    if mask.key_padding.is_some() || mask.attn.is_some() {
        return Some("takes no mask tensor here, only a causal rule".into());
    }
    match mask.causal {
        Some(_) if l != s => Some("its causal rule needs q_len == kv_len".into()),
        _ => None,
    }
}

#[cfg(feature = "metal")]
pub(super) fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: f64) -> Result<Tensor> {
    candle_nn::ops::sdpa(q, k, v, None, mask.causal.is_some(), scale as f32, 1.)
}

#[cfg(not(feature = "metal"))]
pub(super) fn refusal(_: &Call, _: &Mask) -> Option<String> {
    Some("built without the `metal` feature".into())
}

#[cfg(not(feature = "metal"))]
pub(super) fn sdpa(_: &Tensor, _: &Tensor, _: &Tensor, _: &Mask, _: f64) -> Result<Tensor> {
    candle::bail!("sdpa: built without the `metal` feature")
}
