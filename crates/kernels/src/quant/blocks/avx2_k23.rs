//! The 2- and 3-bit k-quants' panels (`repack.rs`: Q2_K, Q3_K, 8 features
//! a panel) with AVX2, and with AVX512-VNNI on 256-bit vectors, as
//! `avx2_k.rs`' Q4_K panels and ggml-cpu's repacked `gemv_q2_K_8x8`: a
//! step of 4 values for each of the 8 features (2 bits of a `qs` word,
//! Q3_K's third bit from its `hmask` word), its products summed over a
//! sub-block of 16, widened, then multiplied by the 8 features' scales
//! of that sub-block (`vpmulld`, one lane each); Q2_K's mins and Q3_K's
//! offset from the inputs' per-16 sums (`vpmaddwd` on scale pairs). Sums
//! stay in `i32` to the block's end, then float as the kernels with rows
//! in lanes float them (`lanes.rs`), so a row's outputs are their bits.
//! Also the unpacking `lanes.rs` shares ([`k23_layout`], [`k23_scales`],
//! [`k23_scale`], [`k23_min_pair`], [`k23_step`]).
//!
//! Element `128n + 32j + l` of a block: bits `2j..2j + 2` of `qs[32n +
//! l]`; Q3_K's third bit, bit `4n + j` of `hmask[l]` (`w = d·(sc −
//! 32)·(u − 4)`); Q2_K's `w = d·sc·u − dmin·m` with `sc`, `m` the low and
//! high nibbles of `scales[h]`, `h` its sub-block of 16.

use std::arch::x86_64::*;

use super::avx2_k::{block_inputs, d_dmin, k_rows, load32, prefetch_ahead, sum_pairs, x4};
use super::inputs::InputRow;

/// A panel block's bytes and where its scales, `hmask` and `qs` are
/// (`repack.rs`: Q2_K's `d` at 0, `dmin` at 16, no `hmask` (0); Q3_K's `d` at 0).
pub(super) const fn k23_layout(q3: bool) -> (usize, usize, usize, usize) {
    match q3 {
        true => (880, 16, 112, 368),
        false => (672, 32, 0, 160),
    }
}

/// A Q2_K (`Q3`: Q3_K) panel block's 8 features' scale bytes, 4 a lane:
/// Q2_K's as stored (the scale in the low nibble, the min in the high
/// one), Q3_K's 6-bit scales (still biased by 32) unpacked from its 3
/// words a lane as ggml's `kmask` words unpack them.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k23_scales<const Q3: bool>(blk: &[u8]) -> [__m256i; 4] {
    let (_, at, _, _) = k23_layout(Q3);
    if !Q3 {
        return std::array::from_fn(|u| load32(blk, at + 32 * u));
    }
    let (low, high) = (_mm256_set1_epi32(0x0F0F_0F0F), _mm256_set1_epi32(0x0303_0303));
    let (a0, a1, a2) = (load32(blk, at), load32(blk, at + 32), load32(blk, at + 64));
    let top = |shift: i32| {
        let bits = _mm256_and_si256(_mm256_srl_epi32(a2, _mm_cvtsi32_si128(shift)), high);
        _mm256_slli_epi32(bits, 4)
    };
    [
        _mm256_or_si256(_mm256_and_si256(a0, low), top(0)),
        _mm256_or_si256(_mm256_and_si256(a1, low), top(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a0, 4), low), top(4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a1, 4), low), top(6)),
    ]
}

/// Sub-block `h`'s scale of each lane as an `i32`, from [`k23_scales`]'
/// bytes: Q2_K's low nibble, Q3_K's 6 bits less 32.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k23_scale<const Q3: bool>(scales: &[__m256i; 4], h: usize) -> __m256i {
    let v = _mm256_srl_epi32(scales[h / 4], _mm_cvtsi32_si128(8 * (h % 4) as i32));
    match Q3 {
        true => _mm256_sub_epi32(
            _mm256_and_si256(v, _mm256_set1_epi32(0xFF)),
            _mm256_set1_epi32(32),
        ),
        false => _mm256_and_si256(v, _mm256_set1_epi32(0xF)),
    }
}

/// The mins of sub-blocks `4u, 4u + 2` (`EVEN`) or `4u + 1, 4u + 3` of
/// each lane as two `i16`s, from [`k23_scales`]' bytes: Q2_K's high
/// nibbles, Q3_K's offset `4·(sc − 32)`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k23_min_pair<const Q3: bool, const EVEN: bool>(scales: &[__m256i; 4], u: usize) -> __m256i {
    let s = scales[u];
    let offset = |b: __m256i| _mm256_slli_epi16(_mm256_sub_epi16(b, _mm256_set1_epi16(32)), 2);
    match (Q3, EVEN) {
        (false, true) => _mm256_and_si256(_mm256_srli_epi16(s, 4), _mm256_set1_epi16(0xF)),
        (false, false) => _mm256_srli_epi16(s, 12),
        (true, true) => offset(_mm256_and_si256(s, _mm256_set1_epi16(0xFF))),
        (true, false) => offset(_mm256_srli_epi16(s, 8)),
    }
}

