//! The format [`PackedLinear::new`](super::PackedLinear::new) packs in,
//! set per thread around a model's construction.

/// How [`PackedLinear::new`](super::PackedLinear::new) packs the weights
/// of the layers it builds on the calling thread (see [`packing_as`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PackFormat {
    /// In the weight's own dtype: f32, bf16 or f16.
    #[default]
    AsStored,
    /// Quantized to llama.cpp's Q8_0 (blocks of 32 int8 with an f16
    /// scale; the inputs quantized alike at each call, integer dot
    /// products), where the input size is a multiple of 32; as stored
    /// otherwise.
    Q8_0,
    /// Quantized to ggml's Q4_0 (blocks of 32 4-bit values with an f16
    /// scale, by ggml's reference rule: gguf-py's bits), the inputs
    /// quantized per block at each call, where the input size is a
    /// multiple of 32; as stored otherwise.
    Q4_0,
}

thread_local! {
    static PACK_FORMAT: std::cell::Cell<PackFormat> = const { std::cell::Cell::new(PackFormat::AsStored) };
}

/// Runs `build` with every layer [`PackedLinear::new`](super::PackedLinear::new) packs on this
/// thread in `format`, then restores the format before (also when `build`
/// panics): a model loader quantizes every linear layer of a model it
/// builds without each layer's constructor taking an option.
pub fn packing_as<R>(format: PackFormat, build: impl FnOnce() -> R) -> R {
    struct Restore(PackFormat);
    impl Drop for Restore {
        fn drop(&mut self) {
            PACK_FORMAT.with(|f| f.set(self.0));
        }
    }
    let _restore = Restore(PACK_FORMAT.with(|f| f.replace(format)));
    build()
}

/// The format [`PackedLinear::new`](super::PackedLinear::new) packs in on this thread now (see
/// [`packing_as`]).
pub fn packing_format() -> PackFormat {
    PACK_FORMAT.with(|f| f.get())
}

/// Weights in a ggml block format lent to the layers a loader builds on
/// this thread ([`lending`]), by the id of the placeholder tensor that
/// stands for each in the model's `VarBuilder`, which hands out tensors
/// only: [`PackedLinear::new`](super::PackedLinear::new) given a
/// placeholder takes its blocks as they are.
struct Lent {
    depth: usize,
    blocks: std::collections::HashMap<candle::TensorId, (crate::quant::BlockFormat, Vec<u8>)>,
}

thread_local! {
    static LENT: std::cell::RefCell<Lent> = std::cell::RefCell::new(Lent {
        depth: 0,
        blocks: std::collections::HashMap::new(),
    });
}

/// Runs `build` with [`lend_blocks`] open on this thread; blocks lent and
/// not taken by a layer (a build that failed half-way) are dropped at the
/// end, also when `build` panics. A build that succeeds with blocks left
/// untaken is an error naming how many: a placeholder that reached
/// anything but a [`PackedLinear`](super::PackedLinear) or an embedding
/// built over one would compute with zeros.
pub fn lending<R>(build: impl FnOnce() -> candle::Result<R>) -> candle::Result<R> {
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            LENT.with(|l| {
                let mut l = l.borrow_mut();
                l.depth -= 1;
                if l.depth == 0 {
                    l.blocks.clear();
                }
            });
        }
    }
    LENT.with(|l| l.borrow_mut().depth += 1);
    let _close = Close;
    let built = build()?;
    let left = LENT.with(|l| l.borrow().blocks.len());
    if left > 0 {
        candle::bail!("{left} weight(s) in a ggml block format were lent to the model and not taken by a layer that keeps them")
    }
    Ok(built)
}

/// A placeholder `(n, k)` f32 tensor (one zero, broadcast: no memory)
/// standing for `data`, `n` rows of `k` weights in `format`'s blocks,
/// which the [`PackedLinear`](super::PackedLinear) built over it (inside
/// the same [`lending`]) keeps as they are. Refused outside [`lending`]
/// and where the bytes do not hold `(n, k)`.
pub fn lend_blocks(
    format: crate::quant::BlockFormat,
    data: Vec<u8>,
    (n, k): (usize, usize),
    device: &candle::Device,
) -> candle::Result<candle::Tensor> {
    if !k.is_multiple_of(format.block_elems()) || data.len() != n * format.row_bytes(k) {
        candle::bail!(
            "{} weight ({n}, {k}): {} bytes do not hold it in blocks of {}",
            format.name(),
            data.len(),
            format.block_elems()
        )
    }
    let t = candle::Tensor::zeros((), candle::DType::F32, device)?.broadcast_as((n, k))?;
    LENT.with(|l| {
        let mut l = l.borrow_mut();
        if l.depth == 0 {
            candle::bail!("lend_blocks: called outside `lending`")
        }
        l.blocks.insert(t.id(), (format, data));
        Ok(())
    })?;
    Ok(t)
}

/// Whether `t` is a placeholder [`lend_blocks`] gave out and no layer has
/// taken yet.
pub fn is_lent(t: &candle::Tensor) -> bool {
    LENT.with(|l| l.borrow().blocks.contains_key(&t.id()))
}

/// The blocks `t` stands for, taken.
pub(crate) fn take_lent(t: &candle::Tensor) -> Option<(crate::quant::BlockFormat, Vec<u8>)> {
    LENT.with(|l| l.borrow_mut().blocks.remove(&t.id()))
}
