//! The k-quants' panels (`repack.rs`: Q4_K, Q5_K, Q6_K, 8 features a
//! panel) with AVX2, and with AVX512-VNNI on 256-bit vectors (the same
//! code, its step `vpdpbusd`, its 32 registers holding 8 rows' sums), as
//! ggml-cpu's repacked `gemv_q4_K_8x8`: a step of 4 values for each of the
//! 8 features, its `vpmaddubsw` products summed in `i16` over a
//! sub-block, widened, then multiplied by the 8 features'
//! scales of that sub-block (`vpmulld`, one lane each); the mins' and
//! Q6_K's offset's part from the inputs' per-16 sums (`vpmaddwd` on
//! scale pairs). Sums stay in `i32` to the block's end. Also the loads the
//! AVX2 files read blocks and inputs with ([`load32`], [`x4`], [`d_dmin`],
//! [`sum_pairs`], [`block_inputs`], [`k_rows`]), and the k-quants'
//! unpacking that `lanes.rs` shares ([`k4_scales`], [`k4_step`],
//! [`q6k_step`]).

use std::arch::x86_64::*;

use super::inputs::InputRow;

/// Blocks ahead of its loads a panel prefetches (a block: 0.7–1.7 KB),
/// so that a decode step's stream of weights is in cache when a block
/// starts: the panels whose steps read two places of a block at once
/// (Q5_K's `qh` and `qs`, Q6_K's `ql` and `qh`, Q3_K's `hmask` and `qs`,
/// Q2_K's scales and `qs`), which the hardware prefetcher alone serves far
/// slower. A panel read in order (Q4_K, the formats of 32) takes none:
/// there the prefetches only add instructions.
const AHEAD: usize = 2;

/// Step `s` (of a block's 32) prefetches its 32nd of the block [`AHEAD`]
/// blocks on: spread over the steps, a block's lines are asked for a few
/// at a time, within what the core's line fill buffers hold.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn prefetch_ahead(blk: &[u8], pb: usize, s: usize) {
    _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(AHEAD * pb + s * pb / 32).cast());
}

/// 32 bytes of `b` from `at` (checked).
#[target_feature(enable = "avx2")]
pub(super) fn load32(b: &[u8], at: usize) -> __m256i {
    let b = &b[at..at + 32];
    // SAFETY: `b` holds 32 bytes.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// A k-quant panel block's 8 features' `d` and `dmin` (f16s at 0 and at
/// 16), widened.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn d_dmin(blk: &[u8]) -> (__m256, __m256) {
    let b = &blk[..32];
    // SAFETY: `b` holds 32 bytes, two 16-byte loads.
    unsafe {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(16).cast())),
        )
    }
}

/// A block's 16 input sums (per 16 values, `i16`) as the pairs that a
/// scale word's pairs multiply (`vpmaddwd`), each in every lane: for word
/// `u` (sub-blocks `4u..4u + 4`), `(s[4u], s[4u + 2])` and `(s[4u + 1],
/// s[4u + 3])`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn sum_pairs(sums: &[i16]) -> [(__m256i, __m256i); 4] {
    let sums = &sums[..16];
    // SAFETY: `sums` holds 16 `i16`s.
    let v = unsafe { _mm256_loadu_si256(sums.as_ptr().cast()) };
    // Each half's s0..s7 as s0, s2, s4, s6, s1, s3, s5, s7: its `i32` lanes
    // (s0, s2), (s4, s6), (s1, s3), (s5, s7).
    let order = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let v = _mm256_shuffle_epi8(v, order);
    let lane = |i: usize| _mm256_permutevar8x32_epi32(v, _mm256_set1_epi32(i as i32));
    std::array::from_fn(|u| {
        let at = 4 * (u / 2) + u % 2;
        (lane(at), lane(at + 2))
    })
}

/// `rows` as `R` rows, checked to hold `nb` blocks of 256 inputs for a
/// k-quant kernel over `nb` panel blocks of `pb` bytes in `panel`, into
/// `out` (8 a row).
pub(super) fn k_rows<'r, 'a, const R: usize>(
    rows: &'r [InputRow<'a>],
    panel: &[u8],
    nb: usize,
    pb: usize,
    out: &[f32],
) -> &'r [InputRow<'a>; R] {
    let rows: &[InputRow; R] = rows.try_into().expect("R rows");
    assert!(panel.len() >= nb * pb && out.len() >= 8 * R);
    for row in rows {
        assert!(row.q.len() >= 256 * nb && row.d.len() >= nb && row.sums.len() >= 16 * nb);
    }
    rows
}

