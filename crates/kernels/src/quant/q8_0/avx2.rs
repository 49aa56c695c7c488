//! The AVX2 micro-kernel of the 8-bit linear layers (also AVX-512's where
//! the processor lacks VNNI), after llama.cpp's `mul_sum_i8_pairs`:
//! `vpmaddubsw` multiplies unsigned bytes by signed ones, so a group of 4
//! inputs `x` is taken as `|x|` (unsigned) against the weights with `x`'s
//! signs applied (`vpsignb`), the same products; `vpmaddwd` by ones then
//! sums each lane's pairs into i32. Exact: `|x|, |q| ≤ 127`, so a pair's
//! sum `≤ 2 · 127 · 127 < 32767` never saturates the i16 lanes.
//!
//! A panel's 16 features are two `ymm` halves of each 64-byte group.

use std::arch::x86_64::*;

use half::f16;

use crate::elem::PanelElem;

/// Rows per tile of a call of several rows (16 `ymm` registers: two
/// halves' i32 and f32 sums a row, the weights, the inputs).
pub(crate) const MR: usize = 2;
/// Panels per tile: each a pair of `ymm` vectors.
pub(crate) const NP: usize = 1;
/// How far ahead of its loads a one-row tile (a decoder's step) prefetches
/// its panel, in bytes: two blocks. The hardware prefetcher alone leaves
/// the single row's stream waiting on memory; tiles of two rows (a
/// prefill's), twice the work a byte, are left to it.
const ONE_ROW_PREFETCH: usize = 1024;

/// The sums of a tile of `rows` rows (1..=2) by one panel added to
/// `out`, as `vnni::tile` adds them (the same layout, order and
/// rounding), from weights stored as `q` (`i8`) and without the inputs'
/// block starts.
///
/// # Safety
/// AVX2, FMA and F16C; the pointers cover the extents `vnni::tile` lists.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    rows: usize,
    panels: usize,
    (nb, blocks): (usize, std::ops::Range<usize>),
    x: *const i8,
    xd: *const f32,
    w: *const u8,
    d: *const u16,
    out: *mut f32,
    out_rs: usize,
) {
    macro_rules! go {
        ($($r:literal $p:literal),*) => {
            match (rows, panels) {
                $(($r, $p) => tile_rows::<$r, $p>(nb, blocks.clone(), x, xd, w, d, out, out_rs),)*
                _ => unreachable!("tiles are at most 2 rows by 1 panel"),
            }
        };
    }
    // SAFETY: forwarded.
    unsafe { go!(1 1, 2 1) }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<const R: usize, const P: usize>(
    nb: usize,
    blocks: std::ops::Range<usize>,
    x: *const i8,
    xd: *const f32,
    w: *const u8,
    d: *const u16,
    out: *mut f32,
    out_rs: usize,
) {
    let (x_rs, w_ps, d_ps) = (nb * 32, nb * 512, nb * 16);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        // Per panel, its features 0..8 and 8..16.
        let mut acc: [[[__m256; 2]; P]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|p| {
                std::array::from_fn(|h| _mm256_loadu_ps(out.add(r * out_rs + 16 * p + 8 * h)))
            })
        });
        for b in blocks {
            let mut isum = [[[_mm256_setzero_si256(); 2]; P]; R];
            let wb = w.add(b * 512);
            for g in 0..8 {
                if R == 1 {
                    _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(ONE_ROW_PREFETCH + 64 * g).cast());
                }
                for (r, isum) in isum.iter_mut().enumerate() {
                    let xv =
                        _mm256_set1_epi32(x.add(r * x_rs + b * 32 + 4 * g).cast::<i32>().read_unaligned());
                    let ax = _mm256_abs_epi8(xv);
                    for (p, isum) in isum.iter_mut().enumerate() {
                        for (h, s) in isum.iter_mut().enumerate() {
                            let wv = _mm256_loadu_si256(wb.add(p * w_ps + 64 * g + 32 * h).cast());
                            let pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
                            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
            for (r, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
                let dx = _mm256_set1_ps(*xd.add(r * nb + b));
                for (p, (acc, isum)) in acc.iter_mut().zip(isum).enumerate() {
                    for (h, (acc, &s)) in acc.iter_mut().zip(isum).enumerate() {
                        let dw = _mm256_cvtph_ps(_mm_loadu_si128(d.add(p * d_ps + b * 16 + 8 * h).cast()));
                        // A product and a sum, each rounded (llama.cpp's
                        // reference order), not a fused multiply-add.
                        *acc =
                            _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx)));
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (p, acc) in acc.iter().enumerate() {
                for (h, &acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(r * out_rs + 16 * p + 8 * h), acc);
                }
            }
        }
    }
}

