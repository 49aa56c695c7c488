//! The panels' products with rows in lanes, for a prefill of 16 rows or
//! more, as ggml-cpu's tiled `tiled_run_micro_vnni_8x16`: a call's inputs
//! are laid out once with several rows' 4 values in one vector
//! ([`LaneInputs`]: 16 rows for AVX512-VNNI's 512-bit vectors,
//! `vnni_lanes.rs`; 8 for AVX2's, `avx2_lanes.rs`), a task's panels are
//! unpacked once into their codes and scales ([`UnpackedPanel`], with
//! AVX2), and each step multiplies a feature's 4 codes (broadcast) by the
//! rows' values in one vector. The panels' own kernels (`avx2.rs`,
//! `avx2_k.rs`) unpack every step's codes anew for each few rows and hold
//! a feature a lane; here the unpacking is shared by all the rows.
//!
//! The kernels' sums are the integers of the panels' kernels of the same
//! instruction set, turned into floats in the same operations in the same
//! order: each row's outputs are those kernels' bits, whatever rows share
//! its vector.

use std::arch::x86_64::*;

use super::avx2::fifth_bits;
use super::avx2_k::{d_dmin, k4_scales, k4_step, lane_byte, load32, q6k_step};
use super::avx2_k23::{k23_layout, k23_min_pair, k23_scale, k23_scales, k23_step};
use super::format::BlockFormat;
use super::inputs::InputRow;
use super::repack::PANEL;
use crate::runtime::pool::par_chunks_mut;

/// Rows `r0..r0 + 8` of a panel's outputs, each its 8 features: `ys`
/// holds them feature by feature (8 runs of `n` rows, `n` a multiple of
/// 8, as the kernels store them); AVX's 8 × 8 transpose (unpack, shuffle,
/// then swap of 128-bit halves).
#[target_feature(enable = "avx")]
pub(crate) fn rows_of(ys: &[f32], n: usize, r0: usize) -> [[f32; 8]; 8] {
    assert!(ys.len() >= PANEL * n && r0 + 8 <= n);
    // SAFETY: feature f's 8 rows from r0 are inside `ys` (asserted).
    let v: [__m256; 8] = std::array::from_fn(|f| unsafe { _mm256_loadu_ps(ys[f * n + r0..].as_ptr()) });
    // Pairs of features interleaved, then 4 features' rows in each
    // 128-bit half (rows 0..4 low, 4..8 high), then halves swapped.
    let t = [
        _mm256_unpacklo_ps(v[0], v[1]),
        _mm256_unpackhi_ps(v[0], v[1]),
        _mm256_unpacklo_ps(v[2], v[3]),
        _mm256_unpackhi_ps(v[2], v[3]),
        _mm256_unpacklo_ps(v[4], v[5]),
        _mm256_unpackhi_ps(v[4], v[5]),
        _mm256_unpacklo_ps(v[6], v[7]),
        _mm256_unpackhi_ps(v[6], v[7]),
    ];
    let q = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    let mut out = [[0f32; 8]; 8];
    for (r, row) in out.iter_mut().enumerate() {
        let (lo, hi) = (q[r % 4], q[4 + r % 4]);
        let w = match r < 4 {
            true => _mm256_permute2f128_ps::<0x20>(lo, hi),
            false => _mm256_permute2f128_ps::<0x31>(lo, hi),
        };
        // SAFETY: `row` holds 8 floats.
        unsafe { _mm256_storeu_ps(row.as_mut_ptr(), w) };
    }
    out
}

/// Groups of 4 values in a 256-value block (a step: 4 values of each row).
pub(super) const STEPS: usize = 64;

/// Values a scale of `format`'s covers, of the k-quants this file takes.
fn sub(format: BlockFormat) -> Option<usize> {
    match format {
        BlockFormat::Q4_K | BlockFormat::Q5_K => Some(32),
        BlockFormat::Q2_K | BlockFormat::Q3_K | BlockFormat::Q6_K => Some(16),
        _ => None,
    }
}

/// Whether the kernels with rows in lanes take `format`: the formats kept
/// in panels.
pub(crate) fn takes(format: BlockFormat) -> bool {
    sub(format).is_some()
        || matches!(
            format,
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1
        )
}

