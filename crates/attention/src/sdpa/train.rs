//! Attention that backpropagates without the `(q_len, kv_len)` scores: the
//! tiled CPU kernel's forward, which keeps each query row's log-sum-exp,
//! and its fused backward (`multihead_kernels::attention::sdpa_backward`),
//! joined to candle's autograd as a [`CustomOp3`] over q, k and v, so that
//! `Tensor::backward` runs the fused backward. What
//! [`AttnPath::CpuTiled`](crate::AttnPath::CpuTiled) runs for tracked
//! tensors.

use candle::{bail, CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};
use multihead_kernels::attention::{self as kernel, Dropout, TileOptions};
use multihead_kernels::isa::Isa;

use super::{sdpa_reference, Call};
use crate::handover::Handover;
use crate::mask::{AttnMask, KeyPaddingMask, Mask};

/// Whether any of q, k and v needs gradients.
pub(super) fn tracked(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    q.track_op() || k.track_op() || v.track_op()
}

/// Why the fused backward cannot serve a tracked call, if it cannot.
pub(super) fn refusal(call: &Call, mask: &Mask) -> Option<String> {
    let Call { q, k, v, .. } = *call;
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle::DType::F32;
    if ![q, k, v].into_iter().all(f32_cpu) {
        return Some(format!(
            "backpropagating needs f32 CPU tensors, found q {:?}, k {:?}, v {:?} on {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype(),
            q.device()
        ));
    }
    let key_padding = mask.key_padding.as_ref().map(KeyPaddingMask::tensor);
    let attn = mask.attn.as_ref().map(AttnMask::tensor);
    key_padding
        .into_iter()
        .chain(attn)
        .any(Tensor::track_op)
        .then(|| "the mask needs gradients, which only the reference path gives it".into())
}

/// The shape a training call's output takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Merge {
    /// `(B, L, H, Dv)`: the heads, a transpose away from `(B, H, L, Dv)`.
    Heads,
    /// `(B, L, H · Dv)`: the heads merged, an output projection's input.
    Features,
}

impl Merge {
    /// The reference path's heads `(B, H, L, Dv)` in this shape.
    fn of_heads(self, heads: &Tensor) -> Result<Tensor> {
        let t = heads.transpose(1, 2)?;
        match self {
            Merge::Heads => Ok(t),
            Merge::Features => {
                let (b, l, h, dv) = t.dims4()?;
                t.reshape((b, l, h * dv))
            }
        }
    }
}

/// `softmax(q kᵀ · scale + mask) v` through the tiled kernel, its result
/// tracked so that its backward is the fused one, in `merge`'s shape;
/// shapes as [`crate::scaled_dot_product_attention`] (validated by the
/// caller, and by [`refusal`]: f32 on the CPU), the last `appended` keys
/// outside the mask, on `isa` (`None`: the kernel's default), with
/// `dropout` on the weights where given.
#[allow(clippy::too_many_arguments)]
pub(super) fn sdpa_train(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    dropout: Option<Dropout>,
    merge: Merge,
) -> Result<Tensor> {
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    match fused(&qd, &kd, &vd, mask, appended, scale, isa, dropout, merge)? {
        Some(op) => q.apply_op3(k, v, op),
        // A non-finite value met a hidden key: the reference path, which
        // reads no hidden value, decides, and backpropagates (with
        // candle's dropout of the same probability).
        None => merge.of_heads(&sdpa_reference(q, k, v, mask, appended, Some(scale), p_of(dropout))?.0),
    }
}

/// The probability of `dropout`, as the reference path takes it.
fn p_of(dropout: Option<Dropout>) -> Option<f32> {
    dropout.map(|d| d.p())
}

/// [`sdpa_train`] of self-attention whose q, k and v are the heads of one
/// projection `qkv` `(B, L, (H + 2 Hkv) · hd)` (q's `heads`, then k's and
/// v's `kv_heads` each), tracked through `qkv` itself: the backward
/// writes the three gradients into one tensor of its shape, where the
/// heads' own views would each have their gradient padded to its shape
/// and summed. The heads merged, `(B, L, H · hd)`.
pub(super) fn sdpa_train_packed(
    qkv: &Tensor,
    heads: usize,
    kv_heads: usize,
    mask: &Mask,
    appended: usize,
    scale: f64,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let (q, k, v) = packed_heads(&qkv.detach(), heads, kv_heads)?;
    match fused(&q, &k, &v, mask, appended, scale, None, dropout, Merge::Features)? {
        Some(fused) => qkv.apply_op1(FusedSelfAttention {
            heads,
            kv_heads,
            fused,
        }),
        None => {
            // As in `sdpa_train`.
            let (q, k, v) = packed_heads(qkv, heads, kv_heads)?;
            Merge::Features
                .of_heads(&sdpa_reference(&q, &k, &v, mask, appended, Some(scale), p_of(dropout))?.0)
        }
    }
}

