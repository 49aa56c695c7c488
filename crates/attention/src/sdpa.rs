//! Scaled dot-product attention, the one function every attention path in
//! this crate ends in, and the bridge from a [`Mask`] to the tiled CPU
//! kernel (`multihead_kernels::attention`) that serves it on the CPU.
//!
//! Port of PyTorch's `F.scaled_dot_product_attention` math reference
//! (`aten/src/ATen/native/transformers/attention.cpp`,
//! `_scaled_dot_product_attention_math`), with two deliberate differences:
//! f16/bf16 scores are softmaxed in f32, and a query row whose keys are all
//! masked returns zeros where PyTorch returns NaN.

use candle::{bail, DType, Result, Tensor, D};
use multihead_kernels::attention::{self as kernel, Dropout, TileOptions};
use multihead_kernels::isa::Isa;

use crate::mask::Mask;
use train::Merge;

/// `softmax(q kᵀ · scale + mask) v` on `(batch, heads, seq, head_dim)`
/// tensors; with [`Mask::softcap`], `softmax(cap · tanh(q kᵀ · scale /
/// cap) + mask) v`.
///
/// # Shapes
/// - `q`: `(batch, heads, q_len, head_dim)`
/// - `k`: `(batch, kv_heads, kv_len, head_dim)`
/// - `v`: `(batch, kv_heads, kv_len, v_head_dim)`
/// - returns `(batch, heads, q_len, v_head_dim)`
///
/// `heads` must be a multiple of `kv_heads` (grouped-query attention;
/// `kv_heads == heads` is ordinary multi-head attention, `kv_heads == 1`
/// multi-query). `scale` defaults to `1 / sqrt(head_dim)` (Gemma's
/// `query_pre_attn_scalar` is `scale = 1 / sqrt(query_pre_attn_scalar)`).
///
/// A query whose keys are all masked gets an all-zero output row (PyTorch
/// gives NaN). For f16 and bf16 inputs the scores are computed and
/// softmaxed in f32; the output is in the input dtype. A NaN or `+inf`
/// score makes its query's row NaN and a non-finite value reaches every
/// query that sees its key, as in PyTorch, on every path; a key the mask
/// hides takes no part, NaN or not. `scale` must be finite and > 0.
///
/// The computation goes through the fastest path that can serve it
/// ([`AttnPath::Auto`]); [`scaled_dot_product_attention_via`] forces one.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
) -> Result<Tensor> {
    scaled_dot_product_attention_via(q, k, v, mask, scale, AttnPath::Auto)
}

/// Which implementation computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnPath {
    /// The fastest path that can serve the call: [`AttnPath::CpuTiled`] on
    /// the CPU, [`AttnPath::FlashAttn`] or [`AttnPath::MetalFused`] where
    /// built and applicable, else [`AttnPath::Reference`]. Calls that need
    /// attention weights always take the reference path, and calls that
    /// need gradients or dropout do unless [`AttnPath::CpuTiled`] can
    /// serve them.
    #[default]
    Auto,
    /// Materialises the `(q_len, kv_len)` scores: returns weights, applies
    /// dropout, backpropagates, runs on every device.
    Reference,
    /// The memory-efficient tiled CPU kernel (f32, f16, bf16 with f32
    /// accumulation; every mask kind; grouped-query). Where q, k or v need
    /// gradients (all f32, the mask's tensors not), `Tensor::backward`
    /// runs its fused backward, which holds no `(q_len, kv_len)` tensor
    /// either. Dropout draws its mask a tile at a time from a seed, and
    /// the backward draws the same one again.
    CpuTiled,
    /// `candle-flash-attn` on CUDA (f16/bf16; no mask but a causal rule),
    /// with the `flash-attn` feature.
    FlashAttn,
    /// candle's fused Metal `sdpa` (no mask but a square causal rule), with
    /// the `metal` feature.
    MetalFused,
}