/// The `R` rows' inputs of block `b` (of 256) as whole arrays: the
/// steps' loads need no bound checks.
#[inline]
pub(super) fn block_inputs<'a, const R: usize>(rows: &[InputRow<'a>; R], b: usize) -> [&'a [i8; 256]; R] {
    std::array::from_fn(|r| rows[r].q[256 * b..256 * b + 256].try_into().expect("256 inputs"))
}

/// The 4 bytes of a row's quantized inputs at `at`, as one `i32` to
/// broadcast.
#[inline]
pub(super) fn x4(q: &[i8], at: usize) -> i32 {
    let four = &q[at..at + 4];
    // SAFETY: `four` holds 4 bytes; any 4 bytes are an `i32`.
    unsafe { four.as_ptr().cast::<i32>().read_unaligned() }
}

/// Byte `i` (0..4) of each `i32` lane, zero-extended.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn lane_byte(v: __m256i, i: i32) -> __m256i {
    _mm256_and_si256(
        _mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * i)),
        _mm256_set1_epi32(0xFF),
    )
}

/// A Q4_K or Q5_K panel block's 8 features' 12 scale bytes (3 words a
/// lane) unpacked as ggml's `utmp`: the scales (0..4 and 4..8 a byte
/// each, `lane_byte`) and the mins alike.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_scales(blk: &[u8]) -> ([__m256i; 2], [__m256i; 2]) {
    let (k1, k2, k3) = (
        _mm256_set1_epi32(0x3f3f_3f3f),
        _mm256_set1_epi32(0x0f0f_0f0f),
        _mm256_set1_epi32(0x0303_0303),
    );
    let (a, bw, c) = (load32(blk, 32), load32(blk, 64), load32(blk, 96));
    let sc = [
        _mm256_and_si256(a, k1),
        _mm256_or_si256(
            _mm256_and_si256(c, k2),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a, 6), k3), 4),
        ),
    ];
    let mn = [
        _mm256_and_si256(bw, k1),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32(c, 4), k2),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(bw, 6), k3), 4),
        ),
    ];
    (sc, mn)
}

/// Step `st` of group `g` (of 64 values) of a Q4_K (`Q5`: Q5_K) panel
/// block: its 8 features' 4 codes of sub-block `2g` (the low nibbles)
/// and of `2g + 1` (the high ones), the fifth bits or'ed in.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_step<const Q5: bool>(blk: &[u8], g: usize, st: usize) -> (__m256i, __m256i) {
    let qs_at = if Q5 { 384 } else { 128 };
    let low = _mm256_set1_epi8(0x0F);
    let v = load32(blk, qs_at + 32 * (8 * g + st));
    let mut lo = _mm256_and_si256(v, low);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if Q5 {
        let qh = load32(blk, 128 + 32 * st);
        let fifth = |bit: usize| {
            let mask = _mm256_set1_epi8(1 << bit);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, mask), mask);
            _mm256_and_si256(set, _mm256_set1_epi8(16))
        };
        lo = _mm256_or_si256(lo, fifth(2 * g));
        hi = _mm256_or_si256(hi, fifth(2 * g + 1));
    }
    (lo, hi)
}

/// Step `st` (of 8) of quarter `j1` (0 or 1) of half `n` of a Q6_K panel
/// block: its 8 features' 4 six-bit codes of quarter `j1` (`ql`'s low
/// nibbles) and of quarter `2 + j1` (the high ones), `qh`'s bits or'ed in.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q6k_step(blk: &[u8], n: usize, j1: usize, st: usize) -> (__m256i, __m256i) {
    let (low, two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let v = load32(blk, Q6K_QL + 32 * (16 * n + 8 * j1 + st));
    let h = load32(blk, Q6K_QH + 32 * (8 * n + st));
    let (hl, hh) = match j1 {
        0 => (_mm256_slli_epi16(h, 4), h),
        _ => (_mm256_slli_epi16(h, 2), _mm256_srli_epi16(h, 2)),
    };
    let lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(hl, two));
    let hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
        _mm256_and_si256(hh, two),
    );
    (lo, hi)
}

/// Where a Q6_K panel block's `ql` and `qh` start (`repack.rs`: `d` at 0,
/// the scales at 16).
const Q6K_QL: usize = 144;
const Q6K_QH: usize = 1168;

