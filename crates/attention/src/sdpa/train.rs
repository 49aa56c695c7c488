//! Attention that backpropagates without the `(q_len, kv_len)` scores: the
//! tiled CPU kernel's forward, which keeps each query row's log-sum-exp,
//! and its fused backward (`multihead_kernels::attention::sdpa_backward`),
//! joined to candle's autograd as a [`CustomOp3`] over q, k and v, so that
//! `Tensor::backward` runs the fused backward. What
//! [`AttnPath::CpuTiled`](crate::AttnPath::CpuTiled) runs for tracked
//! tensors.

use std::sync::Mutex;

use candle::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use multihead_kernels::attention::{self as kernel, TileOptions};
use multihead_kernels::isa::Isa;

use super::{sdpa_reference, Call};
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

/// `softmax(q kᵀ · scale + mask) v` through the tiled kernel, its result
/// tracked so that its backward is the fused one; shapes as
/// [`crate::scaled_dot_product_attention`] (validated by the caller, and
/// by [`refusal`]: f32 on the CPU), the last `appended` keys outside the
/// mask, on `isa` (`None`: the kernel's default).
pub(super) fn sdpa_train(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
) -> Result<Tensor> {
    let masking = mask.masking(q, k, appended)?;
    let options = TileOptions {
        isa,
        ..TileOptions::default()
    };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let Some((out, lse)) = kernel::sdpa_saving_lse(&qd, &kd, &vd, &masking, appended, scale, options)? else {
        // A non-finite value met a hidden key: the reference path, which
        // reads no hidden value, decides, and backpropagates.
        return Ok(sdpa_reference(q, k, v, mask, appended, Some(scale), None)?.0);
    };
    let op = FusedAttention {
        mask: mask.clone(),
        appended,
        scale,
        isa,
        lse,
        // (B, L, H, Dv), the kernel's own buffer.
        out: Mutex::new(Some(out.transpose(1, 2)?)),
    };
    // (B, L, H, Dv) -> (B, H, L, Dv), the view the kernel gives.
    q.apply_op3(k, v, op)?.transpose(1, 2)
}

/// The op that ties a fused forward to its backward. candle hands a
/// custom op's forward storages where the kernel reads tensors, so the
/// forward runs before the op is applied and [`CustomOp3::cpu_fwd`]
/// hands its output over; the op keeps what the backward needs besides
/// q, k, v and the output: the log-sum-exps, `(B, H, L)`.
struct FusedAttention {
    mask: Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    lse: Tensor,
    /// The output, `(B, L, H, Dv)` contiguous, until `cpu_fwd` takes it.
    out: Mutex<Option<Tensor>>,
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
        let Some(out) = self.out.lock().ok().and_then(|mut o| o.take()) else {
            bail!("fused attention: the forward's output was already taken")
        };
        let (storage, layout) = out.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            bail!("fused attention: the output is not on the CPU")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("fused attention: the output is not contiguous")
        };
        let data = cpu.as_slice::<f32>()?[start..end].to_vec();
        Ok((CpuStorage::F32(data), out.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let masking = self.mask.masking(q, k, self.appended)?;
        // `res` and `grad_res` are (B, L, H, Dv); the kernel reads them as
        // (B, H, L, Dv) views.
        let grads = kernel::sdpa_backward(
            q,
            k,
            v,
            &res.transpose(1, 2)?,
            &self.lse,
            &grad_res.transpose(1, 2)?,
            &masking,
            self.appended,
            self.scale,
            self.isa,
        )?;
        let wanted = |t: &Tensor, g: Tensor| t.track_op().then_some(g);
        Ok((wanted(q, grads.q), wanted(k, grads.k), wanted(v, grads.v)))
    }
}