/// The tiled forward of `q`, `k`, `v` (detached), as the op that hands its
/// output over in `merge`'s shape and keeps what the backward needs;
/// `None` where a non-finite value met a hidden key.
#[allow(clippy::too_many_arguments)]
fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    dropout: Option<Dropout>,
    merge: Merge,
) -> Result<Option<FusedAttention>> {
    let masking = mask.masking(q, k, appended, dropout)?;
    let options = TileOptions {
        isa,
        ..TileOptions::default()
    };
    let Some((out, lse)) = kernel::sdpa_saving_lse(q, k, v, &masking, appended, scale, options)? else {
        return Ok(None);
    };
    // (B, L, H, Dv), the kernel's own buffer.
    let out = out.transpose(1, 2)?;
    let out = match merge {
        Merge::Heads => out,
        Merge::Features => {
            let (b, l, h, dv) = out.dims4()?;
            out.reshape((b, l, h * dv))?
        }
    };
    Ok(Some(FusedAttention {
        mask: mask.clone(),
        appended,
        scale,
        isa,
        dropout,
        lse,
        out: Handover::new(out),
    }))
}

/// The q, k and v heads of a packed projection `(B, L, (H + 2 Hkv) · hd)`:
/// `(B, H, L, hd)` and `(B, Hkv, L, hd)` twice, views.
fn packed_heads(qkv: &Tensor, heads: usize, kv_heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, l, width) = qkv.dims3()?;
    let all = heads + 2 * kv_heads;
    if all == 0 || width % all != 0 {
        bail!("fused attention: a projection of {width} features holds no {all} heads of one size")
    }
    let qkv = qkv.reshape((b, l, all, width / all))?;
    let part = |from: usize, n: usize| qkv.narrow(2, from, n)?.transpose(1, 2);
    Ok((
        part(0, heads)?,
        part(heads, kv_heads)?,
        part(heads + kv_heads, kv_heads)?,
    ))
}

/// `t`, the output or its gradient in either [`Merge`] shape, as the
/// kernel reads it: `(B, H, L, Dv)`, a view of `(B, L, H, Dv)`.
fn as_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, l) = (t.dim(0)?, t.dim(1)?);
    t.reshape((b, l, heads, t.elem_count() / (b * l * heads).max(1)))?
        .transpose(1, 2)
}

/// The op that ties a fused forward to its backward. candle hands a
/// custom op's forward storages where the kernel reads tensors, so the
/// forward runs before the op is applied and [`CustomOp3::cpu_fwd`]
/// hands its output over; the op keeps what the backward needs besides
/// q, k, v and the output: the log-sum-exps, `(B, H, L)`, and the dropout
/// whose mask the backward draws again.
struct FusedAttention {
    mask: Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    dropout: Option<Dropout>,
    lse: Tensor,
    /// The output, contiguous in its [`Merge`] shape, until `cpu_fwd`
    /// takes it.
    out: Handover,
}

impl FusedAttention {
    /// The mask and dropout as the forward read them, for `q` and `k`.
    fn masking(&self, q: &Tensor, k: &Tensor) -> Result<kernel::Masking<'_>> {
        self.mask.masking(q, k, self.appended, self.dropout)
    }
}

impl CustomOp3 for FusedAttention {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.take("fused attention")
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let masking = self.masking(q, k)?;
        let h = q.dim(1)?;
        let grads = kernel::sdpa_backward(
            q,
            k,
            v,
            &as_heads(res, h)?,
            &self.lse,
            &as_heads(grad_res, h)?,
            &masking,
            self.appended,
            self.scale,
            self.isa,
        )?;
        let wanted = |t: &Tensor, g: Tensor| t.track_op().then_some(g);
        Ok((wanted(q, grads.q), wanted(k, grads.k), wanted(v, grads.v)))
    }
}

/// [`FusedAttention`] over the packed projection whose heads it attends
/// ([`sdpa_train_packed`]).
struct FusedSelfAttention {
    heads: usize,
    kv_heads: usize,
    fused: FusedAttention,
}

impl CustomOp1 for FusedSelfAttention {
    fn name(&self) -> &'static str {
        "fused-self-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fused.out.take("fused self-attention")
    }

    fn bwd(&self, qkv: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (q, k, v) = packed_heads(qkv, self.heads, self.kv_heads)?;
        let f = &self.fused;
        let masking = f.masking(&q, &k)?;
        let grad = kernel::sdpa_backward_packed(
            &q,
            &k,
            &v,
            &as_heads(res, self.heads)?,
            &f.lse,
            &as_heads(grad_res, self.heads)?,
            &masking,
            f.appended,
            f.scale,
            f.isa,
        )?;
        // (B, L, H + 2 Hkv, hd) -> the projection's (B, L, (H + 2 Hkv) · hd)
        Ok(Some(grad.reshape(qkv.shape())?))
    }
}
