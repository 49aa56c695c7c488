//! Hydra attention (Bolya et al., 2022, "Hydra Attention: Efficient
//! Attention with Many Heads", <https://arxiv.org/abs/2209.07484>).
//!
//! With as many heads as features and the cosine-similarity kernel
//! `sim(q, k) = φ(q)·φ(k)`, `φ(x) = x / ‖x‖₂`, the order of the products can
//! be swapped (the paper's eq. 11):
//!
//! ```text
//! out_i = φ(Q)_i ⊙ Σ_{t allowed for i} φ(K)_t ⊙ V_t
//! ```
//!
//! which costs O(N·D) time and memory instead of softmax attention's
//! O(N²·D). The paper's code is four lines of PyTorch:
//! `q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(...)`,
//! `kv = (k * v).sum(dim=-2, keepdim=True)`, `out = q * kv`.

use candle::{bail, DType, Result, Tensor, D};
use candle_nn::{Init, Linear, Module, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::layout::WeightLayout;
use crate::mask::{KeyPaddingMask, Mask};

/// Smallest norm `φ` divides by, as `F.normalize(eps=1e-12)`: a zero
/// vector maps to zero instead of NaN.
const NORM_EPS: f64 = 1e-12;

/// Positions per block of the blocked running sum (see [`running_sum`]).
const CUMSUM_BLOCK: usize = 64;

/// The configuration of a [`HydraAttention`]: timm `Attention`'s projection
/// options; there is no head count (there are `embed_dim` heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HydraConfig {
    /// Model width `E`.
    pub embed_dim: usize,
    /// Whether the fused `qkv` projection has a bias.
    #[serde(default = "default_true")]
    pub qkv_bias: bool,
    /// Whether the output projection `proj` has a bias.
    #[serde(default = "default_true")]
    pub proj_bias: bool,
}

fn default_true() -> bool {
    true
}

impl HydraConfig {
    /// Width `embed_dim`, both projections with biases (timm's default).
    pub fn new(embed_dim: usize) -> Self {
        Self {
            embed_dim,
            qkv_bias: true,
            proj_bias: true,
        }
    }

    /// Checks every value, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        if self.embed_dim == 0 {
            bail!("HydraConfig: embed_dim must be > 0")
        }
        Ok(())
    }
}

/// `φ(x) = x / max(‖x‖₂, eps)` over the last dim.
fn unit_norm(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(NORM_EPS)?;
    x.broadcast_div(&norm)
}

/// Inclusive running sum over dim 1 of `(B, S, D)`, in blocks: a
/// triangular matmul inside each block of [`CUMSUM_BLOCK`] positions, plus
/// the totals of the blocks before. candle's `cumsum` multiplies by an
/// `S x S` triangle, which would make the causal variant O(N²) again; this
/// is O(N·block·D) and built from differentiable ops.
fn running_sum(x: &Tensor) -> Result<Tensor> {
    let (b, s, d) = x.dims3()?;
    let c = CUMSUM_BLOCK.min(s.max(1));
    let n_blocks = s.div_ceil(c);
    let padded = if n_blocks * c > s {
        let zeros = Tensor::zeros((b, n_blocks * c - s, d), x.dtype(), x.device())?;
        Tensor::cat(&[x, &zeros], 1)?
    } else {
        x.clone()
    };
    // (B, nb, c, D)
    let blocks = padded.reshape((b, n_blocks, c, d))?;
    // tril[i, j] = 1 iff j <= i.
    let tril = Tensor::tril2(c, x.dtype(), x.device())?;
    let within = tril.broadcast_matmul(&blocks)?;
    // (B, nb, D): the sum of every block strictly before each block.
    let totals = within.narrow(2, c - 1, 1)?.squeeze(2)?;
    let before = (totals.cumsum(1)? - &totals)?;
    let out = within.broadcast_add(&before.unsqueeze(2)?)?;
    out.reshape((b, n_blocks * c, d))?.narrow(1, 0, s)
}

