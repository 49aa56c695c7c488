//! The tile products as AVX2+FMA register-blocked micro-kernels over
//! pre-packed keys and values, and the work unit both these and the
//! AVX-512F ones (`avx512.rs`) run.
//!
//! Every (batch, kv-head)'s keys are packed into panels of [`NR`] keys
//! (`Kᵀ` within a panel, by 8 × 8 register transposes) and its values into
//! panels of [`NR`] columns; every query block of every head sharing them
//! reads them from there. They are packed once per call, in parallel, or
//! where each fits in half of L2 and there are enough of them, by each
//! thread for the units it runs (`attention::Packing`), so that they are
//! read back from that thread's L2. A work unit walks key blocks of [`BLOCK_K`]
//! (packed K and V for a block fit in L2) and, inside, groups of [`MR`]
//! query rows: scores for the group (`MR × BLOCK_K`, in L1), its online
//! softmax, then `P · V` into the group's accumulators. A micro-kernel keeps
//! an `MR × NR` block of results in 12 `ymm` registers and issues 12 FMAs
//! per 8 loads, so the tile products run near the FMA units' peak. A
//! thread's unit buffers (queries, accumulators, the score strip) are kept
//! from unit to unit.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::attention::{Problem, Unit};
use super::simd;
use super::KV_PACKS;

/// Query rows per micro-kernel.
pub(super) const MR: usize = 6;
/// Keys (or value columns) per panel: two `ymm` registers.
pub(super) const NR: usize = 16;
/// Keys per block: packed K and V of a block (2 · 512 keys · 64 dims · 4
/// bytes = 256 KiB at head_dim 64) stay in L2 across the unit's row groups,
/// and a group's score strip (`MR` rows of 528 floats: 25 KiB for the
/// AVX-512 kernels' 12) in L1. On the README's Xeon, in one process
/// against 256 (a switch not kept in the repo, 24-30 alternations, a
/// second 256 variant as the null: 0.99-1.00x), B1 H8 N1024 and N4096 ran
/// 1.027x and 1.024x (AVX-512), 1.014x and 1.07x (AVX2), causal 1.00x and
/// 1.03x. Against 256 in a run without the null, blocks of 64 keys were
/// 5-13 % slower, of 128 and 192 from 5 % slower to 5 % faster.
const BLOCK_K: usize = 512;
/// Row stride of a group's score strip: one panel past `BLOCK_K`, so that
/// its rows (read together by the `P · V` kernel) fall in different L1
/// sets instead of every 4 KiB.
pub(super) const STRIP_RS: usize = BLOCK_K + NR;
/// Fewer query rows than this and packing the keys costs about as much as
/// the products it speeds up (a decode step): `gemm` serves those.
pub(super) const MIN_Q_LEN: usize = 16;

