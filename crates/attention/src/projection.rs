//! The input projection of a [`crate::MultiheadAttention`], fused or
//! separate, and PyTorch's initialisation of its linears.

use candle::{Module, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use multihead_kernels::{PackOptions, PackedLinear};

/// The input projection with its output widths: `q_dim` (`embed_dim`)
/// for queries, `kv_dim` (`num_kv_heads * head_dim`) for keys and values.
#[derive(Debug, Clone)]
pub(crate) struct InProjection {
    pub(crate) kind: InKind,
    pub(crate) q_dim: usize,
    pub(crate) kv_dim: usize,
}

#[derive(Debug, Clone)]
pub(crate) enum InKind {
    /// `(q_dim + 2 kv_dim, E)` weight and bias, one layer so that a trained
    /// variable stays one tensor and self-attention projects in one call.
    Fused(PackedLinear),
    Separate {
        q: PackedLinear,
        k: PackedLinear,
        v: PackedLinear,
    },
}

impl InProjection {
    /// Projects query, key and value; `(B, L, q_dim)`, `(B, S, kv_dim)`,
    /// `(B, S, kv_dim)`.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (e, kvd) = (self.q_dim, self.kv_dim);
        match &self.kind {
            InKind::Fused(qkv) => {
                if q.id() == k.id() && k.id() == v.id() {
                    // Self-attention: one matmul, as PyTorch does when
                    // `query is key is value`.
                    let qkv = qkv.forward(q)?;
                    Ok((
                        qkv.narrow(D::Minus1, 0, e)?,
                        qkv.narrow(D::Minus1, e, kvd)?,
                        qkv.narrow(D::Minus1, e + kvd, kvd)?,
                    ))
                } else {
                    let (k, v) = self.forward_kv(k, v)?;
                    Ok((qkv.forward_features(q, 0, e)?, k, v))
                }
            }
            InKind::Separate { q: pq, k: pk, v: pv } => Ok((pq.forward(q)?, pk.forward(k)?, pv.forward(v)?)),
        }
    }

    pub(crate) fn forward_q(&self, q: &Tensor) -> Result<Tensor> {
        match &self.kind {
            InKind::Fused(qkv) => qkv.forward_features(q, 0, self.q_dim),
            InKind::Separate { q: pq, .. } => pq.forward(q),
        }
    }

    pub(crate) fn forward_kv(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (e, kvd) = (self.q_dim, self.kv_dim);
        match &self.kind {
            // Keys and values of one tensor (cross-attention over a
            // memory): one call over both parts of the weight.
            InKind::Fused(qkv) if k.id() == v.id() => {
                let kv = qkv.forward_features(k, e, e + 2 * kvd)?;
                Ok((kv.narrow(D::Minus1, 0, kvd)?, kv.narrow(D::Minus1, kvd, kvd)?))
            }
            InKind::Fused(qkv) => Ok((
                qkv.forward_features(k, e, e + kvd)?,
                qkv.forward_features(v, e + kvd, e + 2 * kvd)?,
            )),
            InKind::Separate { k: pk, v: pv, .. } => Ok((pk.forward(k)?, pv.forward(v)?)),
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

/// How a checkpoint stores a linear layer's weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    /// `nn.Linear`: `(out, in)`.
    OutIn,
    /// GPT-2's `Conv1D`: `(in, out)`, transposed once on loading.
    InOut,
}

/// A linear layer `<name>.weight` (stored as `stored` says), `<name>.bias
/// (out)`, packed as `pack` asks.
pub(crate) fn linear(
    (in_dim, out_dim): (usize, usize),
    bias: bool,
    init: Init,
    stored: Stored,
    pack: &PackOptions,
    vb: VarBuilder,
) -> Result<PackedLinear> {
    let shape = match stored {
        Stored::OutIn => (out_dim, in_dim),
        Stored::InOut => (in_dim, out_dim),
    };
    let w = vb.get_with_hints(shape, "weight", init)?;
    let b = bias
        .then(|| vb.get_with_hints(out_dim, "bias", Init::Const(0.)))
        .transpose()?;
    match stored {
        Stored::OutIn => PackedLinear::with_options(w, b, pack),
        Stored::InOut => PackedLinear::from_in_out_with(w, b, pack),
    }
}
