//! The driver of the packed attention tiles: packing keys and values into
//! panels, the work unit's loop over key blocks and row groups, and the
//! online softmax between a group's two products. The products are the
//! micro-kernels of `avx2.rs` and the shared `panel/avx2.rs` (AVX2+FMA),
//! and of `avx512.rs` (AVX-512F), which read the panel layout of `panel/`.
//!
//! Every (batch, kv-head)'s keys are packed into panels of [`NR`] keys
//! (`Kᵀ` within a panel, by 8 × 8 register transposes) and its values into
//! panels of [`NR`] columns; every query block of every head sharing them
//! reads them from there. They are packed once per call, in parallel, or
//! where each fits in half of L2 and there are enough of them, by each
//! thread for the units it runs ([`crate::attention::Packing`]), so that
//! they are read back from that thread's L2. A work unit walks key blocks
//! of [`BLOCK_K`] (packed K and V for a block fit in L2) and, inside,
//! groups of query rows (6 for AVX2, 12 for AVX-512): scores for the group
//! (in L1), its online softmax, then `P · V` into the group's
//! accumulators. A thread's unit buffers (queries, accumulators, the score
//! strip) are kept from unit to unit.

use super::problem::{write_rows, KvElem, Problem, Unit};
use super::{avx2, avx512};
use crate::panel::avx2::{product, transpose_into};
use crate::panel::{BLOCK_K, MR as AVX2_MR, NR, STRIP_RS};
use crate::rows::lanes::{Ymm, Zmm};
use crate::rows::softmax;
use crate::runtime::pool::{par_chunks_mut, KV_PACKS, PARALLEL_FROM};

/// Fewer query rows than this and packing the keys costs about as much as
/// the products it speeds up (a decode step): `gemm` serves those.
pub(crate) const MIN_Q_LEN: usize = 16;

