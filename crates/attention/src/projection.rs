//! The input projection of a [`crate::MultiheadAttention`], fused or
//! separate, and PyTorch's initialisation of its linears.

use candle::{IndexOp, Module, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::linear::PackedLinear;

#[derive(Debug, Clone)]
pub(crate) enum InProjection {
    /// `(3E, E)` weight and `(3E)` bias, one layer so that a trained
    /// variable stays one tensor and self-attention projects in one call.
    Fused(PackedLinear),
    Separate {
        q: PackedLinear,
        k: PackedLinear,
        v: PackedLinear,
    },
}

impl InProjection {
    /// Projects query, key and value; `(B, L, E)`, `(B, S, E)`, `(B, S, E)`.
    pub(crate) fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        e: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            InProjection::Fused(qkv) => {
                if q.id() == k.id() && k.id() == v.id() {
                    // Self-attention: one matmul, as PyTorch does when
                    // `query is key is value`.
                    let qkv = qkv.forward(q)?;
                    Ok((
                        qkv.narrow(D::Minus1, 0, e)?,
                        qkv.narrow(D::Minus1, e, e)?,
                        qkv.narrow(D::Minus1, 2 * e, e)?,
                    ))
                } else {
                    Ok((
                        qkv.forward_features(q, 0, e)?,
                        qkv.forward_features(k, e, 2 * e)?,
                        qkv.forward_features(v, 2 * e, 3 * e)?,
                    ))
                }
            }
            InProjection::Separate { q: pq, k: pk, v: pv } => {
                Ok((pq.forward(q)?, pk.forward(k)?, pv.forward(v)?))
            }
        }
    }

    /// For self-attention through the fused weight: one matmul, then q, k
    /// and v as `(B, H, T, hd)` views of its output, without copies.
    /// `None` when the inputs differ or the weights are separate.
    pub(crate) fn self_attention_heads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        h: usize,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let InProjection::Fused(fused) = self else {
            return Ok(None);
        };
        if q.id() != k.id() || k.id() != v.id() {
            return Ok(None);
        }
        let (b, t, e) = q.dims3()?;
        // (B, T, 3, H, hd)
        let qkv = fused.forward(q)?.reshape((b, t, 3, h, e / h))?;
        let head = |i: usize| qkv.i((.., .., i))?.transpose(1, 2);
        Ok(Some((head(0)?, head(1)?, head(2)?)))
    }

    pub(crate) fn forward_q(&self, q: &Tensor, e: usize) -> Result<Tensor> {
        match self {
            InProjection::Fused(qkv) => qkv.forward_features(q, 0, e),
            InProjection::Separate { q: pq, .. } => pq.forward(q),
        }
    }

    pub(crate) fn forward_kv(&self, k: &Tensor, v: &Tensor, e: usize) -> Result<(Tensor, Tensor)> {
        match self {
            InProjection::Fused(qkv) => Ok((
                qkv.forward_features(k, e, 2 * e)?,
                qkv.forward_features(v, 2 * e, 3 * e)?,
            )),
            InProjection::Separate { k: pk, v: pv, .. } => Ok((pk.forward(k)?, pv.forward(v)?)),
        }
    }
}

/// `bound = sqrt(6 / (fan_in + fan_out))`: PyTorch's `xavier_uniform_`.
pub(crate) fn xavier_uniform(fan_out: usize, fan_in: usize) -> Init {
    let bound = (6. / (fan_in + fan_out) as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// A linear layer `<name>.weight (out, in)`, `<name>.bias (out)`.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    init: Init,
    vb: VarBuilder,
) -> Result<PackedLinear> {
    let w = vb.get_with_hints((out_dim, in_dim), "weight", init)?;
    let b = bias
        .then(|| vb.get_with_hints(out_dim, "bias", Init::Const(0.)))
        .transpose()?;
    PackedLinear::new(w, b)
}