thread_local! {
    /// A thread's buffers for the units it runs ([`run_block`]), kept
    /// between units and calls.
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Whether this CPU runs the micro-kernels at all.
#[cfg(test)]
pub(super) fn available() -> bool {
    super::isa::current() >= super::isa::Isa::Avx2
}

/// Keys and values of (batch, kv-head)s, packed for the micro-kernels.
pub(super) struct Packed {
    /// Per (batch, kv-head): `ceil(kv_len / NR)` panels of `head_dim × NR`,
    /// key `p·NR + c`'s dim `e` at `p·head_dim·NR + e·NR + c`; zero past
    /// `kv_len`.
    kt: Vec<f32>,
    /// Per (batch, kv-head): `dvp / NR` panels of `kv_len × NR`, value row
    /// `j`'s column `p·NR + c` at `p·kv_len·NR + j·NR + c`; zero past `dv`.
    v: Vec<f32>,
    kv_heads: usize,
    /// The first (batch, kv-head) held, as `batch · kv_heads + kv_head`.
    first: usize,
    kt_len: usize,
    v_len: usize,
    /// `v_head_dim` rounded up to a multiple of `NR`.
    dvp: usize,
}

impl Packed {
    /// Every (batch, kv-head), packed in parallel into buffers from
    /// [`KV_PACKS`] (handed back on drop).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    pub(super) unsafe fn new(p: &Problem, batch: usize, kv_heads: usize) -> Packed {
        let (kt_len, v_len, _) = Self::lens(p);
        let bufs = (
            KV_PACKS.take(batch * kv_heads * kt_len),
            KV_PACKS.take(batch * kv_heads * v_len),
        );
        // SAFETY: the caller's.
        unsafe { Self::fill(p, kv_heads, 0, bufs, true) }
    }

    /// One (batch, kv-head), `pack = batch · kv_heads + kv_head`, packed on
    /// this thread, into `bufs` where given (grown as needed;
    /// [`Packed::release`] gives them back).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    pub(super) unsafe fn one(
        p: &Problem,
        kv_heads: usize,
        pack: usize,
        bufs: Option<(Vec<f32>, Vec<f32>)>,
    ) -> Packed {
        let (kt_len, v_len, _) = Self::lens(p);
        let (mut kt, mut v) = bufs.unwrap_or_default();
        kt.resize(kt_len, 0.);
        v.resize(v_len, 0.);
        // SAFETY: the caller's.
        unsafe { Self::fill(p, kv_heads, pack, (kt, v), false) }
    }

    /// Whether this, from [`Packed::one`], holds (batch, kv-head) `pack`.
    pub(super) fn holds(&self, pack: usize) -> bool {
        self.first == pack
    }

    /// Bytes of one (batch, kv-head)'s packed keys and values.
    pub(super) fn bytes_per_head(p: &Problem) -> usize {
        let (kt_len, v_len, _) = Self::lens(p);
        (kt_len + v_len) * 4
    }

    /// The buffers, for a later [`Packed::one`].
    pub(super) fn release(mut self) -> (Vec<f32>, Vec<f32>) {
        (std::mem::take(&mut self.kt), std::mem::take(&mut self.v))
    }

    /// Floats per (batch, kv-head) of packed keys and of packed values,
    /// and `dvp`.
    fn lens(p: &Problem) -> (usize, usize, usize) {
        let (_, s, d, dv) = p.dims;
        let dvp = dv.div_ceil(NR) * NR;
        (s.div_ceil(NR) * NR * d, s * dvp, dvp)
    }

    /// Packs the (batch, kv-head)s from `first` that fill `bufs`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn fill(
        p: &Problem,
        kv_heads: usize,
        first: usize,
        bufs: (Vec<f32>, Vec<f32>),
        parallel: bool,
    ) -> Packed {
        let (_, s, d, dv) = p.dims;
        let (kt_len, v_len, dvp) = Self::lens(p);
        let (mut kt, mut v) = bufs;
        // Every element is written, padding included: kept buffers hold
        // the last call's data.
        let pack_k = |(i, dst): (usize, &mut [f32])| {
            let (bi, hi) = ((first + i) / kv_heads, (first + i) % kv_heads);
            // SAFETY: the caller's.
            unsafe { pack_panels(dst, s, d, |j| &p.k.data[p.k.offset(bi, hi, j)..][..d]) };
        };
        let pack_v = |(i, dst): (usize, &mut [f32])| {
            let (bi, hi) = ((first + i) / kv_heads, (first + i) % kv_heads);
            for j in 0..s {
                let src = &p.v.data[p.v.offset(bi, hi, j)..][..dv];
                for (pc, panel) in dst.chunks_exact_mut(s * NR).enumerate() {
                    let row: &mut [f32; NR] = (&mut panel[j * NR..][..NR]).try_into().unwrap();
                    match src[pc * NR..].first_chunk::<NR>() {
                        // A whole panel row: a copy of known size, inlined.
                        Some(cols) => *row = *cols,
                        None => {
                            let cols = &src[pc * NR..];
                            row[..cols.len()].copy_from_slice(cols);
                            row[cols.len()..].fill(0.);
                        }
                    }
                }
            }
        };
        if parallel {
            kt.par_chunks_mut(kt_len).enumerate().for_each(pack_k);
            v.par_chunks_mut(v_len).enumerate().for_each(pack_v);
        } else {
            kt.chunks_mut(kt_len).enumerate().for_each(pack_k);
            v.chunks_mut(v_len).enumerate().for_each(pack_v);
        }
        Packed {
            kt,
            v,
            kv_heads,
            first,
            kt_len,
            v_len,
            dvp,
        }
    }
}

