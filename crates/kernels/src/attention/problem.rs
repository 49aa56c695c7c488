//! One [`sdpa`](super::sdpa) call as its work units see it: the problem
//! ([`Problem`]: the inputs' views, the masks and the rules), a unit's rows
//! ([`Unit`]), and a unit's run over its key blocks through `gemm` or the
//! decode-sized products (`decode.rs`): scores, masks, the online softmax
//! and the weighted values, then its rows written out. The packed tiles
//! (`tiles.rs`) run the same units over the same problem.

use candle::{bail, Layout, Result, Storage, Tensor, WithDType};
use gemm::{gemm, Parallelism};
use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
use super::decode;
use super::dropout::Dropout;
use super::mask::{window_isize, PartData, PartView};
use crate::elem::PanelElem;
use crate::rows::simd;
use crate::runtime::isa::Isa;
use crate::runtime::pool::SyncPtr;

/// Keys per tile.
pub(super) const BLOCK_K: usize = 512;
/// Query blocks of fewer rows take the `decode.rs` products on AVX2 and
/// AVX-512 (each key and value read once per row, no packing).
pub(super) const DIRECT_ROWS: usize = 16;
/// A read-only 4-D view (f32, or a cache's bf16/f16 keys and values):
/// base slice and element strides.
pub(crate) struct View<'a, T = f32> {
    pub(crate) data: &'a [T],
    pub(crate) stride: [usize; 4],
}

impl<T> View<'_, T> {
    /// Offset of element `(b, h, i, 0)`.
    pub(crate) fn offset(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.stride[0] + h * self.stride[1] + i * self.stride[2]
    }
}

/// Borrows the data of a CPU tensor of `T`s with a contiguous last dim.
pub(super) fn with_view<T: WithDType, R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(View<T>) -> Result<R>,
) -> Result<R> {
    let (storage, layout): (_, &Layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("cpu attention kernel: {what} is not on the CPU")
    };
    let data = cpu.as_slice::<T>()?;
    let stride = layout.stride();
    if stride.len() != 4 || (stride[3] != 1 && layout.dims()[3] > 1) {
        bail!("cpu attention kernel: {what} needs a contiguous last dim, found strides {stride:?}")
    }
    // A view of an empty tensor may start past the end of its storage.
    let data = data.get(layout.start_offset()..).unwrap_or_default();
    f(View {
        data,
        stride: [stride[0], stride[1], stride[2], 1],
    })
}

/// `t` with a contiguous last dim: the tensor itself where it has one.
pub(super) fn last_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    let (stride, dims) = (t.stride(), t.dims());
    if stride.last() == Some(&1) || dims.last().is_some_and(|&d| d <= 1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// One work unit: query rows `i0..i0 + rows` of heads `hi..hi + heads`
/// (of one kv-head; one head in the packed tiles' units) in batch `bi`,
/// head `hi + t`'s row `r` written to `out[base + t * v_head_dim + r *
/// out_rs ..][..v_head_dim]`, and its log-sum-exp, where `lse` is given,
/// to `lse[lse_base + t * q_len + r]`. Units write disjoint rows.
#[derive(Clone, Copy)]
pub(crate) struct Unit {
    pub(crate) bi: usize,
    pub(crate) hi: usize,
    pub(crate) heads: usize,
    pub(crate) i0: usize,
    pub(crate) rows: usize,
    pub(crate) out: SyncPtr,
    pub(crate) base: usize,
    pub(crate) out_rs: usize,
    /// The rows' log-sum-exp of their scores, `(batch, heads, q_len)`,
    /// kept for a backward pass ([`super::backward`]).
    pub(crate) lse: Option<SyncPtr>,
    pub(crate) lse_base: usize,
}

/// One [`sdpa`](super::sdpa) call as its work units read it: queries in f32, keys and
/// values in `KV`.
pub(crate) struct Problem<'a, KV = f32> {
    pub(crate) q: &'a View<'a>,
    pub(crate) k: &'a View<'a, KV>,
    pub(crate) v: &'a View<'a, KV>,
    /// Key padding and attention masks, over the first `masked_keys` keys.
    pub(super) parts: &'a [PartView<'a>],
    pub(crate) heads_per_kv: usize,
    /// Query heads.
    pub(crate) heads: usize,
    /// (q_len, kv_len, head_dim, v_head_dim)
    pub(crate) dims: (usize, usize, usize, usize),
    pub(crate) scale: f32,
    /// Key `j < masked_keys` is visible to query `i` iff `j <= i + offset`.
    pub(crate) causal: Option<isize>,
    /// With `causal`: and iff `j > i + offset - window`.
    pub(super) window: Option<usize>,
    /// ALiBi: per-head slopes and the offset of the diagonal distances
    /// are measured from.
    pub(super) alibi: Option<(&'a [f32], isize)>,
    /// Soft-capping: scores become `cap · tanh(s / cap)` before the mask.
    pub(crate) softcap: Option<f32>,
    /// Keys past this (`add_bias_kv`, `add_zero_attn`) are never masked.
    pub(crate) masked_keys: usize,
    /// Dropout on the weights after the softmax.
    pub(crate) dropout: Option<Dropout>,
    /// The instruction set the row operations and the decode-sized
    /// products run with (at most what the processor runs).
    pub(crate) isa: Isa,
}