impl AttnPath {
    /// Why `self` cannot serve this call, if it cannot. `Auto` and
    /// `Reference` always can (the reference path serves every valid call).
    fn refusal(self, call: &Call, mask: &Mask, appended: usize, dropout: bool) -> Option<String> {
        let Call { q, k, v, .. } = *call;
        let grads = train::tracked(q, k, v);
        match self {
            AttnPath::Auto | AttnPath::Reference => None,
            AttnPath::CpuTiled if grads => train::refusal(call, mask),
            _ if grads => {
                Some("gradients are tracked and only the reference and CPU paths backpropagate".into())
            }
            AttnPath::CpuTiled => (!kernel::supports(q)).then(|| {
                format!(
                    "needs a CPU tensor of f32/f16/bf16, found {:?} on {:?}",
                    q.dtype(),
                    q.device()
                )
            }),
            _ if dropout => Some("dropout needs the reference or CPU path".into()),
            _ if appended > 0 => Some(
                "keys appended past the mask (add_bias_kv, add_zero_attn) need the reference or CPU path"
                    .into(),
            ),
            _ if mask.window.is_some() || mask.alibi.is_some() || mask.softcap.is_some() => {
                Some("a sliding window, ALiBi or soft-capping needs the reference or CPU path".into())
            }
            AttnPath::FlashAttn => flash::refusal(call, mask),
            AttnPath::MetalFused => metal::refusal(call, mask),
        }
    }

    /// The path `Auto` takes for this call.
    fn resolve(call: &Call, mask: &Mask, appended: usize, dropout: bool) -> AttnPath {
        [AttnPath::FlashAttn, AttnPath::MetalFused, AttnPath::CpuTiled]
            .into_iter()
            .find(|p| p.refusal(call, mask, appended, dropout).is_none())
            .unwrap_or(AttnPath::Reference)
    }
}

/// A call's q, k and v and their dims, checked once by [`check_qkv`]: the
/// paths' refusals read the dims from here instead of re-reading shapes.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) q: &'a Tensor,
    pub(crate) k: &'a Tensor,
    pub(crate) v: &'a Tensor,
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) q_len: usize,
    pub(crate) kv_len: usize,
    pub(crate) head_dim: usize,
    pub(crate) v_head_dim: usize,
}

/// [`scaled_dot_product_attention`] through a chosen [`AttnPath`]; an error
/// says why a forced path cannot serve the call.
pub fn scaled_dot_product_attention_via(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
    path: AttnPath,
) -> Result<Tensor> {
    sdpa_dispatch(q, k, v, mask, 0, scale, path, None, None)
}

/// [`scaled_dot_product_attention_via`] with dropout of probability
/// `dropout_p` on the attention weights (PyTorch's
/// `F.scaled_dot_product_attention(..., dropout_p=p)`): each weight is
/// dropped with probability `p` and the others scaled by `1 / (1 − p)`.
/// On [`AttnPath::CpuTiled`] (which `Auto` takes where it can) the mask
/// is drawn a tile at a time from a seed ([`set_dropout_seed`]) and the
/// fused backward draws it again; the reference path uses candle's
/// dropout. `dropout_p` must be in `[0, 1)`; 0 is no dropout.
pub fn scaled_dot_product_attention_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
    dropout_p: f32,
    path: AttnPath,
) -> Result<Tensor> {
    let dropout = dropout::next(Some(dropout_p))?;
    sdpa_dispatch(q, k, v, mask, 0, scale, path, None, dropout)
}

/// [`scaled_dot_product_attention_via`] on [`AttnPath::CpuTiled`], the
/// kernel running every part of the call with the instruction set `isa`
/// (capped at what the processor runs; `multihead_kernels::isa::supported`
/// lists them): what the tests that compare each variant with the
/// reference path call, any number at once.
pub fn scaled_dot_product_attention_tiled_on(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
    isa: Isa,
) -> Result<Tensor> {
    sdpa_dispatch(q, k, v, mask, 0, scale, AttnPath::CpuTiled, Some(isa), None)
}

