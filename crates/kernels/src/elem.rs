//! The element types a packed weight's panels hold: `f32`, and `bf16` and
//! `f16` as checkpoints store them. The micro-kernels are written once over
//! [`PanelElem`] and widen a panel row to f32 lanes as they load it, so a
//! half-precision weight is read from memory at half the bytes and every
//! product still accumulates in f32. And the tensors the fused ops take as
//! they are ([`plain_cpu_f32`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use candle::{bail, CpuStorage, DType, Layout, Result, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Whether a tensor can take part in the packed path and the other fused
/// CPU ops: an f32 CPU tensor that tracks no gradient.
pub(crate) fn plain_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op()
}

/// An element of packed weight panels.
pub(crate) trait PanelElem: Copy + Default + Send + Sync + 'static {
    /// The element nearest `x` (round to nearest, ties to even, as
    /// PyTorch's `.to(dtype)`).
    fn from_f32(x: f32) -> Self;
    /// The element as f32 (exact).
    fn to_f32(self) -> f32;
    /// `src` widened into `dst`, of the same length, exactly: a copy, or
    /// `half`'s slice conversion (F16C where the processor has it).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// 16 elements from `p` as f32 lanes.
    /// # Safety
    /// AVX-512F is enabled in the calling function; `p` holds 16 elements
    /// and is aligned to their size times 16.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_zmm(p: *const Self) -> __m512;
    /// 16 elements from `p`, which need not be aligned, as f32 lanes.
    /// # Safety
    /// AVX-512F is enabled in the calling function; `p` holds 16 elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn loadu_zmm(p: *const Self) -> __m512;
    /// 8 elements from `p` as f32 lanes.
    /// # Safety
    /// AVX2 and F16C are enabled in the calling function; `p` holds 8
    /// elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_ymm(p: *const Self) -> __m256;
    /// `p` itself where the elements are f32 (for code that reads f32 only,
    /// such as `gemm`), else `None`.
    fn f32_ptr(p: *const Self) -> Option<*const f32> {
        let _ = p;
        None
    }
}

impl PanelElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_load_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn loadu_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_ymm(p: *const Self) -> __m256 {
        // SAFETY: as the trait says.
        unsafe { _mm256_loadu_ps(p) }
    }
    fn f32_ptr(p: *const Self) -> Option<*const f32> {
        Some(p)
    }
}

/// bf16 is f32's top half: widening shifts the bits up by 16.
impl PanelElem for bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe {
            let h = _mm256_load_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn loadu_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_ymm(p: *const Self) -> __m256 {
        // SAFETY: as the trait says.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

/// f16 widens with `vcvtph2ps` (F16C; AVX-512F's 16-lane form).
impl PanelElem for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_cvtph_ps(_mm256_load_si256(p.cast())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn loadu_zmm(p: *const Self) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_ymm(p: *const Self) -> __m256 {
        // SAFETY: as the trait says.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Whether `t` repeats its data along some dimension (a zero stride over
/// more than one element): a broadcast, such as the zeros a checkpoint's
/// pre-flight recorder answers with. Packing or copying one would
/// allocate the full size for no information, so it is left as it is.
pub fn is_broadcast(t: &Tensor) -> bool {
    t.stride().iter().zip(t.dims()).any(|(&s, &d)| s == 0 && d > 1)
}

/// `f` over the data of contiguous f32 CPU tensors, borrowed in place: what
/// a custom op's backward reads its arguments and gradient with; `op`
/// names the op in the error.
pub(crate) fn with_f32_data<R, const N: usize>(
    ts: [&Tensor; N],
    op: &str,
    f: impl FnOnce([&[f32]; N]) -> Result<R>,
) -> Result<R> {
    let guards = ts.map(Tensor::storage_and_layout);
    let mut data = Vec::with_capacity(N);
    for (storage, layout) in &guards {
        let Storage::Cpu(cpu) = &**storage else {
            bail!("{op}: a tensor is not on the CPU")
        };
        data.push(f32_data(cpu, layout, op)?);
    }
    match data.try_into() {
        Ok(data) => f(data),
        Err(_) => bail!("{op}: {N} tensors expected"),
    }
}

/// A custom op's gradient `data` for its argument `t`, in `t`'s shape:
/// `None` where `t` tracks no gradient.
pub(crate) fn grad_for(t: &Tensor, data: Vec<f32>) -> Result<Option<Tensor>> {
    t.track_op()
        .then(|| Tensor::from_vec(data, t.shape(), t.device()))
        .transpose()
}

/// The contiguous f32 data of a custom op's argument; `op` names the op in
/// the error.
pub(crate) fn f32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((start, end))) => Ok(&x[start..end]),
        (CpuStorage::F32(_), None) => bail!("{op}: the inputs must be contiguous"),
        _ => bail!("{op}: the inputs must be f32"),
    }
}

/// [`f32_data`] of an in-place op's destination, to write.
pub(crate) fn f32_data_mut<'a>(s: &'a mut CpuStorage, l: &Layout, op: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((start, end))) => Ok(&mut x[start..end]),
        (CpuStorage::F32(_), None) => bail!("{op}: the inputs must be contiguous"),
        _ => bail!("{op}: the inputs must be f32"),
    }
}