/// Packs `rows` rows of `d` floats (`row(j)`) into `dst`: panels of `NR`
/// rows, transposed within a panel (`row(p·NR + c)[e]` at `p·d·NR + e·NR +
/// c`), zero past `rows`. Writes every element of `dst`.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pack_panels<'a>(dst: &mut [f32], rows: usize, d: usize, row: impl Fn(usize) -> &'a [f32]) {
    for (pi, panel) in dst.chunks_exact_mut(d * NR).enumerate() {
        for half in 0..NR / 8 {
            let j0 = (pi * NR + half * 8).min(rows);
            let srcs: [&[f32]; 8] = std::array::from_fn(|c| if j0 + c < rows { row(j0 + c) } else { &[] });
            let n = (rows - j0).min(8);
            // SAFETY: `n` rows of `d` floats; `d` rows of `NR` floats from
            // column `half · 8` lie in the panel.
            unsafe { transpose_into(&srcs[..n], d, 1., panel[half * 8..].as_mut_ptr(), NR, 8) };
        }
    }
}

/// `dst[e·ds + c] = rows[c][e] · scale` for the `d` dims `e` and the
/// `lanes` (4 or 8) columns `c`, zero for `c >= rows.len()`: an 8 × 8
/// register transpose per 8 dims.
///
/// # Safety
/// The CPU must have AVX2; every row holds `d` floats, `rows.len() <=
/// lanes`, and `dst` has room for `d` rows of stride `ds` of `lanes`
/// floats.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose_into(
    rows: &[&[f32]],
    d: usize,
    scale: f32,
    dst: *mut f32,
    ds: usize,
    lanes: usize,
) {
    debug_assert!(rows.len() <= lanes && (lanes == 4 || lanes == 8));
    debug_assert!(rows.iter().all(|r| r.len() >= d));
    let n = rows.len();
    let sc = _mm256_set1_ps(scale);
    let mut e = 0;
    while e + 8 <= d {
        let mut r = [_mm256_setzero_ps(); 8];
        for (c, r) in r.iter_mut().enumerate() {
            if c < n {
                // SAFETY: dims e..e+8 of a row of `d`.
                *r = _mm256_mul_ps(unsafe { _mm256_loadu_ps(rows[c].as_ptr().add(e)) }, sc);
            }
        }
        for (k, t) in transpose8(r).into_iter().enumerate() {
            // SAFETY: row `e + k < d` of `dst`, `lanes` floats.
            unsafe {
                let at = dst.add((e + k) * ds);
                if lanes == 8 {
                    _mm256_storeu_ps(at, t);
                } else {
                    _mm_storeu_ps(at, _mm256_castps256_ps128(t));
                }
            }
        }
        e += 8;
    }
    for e in e..d {
        for c in 0..lanes {
            // SAFETY: as above.
            unsafe { *dst.add(e * ds + c) = rows.get(c).map_or(0., |r| r[e] * scale) };
        }
    }
}

/// The transpose of the 8 × 8 block whose rows are `r`.
#[inline(always)]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register shuffles; callers are compiled with AVX2.
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

impl Drop for Packed {
    fn drop(&mut self) {
        KV_PACKS.keep(std::mem::take(&mut self.kt));
        KV_PACKS.keep(std::mem::take(&mut self.v));
    }
}

/// Which micro-kernels compute a unit's two products and the online
/// softmax between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernels {
    /// 6 rows × 16 keys in `ymm` registers (this file).
    Avx2,
    /// 12 rows × 32 keys in `zmm` registers (`avx512.rs`).
    Avx512,
}

impl Kernels {
    /// Query rows per micro-kernel call.
    pub(super) fn rows(self) -> usize {
        match self {
            Kernels::Avx2 => MR,
            Kernels::Avx512 => super::avx512::MR,
        }
    }
}