/// The element types [`sdpa`](super::sdpa) reads keys and values in, in place: f32,
/// bf16 and f16. The direct products widen them as they load them, the
/// packed tiles as they pack them, `gemm` a tile at a time.
pub(crate) trait KvElem: PanelElem + WithDType {
    /// The slice itself where its elements are f32.
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
}

impl KvElem for f32 {
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElem for bf16 {}

impl KvElem for f16 {}

impl<KV: KvElem> Problem<'_, KV> {
    /// One past the last masked key query `i` may see by the causal rule.
    fn causal_end(&self, i: usize) -> usize {
        match self.causal {
            Some(off) => (i as isize + off + 1).clamp(0, self.masked_keys as isize) as usize,
            None => self.masked_keys,
        }
    }

    /// The first key query `i` may see by the sliding window (0 without
    /// one): tiles before it are skipped.
    pub(crate) fn keys_start(&self, i: usize) -> usize {
        match (self.causal, self.window) {
            (Some(off), Some(w)) => (i as isize + off + 1)
                .saturating_sub(window_isize(w))
                .clamp(0, self.masked_keys as isize) as usize,
            _ => 0,
        }
    }

    /// One past the last key query `i` sees: the keys a unit or group
    /// whose last row is `i` must visit.
    #[inline]
    pub(crate) fn keys_end(&self, i: usize) -> usize {
        if self.masked_keys < self.dims.1 {
            self.dims.1
        } else {
            self.causal_end(i)
        }
    }

    /// Whether query `i` sees every key of `j0..j0 + cols` with its score
    /// as computed: no mask part or ALiBi, and neither the causal rule nor
    /// the window hides any of them ([`Problem::mask_row`] would leave the
    /// row as it is). A conservative answer: `false` where unsure.
    #[inline]
    pub(crate) fn sees_all_as_scored(&self, i: usize, j0: usize, cols: usize) -> bool {
        self.parts.is_empty()
            && self.alibi.is_none()
            && self.keys_start(i) <= j0
            && self.keys_end(i) >= j0 + cols
            && self.causal_end(i) >= (j0 + cols).min(self.masked_keys)
    }

    /// Applies the mask to `row`, the scores of query `i` (head `hi`,
    /// batch `bi`) for keys `j0..j0 + row.len()`: additive parts add to
    /// the visible keys, and hidden keys are set to `-inf` (set, not added,
    /// so that a hidden key's NaN score cannot leak).
    pub(crate) fn mask_row(&self, row: &mut [f32], bi: usize, hi: usize, i: usize, j0: usize) {
        let masked = self.masked_keys.saturating_sub(j0).min(row.len());
        let row = &mut row[..masked];
        if row.is_empty() {
            return;
        }
        if let Some((slopes, off)) = self.alibi {
            let m = slopes[hi];
            let base = j0 as isize - i as isize - off;
            for (x, d) in row.iter_mut().zip(base..) {
                *x += m * d as f32;
            }
        }
        // A part's entries for this row: one per key, or one for all where
        // the part is broadcast along the keys.
        let entries = |p: &PartView| {
            let off = bi * p.stride[0] + hi * p.stride[1] + i * p.stride[2] + j0 * p.stride[3];
            off..off + if p.stride[3] == 0 { 1 } else { masked }
        };
        for p in self.parts {
            if let PartData::Additive(data) = p.data {
                simd::add_visible(self.isa, row, &data[entries(p)]);
            }
        }
        for p in self.parts {
            match p.data {
                PartData::Additive(data) => simd::hide_where_neg_inf(self.isa, row, &data[entries(p)]),
                PartData::HideWhereNonZero(data) => {
                    simd::hide_where_nonzero(self.isa, row, &data[entries(p)])
                }
                PartData::HideWhereZero(data) => simd::hide_where_zero(self.isa, row, &data[entries(p)]),
            }
        }
        let visible = self.causal_end(i).saturating_sub(j0).min(masked);
        row[visible..].fill(f32::NEG_INFINITY);
        let before = self.keys_start(i).saturating_sub(j0).min(visible);
        row[..before].fill(f32::NEG_INFINITY);
    }