/// Hydra attention on projected queries, keys and values.
///
/// `out_i = φ(q_i) ⊙ Σ_t φ(k_t) ⊙ v_t`, the sum over the keys query `i`
/// may see: all of them, those not marked by the key padding mask, and
/// with a causal rule those with `t <= i + offset` (a running sum).
/// A query that sees no key returns zeros.
///
/// Accepted mask parts: `causal` (any [`crate::Causal`]), `key_padding`
/// ([`KeyPaddingMask::PadWhereTrue`], or [`KeyPaddingMask::Additive`] whose
/// entries are `0` or `-inf`). A per-pair `attn` mask is refused: it has no
/// O(N·D) form. f16/bf16 inputs are computed in f32.
///
/// # Shapes
/// - `q`: `(batch, q_len, dim)`
/// - `k`, `v`: `(batch, kv_len, dim)`
/// - returns `(batch, q_len, dim)`
pub fn hydra_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> Result<Tensor> {
    let (b, l, d) = q.dims3()?;
    let (kb, s, kd) = k.dims3()?;
    if (kb, kd) != (b, d) || v.dims() != k.dims() {
        bail!(
            "hydra_attention: expected k and v of shape (batch, kv_len, dim) = ({b}, _, {d}), found {:?} and {:?}",
            k.dims(),
            v.dims()
        )
    }
    if mask.attn.is_some() {
        bail!("hydra_attention: a per-pair attn mask has no linear-time form; use causal or key_padding")
    }
    let dtype = q.dtype();
    let up = |t: &Tensor| -> Result<Tensor> {
        match dtype {
            DType::F16 | DType::BF16 => t.to_dtype(DType::F32),
            _ => Ok(t.clone()),
        }
    };
    let (q, k, v) = (unit_norm(&up(q)?)?, unit_norm(&up(k)?)?, up(v)?);
    // (B, S, D)
    let mut kv = (k * v)?;
    if let Some(kp) = &mask.key_padding {
        kv = kv.broadcast_mul(&keep_weights(kp, b, s, kv.dtype())?.unsqueeze(2)?)?;
    }
    let out = match mask.causal {
        None => q.broadcast_mul(&kv.sum_keepdim(1)?)?,
        Some(causal) => {
            // Row r of `prefix` is the sum of the first r keys, r in 0..=S;
            // query i sees the first clamp(i + offset + 1, 0, S) keys.
            let zero = Tensor::zeros((b, 1, d), kv.dtype(), kv.device())?;
            let prefix = Tensor::cat(&[&zero, &running_sum(&kv)?], 1)?;
            let offset = causal.offset(l, s);
            let rows: Vec<u32> = (0..l)
                .map(|i| (i as isize + offset + 1).clamp(0, s as isize) as u32)
                .collect();
            let rows = Tensor::from_vec(rows, l, q.device())?;
            (q * prefix.index_select(&rows, 1)?)?
        }
    };
    out.to_dtype(dtype)
}

/// `(B, S)` weights, `1` for a key that counts and `0` for a padding key.
fn keep_weights(kp: &KeyPaddingMask, b: usize, s: usize, dtype: DType) -> Result<Tensor> {
    let (t, what) = match kp {
        KeyPaddingMask::PadWhereTrue(t) => (t, "PadWhereTrue"),
        KeyPaddingMask::Additive(t) => (t, "Additive"),
    };
    if t.dims() != [b, s] {
        bail!(
            "hydra_attention: key_padding_mask ({what}): expected shape (batch, kv_len) = ({b}, {s}), found {:?}",
            t.dims()
        )
    }
    match kp {
        KeyPaddingMask::PadWhereTrue(t) => {
            if !t.dtype().is_int() {
                bail!(
                    "hydra_attention: key_padding_mask (PadWhereTrue) must be an integer tensor, found {:?}",
                    t.dtype()
                )
            }
            t.eq(0u32)?.to_dtype(dtype)
        }
        KeyPaddingMask::Additive(t) => {
            let t = t.to_dtype(DType::F32)?;
            let values: Vec<f32> = t.flatten_all()?.to_vec1()?;
            // Hydra has no scores to add a bias to; only "keep" (0) and
            // "remove" (-inf) have a meaning.
            if let Some(x) = values.iter().find(|x| **x != 0. && **x != f32::NEG_INFINITY) {
                bail!("hydra_attention: an Additive key_padding_mask may hold only 0 and -inf, found {x}")
            }
            t.eq(0f32)?.to_dtype(dtype)
        }
    }
}