thread_local! {
    /// A thread's buffers for the units it runs ([`run_block`]), kept
    /// between units and calls.
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Keys and values of (batch, kv-head)s, packed for the micro-kernels.
pub(crate) struct Packed {
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
    pub(crate) unsafe fn new<KV: KvElem>(p: &Problem<KV>, batch: usize, kv_heads: usize) -> Packed {
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
    pub(crate) unsafe fn one<KV: KvElem>(
        p: &Problem<KV>,
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
    pub(crate) fn holds(&self, pack: usize) -> bool {
        self.first == pack
    }

    /// Bytes of one (batch, kv-head)'s packed keys and values.
    pub(crate) fn bytes_per_head<KV: KvElem>(p: &Problem<KV>) -> usize {
        let (kt_len, v_len, _) = Self::lens(p);
        (kt_len + v_len) * 4
    }

    /// The buffers, for a later [`Packed::one`].
    pub(crate) fn release(mut self) -> (Vec<f32>, Vec<f32>) {
        (std::mem::take(&mut self.kt), std::mem::take(&mut self.v))
    }

    /// Floats per (batch, kv-head) of packed keys and of packed values,
    /// and `dvp`.
    fn lens<KV: KvElem>(p: &Problem<KV>) -> (usize, usize, usize) {
        let (_, s, d, dv) = p.dims;
        let dvp = dv.div_ceil(NR) * NR;
        (s.div_ceil(NR) * NR * d, s * dvp, dvp)
    }

    /// Packs the (batch, kv-head)s from `first` that fill `bufs`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn fill<KV: KvElem>(
        p: &Problem<KV>,
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
                    let row = &mut panel[j * NR..][..NR];
                    match src[pc * NR..].first_chunk::<NR>() {
                        // A whole panel row: a copy (or widening) of known
                        // size, inlined.
                        Some(cols) => KV::widen(cols, row),
                        None => {
                            let cols = &src[pc * NR..];
                            KV::widen(cols, &mut row[..cols.len()]);
                            row[cols.len()..].fill(0.);
                        }
                    }
                }
            }
        };
        if parallel {
            par_chunks_mut(&mut kt, kt_len, PARALLEL_FROM, |i, kt| pack_k((i, kt)));
            par_chunks_mut(&mut v, v_len, PARALLEL_FROM, |i, v| pack_v((i, v)));
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

/// Packs `rows` rows of `d` elements (`row(j)`, f32 or widened to it)
/// into `dst`: panels of `NR` rows, transposed within a panel (`row(p·NR +
/// c)[e]` at `p·d·NR + e·NR + c`), zero past `rows`. Writes every element
/// of `dst`.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pack_panels<'a, E: KvElem>(dst: &mut [f32], rows: usize, d: usize, row: impl Fn(usize) -> &'a [E]) {
    // f32 rows are transposed where they are; half-precision ones are
    // widened 8 at a time into `wide` first.
    let in_place = E::as_f32(&[]).is_some();
    let mut wide = Vec::new();
    for (pi, panel) in dst.chunks_exact_mut(d * NR).enumerate() {
        for half in 0..NR / 8 {
            let j0 = (pi * NR + half * 8).min(rows);
            let n = (rows - j0).min(8);
            let srcs: [&[f32]; 8] = if in_place {
                std::array::from_fn(|c| {
                    if c < n {
                        E::as_f32(row(j0 + c)).unwrap_or_default()
                    } else {
                        &[]
                    }
                })
            } else {
                wide.resize(8 * d, 0.);
                for (c, dst) in wide.chunks_exact_mut(d.max(1)).take(n).enumerate() {
                    E::widen(row(j0 + c), dst);
                }
                std::array::from_fn(|c| if c < n { &wide[c * d..][..d] } else { &[] })
            };
            // SAFETY: `n` rows of `d` floats; `d` rows of `NR` floats from
            // column `half · 8` lie in the panel.
            unsafe { transpose_into(&srcs[..n], d, 1., panel[half * 8..].as_mut_ptr(), NR, 8) };
        }
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
pub(crate) enum Kernels {
    /// 6 rows × 16 keys in `ymm` registers (`avx2.rs`).
    Avx2,
    /// 12 rows × 32 keys in `zmm` registers (`avx512.rs`).
    Avx512,
}

impl Kernels {
    /// Query rows per micro-kernel call.
    pub(crate) fn rows(self) -> usize {
        match self {
            Kernels::Avx2 => AVX2_MR,
            Kernels::Avx512 => avx512::MR,
        }
    }
}

/// Attention for one unit, as [`Problem::run_block`] computes it, through
/// the packed micro-kernels.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and AVX-512F for
/// [`Kernels::Avx512`]; `packed` must come from this problem; the unit's
/// output rows are its own. Returns whether every output is finite.
pub(crate) unsafe fn run_block<KV: KvElem>(
    p: &Problem<KV>,
    packed: &Packed,
    unit: Unit,
    kernels: Kernels,
) -> bool {
    let Unit { bi, hi, i0, rows, .. } = unit;
    debug_assert_eq!(unit.heads, 1, "the packed tiles take one head a unit");
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
            const { assert!(avx512::MR == 12) };
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
                    Kernels::Avx2 => product::<false, f32>(
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
                    Kernels::Avx512 => avx512::scores(
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
                    Kernels::Avx2 => softmax_group_avx2(p, bi, hi, group),
                    Kernels::Avx512 => softmax_group_avx512(p, bi, hi, group),
                }
            }
            // SAFETY: `cols` value rows from `j0` in each of the `dvp / NR`
            // panels of `s · NR` floats, the strip as above, and the
            // group's accumulator rows.
            unsafe {
                let (v, a) = (vp[j0 * NR..].as_ptr(), acc[g0 * dvp..].as_mut_ptr());
                match kernels {
                    Kernels::Avx2 => avx2::weighted_values(gr, strip.as_ptr(), v, s * NR, dvp, cols, a),
                    Kernels::Avx512 => avx512::weighted_values(gr, strip.as_ptr(), v, s * NR, dvp, cols, a),
                }
            }
        }
    }
    let finite = write_rows(acc, dvp, dv, row_max, row_sum, unit);
    SCRATCH.set(buf);
    finite
}

/// A row group's part of the unit for one key block: its first query
/// row `i`, the block's first key `j0` and `cols` keys (`width`: rounded
/// up to whole vectors), its score strip rows (`STRIP_RS` apart), the
/// scores kernel's lane maxima (16 a row), and its rows' running max, sum
/// and accumulators (`acc.len() / row_max.len()` a row).
pub(crate) struct Group<'a> {
    pub(crate) i: usize,
    pub(crate) j0: usize,
    pub(crate) cols: usize,
    pub(crate) width: usize,
    pub(crate) strip: &'a mut [f32],
    pub(crate) maxes: &'a [f32],
    pub(crate) row_max: &'a mut [f32],
    pub(crate) row_sum: &'a mut [f32],
    pub(crate) acc: &'a mut [f32],
}

