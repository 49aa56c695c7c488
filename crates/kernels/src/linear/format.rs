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
