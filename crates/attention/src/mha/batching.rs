//! The layouts an entry point of [`MultiheadAttention`](super::MultiheadAttention)
//! accepts (unbatched, sequence-first) turned batch-first on the way in
//! and back on the way out.

use candle::{Result, Tensor};

use crate::mask::KeyPaddingMask;
use crate::options::{MhaOptions, MhaOutput, SeqLayout};

/// How an entry point's inputs are batched: turned batch-first on the way
/// in, back on the way out.
#[derive(Debug, Clone, Copy)]
pub(super) struct Batching {
    unbatched: bool,
    seq_first: bool,
}

impl Batching {
    pub(super) fn new(unbatched: bool, layout: SeqLayout) -> Self {
        Self {
            unbatched,
            seq_first: layout == SeqLayout::SeqFirst,
        }
    }

    /// An input `(B, T, ..)`: unsqueezed when unbatched, transposed from
    /// `(T, B, ..)` when sequence-first.
    pub(super) fn input(self, t: &Tensor) -> Result<Tensor> {
        match (self.unbatched, self.seq_first) {
            (true, _) => t.unsqueeze(0),
            (false, true) => t.transpose(0, 1),
            (false, false) => Ok(t.clone()),
        }
    }

    /// `opts` for the batch-first inputs: the residual laid out as they
    /// are, and an unbatched call's 1-D key padding mask given its batch.
    pub(super) fn options(self, opts: &MhaOptions) -> Result<MhaOptions> {
        let mut opts = opts.map_residual(|r| self.input(r))?;
        if self.unbatched {
            if let Some(kp) = &opts.mask.key_padding {
                opts.mask.key_padding = Some(match kp {
                    KeyPaddingMask::PadWhereTrue(t) if t.rank() == 1 => {
                        KeyPaddingMask::PadWhereTrue(t.unsqueeze(0)?)
                    }
                    KeyPaddingMask::Additive(t) if t.rank() == 1 => KeyPaddingMask::Additive(t.unsqueeze(0)?),
                    other => other.clone(),
                });
            }
        }
        Ok(opts)
    }

    /// The batch-first output `(B, L, E)` and weights `(B, .., L, S)` in
    /// the caller's layout.
    pub(super) fn output(self, (output, weights): (Tensor, Option<Tensor>)) -> Result<MhaOutput> {
        Ok(match (self.unbatched, self.seq_first) {
            (true, _) => MhaOutput {
                output: output.squeeze(0)?,
                weights: weights.map(|w| w.squeeze(0)).transpose()?,
            },
            (false, true) => MhaOutput {
                output: output.transpose(0, 1)?,
                weights,
            },
            (false, false) => MhaOutput { output, weights },
        })
    }
}