/// A call's inputs, rows in lanes, per group of `lanes` rows (the last one
/// filled out with zero rows): each step's rows × 4 values, and per block
/// the rows' scales; for the k-quants, per pair of scales the rows' two
/// sums as `i16`s in an `i32`, for the formats of 32 the rows' `dx · Σ q`.
pub(crate) struct LaneInputs {
    pub(super) lanes: usize,
    rows: usize,
    pub(super) nb: usize,
    pub(super) pairs: usize,
    pub(super) groups: Vec<LaneGroup>,
}

/// A group's part of [`LaneInputs`].
#[derive(Default)]
pub(super) struct LaneGroup {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) sums: Vec<i32>,
    pub(super) dsums: Vec<f32>,
}

impl LaneInputs {
    /// `rows` (quantized in `format`'s blocks) for a weight in `format`,
    /// `lanes` rows a group, the groups in parallel.
    pub(crate) fn new(format: BlockFormat, rows: &[InputRow], lanes: usize) -> LaneInputs {
        assert!(
            takes(format),
            "{} has no kernel with rows in lanes",
            format.name()
        );
        let (nb, k) = rows.first().map_or((0, 0), |r| (r.d.len(), r.q.len()));
        // Pairs of scales a block, each a pair of the inputs' sums.
        let pairs = sub(format).map_or(0, |sub| 256 / sub / 2);
        let mut groups: Vec<LaneGroup> = (0..rows.len().div_ceil(lanes))
            .map(|_| LaneGroup::default())
            .collect();
        par_chunks_mut(&mut groups, 1, rows.len() * k, |g, group| {
            let group = &mut group[0];
            group.q = vec![0i8; k * lanes];
            group.d = vec![0f32; nb * lanes];
            group.sums = vec![0i32; nb * pairs * lanes];
            group.dsums = vec![0f32; if pairs == 0 { nb * lanes } else { 0 }];
            for (t, row) in rows[g * lanes..].iter().take(lanes).enumerate() {
                for (s, four) in row.q.chunks_exact(4).enumerate() {
                    group.q[(s * lanes + t) * 4..][..4].copy_from_slice(four);
                }
                for b in 0..nb {
                    group.d[b * lanes + t] = row.d[b];
                    if pairs == 0 {
                        group.dsums[b * lanes + t] = row.dsums[b];
                    }
                    // The sums of each scale's values, by pairs of scales.
                    let per = 8 / pairs.max(1);
                    let sum = |i: usize| -> i16 { row.sums[16 * b + per * i..][..per].iter().sum() };
                    for p in 0..pairs {
                        let pair = (i32::from(sum(2 * p + 1)) << 16) | i32::from(sum(2 * p) as u16);
                        group.sums[(b * pairs + p) * lanes + t] = pair;
                    }
                }
            }
        });
        LaneInputs {
            lanes,
            rows: rows.len(),
            nb,
            pairs,
            groups,
        }
    }

    /// Its rows.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Groups of `lanes` rows.
    pub(crate) fn groups(&self) -> usize {
        self.groups.len()
    }
}

/// One k-quant block of a panel's 8 features unpacked: per step the 8
/// features' 4 codes, per scale (of 16 or 32 values) the 8 features'
/// scales, per pair of scales their mins as two `i16`s, and the 8
/// features' `d` and `dmin`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct UnpackedBlock {
    pub(super) codes: [u32; STEPS * PANEL],
    pub(super) sc: [i32; 16 * PANEL],
    pub(super) mins: [i32; 8 * PANEL],
    pub(super) d: [f32; PANEL],
    pub(super) dmin: [f32; PANEL],
}

impl UnpackedBlock {
    const ZERO: UnpackedBlock = UnpackedBlock {
        codes: [0; STEPS * PANEL],
        sc: [0; 16 * PANEL],
        mins: [0; 8 * PANEL],
        d: [0.; PANEL],
        dmin: [0.; PANEL],
    };

    /// Sets the 8 features' `d` and `dmin`.
    #[target_feature(enable = "avx2")]
    fn put_d(&mut self, d: __m256, dmin: __m256) {
        // SAFETY: `d` and `dmin` hold 8 floats each.
        unsafe {
            _mm256_storeu_ps(self.d.as_mut_ptr(), d);
            _mm256_storeu_ps(self.dmin.as_mut_ptr(), dmin);
        }
    }
}