/// One block of 32 values quantized as `mod.rs`'s `quantize_block` does
/// (the same values, bit for bit): its scale rounded to f16 (the bits),
/// and its values in order, 32 bytes. Rounding half away from zero is
/// `trunc(y + copysign(0.5 - 2⁻²⁵, y))`, exact for every float; a block
/// whose scale or its inverse is not finite gets zeros.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_block(v: [__m256; 4]) -> (u16, __m256i) {
    let sign = _mm256_set1_ps(-0.);
    let half = _mm256_set1_ps(0.5 - f32::EPSILON / 4.);
    let a = v.map(|v| _mm256_andnot_ps(sign, v));
    let unord = _mm256_or_ps(
        _mm256_cmp_ps::<_CMP_UNORD_Q>(a[0], a[1]),
        _mm256_cmp_ps::<_CMP_UNORD_Q>(a[2], a[3]),
    );
    let amax = if _mm256_movemask_ps(unord) != 0 {
        f32::NAN
    } else {
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    };
    let scale = amax / 127.;
    let id = if scale != 0. { 1. / scale } else { 0. };
    let bits = _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(scale))) as u16;
    if !(scale.is_finite() && id.is_finite()) {
        return (bits, _mm256_setzero_si256());
    }
    let idv = _mm256_set1_ps(id);
    let i = v.map(|v| {
        let y = _mm256_mul_ps(v, idv);
        let y = _mm256_add_ps(y, _mm256_or_ps(_mm256_and_ps(y, sign), half));
        _mm256_cvttps_epi32(y)
    });
    // Saturating packs (the values are in range) interleave the 128-bit
    // lanes; the permutation puts them back in order.
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    (
        bits,
        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
    )
}

/// One row of `nb` blocks of inputs quantized as `mod.rs`'s
/// `quantize_block` does ([`quantize_block`]): the block's values into
/// `q + 32·b` and its scale rounded to f16 and widened into `d[b]`.
///
/// # Safety
/// AVX2 and F16C; `x` and `q` hold `32·nb` values, `d` `nb`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row(x: *const f32, nb: usize, q: *mut i8, d: *mut f32) {
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        for b in 0..nb {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.add(32 * b + 8 * i)));
            let (bits, values) = quantize_block(v);
            *d.add(b) = f16::from_bits(bits).to_f32();
            _mm256_storeu_si256(q.add(32 * b).cast(), values);
        }
    }
}

/// Feature `c`'s row of `nb` blocks of weights `w` quantized as
/// [`quantize_row`] quantizes inputs, straight into its panel (`mod.rs`'s
/// layout): value `i` of block `b` at `qs + b·512 + (i / 4)·64 + 4·c +
/// i % 4`, the scale's f16 bits at `d + b·16 + c`.
///
/// # Safety
/// AVX2, FMA and F16C; `w` holds `32·nb` elements, `qs` `512·nb` bytes,
/// `d` `16·nb` scales; `c < 16`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_weight_row<S: PanelElem>(
    w: *const S,
    nb: usize,
    c: usize,
    qs: *mut u8,
    d: *mut u16,
) {
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        for b in 0..nb {
            let v: [__m256; 4] = std::array::from_fn(|i| S::load_ymm(w.add(32 * b + 8 * i)));
            let (bits, values) = quantize_block(v);
            *d.add(b * 16 + c) = bits;
            let mut bytes = [0u8; 32];
            _mm256_storeu_si256(bytes.as_mut_ptr().cast(), values);
            for (g, four) in bytes.as_chunks::<4>().0.iter().enumerate() {
                qs.add(b * 512 + g * 64 + 4 * c)
                    .cast::<[u8; 4]>()
                    .write_unaligned(*four);
            }
        }
    }
}