/// Hydra attention with timm `Attention`'s projections: a fused `qkv`
/// linear `(3E, E)` and an output `proj` `(E, E)`, so any ViT block can
/// switch between softmax and Hydra attention on the same checkpoint
/// layout. Port of the paper's Algorithm 1 inside timm's
/// `timm.models.vision_transformer.Attention`.
#[derive(Debug, Clone)]
pub struct HydraAttention {
    cfg: HydraConfig,
    qkv: Linear,
    proj: Linear,
}

impl HydraAttention {
    /// Loads (or, from a `VarMap`, initialises) `qkv` and `proj` under `vb`.
    pub fn new(cfg: &HydraConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with_layout(cfg, &WeightLayout::timm(), vb)
    }

    /// Loads the projections by the names of a [`WeightLayout::FusedQkv`];
    /// other layouts are refused (Hydra blocks exist only in timm models).
    pub fn new_with_layout(cfg: &HydraConfig, layout: &WeightLayout, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let WeightLayout::FusedQkv { qkv, proj } = layout else {
            bail!("HydraAttention: only the fused qkv layout is supported, found {layout:?}")
        };
        let e = cfg.embed_dim;
        let bound = (6. / (4 * e) as f64).sqrt();
        let xavier = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let out_bound = 1. / (e as f64).sqrt();
        let out_init = Init::Uniform {
            lo: -out_bound,
            up: out_bound,
        };
        let linear = |out_dim: usize, bias: bool, init: Init, vb: VarBuilder| -> Result<Linear> {
            let w = vb.get_with_hints((out_dim, e), "weight", init)?;
            let b = bias
                .then(|| vb.get_with_hints(out_dim, "bias", Init::Const(0.)))
                .transpose()?;
            Ok(Linear::new(w, b))
        };
        Ok(Self {
            cfg: cfg.clone(),
            qkv: linear(3 * e, cfg.qkv_bias, xavier, vb.pp(qkv))?,
            proj: linear(e, cfg.proj_bias, out_init, vb.pp(proj))?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &HydraConfig {
        &self.cfg
    }

    /// Self-attention with a mask (see [`hydra_attention`] for the parts
    /// it accepts).
    ///
    /// # Shapes
    /// - `xs`: `(batch, seq, embed_dim)`; returns the same
    pub fn forward_masked(&self, xs: &Tensor, mask: &Mask) -> Result<Tensor> {
        let (_, _, e) = xs.dims3()?;
        if e != self.cfg.embed_dim {
            bail!(
                "HydraAttention: input has {e} features, expected embed_dim {}",
                self.cfg.embed_dim
            )
        }
        // (B, N, 3E)
        let qkv = self.qkv.forward(xs)?;
        let q = qkv.narrow(D::Minus1, 0, e)?;
        let k = qkv.narrow(D::Minus1, e, e)?;
        let v = qkv.narrow(D::Minus1, 2 * e, e)?;
        self.proj.forward(&hydra_attention(&q, &k, &v, mask)?)
    }
}

impl Module for HydraAttention {
    /// Unmasked self-attention: `(batch, seq, embed_dim)` → same.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_masked(xs, &Mask::new())
    }
}
