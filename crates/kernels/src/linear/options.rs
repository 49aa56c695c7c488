//! How [`PackedLinear`](super::PackedLinear) packs a layer's weight: the
//! options a loader passes to every layer it builds ([`PackOptions`]),
//! held by no thread or global, so that two models packed two ways can be
//! built at once.

use candle::DType;

use super::calibrate::bf16_dot_pays;
use super::lent::LentBlocks;
use crate::runtime::isa::{current, runnable, Isa};

/// The format a layer's weight is packed in (ggml's names).
#[allow(non_camel_case_types)]
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
    /// Quantized to ggml's Q4_K (super-blocks of 256 4-bit values, 6-bit
    /// scales and mins per 32, by ggml's reference rule:
    /// `quantize_row_q4_K_ref`'s bits) where the input size is a multiple
    /// of 256, to Q5_0 where it is a multiple of 32 only (the fallback
    /// `llama-quantize` takes for Q4_K), as stored otherwise; the inputs
    /// quantized per block at each call.
    Q4_K,
}

/// How [`PackedLinear::with_options`](super::PackedLinear::with_options)
/// packs: the format, the instruction set the kernels run with, and the
/// ggml blocks a GGUF loader lent to the layers ([`LentBlocks`]). A
/// loader makes one and passes it to every layer of the model it builds;
/// the default packs as stored, for [`isa::current`](crate::isa::current),
/// with nothing lent, as [`PackedLinear::new`](super::PackedLinear::new)
/// does.
///
/// ```
/// use candle::{Device, Module, Tensor};
/// use multihead_kernels::{PackFormat, PackOptions, PackedLinear};
///
/// # fn main() -> candle::Result<()> {
/// let w = Tensor::randn(0f32, 1., (64, 32), &Device::Cpu)?;
/// let q8 = PackOptions::new().with_format(PackFormat::Q8_0);
/// let layer = PackedLinear::with_options(w.clone(), None, &q8)?;
/// assert!(layer.is_quantized());
/// assert!(!PackedLinear::new(w, None)?.is_quantized());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct PackOptions {
    format: PackFormat,
    isa: Option<Isa>,
    lent: Option<LentBlocks>,
}

impl PackOptions {
    /// As stored, for [`isa::current`](crate::isa::current), nothing lent.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same, packing in `format`.
    pub fn with_format(mut self, format: PackFormat) -> Self {
        self.format = format;
        self
    }

    /// The same, packing for `isa` (capped at what the processor runs:
    /// [`isa::runnable`](crate::isa::runnable)) rather than
    /// [`isa::current`](crate::isa::current).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.isa = Some(isa);
        self
    }

    /// The same, the layers taking the blocks `lent` holds for the
    /// placeholders they are built over.
    pub fn with_lent(mut self, lent: LentBlocks) -> Self {
        self.lent = Some(lent);
        self
    }

    /// The format layers pack in.
    pub fn format(&self) -> PackFormat {
        self.format
    }

    /// The instruction set layers are packed for: the one asked for where
    /// the processor runs it, else [`isa::current`](crate::isa::current).
    pub fn isa(&self) -> Isa {
        self.isa.map_or_else(current, runnable)
    }

    /// The instruction set a weight stored in `dtype` is packed for:
    /// [`PackOptions::isa`], except that by default bf16 weights take
    /// AVX512-BF16's `vdpbf16ps` only where it measures no slower than
    /// widening them for f32 FMAs (`calibrate.rs`), so that bf16 is never
    /// slower than f32 for want of the choice. An instruction set asked
    /// for ([`PackOptions::with_isa`]) is kept.
    pub(crate) fn isa_for(&self, dtype: DType) -> Isa {
        let isa = self.isa();
        let widen = self.isa.is_none() && isa == Isa::Avx512Bf16 && dtype == DType::BF16 && !bf16_dot_pays();
        if widen {
            Isa::Avx512
        } else {
            isa
        }
    }

    /// The blocks lent to the layers, if any.
    pub fn lent(&self) -> Option<&LentBlocks> {
        self.lent.as_ref()
    }

    /// Whether `t` is a placeholder for blocks lent in these options and
    /// not taken yet ([`LentBlocks::is_lent`]).
    pub fn is_lent(&self, t: &candle::Tensor) -> bool {
        self.lent.as_ref().is_some_and(|l| l.is_lent(t))
    }
}
