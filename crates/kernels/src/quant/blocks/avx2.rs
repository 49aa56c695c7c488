//! The block products with AVX2, as ggml's AVX2 `vec_dot`s: each block's
//! values brought to `u8` lanes once for up to 8 input rows and
//! multiplied with `vpmaddubsw` (`u8 · i8` pairs, below `2·63·127`, so
//! never saturating), then `vpmaddwd` by the scales; sums in `i32` lanes
//! to the block's end and in f32 lanes to the row's.
//!
//! The formats in panels of 8 features (`repack.rs`: the formats of 32
//! here, the k-quants in `avx2_k.rs`) take a step's products one lane per
//! feature. Q2_K and Q3_K stay in rows, each block unpacked into a
//! buffer for up to 8 input rows (a prefill of 16 rows or more unpacks 8
//! features' rows into the form of `lanes.rs`). Q8_0, whose `u` can be 255, goes to the portable code: its
//! weights take the Q8_0 kernels (`quant/q8_0/`).

use std::arch::x86_64::*;

use super::avx2_k::{self, load32, x4};
use super::format::{q3k_scales, unpack, BlockFormat, Unpacked};
use super::inputs::{row_groups, InputRow};

/// An f16 at `b[at..at + 2]`.
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// How far ahead of its loads a panel's blocks are prefetched, in bytes:
/// a decode step reads one stream of weights, which the hardware
/// prefetcher alone does not keep ahead of (as for Q8_0, `quant/q8_0/avx2.rs`).
const PREFETCH: usize = 1024;

/// Weight row `w` (a k-quant's blocks) times input rows `rows`, into
/// `out`: the AVX2 form of `portable::dot_rows` for the k-quants (256
/// values a block), 8 rows at a time (then 4, 2, 1), each group's sums in
/// registers.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_rows(format: BlockFormat, w: &[u8], rows: &[InputRow], out: &mut [f32]) {
    debug_assert_eq!(
        format.block_elems(),
        256,
        "{} has no AVX2 row kernel",
        format.name()
    );
    for (at, n) in row_groups(rows.len(), 8) {
        let (rows, out) = (&rows[at..at + n], &mut out[at..at + n]);
        match (n, format) {
            (8, BlockFormat::Q3_K) => dot_256::<8, true>(format, w, rows, out),
            (4, BlockFormat::Q3_K) => dot_256::<4, true>(format, w, rows, out),
            (2, BlockFormat::Q3_K) => dot_256::<2, true>(format, w, rows, out),
            (_, BlockFormat::Q3_K) => dot_256::<1, true>(format, w, rows, out),
            (8, _) => dot_256::<8, false>(format, w, rows, out),
            (4, _) => dot_256::<4, false>(format, w, rows, out),
            (2, _) => dot_256::<2, false>(format, w, rows, out),
            _ => dot_256::<1, false>(format, w, rows, out),
        }
    }
}

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
                let blk = &panel[b * pb..b * pb + pb];
                for line in (0..pb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH + line).cast());
                }
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

/// A Q2_K block's 16 scales and 16 mins (the low and high nibbles of its
/// first 16 bytes) as `i16`s.
#[inline]
#[target_feature(enable = "avx2")]
fn q2k_scales(b: &[u8]) -> (__m256i, __m256i) {
    let b = &b[..16];
    // SAFETY: `b` holds 16 bytes.
    let s = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(b.as_ptr().cast()) });
    (
        _mm256_and_si256(s, _mm256_set1_epi16(0xF)),
        _mm256_srli_epi16(s, 4),
    )
}

/// A k-quant block kept in rows unpacked: Q2_K and Q3_K with vector code,
/// others as `format.rs` unpacks them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unpack_k(format: BlockFormat, b: &[u8], p: &mut Unpacked) {
    let store = |u: &mut [u8; 256], at: usize, v: __m256i| {
        let u = &mut u[at..at + 32];
        // SAFETY: `u` holds 32 bytes.
        unsafe { _mm256_storeu_si256(u.as_mut_ptr().cast(), v) }
    };
    match format {
        BlockFormat::Q2_K | BlockFormat::Q3_K => {
            // Element 128n + 32j + l: bits 2j.. of qs[32n + l]; Q3_K's
            // third bit is bit 4n + j of hmask[l].
            let (qs, three) = match format {
                BlockFormat::Q3_K => (32, Some(load32(b, 0))),
                _ => (16, None),
            };
            let two_bits = _mm256_set1_epi8(3);
            for n in 0..2 {
                let q = load32(b, qs + 32 * n);
                for j in 0..4 {
                    let mut u =
                        _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), two_bits);
                    if let Some(hm) = three {
                        let mask = _mm256_set1_epi8(1 << (4 * n + j));
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, mask), mask);
                        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(4)));
                    }
                    store(&mut p.u, 128 * n + 32 * j, u);
                }
            }
            if format == BlockFormat::Q3_K {
                p.d = f16_at(b, 108);
                p.dmin = p.d;
                let s = q3k_scales(&b[96..108]);
                // SAFETY: `s` holds 16 bytes.
                let s = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(s.as_ptr().cast()) });
                let sc = _mm256_sub_epi16(s, _mm256_set1_epi16(32));
                // SAFETY: `sc` and `m` hold 16 `i16` each.
                unsafe {
                    _mm256_storeu_si256(p.sc.as_mut_ptr().cast(), sc);
                    _mm256_storeu_si256(p.m.as_mut_ptr().cast(), _mm256_slli_epi16(sc, 2));
                }
            } else {
                p.d = f16_at(b, 80);
                p.dmin = f16_at(b, 82);
                let (sc, m) = q2k_scales(b);
                // SAFETY: `sc` and `m` hold 16 `i16` each.
                unsafe {
                    _mm256_storeu_si256(p.sc.as_mut_ptr().cast(), sc);
                    _mm256_storeu_si256(p.m.as_mut_ptr().cast(), m);
                }
            }
        }
        _ => unpack(format, b, p),
    }
}