/// Attention for one unit, as [`Problem::run_block`] computes it, through
/// the packed micro-kernels.
///
/// # Safety
/// The CPU must have AVX2 and FMA ([`available`]), and AVX-512F for
/// [`Kernels::Avx512`]; `packed` must come from this problem; the unit's
/// output rows are its own. Returns whether every output is finite.
pub(super) unsafe fn run_block(p: &Problem, packed: &Packed, unit: Unit, kernels: Kernels) -> bool {
    let Unit { bi, hi, i0, rows, .. } = unit;
    let (_, s, d, dv) = p.dims;
    let dvp = packed.dvp;
    let pack = bi * packed.kv_heads + hi / p.heads_per_kv - packed.first;
    let kt = &packed.kt[pack * packed.kt_len..][..packed.kt_len];
    let vp = &packed.v[pack * packed.v_len..][..packed.v_len];
    // The block's queries, scaled: contiguous rows for the AVX2 kernel;
    // for the AVX-512 one, each group of its rows interleaved (dim `e` of
    // the group's rows at `e·MR`, see `avx512::scores`).
    let mr = kernels.rows();
    let q_row = |r: usize| &p.q.data[p.q.offset(bi, hi, i0 + r)..][..d];
    // The unit's buffers, from this thread's last unit: the queries and
    // the strip are written before they are read, the rest set here.
    let (q_len, acc_len) = (rows.next_multiple_of(mr) * d, rows * dvp);
    let mut buf = SCRATCH.take();
    let need = q_len + acc_len + 2 * rows + mr * STRIP_RS + mr * 16;
    if buf.len() < need {
        buf.resize(need, 0.);
    }
    let (q, rest) = buf.split_at_mut(q_len);
    let (acc, rest) = rest.split_at_mut(acc_len);
    let (row_max, rest) = rest.split_at_mut(rows);
    let (row_sum, rest) = rest.split_at_mut(rows);
    let (strip, rest) = rest.split_at_mut(mr * STRIP_RS);
    // The scores kernel's per-lane row maxima, 16 per row (8 used on AVX2).
    let maxes = &mut rest[..mr * 16];
    acc.fill(0.);
    row_max.fill(f32::NEG_INFINITY);
    row_sum.fill(0.);
    match kernels {
        Kernels::Avx2 => {
            for r in 0..rows {
                for (y, &x) in q[r * d..][..d].iter_mut().zip(q_row(r)) {
                    *y = x * p.scale;
                }
            }
        }
        Kernels::Avx512 => {
            // A group's 12 rows as 8 + 4 transposed lanes.
            const { assert!(super::avx512::MR == 12) };
            for g0 in (0..rows).step_by(mr) {
                for (c0, lanes) in [(0, 8), (8, 4)] {
                    let n = rows.saturating_sub(g0 + c0).min(lanes);
                    let srcs: [&[f32]; 8] =
                        std::array::from_fn(|c| if c < n { q_row(g0 + c0 + c) } else { &[] });
                    // SAFETY: `n <= lanes` rows of `d`; the group's `d` rows
                    // of `mr` floats lie in `q`.
                    unsafe {
                        transpose_into(&srcs[..n], d, p.scale, q[g0 * d + c0..].as_mut_ptr(), mr, lanes)
                    };
                }
            }
        }
    }
    let kv_end = p.keys_end(i0 + rows - 1);
    // Panels start at multiples of NR; keys before the first row's window
    // are skipped whole.
    let start = p.keys_start(i0) / NR * NR;
    for j0 in (start..kv_end).step_by(BLOCK_K) {
        for g0 in (0..rows).step_by(mr) {
            let gr = mr.min(rows - g0);
            let cols = p.keys_end(i0 + g0 + gr - 1).min(j0 + BLOCK_K).saturating_sub(j0);
            if cols == 0 {
                continue;
            }
            maxes.fill(f32::NEG_INFINITY);
            // SAFETY: the group's `gr` query rows, `ceil(cols / NR)` panels
            // from key `j0` (a multiple of NR), `gr` strip rows of
            // `BLOCK_K >= cols` floats and `gr` rows of maxima all lie in
            // their buffers.
            unsafe {
                let (q, kt, panels) = (q[g0 * d..].as_ptr(), kt[j0 * d..].as_ptr(), cols.div_ceil(NR));
                match kernels {
                    Kernels::Avx2 => scores::<false>(
                        gr,
                        q,
                        d,
                        d,
                        kt,
                        panels,
                        strip.as_mut_ptr(),
                        STRIP_RS,
                        Some((maxes.as_mut_ptr(), cols)),
                    ),
                    Kernels::Avx512 => super::avx512::scores(
                        gr,
                        q,
                        d,
                        kt,
                        cols,
                        strip.as_mut_ptr(),
                        STRIP_RS,
                        maxes.as_mut_ptr(),
                    ),
                }
            }
            // Whole vectors: the strip's columns past `cols` are hidden too.
            let width = cols.next_multiple_of(match kernels {
                Kernels::Avx2 => 8,
                Kernels::Avx512 => 16,
            });
            let group = Group {
                i: i0 + g0,
                j0,
                cols,
                width,
                strip: &mut strip[..gr * STRIP_RS],
                maxes,
                row_max: &mut row_max[g0..g0 + gr],
                row_sum: &mut row_sum[g0..g0 + gr],
                acc: &mut acc[g0 * dvp..(g0 + gr) * dvp],
            };
            // SAFETY: the instruction sets the caller vouched for; `width`
            // is a multiple of their vectors.
            unsafe {
                match kernels {
                    Kernels::Avx2 => softmax_group(p, bi, hi, group),
                    Kernels::Avx512 => super::avx512::softmax_group(p, bi, hi, group),
                }
            }
            // SAFETY: `cols` value rows from `j0` in each of the `dvp / NR`
            // panels of `s · NR` floats, the strip as above, and the
            // group's accumulator rows.
            unsafe {
                let (v, a) = (vp[j0 * NR..].as_ptr(), acc[g0 * dvp..].as_mut_ptr());
                match kernels {
                    Kernels::Avx2 => weighted_values(gr, strip.as_ptr(), v, s * NR, dvp, cols, a),
                    Kernels::Avx512 => {
                        super::avx512::weighted_values(gr, strip.as_ptr(), v, s * NR, dvp, cols, a)
                    }
                }
            }
        }
    }
    let finite = super::attention::write_rows(acc, dvp, dv, row_sum, unit);
    SCRATCH.set(buf);
    finite
}