/// The dispatch behind every attention call. The last `appended` keys
/// (`add_bias_kv`, `add_zero_attn`) lie outside the mask: every query sees
/// them, and `mask` covers the keys before them. The CPU kernel runs on
/// `isa` (`None`: the default, `multihead_kernels::isa::current`), with
/// `dropout` on the weights where given (the reference path draws its own
/// mask of the same probability).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_dispatch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: Option<f64>,
    path: AttnPath,
    isa: Option<Isa>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let (call, scale, mask, path) = plan(q, k, v, mask, appended, scale, path, dropout.is_some())?;
    let mask = &*mask;
    if call.batch * call.heads == 0 {
        // An empty batch gives an empty output, whichever path was asked.
        return Tensor::zeros(
            (call.batch, call.heads, call.q_len, call.v_head_dim),
            q.dtype(),
            q.device(),
        );
    }
    // Half-precision keys and values beside f32 queries: the CPU kernel
    // reads them as they are, every other path in the queries' dtype.
    let (k, v) = &match path {
        AttnPath::CpuTiled => (k.clone(), v.clone()),
        _ => kv_in_dtype_of(q, k, v)?,
    };
    match path {
        AttnPath::CpuTiled if train::tracked(q, k, v) => {
            train::sdpa_train(q, k, v, mask, appended, scale, isa, dropout, Merge::Heads)?.transpose(1, 2)
        }
        AttnPath::CpuTiled => sdpa_tiled(q, k, v, mask, appended, scale, isa, dropout),
        AttnPath::FlashAttn => flash::sdpa(q, k, v, mask, scale),
        AttnPath::MetalFused => metal::sdpa(q, k, v, mask, scale),
        AttnPath::Auto | AttnPath::Reference => {
            Ok(sdpa_reference(q, k, v, mask, appended, Some(scale), dropout.map(|d| d.p()))?.0)
        }
    }
}

/// What a call resolves before it runs: its checked shapes and scale, the
/// mask without a window that hides nothing, and the path that serves it
/// (an error where `path` was forced and cannot), with `dropout` or not.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn plan<'a>(
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    mask: &'a Mask,
    appended: usize,
    scale: Option<f64>,
    path: AttnPath,
    dropout: bool,
) -> Result<(Call<'a>, f64, std::borrow::Cow<'a, Mask>, AttnPath)> {
    let call = check_qkv(q, k, v)?;
    let scale = check_scale(scale, call.head_dim)?;
    let mask = mask.without_inert_window(call.q_len, call.kv_len);
    if let Some(why) = path.refusal(&call, &mask, appended, dropout) {
        bail!("sdpa: the {path:?} path cannot serve this call: {why}")
    }
    let path = match path {
        AttnPath::Auto => AttnPath::resolve(&call, &mask, appended, dropout),
        p => p,
    };
    Ok((call, scale, mask, path))
}

/// [`sdpa_dispatch`] where the fused training path serves the call (f32
/// CPU tensors that track gradients on [`AttnPath::CpuTiled`], chosen or
/// resolved): the heads merged, `(B, L, H · Dv)`, the output projection's
/// input with no view between them — in candle's backward each view
/// costs a zeroed buffer and a sum of its gradient. `packed`, where
/// given, is the self-attention projection `(B, L, (H + 2 Hkv) · hd)`
/// whose heads q, k and v are, views as they came out of it: the
/// backward then gives its gradient in one piece. `dropout` as
/// [`sdpa_dispatch`]'s. `None` where another path serves the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_train_merged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    packed: Option<&Tensor>,
    mask: &Mask,
    appended: usize,
    scale: Option<f64>,
    path: AttnPath,
    dropout: Option<Dropout>,
) -> Result<Option<Tensor>> {
    if !train::tracked(q, k, v) {
        return Ok(None);
    }
    let (call, scale, mask, path) = plan(q, k, v, mask, appended, scale, path, dropout.is_some())?;
    if path != AttnPath::CpuTiled || call.batch * call.heads == 0 {
        return Ok(None);
    }
    let merged = match packed {
        Some(qkv) => {
            train::sdpa_train_packed(qkv, call.heads, call.kv_heads, &mask, appended, scale, dropout)
        }
        None => train::sdpa_train(q, k, v, &mask, appended, scale, None, dropout, Merge::Features),
    };
    merged.map(Some)
}

/// `softmax(q kᵀ · scale + mask) v` (soft-capped where the mask asks)
/// through the tiled kernel; shapes as
/// [`crate::scaled_dot_product_attention`] (validated by the caller), the
/// last `appended` keys outside the mask, on `isa` (`None`: the
/// kernel's default), with `dropout` on the weights where given.
#[allow(clippy::too_many_arguments)]
fn sdpa_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let options = TileOptions {
        isa,
        ..TileOptions::default()
    };
    sdpa_tiled_with(q, k, v, mask, appended, scale, options, dropout)
}