/// One block of 32 of a panel's 8 features unpacked: per step the 8
/// features' 4 codes, and their `d` and `dmin` (`w = d·u − dmin`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Unpacked32 {
    pub(super) codes: [u32; 8 * PANEL],
    pub(super) d: [f32; PANEL],
    pub(super) dmin: [f32; PANEL],
}

/// A panel's blocks unpacked.
pub(crate) enum UnpackedPanel {
    K(Vec<UnpackedBlock>),
    Of32(Vec<Unpacked32>),
}

/// A panel's `nb` blocks (`repack.rs`'s layout) unpacked.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn unpack_panel(format: BlockFormat, panel: &[u8], nb: usize) -> UnpackedPanel {
    let pb = panel.len() / nb.max(1);
    let blocks = panel.chunks_exact(pb);
    // Each block unpacked in its place in the vector (a block of 256 is
    // 2.8 KB).
    if sub(format).is_some() {
        let mut out = vec![UnpackedBlock::ZERO; nb];
        for (blk, o) in blocks.zip(out.iter_mut()) {
            match format {
                BlockFormat::Q4_K => unpack_k4::<false>(blk, o),
                BlockFormat::Q5_K => unpack_k4::<true>(blk, o),
                BlockFormat::Q2_K => unpack_k23::<false>(blk, o),
                BlockFormat::Q3_K => unpack_k23::<true>(blk, o),
                _ => unpack_q6k(blk, o),
            }
        }
        return UnpackedPanel::K(out);
    }
    UnpackedPanel::Of32(blocks.map(|b| unpack_32(format, b)).collect())
}

/// Stores 8 `i32` lanes at `at` of `dst`.
#[inline]
#[target_feature(enable = "avx2")]
fn store8<T: Copy>(dst: &mut [T], at: usize, v: __m256i) {
    assert!(size_of::<T>() == 4);
    let dst = &mut dst[at..at + 8];
    // SAFETY: `dst` holds 8 values of 4 bytes.
    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), v) }
}

/// A Q4_K (`Q5`: Q5_K) panel block into `o`, as `avx2_k.rs`'s `panel_k4!` reads it.
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_k4<const Q5: bool>(blk: &[u8], o: &mut UnpackedBlock) {
    let qs_at = if Q5 { 384 } else { 128 };
    assert!(blk.len() >= qs_at + 1024);
    let (d, dmin) = d_dmin(blk);
    o.put_d(d, dmin);
    let (sc, mn) = k4_scales(blk);
    for s in 0..8 {
        store8(&mut o.sc, 8 * s, lane_byte(sc[s / 4], (s % 4) as i32));
    }
    for p in 0..4 {
        let (m0, m1) = (
            lane_byte(mn[p / 2], 2 * (p % 2) as i32),
            lane_byte(mn[p / 2], 2 * (p % 2) as i32 + 1),
        );
        store8(&mut o.mins, 8 * p, _mm256_or_si256(m0, _mm256_slli_epi32(m1, 16)));
    }
    for g in 0..4 {
        for st in 0..8 {
            let (lo, hi) = k4_step::<Q5>(blk, g, st);
            store8(&mut o.codes, 8 * (16 * g + st), lo);
            store8(&mut o.codes, 8 * (16 * g + 8 + st), hi);
        }
    }
}

/// A Q2_K (`Q3`: Q3_K) panel block into `o`, as `avx2_k23.rs`'s
/// `panel_k23!` reads it; Q3_K's mins are the offset `4·sc`.
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_k23<const Q3: bool>(blk: &[u8], o: &mut UnpackedBlock) {
    let (pb, _, _, _) = k23_layout(Q3);
    assert!(blk.len() >= pb);
    let (d, dmin) = d_dmin(blk);
    o.put_d(d, if Q3 { d } else { dmin });
    let scales = k23_scales::<Q3>(blk);
    for h in 0..16 {
        store8(&mut o.sc, 8 * h, k23_scale::<Q3>(&scales, h));
    }
    // Pair p holds sub-blocks 2p and 2p + 1: of the word's even pair
    // (sub-blocks 4u, 4u + 2) and odd one (4u + 1, 4u + 3), the low or
    // high halves.
    for u in 0..4 {
        let (even, odd) = (
            k23_min_pair::<Q3, true>(&scales, u),
            k23_min_pair::<Q3, false>(&scales, u),
        );
        let halves = _mm256_set1_epi32(0xFFFF);
        let first = _mm256_or_si256(_mm256_and_si256(even, halves), _mm256_slli_epi32(odd, 16));
        let second = _mm256_or_si256(_mm256_srli_epi32(even, 16), _mm256_andnot_si256(halves, odd));
        store8(&mut o.mins, 8 * (2 * u), first);
        store8(&mut o.mins, 8 * (2 * u + 1), second);
    }
    for n in 0..2 {
        for j in 0..4 {
            for i in 0..8 {
                store8(
                    &mut o.codes,
                    8 * (32 * n + 8 * j + i),
                    k23_step::<Q3>(blk, n, j, i),
                );
            }
        }
    }
}

