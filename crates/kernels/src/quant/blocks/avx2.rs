//! The block products with AVX2, as ggml's AVX2 `vec_dot`s: the panels
//! of 8 features (`repack.rs`) take a step's products one lane per
//! feature, multiplied with `vpmaddubsw` (`u8 · i8` pairs, below
//! `2·63·127`, so never saturating), then `vpmaddwd`; sums in `i32` lanes
//! to the block's end and in f32 lanes to the row's. Here the dispatch and
//! the formats of 32; the k-quants in `avx2_k.rs` (Q4_K, Q5_K, Q6_K) and
//! `avx2_k23.rs` (Q2_K, Q3_K). Q8_0, whose `u` can be 255, goes to the
//! portable code: its weights take the Q8_0 kernels (`quant/q8_0/`).

use std::arch::x86_64::*;

use super::avx2_k::{self, load32, x4};
use super::avx2_k23;
use super::format::BlockFormat;
use super::inputs::{row_groups, InputRow};

/// The formats of 32 as `panel_32`'s const parameter.
pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;

/// A panel of 8 features (`repack.rs`, `nb` blocks) times input rows
/// `rows`, into `out` (8 a row, the panel's features in order): 4 rows
/// at a time (then 2, 1), each group's sums in registers.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    // The k-quants' kernels hold 2 rows' sums in registers, the others 4.
    let most = if format.block_elems() == 256 { 2 } else { 4 };
    for (at, n) in row_groups(rows.len(), most) {
        let (rows, out) = (&rows[at..at + n], &mut out[8 * at..8 * (at + n)]);
        macro_rules! by_rows {
            ($f:expr) => {
                match n {
                    4 => panel_32::<$f, 4>(panel, nb, rows, out),
                    2 => panel_32::<$f, 2>(panel, nb, rows, out),
                    _ => panel_32::<$f, 1>(panel, nb, rows, out),
                }
            };
        }
        match (format, n) {
            (BlockFormat::Q4_K, 2) => avx2_k::panel_k4::<false, 2>(panel, nb, rows, out),
            (BlockFormat::Q4_K, _) => avx2_k::panel_k4::<false, 1>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 2) => avx2_k::panel_k4::<true, 2>(panel, nb, rows, out),
            (BlockFormat::Q5_K, _) => avx2_k::panel_k4::<true, 1>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 2) => avx2_k::panel_q6k::<2>(panel, nb, rows, out),
            (BlockFormat::Q6_K, _) => avx2_k::panel_q6k::<1>(panel, nb, rows, out),
            (BlockFormat::Q2_K, 2) => avx2_k23::panel_k23::<false, 2>(panel, nb, rows, out),
            (BlockFormat::Q2_K, _) => avx2_k23::panel_k23::<false, 1>(panel, nb, rows, out),
            (BlockFormat::Q3_K, 2) => avx2_k23::panel_k23::<true, 2>(panel, nb, rows, out),
            (BlockFormat::Q3_K, _) => avx2_k23::panel_k23::<true, 1>(panel, nb, rows, out),
            (BlockFormat::Q4_0, _) => by_rows!(Q4_0),
            (BlockFormat::Q4_1, _) => by_rows!(Q4_1),
            (BlockFormat::Q5_0, _) => by_rows!(Q5_0),
            _ => by_rows!(Q5_1),
        }
    }
}

/// The fifth bits of a step: byte `4c + t` (of each 128-bit half's
/// features) 16 where bit `shift + t` of feature `c`'s `qh` (lane `c`) is
/// set.
#[target_feature(enable = "avx2")]
pub(super) fn fifth_bits(qh: __m256i, shift: i32) -> __m256i {
    let shifted = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(shift));
    let spread = _mm256_shuffle_epi8(
        shifted,
        _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, //
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
        ),
    );
    let bit = _mm256_set1_epi32(0x0804_0201);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// `R` rows times one panel of format `F`: per block, the 8 features'