/// A row group's part of the unit for one key block: its first query
/// row `i`, the block's first key `j0` and `cols` keys (`width`: rounded
/// up to whole vectors), its score strip rows (`STRIP_RS` apart), the
/// scores kernel's lane maxima (16 a row), and its rows' running max, sum
/// and accumulators (`acc.len() / row_max.len()` a row).
pub(super) struct Group<'a> {
    pub(super) i: usize,
    pub(super) j0: usize,
    pub(super) cols: usize,
    pub(super) width: usize,
    pub(super) strip: &'a mut [f32],
    pub(super) maxes: &'a [f32],
    pub(super) row_max: &'a mut [f32],
    pub(super) row_sum: &'a mut [f32],
    pub(super) acc: &'a mut [f32],
}

/// The online softmax of a group's score rows for one key block: masked
/// where the mask touches them (the scores kernel's row max serves the
/// others), keys past a row's last and the vector's tail hidden, then
/// `online(row, m, l, acc, known_max)`; `lanes_max(m)` reduces a row's
/// lane maxima. Inlined into each instruction set's caller, so that its
/// vector helpers inline too.
#[inline(always)]
pub(super) fn softmax_group_with(
    p: &Problem,
    bi: usize,
    hi: usize,
    g: Group,
    lanes_max: impl Fn(&[f32]) -> f32,
    online: impl Fn(&mut [f32], &mut f32, &mut f32, &mut [f32], Option<f32>),
) {
    let dvp = g.acc.len() / g.row_max.len();
    for (r, (m, l)) in g.row_max.iter_mut().zip(g.row_sum.iter_mut()).enumerate() {
        let i = g.i + r;
        let row = &mut g.strip[r * STRIP_RS..][..g.width];
        // The scores kernel's row max serves a row the mask leaves as it is.
        let known_max = p
            .sees_all_as_scored(i, g.j0, g.cols)
            .then(|| lanes_max(&g.maxes[r * 16..][..16]));
        if known_max.is_none() {
            p.mask_row(&mut row[..g.cols], bi, hi, i, g.j0);
        }
        // Keys past the group's last row's, and the vector's tail.
        let end = p.keys_end(i).saturating_sub(g.j0).min(g.cols);
        row[end..].fill(f32::NEG_INFINITY);
        online(row, m, l, &mut g.acc[r * dvp..][..dvp], known_max);
    }
}

/// [`softmax_group_with`] with 8-lane max and `exp`.
///
/// # Safety
/// AVX2+FMA; `g.width` is a multiple of 8.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn softmax_group(p: &Problem, bi: usize, hi: usize, g: Group) {
    // SAFETY: this function's features; whole vectors of each row.
    softmax_group_with(
        p,
        bi,
        hi,
        g,
        |m| unsafe { lanes_max(m.as_ptr()) },
        |row, m, l, a, known| unsafe { online_softmax(row, m, l, a, known) },
    );
}

