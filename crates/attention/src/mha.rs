//! Multi-head attention with PyTorch's semantics: the module, and its
//! entry points, which share the same steps (heads projected, normed and
//! rotated, attention, output projection):
//! - [`MultiheadAttention::forward_attn`]: query, key and value;
//! - [`MultiheadAttention::forward_cached`]: a decoder step over a
//!   [`KvCache`](crate::KvCache);
//! - [`MultiheadAttention::project_kv`] and
//!   [`MultiheadAttention::forward_projected`]: keys and values projected
//!   once (a fixed encoder memory).
//!
//! A decoder's step, [`MultiheadAttention::forward_cached`], reads top to
//! bottom in `mha/steps.rs`, above the steps the other entry points share
//! with it. Building the module from each weight layout is
//! `mha/build.rs`'s; the layouts a PyTorch call may come in (unbatched,
//! sequence-first), `mha/batching.rs`'s.
//!
//! Port of `torch.nn.MultiheadAttention` (`torch/nn/modules/activation.py`)
//! and `F.multi_head_attention_forward` (`torch/nn/functional.py`).

mod batching;
mod build;
mod steps;

use candle::{bail, Result, Tensor};
use candle_nn::{Module, ModuleT};

use multihead_kernels::LayerNorm;
use multihead_kernels::PackedLinear;

use crate::config::MhaConfig;
use crate::options::{MhaOptions, MhaOutput, SeqLayout};
use crate::projection::InProjection;
use crate::rotary::Rotary;
use batching::Batching;

/// Multi-head attention, `torch.nn.MultiheadAttention`.
///
/// Self-attention through [`MultiheadAttention::forward`] (eval) and
/// [`ModuleT`] / [`MultiheadAttention::forward_t`] (dropout when training);
/// cross-attention, masks and attention weights through
/// [`MultiheadAttention::forward_attn`].
#[derive(Debug, Clone)]
pub struct MultiheadAttention {
    pub(crate) cfg: MhaConfig,
    pub(crate) in_proj: InProjection,
    out_proj: PackedLinear,
    /// `bias_k`, `bias_v`, each `(1, 1, E)`.
    bias_kv: Option<(Tensor, Tensor)>,
    /// `q_norm`, `k_norm` over `head_dim` (timm, Qwen3).
    qk_norm: Option<(HeadNorm, HeadNorm)>,
    /// Rotary embedding of q and k, when the config asks for one.
    pub(crate) rotary: Option<Rotary>,
}

