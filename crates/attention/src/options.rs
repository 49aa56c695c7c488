//! The options and outputs of a [`crate::MultiheadAttention`] call.

use candle::{Result, Tensor};

use crate::mask::Mask;
use crate::sdpa::AttnPath;

/// Which attention weights a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NeedWeights {
    /// None (PyTorch `need_weights=False`); lets the fast paths serve.
    #[default]
    No,
    /// Averaged over heads, `(batch, q_len, kv_len)` (PyTorch
    /// `need_weights=True`, `average_attn_weights=True`).
    Averaged,
    /// Per head, `(batch, heads, q_len, kv_len)` (PyTorch
    /// `average_attn_weights=False`).
    PerHead,
}

/// Whether 3-D inputs are `(batch, seq, feature)` or PyTorch's default
/// `(seq, batch, feature)`. 2-D inputs are always unbatched `(seq, feature)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SeqLayout {
    /// `(batch, seq, feature)` (PyTorch `batch_first=True`).
    #[default]
    BatchFirst,
    /// `(seq, batch, feature)` (PyTorch's default, `batch_first=False`).
    SeqFirst,
}

/// Options of one [`crate::MultiheadAttention::forward_attn`] call.
#[derive(Debug, Clone, Default)]
pub struct MhaOptions {
    /// Masks; shapes are those of the batch-first problem (see [`Mask`]).
    /// For unbatched input, a key padding mask may be 1-D `(kv_len)`.
    pub mask: Mask,
    /// Which attention weights to return.
    pub need_weights: NeedWeights,
    /// Layout of 3-D inputs and outputs.
    pub layout: SeqLayout,
    /// Training mode: dropout on the attention weights is applied only here.
    pub train: bool,
    /// Which attention implementation to use (default: the fastest that
    /// can serve the call).
    pub path: AttnPath,
    /// Added to the output, a residual block's `x + attn(x)`: shaped as the
    /// output. Where the output projection is packed, its tiles start from
    /// it ([`crate::PackedLinear::forward_add`]).
    pub residual: Option<Tensor>,
}

impl MhaOptions {
    /// Default options: no mask, no weights, batch-first, eval.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the mask.
    pub fn with_mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }

    /// Sets which weights to return.
    pub fn with_weights(mut self, need_weights: NeedWeights) -> Self {
        self.need_weights = need_weights;
        self
    }

    /// Sets the input layout.
    pub fn with_layout(mut self, layout: SeqLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Forces an attention implementation.
    pub fn with_path(mut self, path: AttnPath) -> Self {
        self.path = path;
        self
    }

    /// Sets training mode.
    pub fn with_train(mut self, train: bool) -> Self {
        self.train = train;
        self
    }

    /// Sets a tensor to add to the output (see [`MhaOptions::residual`]).
    pub fn with_residual(mut self, residual: Tensor) -> Self {
        self.residual = Some(residual);
        self
    }

    /// These options with the residual passed through `f` (into the
    /// batch-first layout the projections see).
    pub(crate) fn map_residual(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            residual: self.residual.as_ref().map(f).transpose()?,
            ..self.clone()
        })
    }
}

/// What [`crate::MultiheadAttention::forward_attn`] returns.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// Attention output, in the query's layout: `(batch, q_len, embed_dim)`,
    /// `(q_len, batch, embed_dim)` or unbatched `(q_len, embed_dim)`.
    pub output: Tensor,
    /// Attention weights as asked by [`NeedWeights`]:
    /// `(batch, q_len, kv_len)` or `(batch, heads, q_len, kv_len)`, without
    /// the batch dim for unbatched input. `kv_len` includes keys added by
    /// `add_bias_kv` and `add_zero_attn`.
    pub weights: Option<Tensor>,
}