/// Picks the micro-kernel instance for a group of `rows` (1..=MR).
macro_rules! by_rows {
    ($rows:expr, $f:ident$(::<_, $acc:tt>)?($($arg:expr),*)) => {
        match $rows {
            1 => $f::<1 $(, $acc)?>($($arg),*),
            2 => $f::<2 $(, $acc)?>($($arg),*),
            3 => $f::<3 $(, $acc)?>($($arg),*),
            4 => $f::<4 $(, $acc)?>($($arg),*),
            5 => $f::<5 $(, $acc)?>($($arg),*),
            _ => $f::<MR $(, $acc)?>($($arg),*),
        }
    };
}

/// `out[r·out_rs + c] = Σₑ q[r·q_rs + e] · Kᵀ[e, c]` for `rows` rows, `d`
/// dims and `panels · NR` keys (or output features), `+=` with `ACC`. With
/// `maxes` `Some((m, cols))`, the softmax's row max comes with it: lane `c`
/// of `m[r·16..]` becomes the largest of itself and row `r`'s scores of
/// keys `c`, `c + 8`, … below `cols` (a NaN score may be skipped, as by
/// `row_max`).
///
/// # Safety
/// AVX2+FMA; the pointers cover those extents (`m` `rows · 16` floats).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores<const ACC: bool>(
    rows: usize,
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const f32,
    panels: usize,
    out: *mut f32,
    out_rs: usize,
    maxes: Option<(*mut f32, usize)>,
) {
    // SAFETY: forwarded.
    unsafe {
        by_rows!(
            rows,
            scores_rows::<_, ACC>(q, q_rs, d, kt, panels, out, out_rs, maxes)
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_rows<const R: usize, const ACC: bool>(
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const f32,
    panels: usize,
    strip: *mut f32,
    out_rs: usize,
    maxes: Option<(*mut f32, usize)>,
) {
    // Each row's own pointer, a step's broadcasts indexed by the dim from
    // them. Seeing the rows a stride apart, LLVM rebuilt their addresses
    // from the stride every step: 27 µops a step where 23 do, for 12 FMAs
    // that take 6 cycles on two ports (4.5 µops a cycle, near what the
    // core issues); `black_box` hides the stride. On the README's Xeon
    // capped at AVX2, in one process against the rebuilt addresses (a
    // switch not kept in the repo; three runs of 20 alternations, a second
    // copy of the old code as the null at 0.98-1.06x): linears of the
    // ViT's and the transformer's shapes 1.04-1.22x (one level with the
    // null), attention B1 N1024 1.04-1.06x, B8 N197 1.05x, N4096 level.
    // The AVX-512 linear tile given the same (11 scalar µops a step down
    // to 3, beside 24 FMAs over 12 cycles: 3.75 µops a cycle before) was
    // level; four steps a loop, later, were not (`avx512::linear_tile_rows`).
    // SAFETY: the group's rows lie in the caller's allocation.
    let rows_at: [*const f32; R] = std::hint::black_box(std::array::from_fn(|r| unsafe { q.add(r * q_rs) }));
    for pi in 0..panels {
        // SAFETY: (here and below) inside the extents the caller vouched for.
        unsafe {
            let kt = kt.add(pi * d * NR);
            let mut c = [[_mm256_setzero_ps(); 2]; R];
            if ACC {
                for (r, c) in c.iter_mut().enumerate() {
                    let src = strip.add(r * out_rs + pi * NR);
                    *c = [_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))];
                }
            }
            macro_rules! step {
                ($e:expr) => {{
                    let e = $e;
                    let k0 = _mm256_loadu_ps(kt.add(e * NR));
                    let k1 = _mm256_loadu_ps(kt.add(e * NR + 8));
                    for (c, row) in c.iter_mut().zip(rows_at) {
                        let a = _mm256_broadcast_ss(&*row.add(e));
                        c[0] = _mm256_fmadd_ps(a, k0, c[0]);
                        c[1] = _mm256_fmadd_ps(a, k1, c[1]);
                    }
                }};
            }
            // Four steps a loop, so that its counter and pointer come once
            // per four (as in `avx512::linear_tile_rows`). Capped at AVX2 on
            // the README's Xeon, in one process against one step a loop (a
            // switch not kept in the repo, a second copy of the current
            // code as the null, 10-12 rounds, two threads): 512 × 512 →
            // 2048 1.08x and 1.06x (nulls 1.03x, 1.01x), 197 × 768 → 2304
            // 1.08x (1.03x), 512 × 2048 → 512 1.06x (1.01x); the attention
            // B1 N1024 1.05x (1.04x), ViT-B/16 B1 1.06x (1.04x); the
            // `nn.Transformer` forward 1.03x in both runs, against nulls
            // of 1.05x and 1.02x: no gain shown there.
            unrolled!(d, [0, 1, 2, 3], step);
            for (r, c) in c.iter().enumerate() {
                let dst = strip.add(r * out_rs + pi * NR);
                _mm256_storeu_ps(dst, c[0]);
                _mm256_storeu_ps(dst.add(8), c[1]);
            }
            if let Some((m, cols)) = maxes {
                // Lanes of keys below `cols`, for each half of the panel.
                let lane = _mm256_setr_ps(0., 1., 2., 3., 4., 5., 6., 7.);
                let valid: [__m256; 2] = std::array::from_fn(|h| {
                    let n = cols.saturating_sub(pi * NR + h * 8).min(8) as f32;
                    _mm256_cmp_ps::<_CMP_LT_OQ>(lane, _mm256_set1_ps(n))
                });
                for (r, c) in c.iter().enumerate() {
                    let m = m.add(r * 16);
                    let mut mx = _mm256_loadu_ps(m);
                    for (c, valid) in c.iter().zip(valid) {
                        mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, *c), valid);
                    }
                    _mm256_storeu_ps(m, mx);
                }
            }
        }
    }
}