/// The k-quants kept in rows (`OFFSET`: Q3_K's offset, whose `dmin` is
/// `d`; else Q2_K's mins): `Σ_b dx·(d·Σ_h sc_h Σ u·q − dmin·Σ_h
/// m_h·sums_h)`, each block's two sums whole in integers, then the float
/// operations of the kernels with rows in lanes (`avx2_lanes.rs`,
/// `vnni_lanes.rs`), so that a row gives their bits.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_256<const R: usize, const OFFSET: bool>(
    format: BlockFormat,
    w: &[u8],
    rows: &[InputRow],
    out: &mut [f32],
) {
    let rows: &[InputRow; R] = rows.try_into().expect("R rows");
    let mut acc = [0f32; R];
    let mut p = Unpacked::default();
    let bb = format.block_bytes();
    // Per chunk c of 32 (of the 8 scales in a 128-bit lane): the low
    // lane's 8 `i16` take scale 2c, the high lane's scale 2c + 1.
    let pick: [__m256i; 8] = std::array::from_fn(|c| {
        let (a, b) = ((4 * c) as i8, (4 * c + 2) as i8);
        _mm256_setr_epi8(
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1, //
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
        )
    });
    for (b, block) in w.chunks_exact(bb).enumerate() {
        for line in (0..bb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(block.as_ptr().wrapping_add(PREFETCH + line).cast());
        }
        unpack_k(format, block, &mut p);
        // The 16 scales in both halves, each half's shuffle picking two.
        // SAFETY: `sc` and `m` hold 16 `i16` each.
        let (sc, m) = unsafe {
            (
                _mm256_loadu_si256(p.sc.as_ptr().cast()),
                _mm256_loadu_si256(p.m.as_ptr().cast()),
            )
        };
        let sc_lo = _mm256_permute2x128_si256(sc, sc, 0x00);
        let sc_hi = _mm256_permute2x128_si256(sc, sc, 0x11);
        let scales: [__m256i; 8] = std::array::from_fn(|c| {
            let half = if c < 4 { sc_lo } else { sc_hi };
            _mm256_shuffle_epi8(half, pick[c % 4])
        });
        let u: [__m256i; 8] = std::array::from_fn(|c| load32(&p.u, 32 * c));
        for r in 0..R {
            let row = &rows[r];
            let q = &row.q[256 * b..256 * b + 256];
            let mut isum = _mm256_setzero_si256();
            for c in 0..8 {
                // SAFETY: `q` holds 256 bytes from `32·c`.
                let qv = unsafe { _mm256_loadu_si256(q.as_ptr().add(32 * c).cast()) };
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], qv), scales[c]));
            }
            let sums = &row.sums[16 * b..16 * b + 16];
            // SAFETY: `sums` holds 16 `i16`.
            let msum = _mm256_madd_epi16(m, unsafe { _mm256_loadu_si256(sums.as_ptr().cast()) });
            let dx = row.d[b];
            if OFFSET {
                let total = hsum_i32(_mm256_sub_epi32(isum, msum));
                acc[r] = (total as f32).mul_add(p.d * dx, acc[r]);
            } else {
                let (isum, msum) = hsum_i32_pair(isum, msum);
                acc[r] = (-(msum as f32)).mul_add(p.dmin * dx, acc[r]);
                acc[r] = (isum as f32).mul_add(p.d * dx, acc[r]);
            }
        }
    }
    out.copy_from_slice(&acc);
}

/// The eight lanes' sum (wrapping, as the lanes' `i32` sums do).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// The eight lanes' sums of `a` and of `b` (wrapping), in one pass.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32_pair(a: __m256i, b: __m256i) -> (i32, i32) {
    // a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7
    let s = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b11_11_01_01));
    (_mm_cvtsi128_si32(s), _mm_extract_epi32(s, 2))
}