/// Q4_K (`Q5`: Q5_K) panels times `R` rows, into `out` (8 a row), as a
/// function `$name` with `$features`, `$step(s, u, x)` adding a step's
/// products to `s` and `$widen(s)` its sums as `i32` (AVX2: `vpmaddubsw`
/// into `i16`, widened by `vpmaddwd`, `$i16` true; VNNI: `vpdpbusd` into
/// `i32`).
macro_rules! panel_k4 {
    ($name:ident, $features:literal, $step:expr, $widen:expr, $i16:expr) => {
        #[target_feature(enable = $features)]
        pub(crate) fn $name<const Q5: bool, const R: usize>(
            panel: &[u8],
            nb: usize,
            rows: &[InputRow],
            out: &mut [f32],
        ) {
            let step = $step;
            let widen = $widen;

            let pb = if Q5 { 1408 } else { 1152 };
            let rows = k_rows::<R>(rows, panel, nb, pb, out);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let blk = &panel[b * pb..b * pb + pb];
                let (d, dmin) = d_dmin(blk);
                let (sc, mn) = k4_scales(blk);
                // The mins' part, from the inputs' sums, taken from the
                // accumulators before the products: no register holds it
                // during them.
                for r in 0..R {
                    let mut msum = _mm256_setzero_si256();
                    for g in 0..4 {
                        let (ma, mb) = (
                            lane_byte(mn[g / 2], 2 * (g % 2) as i32),
                            lane_byte(mn[g / 2], 2 * (g % 2) as i32 + 1),
                        );
                        // The two sub-blocks' input sums (each of 32: two of 16).
                        let sums = &rows[r].sums[16 * b + 4 * g..16 * b + 4 * g + 4];
                        let (s0, s1) = (i32::from(sums[0] + sums[1]), i32::from(sums[2] + sums[3]));
                        let mins = _mm256_add_epi32(
                            _mm256_mullo_epi32(ma, _mm256_set1_epi32(s0)),
                            _mm256_mullo_epi32(mb, _mm256_set1_epi32(s1)),
                        );
                        msum = _mm256_add_epi32(msum, mins);
                    }
                    let dx = _mm256_set1_ps(rows[r].d[b]);
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[r]);
                }
                let qs = block_inputs(rows, b);
                let mut isum = [_mm256_setzero_si256(); R];
                for g in 0..4 {
                    // Sub-blocks 2g (the low nibbles) and 2g + 1 (the high ones).
                    let (sa, sb) = (
                        lane_byte(sc[g / 2], 2 * (g % 2) as i32),
                        lane_byte(sc[g / 2], 2 * (g % 2) as i32 + 1),
                    );
                    // In `i16` (AVX2), Q4's 8 steps' products fit
                    // (8·2·15·127), Q5's 4; in `i32` (VNNI), any, and one
                    // run of 8 leaves Q5's 8 rows' sums in registers.
                    let halves = if Q5 && $i16 { 2 } else { 1 };
                    let mut wide_lo = [_mm256_setzero_si256(); R];
                    let mut wide_hi = [_mm256_setzero_si256(); R];
                    for h in 0..halves {
                        let mut s_lo = [_mm256_setzero_si256(); R];
                        let mut s_hi = [_mm256_setzero_si256(); R];
                        for st in h * 8 / halves..(h + 1) * 8 / halves {
                            if Q5 {
                                prefetch_ahead(blk, pb, 8 * g + st);
                            }
                            let (lo, hi) = k4_step::<Q5>(blk, g, st);
                            for r in 0..R {
                                let q = qs[r];
                                let (xl, xh) = (x4(q, 64 * g + 4 * st), x4(q, 64 * g + 32 + 4 * st));
                                s_lo[r] = step(s_lo[r], lo, _mm256_set1_epi32(xl));
                                s_hi[r] = step(s_hi[r], hi, _mm256_set1_epi32(xh));
                            }
                        }
                        for r in 0..R {
                            wide_lo[r] = _mm256_add_epi32(wide_lo[r], widen(s_lo[r]));
                            wide_hi[r] = _mm256_add_epi32(wide_hi[r], widen(s_hi[r]));
                        }
                    }
                    for r in 0..R {
                        let scaled = _mm256_add_epi32(
                            _mm256_mullo_epi32(wide_lo[r], sa),
                            _mm256_mullo_epi32(wide_hi[r], sb),
                        );
                        isum[r] = _mm256_add_epi32(isum[r], scaled);
                    }
                }
                for r in 0..R {
                    let dx = _mm256_set1_ps(rows[r].d[b]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
                }
            }
            for (acc, out) in acc.iter().zip(out.chunks_exact_mut(8)) {
                // SAFETY: `out` holds 8 floats.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
            }
        }
    };
}

avx2_and_vnni!(panel_k4, panel_k4, panel_k4_vnni);