/// The largest of the 8 lanes at `m`, for the maxima [`scores`] kept.
///
/// # Safety
/// AVX2+FMA; `m` holds 8 floats.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn lanes_max(m: *const f32) -> f32 {
    // SAFETY: 8 floats, as the caller vouched.
    hmax(unsafe { _mm256_loadu_ps(m) })
}

/// `acc[r·dvp + p·NR + c] += Σⱼ strip[r·STRIP_RS + j] · v[p·panel + j·NR +
/// c]` for `rows` rows, `cols` keys and all `dvp / NR` panels.
///
/// # Safety
/// AVX2+FMA; the pointers cover those extents.
unsafe fn weighted_values(
    rows: usize,
    strip: *const f32,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { by_rows!(rows, weighted_values_rows(strip, v, panel, dvp, cols, acc)) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_values_rows<const R: usize>(
    strip: *const f32,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    for c0 in (0..dvp).step_by(NR) {
        // SAFETY: (here and below) inside the extents the caller vouched for.
        unsafe {
            let mut c: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
            for (r, c) in c.iter_mut().enumerate() {
                c[0] = _mm256_loadu_ps(acc.add(r * dvp + c0));
                c[1] = _mm256_loadu_ps(acc.add(r * dvp + c0 + 8));
            }
            let v = v.add(c0 / NR * panel);
            for j in 0..cols {
                let v0 = _mm256_loadu_ps(v.add(j * NR));
                let v1 = _mm256_loadu_ps(v.add(j * NR + 8));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = _mm256_broadcast_ss(&*strip.add(r * STRIP_RS + j));
                    c[0] = _mm256_fmadd_ps(a, v0, c[0]);
                    c[1] = _mm256_fmadd_ps(a, v1, c[1]);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm256_storeu_ps(acc.add(r * dvp + c0), c[0]);
                _mm256_storeu_ps(acc.add(r * dvp + c0 + 8), c[1]);
            }
        }
    }
}

/// One key block of a row's online softmax ([`simd::online_softmax_block`])
/// with 8-lane max and `exp`.
///
/// # Safety
/// AVX2+FMA; `row.len()` is a multiple of 8.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn online_softmax(
    row: &mut [f32],
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
    row_max_known: Option<f32>,
) {
    // SAFETY: this function's features; whole vectors of `row`.
    simd::online_softmax_block(
        row,
        m,
        l,
        acc,
        |r| row_max_known.unwrap_or_else(|| unsafe { row_max(r) }),
        |r, mx| unsafe { exp_sub_sum(r, mx) },
    );
}

/// The largest score of `row` (a multiple of 8 long); `max_ps` may skip a
/// NaN (it returns its second operand when either is NaN).
///
/// # Safety
/// AVX2+FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn row_max(row: &[f32]) -> f32 {
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..row.len()).step_by(8) {
        // SAFETY: a whole vector inside `row`.
        mx = _mm256_max_ps(mx, unsafe { _mm256_loadu_ps(row.as_ptr().add(j)) });
    }
    hmax(mx)
}

