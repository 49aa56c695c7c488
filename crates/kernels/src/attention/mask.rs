//! The mask as the kernel reads it: [`Masking`], the rules and the tensor
//! parts a caller gives, each [`MaskPart`] in its own broadcast shape; and
//! [`PartView`], a part's data with its broadcast strides, which
//! [`Problem::mask_row`](super::problem::Problem::mask_row) reads a row
//! of at a time.

use std::ops::Deref;

use candle::{bail, Layout, Result, Storage, Tensor};

use super::dropout::Dropout;

/// One mask tensor as the kernel reads it: in its own broadcast shape
/// (4-D, broadcastable to `(batch, heads, q_len, kv_len)`, contiguous),
/// never expanded to the full score shape.
#[derive(Debug, Clone)]
pub enum MaskPart {
    /// `u8`; a non-zero entry hides the pair.
    HideWhereNonZero(Tensor),
    /// `u8`; a zero entry hides the pair.
    HideWhereZero(Tensor),
    /// `f32`, added to the scores of visible pairs; `-inf` hides the pair.
    Additive(Tensor),
}

impl MaskPart {
    /// The part's tensor.
    pub fn tensor(&self) -> &Tensor {
        match self {
            Self::HideWhereNonZero(t) | Self::HideWhereZero(t) | Self::Additive(t) => t,
        }
    }
}

/// A window's length as a signed key distance, saturating: a window longer
/// than any sequence hides nothing rather than wrapping negative.
pub fn window_isize(w: usize) -> isize {
    isize::try_from(w).unwrap_or(isize::MAX)
}

/// What hides or biases the scores of the keys before the `appended` ones
/// of [`sdpa`](super::sdpa) (those are never masked: PyTorch's `add_bias_kv` and
/// `add_zero_attn`). A query sees key `j` iff every part, the causal rule
/// and the window let it.
#[derive(Debug, Clone, Default)]
pub struct Masking<'a> {
    /// Tensor masks, each in its own broadcast shape.
    pub parts: Vec<MaskPart>,
    /// The causal rule: key `j` is visible to query `i` iff `j <= i +
    /// offset`.
    pub causal: Option<isize>,
    /// With `causal`: and iff `j > i + offset - window`.
    pub window: Option<usize>,
    /// ALiBi: per-head slopes, and the offset of the diagonal distances
    /// are measured from (`slope · (j - i - offset)` is added).
    pub alibi: Option<(&'a [f32], isize)>,
    /// Logit soft-capping (Gemma 2): every scaled score `s` becomes `cap ·
    /// tanh(s / cap)` before the mask and ALiBi apply to it, the appended
    /// keys' too. Finite and > 0 (checked by the caller).
    pub softcap: Option<f32>,
    /// Dropout on the weights after the softmax (training): a dropped
    /// pair's weight is 0, a kept one's scaled by `1 / (1 − p)`; the
    /// backward draws the same mask from the seed.
    pub dropout: Option<Dropout>,
}

/// A mask part's data as the kernel reads it, with its element strides
/// over (batch, head, query, key); a broadcast dim has stride 0.
pub(super) struct PartView<'a> {
    pub(super) data: PartData<'a>,
    pub(super) stride: [usize; 4],
}

/// A part's elements, by what they do.
#[derive(Clone, Copy)]
pub(super) enum PartData<'a> {
    HideWhereNonZero(&'a [u8]),
    HideWhereZero(&'a [u8]),
    Additive(&'a [f32]),
}

impl<'a> PartView<'a> {
    pub(super) fn new(part: &MaskPart, storage: &'a Storage, layout: &Layout) -> Result<Self> {
        let Storage::Cpu(cpu) = storage else {
            bail!("cpu attention kernel: mask is not on the CPU")
        };
        let dims = layout.dims();
        let [_, d1, d2, d3] = *dims else {
            bail!("cpu attention kernel: mask part must be 4-D, found {dims:?}")
        };
        // Parts are contiguous in their own shape ([`MaskPart`]).
        let dense = [d1 * d2 * d3, d2 * d3, d3, 1];
        let mut stride = [0; 4];
        for i in 0..4 {
            stride[i] = if dims[i] > 1 { dense[i] } else { 0 };
        }
        let start = layout.start_offset();
        let data = match part {
            MaskPart::HideWhereNonZero(_) => PartData::HideWhereNonZero(&cpu.as_slice::<u8>()?[start..]),
            MaskPart::HideWhereZero(_) => PartData::HideWhereZero(&cpu.as_slice::<u8>()?[start..]),
            MaskPart::Additive(_) => PartData::Additive(&cpu.as_slice::<f32>()?[start..]),
        };
        Ok(Self { data, stride })
    }
}

/// Each part's storage and layout, held while [`part_views`] of them are
/// read.
pub(super) fn part_storages(parts: &[MaskPart]) -> Vec<(impl Deref<Target = Storage> + '_, &Layout)> {
    parts.iter().map(|p| p.tensor().storage_and_layout()).collect()
}

/// The views of `parts` over their `storages` ([`part_storages`]).
pub(super) fn part_views<'a, S: Deref<Target = Storage>>(
    parts: &[MaskPart],
    storages: &'a [(S, &Layout)],
) -> Result<Vec<PartView<'a>>> {
    parts
        .iter()
        .zip(storages)
        .map(|(part, (storage, layout))| PartView::new(part, storage, layout))
        .collect()
}