/// A Q6_K panel block into `o`, as `avx2_k.rs`'s `panel_q6k!` reads it; its mins
/// are the offset `32·sc`.
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q6k(blk: &[u8], o: &mut UnpackedBlock) {
    assert!(blk.len() >= 1680);
    // SAFETY: `blk` holds the block, past the 16-byte load at 0.
    let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast())) };
    o.put_d(d, d);
    let scales: [__m256i; 4] = std::array::from_fn(|i| load32(blk, 16 + 32 * i));
    let scale = |h: usize| {
        let v = _mm256_sll_epi32(scales[h / 4], _mm_cvtsi32_si128(24 - 8 * (h % 4) as i32));
        _mm256_srai_epi32(v, 24)
    };
    for h in 0..16 {
        store8(&mut o.sc, 8 * h, scale(h));
    }
    for p in 0..8 {
        let lo = _mm256_and_si256(_mm256_slli_epi32(scale(2 * p), 5), _mm256_set1_epi32(0xFFFF));
        store8(
            &mut o.mins,
            8 * p,
            _mm256_or_si256(lo, _mm256_slli_epi32(scale(2 * p + 1), 21)),
        );
    }
    for n in 0..2 {
        for j1 in 0..2 {
            for st in 0..8 {
                let (lo, hi) = q6k_step(blk, n, j1, st);
                store8(&mut o.codes, 8 * (32 * n + 8 * j1 + st), lo);
                store8(&mut o.codes, 8 * (32 * n + 16 + 8 * j1 + st), hi);
            }
        }
    }
}

/// A panel block of a format of 32, as `avx2.rs`'s `panel_32!` reads it.
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_32(format: BlockFormat, blk: &[u8]) -> Unpacked32 {
    // Where the mins, fifth bits and nibbles are.
    let (m_at, qh_at, qs_at) = match format {
        BlockFormat::Q4_0 => (0, 0, 16),
        BlockFormat::Q4_1 => (16, 0, 32),
        BlockFormat::Q5_0 => (0, 16, 48),
        _ => (16, 32, 64),
    };
    assert!(blk.len() >= qs_at + 128);
    let mut o = Unpacked32 {
        codes: [0; 8 * PANEL],
        d: [0.; PANEL],
        dmin: [0.; PANEL],
    };
    // SAFETY: `blk` holds the block, past every 16-byte load below; `o.d`
    // and `o.dmin` hold 8 floats.
    unsafe {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast()));
        let dmin = match format {
            BlockFormat::Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(8.)),
            BlockFormat::Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(16.)),
            _ => _mm256_sub_ps(
                _mm256_setzero_ps(),
                _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().add(m_at).cast())),
            ),
        };
        _mm256_storeu_ps(o.d.as_mut_ptr(), d);
        _mm256_storeu_ps(o.dmin.as_mut_ptr(), dmin);
    }
    let five = matches!(format, BlockFormat::Q5_0 | BlockFormat::Q5_1);
    let qh = if five {
        load32(blk, qh_at)
    } else {
        _mm256_setzero_si256()
    };
    let low = _mm256_set1_epi8(0x0F);
    for g in 0..4 {
        let v = load32(blk, qs_at + 32 * g);
        let mut lo = _mm256_and_si256(v, low);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if five {
            lo = _mm256_or_si256(lo, fifth_bits(qh, 4 * g as i32));
            hi = _mm256_or_si256(hi, fifth_bits(qh, 16 + 4 * g as i32));
        }
        // Values 4g.. and 16 + 4g..: steps g and 4 + g.
        store8(&mut o.codes, 8 * g, lo);
        store8(&mut o.codes, 8 * (4 + g), hi);
    }
    o
}