/// `row[j] = e^(row[j] - max)` in place (a multiple of 8 long); the sum.
///
/// # Safety
/// AVX2+FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
    let (n, x) = (row.len(), row.as_mut_ptr());
    let mv = _mm256_set1_ps(max);
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: (here and below) whole vectors inside `row`.
    unsafe {
        // Two vectors a step: the exp is one long dependency chain.
        let pairs = n / 16 * 16;
        for j in (0..pairs).step_by(16) {
            let e0 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x.add(j)), mv));
            let e1 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x.add(j + 8)), mv));
            _mm256_storeu_ps(x.add(j), e0);
            _mm256_storeu_ps(x.add(j + 8), e1);
            s0 = _mm256_add_ps(s0, e0);
            s1 = _mm256_add_ps(s1, e1);
        }
        if pairs < n {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x.add(pairs)), mv));
            _mm256_storeu_ps(x.add(pairs), e);
            s0 = _mm256_add_ps(s0, e);
        }
    }
    hsum(_mm256_add_ps(s0, s1))
}

#[target_feature(enable = "avx2,fma")]
fn hmax(v: __m256) -> f32 {
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h)
}

#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h)
}

/// `e^x` for `x <= 0` (and `-inf`), 8 lanes, in 13 instructions: `x = n·ln2
/// + r` with `|r| <= ln2/2` and a degree-5 polynomial for `e^r` (fitted for
/// relative error over that range, constant term exactly 1); relative error
/// < 5e-7, `e^0 = 1` exactly, and exactly 0 below -87.
#[target_feature(enable = "avx2,fma")]
fn exp_nonpositive(x: __m256) -> __m256 {
    // n = round(x / ln2), held in the low mantissa bits of `big`: adding
    // 1.5·2²³ rounds to an integer.
    let magic = _mm256_set1_ps(12_582_912.0);
    let big = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), magic);
    let n = _mm256_sub_ps(big, magic);
    // One FMA suffices: f32's ln2 is 1.9e-9 off and |n| <= 126.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(std::f32::consts::LN_2), x);
    let mut p = _mm256_set1_ps(8.290_317e-3);
    for c in [4.189_793e-2, 1.666_763_6e-1, 4.999_915e-1, 9.999_997e-1, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // 2^n: n's two's-complement bits, shifted into the exponent field (the
    // magic's own bits shift out), plus the bias. n is in [-126, 0] for x
    // in [-87, 0]; below, the result is masked to 0 whatever it was.
    let pow2n = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_slli_epi32::<23>(_mm256_castps_si256(big)),
        _mm256_set1_epi32(127 << 23),
    ));
    let hidden = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
    _mm256_andnot_ps(hidden, _mm256_mul_ps(p, pow2n))
}

#[cfg(test)]
mod tests {
    use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps};

    #[test]
    fn vector_exp_matches_std_on_its_range() {
        if !super::available() {
            return;
        }
        let mut worst = 0f64;
        let xs: Vec<f32> = (0..=87_000).map(|i| -(i as f32) / 1000.).collect();
        for chunk in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: AVX2+FMA checked above; 8 floats in and out.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    super::exp_nonpositive(_mm256_loadu_ps(chunk.as_ptr())),
                )
            };
            for (&x, &y) in chunk.iter().zip(&out) {
                let e = (x as f64).exp();
                worst = worst.max(((y as f64 - e) / e).abs());
            }
        }
        assert!(worst < 5e-7, "worst relative error {worst:e}");
        let mut out = [1f32; 8];
        let special = [f32::NEG_INFINITY, -100., -87.5, -1e30, 0., -0., -1e-30, -88.];
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_ps(
                out.as_mut_ptr(),
                super::exp_nonpositive(_mm256_loadu_ps(special.as_ptr())),
            )
        };
        assert_eq!(out[..4], [0.; 4]);
        assert_eq!(out[4..7], [1.; 3]);
        assert_eq!(out[7], 0.);
    }
}
