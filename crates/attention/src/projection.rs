//! The input projection of a [`crate::MultiheadAttention`], fused or
//! separate, and PyTorch's initialisation of its linears.

use candle::{IndexOp, Result, Tensor, D};
use candle_nn::{Init, Linear, Module, VarBuilder};

#[derive(Debug, Clone)]
pub(crate) enum InProjection {
    /// `(3E, E)` weight and `(3E)` bias, split at forward time so that a
    /// trained variable stays one tensor.
    Fused {
        weight: Tensor,
        bias: Option<Tensor>,
    },
    Separate {
        q: Linear,
        k: Linear,
        v: Linear,
    },
}

impl InProjection {
    fn fused_part(weight: &Tensor, bias: &Option<Tensor>, i: usize, e: usize) -> Result<Linear> {
        let w = weight.narrow(0, i * e, e)?;
        let b = bias.as_ref().map(|b| b.narrow(0, i * e, e)).transpose()?;
        Ok(Linear::new(w, b))
    }

    /// Projects query, key and value; `(B, L, E)`, `(B, S, E)`, `(B, S, E)`.
    pub(crate) fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        e: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            InProjection::Fused { weight, bias } => {
                if q.id() == k.id() && k.id() == v.id() {
                    // Self-attention: one matmul, as PyTorch does when
                    // `query is key is value`.
                    let qkv = forward(&Linear::new(weight.clone(), bias.clone()), q)?;
                    Ok((
                        qkv.narrow(D::Minus1, 0, e)?,
                        qkv.narrow(D::Minus1, e, e)?,
                        qkv.narrow(D::Minus1, 2 * e, e)?,
                    ))
                } else {
                    Ok((
                        forward(&Self::fused_part(weight, bias, 0, e)?, q)?,
                        forward(&Self::fused_part(weight, bias, 1, e)?, k)?,
                        forward(&Self::fused_part(weight, bias, 2, e)?, v)?,
                    ))
                }
            }
            InProjection::Separate { q: pq, k: pk, v: pv } => {
                Ok((forward(pq, q)?, forward(pk, k)?, forward(pv, v)?))
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
        let InProjection::Fused { weight, bias } = self else {
            return Ok(None);
        };
        if q.id() != k.id() || k.id() != v.id() {
            return Ok(None);
        }
        let (b, t, e) = q.dims3()?;
        // (B, T, 3, H, hd)
        let qkv = forward(&Linear::new(weight.clone(), bias.clone()), q)?.reshape((b, t, 3, h, e / h))?;
        let head = |i: usize| qkv.i((.., .., i))?.transpose(1, 2);
        Ok(Some((head(0)?, head(1)?, head(2)?)))
    }

    pub(crate) fn forward_q(&self, q: &Tensor, e: usize) -> Result<Tensor> {
        match self {
            InProjection::Fused { weight, bias } => forward(&Self::fused_part(weight, bias, 0, e)?, q),
            InProjection::Separate { q: pq, .. } => forward(pq, q),
        }
    }

    pub(crate) fn forward_kv(&self, k: &Tensor, v: &Tensor, e: usize) -> Result<(Tensor, Tensor)> {
        match self {
            InProjection::Fused { weight, bias } => Ok((
                forward(&Self::fused_part(weight, bias, 1, e)?, k)?,
                forward(&Self::fused_part(weight, bias, 2, e)?, v)?,
            )),
            InProjection::Separate { k: pk, v: pv, .. } => Ok((forward(pk, k)?, forward(pv, v)?)),
        }
    }
}

/// `lin.forward(x)`, through the CPU kernel's packed products where they
/// serve (`cpu_kernel::linear`).
pub(crate) fn forward(lin: &Linear, x: &Tensor) -> Result<Tensor> {
    match crate::cpu_kernel::linear(x, lin.weight(), lin.bias())? {
        Some(y) => Ok(y),
        None => lin.forward(x),
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
) -> Result<Linear> {
    let w = vb.get_with_hints((out_dim, in_dim), "weight", init)?;
    let b = bias
        .then(|| vb.get_with_hints(out_dim, "bias", Init::Const(0.)))
        .transpose()?;
    Ok(Linear::new(w, b))
}
