//! A vector of `f32` lanes per instruction set, so that kernels are
//! written once over the vector width (`softmax.rs`, `attention/decode.rs`) and
//! instantiated inside a `#[target_feature]` function per set, where the
//! `#[inline(always)]` lane operations compile to that set's instructions:
//! [`Ymm`] (AVX2+FMA, 8 lanes) and [`Zmm`] (AVX-512F, 16); `f32` itself is
//! the one-lane type, for tails, scalar uses and the portable path.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::elem::PanelElem;

/// A vector of `f32` lanes.
pub(crate) trait Lanes: Copy {
    const N: usize;
    /// # Safety
    /// The instruction set is enabled in the calling function.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn splat(x: f32) -> Self;
    /// # Safety
    /// As [`Lanes::zero`]; `p` holds `N` floats.
    unsafe fn load(p: *const f32) -> Self;
    /// `N` elements of a [`PanelElem`] type (f32, bf16 or f16), widened.
    /// # Safety
    /// As [`Lanes::zero`], with F16C for `ymm`; `p` holds `N` elements.
    unsafe fn load_elem<E: PanelElem>(p: *const E) -> Self;
    /// # Safety
    /// As [`Lanes::load`].
    unsafe fn store(self, p: *mut f32);
    /// `a · b + self`.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn fmadd(self, a: Self, b: Self) -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn add(self, b: Self) -> Self;
    /// `self · b`.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn mul(self, b: Self) -> Self;
    /// The sum of the lanes.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn sum(self) -> f32;
    /// Lane `i` the sum of `v[i]`'s lanes, for `N` vectors: a transposing
    /// tree of shuffles and adds, under 3 operations a vector where
    /// [`Lanes::sum`] takes 6 to 8.
    /// # Safety
    /// As [`Lanes::zero`]; `v` holds at least `N` vectors.
    unsafe fn sums(v: &[Self]) -> Self;
    /// `self - b`.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn sub(self, b: Self) -> Self;
    /// The larger of `self` and `b` per lane; `b` where either is NaN (as
    /// `maxps`), so a NaN may be skipped.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn max(self, b: Self) -> Self;
    /// The smaller of `self` and `b` per lane; `b` where either is NaN (as
    /// `minps`).
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn min(self, b: Self) -> Self;
    /// `self / b`, correctly rounded.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn div(self, b: Self) -> Self;
    /// The largest lane (a NaN lane may be skipped).
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn max_lane(self) -> f32;
    /// `p · 2ⁿ` per lane where `x >= -87`, for `n` an integer in `[-126,
    /// 0]` there; 0 where `x < -87`; NaN where `x` or `p` is NaN: the last
    /// step of [`crate::rows::softmax::exp_nonpositive`].
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn scale_pow2(p: Self, n: Self, x: Self) -> Self;
}