/// Step `i` (of 8) of quarter `j` of half `n` of a Q2_K (`Q3`: Q3_K)
/// panel block: its 8 features' 4 codes (elements `128n + 32j + 4i..`).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k23_step<const Q3: bool>(blk: &[u8], n: usize, j: usize, i: usize) -> __m256i {
    let (_, _, hm_at, qs_at) = k23_layout(Q3);
    let v = load32(blk, qs_at + 32 * (8 * n + i));
    let code = _mm256_and_si256(
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * j as i32)),
        _mm256_set1_epi8(3),
    );
    if !Q3 {
        return code;
    }
    // Bit 4n + j of each byte to bit 2 (a shift within the byte either way).
    let h = load32(blk, hm_at + 32 * i);
    let bit = (4 * n + j) as i32;
    let moved = match bit >= 2 {
        true => _mm256_srl_epi16(h, _mm_cvtsi32_si128(bit - 2)),
        false => _mm256_sll_epi16(h, _mm_cvtsi32_si128(2 - bit)),
    };
    _mm256_or_si256(code, _mm256_and_si256(moved, _mm256_set1_epi8(4)))
}

/// Q2_K (`Q3`: Q3_K) panels times `R` rows, into `out` (8 a row), as a
/// function `$name` with `$features`, `$step(s, u, x)` adding a step's
/// products to `s` and `$widen(s)` its sums as `i32` (AVX2: `vpmaddubsw`
/// into `i16`, a sub-block's 4 steps below `4·2·7·127`, widened by
/// `vpmaddwd`; VNNI: `vpdpbusd` into `i32`).
macro_rules! panel_k23 {
    ($name:ident, $features:literal, $step:expr, $widen:expr, $i16:expr) => {
        #[target_feature(enable = $features)]
        pub(crate) fn $name<const Q3: bool, const R: usize>(
            panel: &[u8],
            nb: usize,
            rows: &[InputRow],
            out: &mut [f32],
        ) {
            let step = $step;
            let widen = $widen;

            let (pb, _, _, _) = k23_layout(Q3);
            let rows = k_rows::<R>(rows, panel, nb, pb, out);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let blk = &panel[b * pb..b * pb + pb];
                let (d, dmin) = d_dmin(blk);
                let scales = k23_scales::<Q3>(blk);
                // The mins' (Q3_K: the offset's) part from the inputs'
                // sums, by pairs of sub-blocks.
                let mut msum = [_mm256_setzero_si256(); R];
                for (r, msum) in msum.iter_mut().enumerate() {
                    let pairs = sum_pairs(&rows[r].sums[16 * b..16 * b + 16]);
                    for (u, (s02, s13)) in pairs.into_iter().enumerate() {
                        let (even, odd) = (
                            k23_min_pair::<Q3, true>(&scales, u),
                            k23_min_pair::<Q3, false>(&scales, u),
                        );
                        let e = _mm256_madd_epi16(even, s02);
                        let o = _mm256_madd_epi16(odd, s13);
                        *msum = _mm256_add_epi32(*msum, _mm256_add_epi32(e, o));
                    }
                }
                if !Q3 {
                    for r in 0..R {
                        let dx = _mm256_set1_ps(rows[r].d[b]);
                        acc[r] =
                            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(dmin, dx), acc[r]);
                    }
                }
                let qs = block_inputs(rows, b);
                let mut isum = [_mm256_setzero_si256(); R];
                for n in 0..2 {
                    for j in 0..4 {
                        for half in 0..2 {
                            let mut s = [_mm256_setzero_si256(); R];
                            for i in 4 * half..4 * half + 4 {
                                if i % 2 == 0 {
                                    prefetch_ahead(blk, pb, 16 * n + 4 * j + i / 2);
                                }
                                let codes = k23_step::<Q3>(blk, n, j, i);
                                for r in 0..R {
                                    let x = x4(qs[r], 128 * n + 32 * j + 4 * i);
                                    s[r] = step(s[r], codes, _mm256_set1_epi32(x));
                                }
                            }
                            let scale = k23_scale::<Q3>(&scales, 8 * n + 2 * j + half);
                            for r in 0..R {
                                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(widen(s[r]), scale));
                            }
                        }
                    }
                }
                for r in 0..R {
                    let dx = _mm256_set1_ps(rows[r].d[b]);
                    let total = match Q3 {
                        true => _mm256_sub_epi32(isum[r], msum[r]),
                        false => isum[r],
                    };
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[r]);
                }
            }
            for (acc, out) in acc.iter().zip(out.chunks_exact_mut(8)) {
                // SAFETY: `out` holds 8 floats.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
            }
        }
    };
}

avx2_and_vnni!(panel_k23, panel_k23, panel_k23_vnni);