    /// Dropout on `row`, the weights of query `i` (head `hi`, batch `bi`)
    /// for keys `j0..j0 + row.len()`, where the problem has it.
    #[inline]
    pub(crate) fn drop_row(&self, row: &mut [f32], bi: usize, hi: usize, i: usize, j0: usize) {
        if let Some(dropout) = &self.dropout {
            let l = self.dims.0;
            dropout.apply(self.isa, ((bi * self.heads + hi) * l + i) as u64, j0, row);
        }
    }

    /// Attention for one unit's query rows, written to its output rows;
    /// whether every output is finite. Its heads' rows go together, head
    /// by head (`t·rows + r` for head `hi + t`'s row `r`), through each
    /// block of keys and values of their kv-head.
    pub(super) fn run_block(&self, unit: Unit) -> bool {
        let Unit {
            bi,
            hi,
            heads,
            i0,
            rows,
            ..
        } = unit;
        let (l, _, d, dv) = self.dims;
        let kvh = hi / self.heads_per_kv;
        debug_assert!((hi + heads - 1) / self.heads_per_kv == kvh);
        let n = heads * rows;
        // The keys any row of this block may see.
        let kv_end = self.keys_end(i0 + rows - 1);
        let mut acc = vec![0f32; n * dv];
        let mut row_max = vec![f32::NEG_INFINITY; n];
        let mut row_sum = vec![0f32; n];
        let bk = BLOCK_K.min(kv_end.max(1));
        let mut tile = vec![0f32; n * bk];
        // The query rows as runs of one stride: the heads' single rows as
        // one run (a decoder's step), else each head's rows.
        let (q_rs, runs, run_rows) = if rows == 1 {
            (self.q.stride[1], 1, heads)
        } else {
            (self.q.stride[2], heads, rows)
        };
        // Decode-sized blocks (too few rows for `gemm` to pay for its
        // packing) take the products read in place (`decode.rs`).
        let lanes = if n < DIRECT_ROWS { self.isa } else { Isa::Portable };
        let mut j0 = self.keys_start(i0);
        while j0 < kv_end {
            let cols = bk.min(kv_end - j0);
            let k_off = self.k.offset(bi, kvh, j0);
            for t in 0..runs {
                let q_off = self.q.offset(bi, hi + t, i0);
                let tile = &mut tile[t * run_rows * cols..];
                // SAFETY: the offsets and strides come from the tensors' own
                // layouts and stay inside their data for these row/col
                // counts; `lanes` is at most what the processor runs.
                unsafe {
                    let (q, k) = (self.q.data.as_ptr().add(q_off), self.k.data.as_ptr().add(k_off));
                    let k_rs = self.k.stride[2];
                    match lanes {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 | Isa::Avx512Bf16 => {
                            decode::zmm::scores(run_rows, q, q_rs, k, k_rs, cols, d, self.scale, tile)
                        }
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => {
                            decode::ymm::scores(run_rows, q, q_rs, k, k_rs, cols, d, self.scale, tile)
                        }
                        // tile (rows, cols) = scale · Q (rows, d) · Kᵀ (d, cols)
                        _ => {
                            let (k, k_rs, _widened) = f32_rows(k, k_rs, cols, d);
                            gemm(
                                run_rows,
                                cols,
                                d,
                                tile.as_mut_ptr(),
                                1,
                                cols as isize,
                                false,
                                q,
                                1,
                                q_rs as isize,
                                k,
                                k_rs as isize,
                                1,
                                0.,
                                self.scale,
                                false,
                                false,
                                false,
                                Parallelism::None,
                            )
                        }
                    }
                }
            }
            for r in 0..n {
                let row = &mut tile[r * cols..(r + 1) * cols];
                if let Some(cap) = self.softcap {
                    simd::softcap_row(self.isa, row, cap);
                }
                self.mask_row(row, bi, hi + r / rows, i0 + r % rows, j0);
                let acc_row = &mut acc[r * dv..(r + 1) * dv];
                simd::online_softmax_row(self.isa, row, &mut row_max[r], &mut row_sum[r], acc_row);
                self.drop_row(row, bi, hi + r / rows, i0 + r % rows, j0);
            }
            let v_off = self.v.offset(bi, kvh, j0);
            // SAFETY: as above.
            unsafe {
                let (v, v_rs) = (self.v.data.as_ptr().add(v_off), self.v.stride[2]);
                match lanes {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 | Isa::Avx512Bf16 => {
                        decode::zmm::weighted_values(n, &tile, cols, v, v_rs, dv, &mut acc)
                    }
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => decode::ymm::weighted_values(n, &tile, cols, v, v_rs, dv, &mut acc),
                    // acc (n, dv) += P (n, cols) · V (cols, dv)
                    _ => {
                        let (v, v_rs, _widened) = f32_rows(v, v_rs, cols, dv);
                        gemm(
                            n,
                            dv,
                            cols,
                            acc.as_mut_ptr(),
                            1,
                            dv as isize,
                            true,
                            tile.as_ptr(),
                            1,
                            cols as isize,
                            v,
                            1,
                            v_rs as isize,
                            1.,
                            1.,
                            false,
                            false,
                            false,
                            Parallelism::None,
                        )
                    }
                }
            }
            j0 += cols;
        }
        (0..heads).fold(true, |finite, t| {
            let head = Unit {
                base: unit.base + t * dv,
                lse_base: unit.lse_base + t * l,
                ..unit
            };
            let rows = t * rows..(t + 1) * rows;
            write_rows(
                &acc[rows.start * dv..],
                dv,
                dv,
                &row_max[rows.clone()],
                &row_sum[rows],
                head,
            ) && finite
        })
    }
}