/// [`sdpa_tiled`] with the kernel's instruction set, tiles and packing as
/// `options` asks.
#[allow(clippy::too_many_arguments)]
fn sdpa_tiled_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    options: TileOptions,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let masking = mask.masking(q, k, appended, dropout)?;
    match kernel::sdpa(q, k, v, &masking, appended, scale, options)? {
        Some(out) => Ok(out),
        // A non-finite value met a hidden key: the reference path, which
        // reads no hidden value, decides.
        None => Ok(sdpa_reference(q, k, v, mask, appended, Some(scale), dropout.map(|d| d.p()))?.0),
    }
}

/// `k` and `v` in `q`'s dtype (themselves where they are in it).
fn kv_in_dtype_of(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?))
}

/// Whether `s` is a usable attention scale: finite and > 0 as an f32, the
/// scores' dtype (0 or infinity there would give uniform weights or NaN
/// rows).
pub(crate) fn scale_is_valid(s: f64) -> bool {
    s > 0. && (s as f32).is_finite() && (s as f32) > 0.
}

/// The scale to use: `1 / sqrt(head_dim)` by default; a given one must be
/// valid ([`scale_is_valid`]).
pub(crate) fn check_scale(scale: Option<f64>, head_dim: usize) -> Result<f64> {
    match scale {
        None => Ok(1. / (head_dim.max(1) as f64).sqrt()),
        Some(s) if scale_is_valid(s) => Ok(s),
        Some(s) => bail!("sdpa: scale must be finite and > 0 as an f32 (the scores' dtype), found {s}"),
    }
}

/// `candle-flash-attn` dispatch; compiled only with the `flash-attn` feature.
mod flash;

/// candle's fused Metal kernel; compiled only with the `metal` feature.
mod metal;

/// The tiled kernel's forward and fused backward as one autograd op.
mod train;

/// The seeds of the fused paths' dropout masks.
pub(crate) mod dropout;
pub use dropout::set_dropout_seed;

#[cfg(test)]
mod tiled_tests;

#[cfg(test)]
mod dropout_tests;

/// [`scaled_dot_product_attention`] that also returns the attention
/// weights, `(batch, heads, q_len, kv_len)`, in the input dtype.
pub fn scaled_dot_product_attention_with_weights(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    sdpa_reference(q, k, v, mask, 0, scale, None)
}