/// Q6_K panels times `R` rows, into `out` (8 a row): `w = d·sc·(u −
/// 32)` per 16 elements, `u` six bits from `ql` and `qh`; `$step` and
/// `$widen` as [`panel_k4!`]'s. With `i16` sums (`$i16`) they are widened
/// every two steps; in `i32` (VNNI) the steps add to the group's sums
/// themselves, which leaves registers for 8 rows.
macro_rules! panel_q6k {
    ($name:ident, $features:literal, $step:expr, $widen:expr, $i16:expr) => {
        #[target_feature(enable = $features)]
        pub(crate) fn $name<const R: usize>(panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
            let step = $step;
            let widen = $widen;

            // The panel block: `d` at 0, the scales at 16, `ql` and `qh`.
            const PB: usize = 1680;
            let rows = k_rows::<R>(rows, panel, nb, PB, out);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let blk = &panel[b * PB..b * PB + PB];
                // SAFETY: `blk` holds `PB` bytes, past the 16-byte load at 0.
                let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast())) };
                // The 16 scales (i8) of each feature: 4 words a lane.
                let scales: [__m256i; 4] = std::array::from_fn(|i| load32(blk, 16 + 32 * i));
                // Scale `h` of each lane, sign-extended.
                let scale = |h: usize| {
                    let v = _mm256_sll_epi32(scales[h / 4], _mm_cvtsi32_si128(24 - 8 * (h % 4) as i32));
                    _mm256_srai_epi32(v, 24)
                };
                let qs = block_inputs(rows, b);
                let mut isum = [_mm256_setzero_si256(); R];
                for n in 0..2 {
                    for j1 in 0..2 {
                        for hh in 0..2 {
                            // Groups of 16: quarter j1's (low nibbles) and quarter
                            // 2 + j1's (high), half hh of each.
                            let mut w_lo = [_mm256_setzero_si256(); R];
                            let mut w_hi = [_mm256_setzero_si256(); R];
                            for pair in 0..2 {
                                // Two steps' products fit `i16` (2·2·63·127).
                                let (mut s_lo, mut s_hi) = match $i16 {
                                    true => ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]),
                                    false => (w_lo, w_hi),
                                };
                                for st in 4 * hh + 2 * pair..4 * hh + 2 * pair + 2 {
                                    prefetch_ahead(blk, PB, 16 * n + 8 * j1 + st);
                                    let (lo, hi) = q6k_step(blk, n, j1, st);
                                    for r in 0..R {
                                        let q = qs[r];
                                        let at = 128 * n + 32 * j1 + 4 * st;
                                        let (xl, xh) = (x4(q, at), x4(q, at + 64));
                                        s_lo[r] = step(s_lo[r], lo, _mm256_set1_epi32(xl));
                                        s_hi[r] = step(s_hi[r], hi, _mm256_set1_epi32(xh));
                                    }
                                }
                                if $i16 {
                                    for r in 0..R {
                                        w_lo[r] = _mm256_add_epi32(w_lo[r], widen(s_lo[r]));
                                        w_hi[r] = _mm256_add_epi32(w_hi[r], widen(s_hi[r]));
                                    }
                                } else {
                                    (w_lo, w_hi) = (s_lo, s_hi);
                                }
                            }
                            let (h_lo, h_hi) = (8 * n + 2 * j1 + hh, 8 * n + 2 * (2 + j1) + hh);
                            let (sc_lo, sc_hi) = (scale(h_lo), scale(h_hi));
                            for r in 0..R {
                                let scaled = _mm256_add_epi32(
                                    _mm256_mullo_epi32(w_lo[r], sc_lo),
                                    _mm256_mullo_epi32(w_hi[r], sc_hi),
                                );
                                isum[r] = _mm256_add_epi32(isum[r], scaled);
                            }
                        }
                    }
                }
                // The offset: 32·Σ_h sc_h·Σ_{i∈h} q_i, scale pairs (even and odd
                // bytes of each word, sign-extended) by input-sum pairs.
                for r in 0..R {
                    let sums = &rows[r].sums[16 * b..16 * b + 16];
                    let mut off = _mm256_setzero_si256();
                    for (s, (s02, s13)) in scales.iter().zip(sum_pairs(sums)) {
                        let even = _mm256_srai_epi16(_mm256_slli_epi16(*s, 8), 8);
                        let odd = _mm256_srai_epi16(*s, 8);
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(even, s02));
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(odd, s13));
                    }
                    let total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
                    let dx = _mm256_set1_ps(rows[r].d[b]);
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

avx2_and_vnni!(panel_q6k, panel_q6k, panel_q6k_vnni);