/// The online softmax of a group's score rows for one key block:
/// soft-capped where the problem asks (`softcap(row, cap)`), masked where
/// the mask touches them (the scores kernel's row max serves the others,
/// capped as the scores are), keys past a row's last and the vector's tail
/// hidden, then `online(row, m, l, acc, known_max)` and dropout on the
/// weights it leaves in the row (after their sum); `lanes_max(m)`
/// reduces a row's lane maxima. Inlined into each instruction set's
/// caller, so that its vector helpers inline too.
#[inline(always)]
pub(crate) fn softmax_group_with<KV: KvElem>(
    p: &Problem<KV>,
    bi: usize,
    hi: usize,
    g: Group,
    lanes_max: impl Fn(&[f32]) -> f32,
    softcap: impl Fn(&mut [f32], f32),
    online: impl Fn(&mut [f32], &mut f32, &mut f32, &mut [f32], Option<f32>),
) {
    let dvp = g.acc.len() / g.row_max.len();
    for (r, (m, l)) in g.row_max.iter_mut().zip(g.row_sum.iter_mut()).enumerate() {
        let i = g.i + r;
        let row = &mut g.strip[r * STRIP_RS..][..g.width];
        // The scores kernel's row max serves a row the mask leaves as it is.
        let mut known_max = p
            .sees_all_as_scored(i, g.j0, g.cols)
            .then(|| lanes_max(&g.maxes[r * 16..][..16]));
        if let Some(cap) = p.softcap {
            // Whole vectors: the columns past `cols` (zero-padded keys'
            // scores) are hidden below. The cap is monotonic, so the
            // capped max is the max of the capped scores.
            softcap(row, cap);
            known_max = known_max.map(|x| softmax::softcap(x, cap));
        }
        if known_max.is_none() {
            p.mask_row(&mut row[..g.cols], bi, hi, i, g.j0);
        }
        // Keys past the group's last row's, and the vector's tail.
        let end = p.keys_end(i).saturating_sub(g.j0).min(g.cols);
        row[end..].fill(f32::NEG_INFINITY);
        online(row, m, l, &mut g.acc[r * dvp..][..dvp], known_max);
        p.drop_row(&mut row[..end], bi, hi, i, g.j0);
    }
}

/// [`softmax_group_with`] on `ymm` lanes.
///
/// # Safety
/// AVX2+FMA; `g.width` is a multiple of 8.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_group_avx2<KV: KvElem>(p: &Problem<KV>, bi: usize, hi: usize, g: Group) {
    // SAFETY: this function's features; whole vectors of each row.
    softmax_group_with(
        p,
        bi,
        hi,
        g,
        |m| unsafe { softmax::lanes_max::<Ymm>(m.as_ptr()) },
        |row, cap| unsafe { softmax::softcap_row::<Ymm>(row, cap) },
        |row, m, l, acc, known| unsafe { softmax::online_softmax_block::<Ymm>(row, m, l, acc, known) },
    );
}

/// [`softmax_group_with`] on `zmm` lanes.
///
/// # Safety
/// AVX-512F; `g.width` is a multiple of 16.
#[target_feature(enable = "avx512f")]
unsafe fn softmax_group_avx512<KV: KvElem>(p: &Problem<KV>, bi: usize, hi: usize, g: Group) {
    // SAFETY: this function's features; whole vectors of each row.
    softmax_group_with(
        p,
        bi,
        hi,
        g,
        |m| unsafe { softmax::lanes_max::<Zmm>(m.as_ptr()) },
        |row, cap| unsafe { softmax::softcap_row::<Zmm>(row, cap) },
        |row, m, l, acc, known| unsafe { softmax::online_softmax_block::<Zmm>(row, m, l, acc, known) },
    );
}