impl MultiheadAttention {
    /// This attention with its output times `gamma` `(embed_dim)` (timm's
    /// `LayerScale` after it) folded into the output projection's weights
    /// ([`PackedLinear::scaled_outputs`]), so that
    /// [`MhaOptions::with_residual`] can still fuse the residual add after
    /// it. `None` where the projection is not packed or `gamma` trains.
    pub fn with_output_scale(&self, gamma: &Tensor) -> Result<Option<Self>> {
        Ok(self.out_proj.scaled_outputs(gamma)?.map(|out_proj| Self {
            out_proj,
            ..self.clone()
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }

    /// The general call: query, key and value, with masks and options.
    ///
    /// # Shapes
    /// Batch-first (default):
    /// - `query`: `(batch, q_len, embed_dim)`
    /// - `key`: `(batch, kv_len, kdim)`
    /// - `value`: `(batch, kv_len, vdim)`
    /// - output: `(batch, q_len, embed_dim)`
    ///
    /// With [`SeqLayout::SeqFirst`] the first two dims of all of these swap.
    /// 2-D inputs are unbatched: `(q_len, embed_dim)`, `(kv_len, kdim)`,
    /// `(kv_len, vdim)` → `(q_len, embed_dim)`.
    ///
    /// Passing the same tensor as query, key and value is self-attention
    /// and projects with one fused matmul. With rotary embeddings
    /// configured, queries and keys sit at positions `0..`; the config's
    /// sliding window and ALiBi join `opts.mask`.
    pub fn forward_attn(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        let unbatched = match (query.rank(), key.rank(), value.rank()) {
            (3, 3, 3) => false,
            (2, 2, 2) => true,
            (q, k, v) => bail!(
                "MultiheadAttention: query, key and value must all be 3-D (batched) or all 2-D (unbatched), \
                 found ranks {q}, {k}, {v}"
            ),
        };
        let call = Batching::new(unbatched, opts.layout);
        let self_attn = query.id() == key.id() && key.id() == value.id();
        let query = call.input(query)?;
        let (key, value) = if self_attn {
            (query.clone(), query.clone())
        } else {
            (call.input(key)?, call.input(value)?)
        };
        let opts = &call.options(opts)?;
        let cfg = &self.cfg;
        let (b, l) = self.check_query(&query)?;
        let (kb, s, ke) = key.dims3()?;
        let (vb, vs, ve) = value.dims3()?;
        if ke != cfg.kdim() {
            bail!(
                "MultiheadAttention: key has {ke} features, expected kdim {}",
                cfg.kdim()
            )
        }
        if ve != cfg.vdim() {
            bail!(
                "MultiheadAttention: value has {ve} features, expected vdim {}",
                cfg.vdim()
            )
        }
        if kb != b || vb != b {
            bail!("MultiheadAttention: batch sizes differ: query {b}, key {kb}, value {vb}")
        }
        if vs != s {
            bail!("MultiheadAttention: key has {s} positions but value has {vs}")
        }
        if s == 0 {
            bail!("MultiheadAttention: key and value are empty sequences (kv_len 0)")
        }
        let mask = self.mask_for(&opts.mask, b, l, s)?;
        // (B, H, L, hd), (B, Hkv, S, hd), (B, Hkv, S, hd)
        let (q, mut k, mut v, mut packed) = match &self.bias_kv {
            None => self.project_heads(&query, &key, &value)?,
            Some((bk, bv)) => {
                // `bias_k`, `bias_v` join the keys and values before the
                // heads split: (B, S + 1, E).
                let (q, k, v) = self.in_proj.forward(&query, &key, &value)?;
                let e = cfg.embed_dim;
                let k = Tensor::cat(&[&k, &bk.broadcast_as((b, 1, e))?], 1)?;
                let v = Tensor::cat(&[&v, &bv.broadcast_as((b, 1, e))?], 1)?;
                let (h, kvh) = (cfg.num_heads, cfg.kv_heads());
                let (q, k) = (self.split_heads(&q, h)?, self.split_heads(&k, kvh)?);
                (
                    self.norm_q(&q)?,
                    self.norm_k(&k)?,
                    self.split_heads(&v, kvh)?,
                    None,
                )
            }
        };
        let mut q = q;
        if let Some(rotary) = &self.rotary {
            packed = None;
            // Positions 0.. for the queries and for the keys.
            if l == s {
                (q, k) = rotary.apply_qk(&q, &k, &positions(b, 0, l, q.device())?)?;
            } else {
                q = rotary.apply(&q, &positions(b, 0, l, q.device())?)?;
                k = rotary.apply(&k, &positions(b, 0, s, k.device())?)?;
            }
        }
        let mut extra_keys = usize::from(self.bias_kv.is_some());
        if cfg.add_zero_attn {
            let zeros = Tensor::zeros((b, cfg.num_heads, 1, cfg.head_dim()), k.dtype(), k.device())?;
            k = Tensor::cat(&[&k, &zeros], 2)?;
            v = Tensor::cat(&[&v, &zeros], 2)?;
            extra_keys += 1;
            packed = None;
        }
        // The appended keys are visible to every query (PyTorch pads its
        // masks with zeros): the mask covers the keys before them.
        call.output(self.attend(&q, &k, &v, packed.as_ref(), &mask, extra_keys, opts)?)
    }

    /// Self-attention in eval mode: `(batch, seq, embed_dim)` → same.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_t(xs, false)
    }

    /// Self-attention, with dropout on the attention weights when `train`:
    /// `(batch, seq, embed_dim)` → same. The [`ModuleT`] implementation.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let opts = MhaOptions::new().with_train(train);
        Ok(self.forward_attn(xs, xs, xs, &opts)?.output)
    }

    /// Projects keys and values and splits them into heads, for reuse across
    /// calls: cross-attention over a fixed encoder memory, or a decoder's
    /// self-attention cache (append along dim 2).
    ///
    /// # Shapes
    /// - `key`: `(batch, kv_len, kdim)`, `value`: `(batch, kv_len, vdim)`
    /// - returns `k`, `v`: `(batch, num_kv_heads, kv_len, head_dim)` each,
    ///   contiguous (after qk-norm on `k` when configured)
    ///
    /// No position encoding is applied: with rotary embeddings configured,
    /// use [`MultiheadAttention::forward_cached`], which places each key.
    pub fn project_kv(&self, key: &Tensor, value: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check_no_extra_keys("project_kv")?;
        if self.rotary.is_some() {
            bail!(
                "MultiheadAttention::project_kv: rotary embeddings need each key's position; \
                 use forward_cached with a KvCache"
            )
        }
        if key.rank() != 3 || value.rank() != 3 {
            bail!(
                "MultiheadAttention::project_kv: key and value must be 3-D (batch, kv_len, features), found {:?} and {:?}",
                key.dims(),
                value.dims()
            )
        }
        let (kb, s, ke) = key.dims3()?;
        let (vb, vs, ve) = value.dims3()?;
        if (ke, ve) != (self.cfg.kdim(), self.cfg.vdim()) {
            bail!(
                "MultiheadAttention::project_kv: key/value have {ke}/{ve} features, expected kdim {} / vdim {}",
                self.cfg.kdim(),
                self.cfg.vdim()
            )
        }
        if (kb, s) != (vb, vs) {
            bail!(
                "MultiheadAttention::project_kv: key is {:?} but value is {:?}",
                key.dims(),
                value.dims()
            )
        }
        let (k, v) = self.in_proj.forward_kv(key, value)?;
        let kvh = self.cfg.kv_heads();
        // Contiguous, so that caches which copy in place (candle-nn's
        // `KvCache`, `slice_set`) take them as they are.
        Ok((
            self.norm_k(&self.split_heads(&k, kvh)?)?.contiguous()?,
            self.split_heads(&v, kvh)?.contiguous()?,
        ))
    }

    /// Attention of `query` over keys and values already projected by
    /// [`MultiheadAttention::project_kv`], batch-first.
    ///
    /// # Shapes
    /// - `query`: `(batch, q_len, embed_dim)`, or unbatched `(q_len, embed_dim)`
    /// - `k`, `v`: `(batch, num_kv_heads, kv_len, head_dim)`, or unbatched
    ///   `(num_kv_heads, kv_len, head_dim)`
    /// - output: the query's shape; weights as `opts.need_weights` says.
    ///
    /// `opts.layout` must be batch-first. For a decoder step over a cache
    /// holding earlier positions, use [`MultiheadAttention::forward_cached`],
    /// or pass `Mask::causal(Causal::BottomRight)`.
    pub fn forward_projected(
        &self,
        query: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        self.check_no_extra_keys("forward_projected")?;
        if self.rotary.is_some() {
            bail!(
                "MultiheadAttention::forward_projected: rotary embeddings need each query's position; \
                 use forward_cached with a KvCache"
            )
        }
        if opts.layout != SeqLayout::BatchFirst {
            bail!(
                "MultiheadAttention::forward_projected: takes batch-first inputs only, found {:?}",
                opts.layout
            )
        }
        let unbatched = match (query.rank(), k.rank(), v.rank()) {
            (3, 4, 4) => false,
            (2, 3, 3) => true,
            _ => bail!(
                "MultiheadAttention::forward_projected: expected query (batch, q_len, embed_dim) with k, v \
                 (batch, kv_heads, kv_len, head_dim), or all unbatched; found query {:?}, k {:?}, v {:?}",
                query.dims(),
                k.dims(),
                v.dims()
            ),
        };
        let call = Batching::new(unbatched, SeqLayout::BatchFirst);
        let (query, k, v) = (call.input(query)?, call.input(k)?, call.input(v)?);
        let opts = &call.options(opts)?;
        let (b, l) = self.check_query(&query)?;
        let expected = (b, self.cfg.kv_heads(), self.cfg.head_dim());
        for (name, t) in [("k", &k), ("v", &v)] {
            let (tb, th, _, thd) = t.dims4()?;
            if (tb, th, thd) != expected {
                bail!(
                    "MultiheadAttention::forward_projected: {name} is {:?}, expected (batch, kv_heads, kv_len, head_dim) with {expected:?}",
                    t.dims()
                )
            }
        }
        if k.dim(2)? != v.dim(2)? || k.dim(2)? == 0 {
            bail!(
                "MultiheadAttention::forward_projected: k has {} positions and v {} (equal and > 0 needed)",
                k.dim(2)?,
                v.dim(2)?
            )
        }
        let mask = self.mask_for(&opts.mask, b, l, k.dim(2)?)?;
        let q = self.in_proj.forward_q(&query)?;
        let q = self.norm_q(&self.split_heads(&q, self.cfg.num_heads)?)?;
        call.output(self.attend(&q, &k, &v, None, &mask, 0, opts)?)
    }
}

/// qk-norm over the features of a head.
#[derive(Debug, Clone)]
pub(crate) enum HeadNorm {
    Layer(LayerNorm),
    Rms(multihead_kernels::RmsNorm),
    /// Over all heads of a token at once ([`crate::NormKind::RmsNormAllHeads`]).
    RmsAllHeads(multihead_kernels::RmsNorm),
}

impl Module for HeadNorm {
    /// `(B, H, T, hd)` heads, normalised.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            HeadNorm::Layer(n) => n.forward(xs),
            HeadNorm::Rms(n) => n.forward(xs),
            HeadNorm::RmsAllHeads(n) => {
                let (b, h, t, hd) = xs.dims4()?;
                let tokens = xs.transpose(1, 2)?.reshape((b, t, h * hd))?;
                n.forward(&tokens)?
                    .reshape((b, t, h, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            }
        }
    }
}

/// `(batch, len)` `u32` positions `start..start + len` in every row.
pub(crate) fn positions(batch: usize, start: usize, len: usize, device: &candle::Device) -> Result<Tensor> {
    Tensor::arange(start as u32, (start + len) as u32, device)?
        .unsqueeze(0)?
        .repeat((batch, 1))
}

/// `ModuleT`, not `Module`: candle implements `ModuleT` for every `Module`
/// by ignoring `train`, so a generic trainer calling `forward_t(x, true)`
/// would silently get no attention dropout. [`MultiheadAttention::forward`]
/// is the eval-mode call.
impl ModuleT for MultiheadAttention {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        MultiheadAttention::forward_t(self, xs, train)
    }
}
