//! Weights in a ggml block format lent to the layers a loader builds: a
//! GGUF loader's `VarBuilder` hands out tensors only, so each matrix kept
//! as its blocks stands there as a placeholder, and the layer built over
//! it takes the blocks from the [`LentBlocks`] in its
//! [`PackOptions`](super::PackOptions).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle::{bail, DType, Device, Result, Tensor, TensorId};

use crate::quant::BlockFormat;

/// Lent blocks by the id of their placeholder: the format and the bytes.
type Blocks = HashMap<TensorId, (BlockFormat, Vec<u8>)>;

/// Blocks lent to the layers of one model as it is built, by the id of
/// the placeholder tensor that stands for each ([`LentBlocks::lend`]):
/// [`PackedLinear::with_options`](super::PackedLinear::with_options) given
/// a placeholder takes its blocks as they are. Clones share the blocks
/// (the loader's reader lends, the options the layers get take); blocks
/// never taken are dropped with the last clone.
#[derive(Clone, Default)]
pub struct LentBlocks {
    blocks: Arc<Mutex<Blocks>>,
}

impl std::fmt::Debug for LentBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentBlocks")
            .field("untaken", &self.untaken())
            .finish()
    }
}

impl LentBlocks {
    /// Nothing lent yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The map, also where a thread panicked holding it: every change to
    /// it is one insert or one remove, so it is whole.
    fn map(&self) -> MutexGuard<'_, Blocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A placeholder `(n, k)` f32 tensor (one zero, broadcast: no memory)
    /// standing for `data`, `n` rows of `k` weights in `format`'s blocks,
    /// which the layer built over it keeps as they are. Refused where the
    /// bytes do not hold `(n, k)`.
    pub fn lend(
        &self,
        format: BlockFormat,
        data: Vec<u8>,
        (n, k): (usize, usize),
        device: &Device,
    ) -> Result<Tensor> {
        if !k.is_multiple_of(format.block_elems()) || data.len() != n * format.row_bytes(k) {
            bail!(
                "{} weight ({n}, {k}): {} bytes do not hold it in blocks of {}",
                format.name(),
                data.len(),
                format.block_elems()
            )
        }
        let t = Tensor::zeros((), DType::F32, device)?.broadcast_as((n, k))?;
        self.map().insert(t.id(), (format, data));
        Ok(t)
    }

    /// An empty buffer with room for `len` bytes, to copy a weight's
    /// blocks into before lending them, in memory asked to be backed by
    /// huge pages: the layer keeps the buffer as it is (repacked in place
    /// where its format goes into panels), and a decode step streams it.
    pub fn buffer(len: usize) -> Vec<u8> {
        crate::runtime::pages::reserved(len)
    }

    /// Whether `t` is a placeholder [`LentBlocks::lend`] gave out and no
    /// layer has taken yet.
    pub fn is_lent(&self, t: &Tensor) -> bool {
        self.map().contains_key(&t.id())
    }

    /// How many lent blocks no layer has taken.
    pub fn untaken(&self) -> usize {
        self.map().len()
    }

    /// An error naming how many blocks no layer took, where any is left
    /// after a build: a placeholder that reached anything but a
    /// [`PackedLinear`](super::PackedLinear) (or an embedding built over
    /// one) would compute with zeros.
    pub fn all_taken(&self) -> Result<()> {
        match self.untaken() {
            0 => Ok(()),
            left => bail!(
                "{left} weight(s) in a ggml block format were lent to the model and not taken by a layer that keeps them"
            ),
        }
    }

    /// The blocks `t` stands for, taken.
    pub(crate) fn take(&self, t: &Tensor) -> Option<(BlockFormat, Vec<u8>)> {
        self.map().remove(&t.id())
    }
}