/// `rows` rows of `d` elements from `p` (row stride `rs`) as f32 rows for
/// `gemm`: in place where they are f32, else widened into the returned
/// buffer, which the pointer borrows.
///
/// # Safety
/// `p` covers the rows.
unsafe fn f32_rows<E: PanelElem>(
    p: *const E,
    rs: usize,
    rows: usize,
    d: usize,
) -> (*const f32, usize, Vec<f32>) {
    if let Some(p) = E::f32_ptr(p) {
        return (p, rs, Vec::new());
    }
    let mut widened = vec![0f32; rows * d];
    for (j, dst) in widened.chunks_exact_mut(d.max(1)).enumerate() {
        // SAFETY: row j < rows of d elements, as the caller vouched.
        E::widen(unsafe { std::slice::from_raw_parts(p.add(j * rs), d) }, dst);
    }
    (widened.as_ptr(), d, widened)
}

/// Writes the unit's normalised rows: row `r`'s first `dv` accumulators
/// (of `acc_rs`) over its sum to the unit's output row `r`, and `max +
/// ln(sum)` to its log-sum-exp where the unit keeps them; whether every
/// output is finite.
pub(crate) fn write_rows(
    acc: &[f32],
    acc_rs: usize,
    dv: usize,
    row_max: &[f32],
    row_sum: &[f32],
    unit: Unit,
) -> bool {
    let mut finite = true;
    for (r, (&max, &sum)) in row_max.iter().zip(row_sum).enumerate() {
        if let Some(lse) = unit.lse {
            // A row that saw no key gets -inf (its weights are all 0); a NaN
            // row keeps NaN.
            let y = if sum > 0. || sum.is_nan() {
                max + sum.ln()
            } else {
                f32::NEG_INFINITY
            };
            // SAFETY: the unit's rows of `lse` are its own (the callers'
            // contract), in bounds as `out`'s are.
            unsafe { lse.get().add(unit.lse_base + r).write(y) };
        }
        // A row that saw no key keeps sum 0 and an all-zero accumulator; a
        // NaN row (`softmax::poison`) keeps sum NaN and NaN accumulators.
        let inv = if sum > 0. || sum.is_nan() { 1. / sum } else { 0. };
        for (c, a) in acc[r * acc_rs..][..dv].iter().enumerate() {
            let y = a * inv;
            finite &= y.is_finite();
            // SAFETY: row r of this unit lies in `out`'s allocation and no
            // other unit writes it (the callers' contract); written, not
            // read, as it starts uninitialised.
            unsafe { unit.out.get().add(unit.base + r * unit.out_rs + c).write(y) };
        }
    }
    finite
}