/// sums in the lanes of one vector, `Σ d·dx·Σ u·q − dmin·(dx·Σ q)`; as a
/// function `$name` with `$features`, `$step(s, u, x)` adding a step's
/// products to `s` and `$widen(s)` its sums as `i32` (AVX2: `vpmaddubsw`
/// into `i16`, widened by `vpmaddwd`; VNNI: `vpdpbusd` into `i32`).
macro_rules! panel_32 {
    ($name:ident, $features:literal, $step:expr, $widen:expr, $i16:expr) => {
        #[target_feature(enable = $features)]
        pub(super) fn $name<const F: u8, const R: usize>(
            panel: &[u8],
            nb: usize,
            rows: &[InputRow],
            out: &mut [f32],
        ) {
            // The panel block's size and where its mins, fifth bits and nibbles are.
            let (pb, m_at, qh_at, qs_at) = match F {
                Q4_0 => (144, 0, 0, 16),
                Q4_1 => (160, 16, 0, 32),
                Q5_0 => (176, 0, 16, 48),
                _ => (192, 16, 32, 64),
            };
            let rows: &[InputRow; R] = rows.try_into().expect("R rows");
            assert!(panel.len() >= nb * pb && out.len() >= 8 * R);
            for row in rows {
                assert!(row.q.len() >= 32 * nb && row.d.len() >= nb && row.dsums.len() >= nb);
            }
            let (step, widen) = ($step, $widen);
            let low = _mm256_set1_epi8(0x0F);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // No software prefetch: a panel's blocks are read in order,
                // which the hardware prefetcher follows, so prefetches here
                // would only add instructions (the k-quants whose steps
                // read two places of a block take them: `prefetch_ahead`).
                let blk = &panel[b * pb..b * pb + pb];
                // SAFETY: `blk` holds `pb` bytes, past every offset read below.
                let (d, dmin, qh) = unsafe {
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast()));
                    let dmin = match F {
                        Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(8.)),
                        Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(16.)),
                        _ => _mm256_sub_ps(
                            _mm256_setzero_ps(),
                            _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().add(m_at).cast())),
                        ),
                    };
                    let qh = match F {
                        Q5_0 | Q5_1 => _mm256_loadu_si256(blk.as_ptr().add(qh_at).cast()),
                        _ => _mm256_setzero_si256(),
                    };
                    (d, dmin, qh)
                };
                let mut isum = [_mm256_setzero_si256(); R];
                for pair in 0..2 {
                    // Two steps' products (AVX2: in i16, at most 4·2·31·127 < 2¹⁵).
                    let mut s16 = [_mm256_setzero_si256(); R];
                    for g in 2 * pair..2 * pair + 2 {
                        let v = load32(blk, qs_at + 32 * g);
                        let mut lo = _mm256_and_si256(v, low);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        if F == Q5_0 || F == Q5_1 {
                            lo = _mm256_or_si256(lo, fifth_bits(qh, 4 * g as i32));
                            hi = _mm256_or_si256(hi, fifth_bits(qh, 16 + 4 * g as i32));
                        }
                        for r in 0..R {
                            let q = &rows[r].q[32 * b..32 * b + 32];
                            let x = |at: usize| x4(q, at);
                            let (xlo, xhi) = (
                                _mm256_set1_epi32(x(4 * g)),
                                _mm256_set1_epi32(x(16 + 4 * g)),
                            );
                            s16[r] = step(step(s16[r], lo, xlo), hi, xhi);
                        }
                    }
                    for r in 0..R {
                        isum[r] = _mm256_add_epi32(isum[r], widen(s16[r]));
                    }
                }
                for r in 0..R {
                    let row = &rows[r];
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(row.d[b]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dmin, _mm256_set1_ps(row.dsums[b]), acc[r]);
                }
            }
            for (acc, out) in acc.iter().zip(out.chunks_exact_mut(8)) {
                // SAFETY: `out` holds 8 floats.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
            }
        }
    };
}

avx2_and_vnni!(panel_32, panel_32, panel_32_vnni);