/// The dims of a valid call, or an error that names the mismatch.
pub(crate) fn check_qkv<'a>(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> Result<Call<'a>> {
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
    let (vb, vh, vs, dv) = v.dims4()?;
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
    if l == 0 || s == 0 {
        bail!("sdpa: empty sequence: q_len {l}, kv_len {s} (both must be > 0)")
    }
    if kh == 0 || h % kh != 0 {
        bail!("sdpa: q heads ({h}) must be a multiple of k/v heads ({kh})")
    }
    // f32 queries may meet bf16 or f16 keys and values: a cache stored in
    // half precision beside an f32 model.
    let half_cache = q.dtype() == DType::F32 && matches!(k.dtype(), DType::BF16 | DType::F16);
    if k.dtype() != v.dtype() || (k.dtype() != q.dtype() && !half_cache) {
        bail!(
            "sdpa: dtypes differ: q {:?}, k {:?}, v {:?} (k and v must match, and match q unless q is f32 \
             and they are bf16 or f16)",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    Ok(Call {
        q,
        k,
        v,
        batch: b,
        heads: h,
        kv_heads: kh,
        q_len: l,
        kv_len: s,
        head_dim: d,
        v_head_dim: dv,
    })
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
/// the output and the weights. The last `appended` keys lie outside the
/// mask (see [`sdpa_dispatch`]).
///
/// It defines what every path computes where values are not finite: a pair
/// hidden by the mask takes no part at all (its score is `-inf` and its
/// value is not read), while visible pairs follow IEEE arithmetic as
/// PyTorch does: a NaN or `+inf` score makes the query's row NaN, and a NaN
/// or infinite value reaches every query that sees its key.
pub(crate) fn sdpa_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: Option<f64>,
    dropout: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let Call {
        batch: b,
        heads: h,
        q_len: l,
        kv_len: s,
        head_dim,
        ..
    } = check_qkv(q, k, v)?;
    let scale = check_scale(scale, head_dim)?;
    let (k, v) = &kv_in_dtype_of(q, k, v)?;
    if b * h == 0 {
        // An empty batch gives an empty output, as the tiled path does.
        let dv = v.dim(3)?;
        return Ok((
            Tensor::zeros((b, h, l, dv), v.dtype(), v.device())?,
            Tensor::zeros((b, h, l, s), v.dtype(), v.device())?,
        ));
    }
    let masked_len = s.saturating_sub(appended);
    let k = repeat_kv(k, h)?;
    let v = repeat_kv(v, h)?;
    // (B, H, L, S), in f32: f16 products overflow past 65504 and half
    // precision loses the small differences the softmax amplifies.
    let q = q.to_dtype(DType::F32)?.contiguous()?;
    let k = k.to_dtype(DType::F32)?.contiguous()?;
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    let (hidden, added) = mask.hidden_and_added((b, h, l, masked_len), appended, q.device())?;
    if let Some(cap) = mask.softcap {
        // HF's `eager_attention_forward` (Gemma 2): before the mask.
        scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
    }
    if let Some(added) = &added {
        scores = scores.broadcast_add(added)?;
    }
    let hidden = hidden.map(|m| m.broadcast_as(scores.shape())).transpose()?;
    if let Some(hidden) = &hidden {
        // Set, not added: a hidden pair's NaN score must not leak.
        let neg = Tensor::new(f32::NEG_INFINITY, q.device())?.broadcast_as(scores.shape())?;
        scores = hidden.where_cond(&neg, &scores)?;
    }
    let mut weights = masked_softmax_last_dim(&scores)?;
    if let Some(p) = dropout.filter(|&p| p > 0.) {
        weights = candle_nn::ops::dropout(&weights, p)?;
    }
    let weights = weights.to_dtype(v.dtype())?;
    // (B, H, L, Dv)
    let out = weighted_values(&weights, hidden.as_ref(), &v.contiguous()?)?;
    Ok((out, weights))
}

/// `weights · v`, where a key hidden from a query contributes nothing to
/// it even when its value is NaN or infinite (a plain product would give
/// `0 · NaN = NaN`); visible keys follow IEEE arithmetic.
///
/// # Shapes
/// - `weights`: `(B, H, L, S)`, `hidden`: `u8`, the same, `v`: `(B, H, S, Dv)`
fn weighted_values(weights: &Tensor, hidden: Option<&Tensor>, v: &Tensor) -> Result<Tensor> {
    let Some(hidden) = hidden.filter(|_| v.elem_count() > 0) else {
        return weights.matmul(v);
    };
    // `x - x` is 0 for finite x and NaN otherwise.
    let finite = v.sub(v)?.eq(0f64)?;
    let all_finite = finite.flatten_all()?.min(0)?.to_scalar::<u8>()? == 1;
    if all_finite {
        return weights.matmul(v);
    }
    let dtype = v.dtype();
    let zeros = v.zeros_like()?;
    let out = weights.matmul(&finite.where_cond(v, &zeros)?)?;
    // What the non-finite values add, counted through indicator products
    // over the visible keys: any NaN, or an infinity times a zero weight,
    // or infinities of both signs give NaN; else an infinity wins.
    let f = |t: Tensor| t.to_dtype(dtype);
    let visible = f(hidden.eq(0f64)?)?;
    let positive = (&visible * f(weights.gt(0f64)?)?)?;
    let zero = (&visible * f(weights.eq(0f64)?)?)?;
    let nan = visible.matmul(&f(v.ne(v)?)?)?.gt(0f64)?;
    let pos_inf = f(v.eq(f64::INFINITY)?)?;
    let neg_inf = f(v.eq(f64::NEG_INFINITY)?)?;
    let plus = positive.matmul(&pos_inf)?.gt(0f64)?;
    let minus = positive.matmul(&neg_inf)?.gt(0f64)?;
    let inf_times_zero = zero.matmul(&(pos_inf + neg_inf)?)?.gt(0f64)?;
    let full = |x: f64| Tensor::full(x, out.shape(), out.device())?.to_dtype(dtype);
    let out = minus.where_cond(&full(f64::NEG_INFINITY)?, &out)?;
    let out = plus.where_cond(&full(f64::INFINITY)?, &out)?;
    let nan = nan
        .broadcast_maximum(&inf_times_zero)?
        .broadcast_maximum(&plus.minimum(&minus)?)?;
    nan.where_cond(&full(f64::NAN)?, &out)
}