/// `maxps`'s rule: `a` where `a > b`, else `b` (so `b` where either is
/// NaN).
#[inline(always)]
fn max_f32(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// `minps`'s rule: `a` where `a < b`, else `b` (so `b` where either is
/// NaN).
#[inline(always)]
fn min_f32(a: f32, b: f32) -> f32 {
    if a < b {
        a
    } else {
        b
    }
}

/// One lane: the tails of rows that are not a whole number of vectors,
/// the scalar uses of [`crate::rows::softmax::exp_nonpositive`] (vectorised by
/// the compiler in `simd.rs`'s loops), and processors without AVX2.
impl Lanes for f32 {
    const N: usize = 1;
    #[inline(always)]
    unsafe fn zero() -> Self {
        0.
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's.
        unsafe { p.read() }
    }
    #[inline(always)]
    unsafe fn load_elem<E: PanelElem>(p: *const E) -> Self {
        // SAFETY: the caller's.
        unsafe { p.read() }.to_f32()
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's.
        unsafe { p.write(self) }
    }
    #[inline(always)]
    unsafe fn fmadd(self, a: Self, b: Self) -> Self {
        a.mul_add(b, self)
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        self + b
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        self * b
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn sums(v: &[Self]) -> Self {
        v[0]
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        self - b
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        max_f32(self, b)
    }
    #[inline(always)]
    unsafe fn min(self, b: Self) -> Self {
        min_f32(self, b)
    }
    #[inline(always)]
    unsafe fn div(self, b: Self) -> Self {
        self / b
    }
    #[inline(always)]
    unsafe fn max_lane(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn scale_pow2(p: Self, n: Self, x: Self) -> Self {
        // 2^n from its exponent bits. `n` as an integer through the bits of
        // `n + 1.5·2²³` rather than a cast, whose saturation keeps the
        // compiler from vectorising; lanes below -87 (where `n` may be
        // -inf) are 0 whatever the bits.
        const MAGIC: f32 = 12_582_912.0;
        let n = (n + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
        let pow2n = f32::from_bits((n.wrapping_add(127) << 23) as u32);
        if x < -87. {
            0.
        } else {
            p * pow2n
        }
    }
}

/// AVX2+FMA: 8 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Ymm(__m256);

/// AVX-512F: 16 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Zmm(__m512);

/// The lane operations that are one intrinsic each, for the lane type
/// `$t` of `$n` lanes.
#[cfg(target_arch = "x86_64")]
macro_rules! elementwise {
    ($t:ident, $n:literal, $setzero:ident, $set1:ident, $loadu:ident, $storeu:ident, $fmadd:ident, $add:ident, $mul:ident, $sub:ident, $max:ident, $min:ident, $div:ident) => {
        const N: usize = $n;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: (here and below) the caller's.
            $t(unsafe { $setzero() })
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            $t(unsafe { $set1(x) })
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            $t(unsafe { $loadu(p) })
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { $storeu(p, self.0) }
        }
        #[inline(always)]
        unsafe fn fmadd(self, a: Self, b: Self) -> Self {
            $t(unsafe { $fmadd(a.0, b.0, self.0) })
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            $t(unsafe { $add(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            $t(unsafe { $mul(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            $t(unsafe { $sub(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            $t(unsafe { $max(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            $t(unsafe { $min(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            $t(unsafe { $div(self.0, b.0) })
        }
    };
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Ymm {
    elementwise!(
        Ymm,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        _mm256_sub_ps,
        _mm256_max_ps,
        _mm256_min_ps,
        _mm256_div_ps
    );
    #[inline(always)]
    unsafe fn load_elem<E: PanelElem>(p: *const E) -> Self {
        // SAFETY: the caller's.
        Ymm(unsafe { E::load_ymm(p) })
    }
    #[inline(always)]
    unsafe fn max_lane(self) -> f32 {
        let h = _mm_max_ps(_mm256_castps256_ps128(self.0), _mm256_extractf128_ps::<1>(self.0));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
    }
    #[inline(always)]
    unsafe fn scale_pow2(p: Self, n: Self, x: Self) -> Self {
        // 2^n: n's bits shifted into the exponent field, plus the bias;
        // lanes below -87 are masked to 0 whatever they held.
        let pow2n = _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n.0)),
            _mm256_set1_epi32(127 << 23),
        ));
        let hidden = _mm256_cmp_ps::<_CMP_LT_OQ>(x.0, _mm256_set1_ps(-87.0));
        Ymm(_mm256_andnot_ps(hidden, _mm256_mul_ps(p.0, pow2n)))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(self.0), _mm256_extractf128_ps::<1>(self.0));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
    #[inline(always)]
    unsafe fn sums(v: &[Self]) -> Self {
        // Pairs of vectors: lanes (2i, 2i+1, 2i, 2i+1) of each 128-bit half
        // hold partial sums of vectors 2i and 2i + 1.
        let c: [__m256; 4] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i].0, v[2 * i + 1].0);
            _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
        });
        // Each 128-bit half: partial sums of vectors 4i..4i + 4.
        let e: [__m256; 2] = std::array::from_fn(|i| {
            let (x, y) = (_mm256_castps_pd(c[2 * i]), _mm256_castps_pd(c[2 * i + 1]));
            _mm256_add_ps(
                _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
            )
        });
        Ymm(_mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(e[0], e[1]),
            _mm256_permute2f128_ps::<0x31>(e[0], e[1]),
        ))
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Zmm {
    elementwise!(
        Zmm,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        _mm512_sub_ps,
        _mm512_max_ps,
        _mm512_min_ps,
        _mm512_div_ps
    );
    #[inline(always)]
    unsafe fn load_elem<E: PanelElem>(p: *const E) -> Self {
        // SAFETY: the caller's.
        Zmm(unsafe { E::loadu_zmm(p) })
    }
    #[inline(always)]
    unsafe fn max_lane(self) -> f32 {
        // SAFETY: the caller's.
        unsafe { _mm512_reduce_max_ps(self.0) }
    }
    #[inline(always)]
    unsafe fn scale_pow2(p: Self, n: Self, x: Self) -> Self {
        // `vscalefps` applies 2^n, and the zeroing below -87 (NaN kept),
        // in one instruction.
        // SAFETY: the caller's.
        unsafe {
            let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x.0, _mm512_set1_ps(-87.0));
            Zmm(_mm512_maskz_scalef_ps(kept, p.0, n.0))
        }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: the caller's.
        unsafe { _mm512_reduce_add_ps(self.0) }
    }
    #[inline(always)]
    unsafe fn sums(v: &[Self]) -> Self {
        // SAFETY: (the block) the caller's.
        unsafe {
            // As `Ymm::sums`, per 128-bit block: pairs, then fours.
            let c: [__m512; 8] = std::array::from_fn(|i| {
                let (a, b) = (v[2 * i].0, v[2 * i + 1].0);
                _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
            });
            let e: [__m512; 4] = std::array::from_fn(|i| {
                let (x, y) = (_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]));
                _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
                )
            });
            // Blocks (0, 2) plus blocks (1, 3) of two vectors, twice: block
            // i of the result holds the sums of vectors 4i..4i + 4.
            let halve = |a: __m512, b: __m512| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                )
            };
            Zmm(halve(halve(e[0], e[1]), halve(e[2], e[3])))
        }
    }
}

/// Lanes `0..n` of a 16-lane (`zmm`) mask (`n` may exceed 16): the masked
/// loads and stores of the AVX-512 kernels' last, partial vectors.
#[cfg(target_arch = "x86_64")]
pub(crate) fn zmm_mask(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}
