//! The memory-efficient attention kernel (see the module doc of `cpu`).

use std::sync::atomic::{AtomicBool, Ordering};

use candle::{bail, DType, Layout, Result, Storage, Tensor};
use gemm::{gemm, Parallelism};

use crate::mask::{Mask, MaskPart};

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::isa::Isa;
#[cfg(target_arch = "x86_64")]
use super::lanes;
use super::simd;

/// Bytes of one (batch, kv-head)'s packed keys and values up to which
/// threads pack their own ([`Packing::PerThread`]): half of a 2 MiB L2.
#[cfg(target_arch = "x86_64")]
const HEAD_PACK_MAX: usize = 1 << 20;

thread_local! {
    /// The (batch, kv-head) a thread packed last, and the call it was for.
    #[cfg(target_arch = "x86_64")]
    static HEAD_PACK: std::cell::Cell<Option<(usize, avx2::Packed)>> = const { std::cell::Cell::new(None) };
}

/// Numbers the packed calls, so that a thread never takes another call's
/// packed keys for its own.
#[cfg(target_arch = "x86_64")]
static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Query rows per work unit, at most.
const BLOCK_Q: usize = 384;
/// The same for the packed micro-kernels: 16 groups of the AVX2 kernels' 6
/// rows, 8 of the AVX-512 kernels' 12.
const AVX2_BLOCK_Q: usize = 96;
/// Keys per tile.
const BLOCK_K: usize = 512;
/// Query blocks of fewer rows take the `lanes.rs` products on AVX2 and
/// AVX-512 (each key and value read once per row, no packing).
const DIRECT_ROWS: usize = 16;

/// A read-only 4-D f32 view: base slice and element strides.
pub(super) struct View<'a> {
    pub(super) data: &'a [f32],
    pub(super) stride: [usize; 4],
}

impl View<'_> {
    /// Offset of element `(b, h, i, 0)`.
    pub(super) fn offset(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.stride[0] + h * self.stride[1] + i * self.stride[2]
    }
}

/// Borrows the f32 data of a CPU tensor with a contiguous last dim.
fn with_view<R>(t: &Tensor, what: &str, f: impl FnOnce(View) -> Result<R>) -> Result<R> {
    let (storage, layout): (_, &Layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("cpu attention kernel: {what} is not on the CPU")
    };
    let data = cpu.as_slice::<f32>()?;
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

/// Whether the kernel can serve these inputs.
pub(crate) fn supports(q: &Tensor) -> bool {
    q.device().is_cpu() && matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// `softmax(q kᵀ · scale + mask) v` without materialising the scores.
/// Shapes as [`crate::scaled_dot_product_attention`] (validated by the
/// caller); the last `appended` keys lie outside the mask; returns
/// `(batch, heads, q_len, v_head_dim)` in `q`'s dtype, a view of a
/// `(batch, q_len, heads, v_head_dim)` buffer.
pub(crate) fn sdpa_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
) -> Result<Tensor> {
    sdpa_cpu_with(q, k, v, mask, appended, scale, None, None)
}

/// How a tile's two products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tiles {
    /// `gemm` calls on the strided inputs: any CPU, and decode-sized calls.
    Gemm,
    /// AVX2+FMA micro-kernels on packed keys and values.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    /// AVX-512F micro-kernels on the same packed keys and values.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Tiles {
    /// The faster choice on this CPU for `q_len` query rows and these head
    /// dims (the packed layout needs both non-zero).
    fn best(q_len: usize, head_dim: usize, v_head_dim: usize) -> Tiles {
        #[cfg(target_arch = "x86_64")]
        if q_len >= avx2::MIN_Q_LEN && head_dim > 0 && v_head_dim > 0 {
            match super::isa::current() {
                super::isa::Isa::Avx512 => return Tiles::Avx512,
                super::isa::Isa::Avx2 => return Tiles::Avx2,
                super::isa::Isa::Portable => {}
            }
        }
        let _ = (q_len, head_dim, v_head_dim);
        Tiles::Gemm
    }
}

/// Where the micro-kernels' packed keys and values are packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Packing {
    /// Every (batch, kv-head) at once, in parallel, before the units run;
    /// the units read them from wherever they are by then (L3 or memory
    /// once they outgrow L2).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Shared,
    /// By each thread, for the (batch, kv-head) of the unit it runs, kept
    /// for its next units: a (batch, kv-head)'s packed keys and values are
    /// written and read from the thread's own L2.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    PerThread,
}

impl Packing {
    /// Per thread where a (batch, kv-head) packs into half of L2 and there
    /// are enough of them (`packs`) that threads seldom pack the same one.
    #[cfg(target_arch = "x86_64")]
    fn best(p: &Problem, packs: usize) -> Packing {
        if packs >= 2 * rayon::current_num_threads() && avx2::Packed::bytes_per_head(p) <= HEAD_PACK_MAX {
            Packing::PerThread
        } else {
            Packing::Shared
        }
    }
}

/// `t` with a contiguous last dim: the tensor itself where it has one.
fn last_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    let (stride, dims) = (t.stride(), t.dims());
    if stride.last() == Some(&1) || dims.last().is_some_and(|&d| d <= 1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// [`sdpa_cpu`] with the tile products and the packing forced (`None`:
/// the best).
#[allow(clippy::too_many_arguments)]
fn sdpa_cpu_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    appended: usize,
    scale: f64,
    tiles: Option<Tiles>,
    packing: Option<Packing>,
) -> Result<Tensor> {
    let dtype = q.dtype();
    if dtype != DType::F32 {
        // Half precision: compute in f32 (f32 accumulation), cast back.
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        return sdpa_cpu_with(&f(q)?, &f(k)?, &f(v)?, mask, appended, scale, tiles, packing)?.to_dtype(dtype);
    }
    // The kernel reads rows in place; any other layout is copied once.
    let (q, k, v) = (
        last_dim_contiguous(q)?,
        last_dim_contiguous(k)?,
        last_dim_contiguous(v)?,
    );
    let (b, h, l, d) = q.dims4()?;
    let (_, kh, s, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let masked_keys = s.saturating_sub(appended);
    // Key padding and attention masks are read in their own shapes (bytes
    // stay bytes); the causal rule stays a rule, so tiles above the
    // diagonal are skipped instead of computed and masked.
    let parts = mask.tensor_parts((b, h, l, masked_keys))?;
    let causal = mask.causal.map(|c| c.offset(l, masked_keys));
    let alibi = mask
        .alibi
        .as_ref()
        .map(|a| (a.slopes(), mask.alibi_offset(l, masked_keys)));
    // Set by a unit that wrote a non-finite output.
    let non_finite = AtomicBool::new(false);
    // Every (batch, row, head) slot is written by exactly one work unit.
    let mut out: Vec<f32> = Vec::with_capacity(b * l * h * dv);
    let tiles = tiles.unwrap_or_else(|| Tiles::best(l, d, dv));
    // Query blocks of at most `block` rows, as even as the length allows.
    let block = match tiles {
        Tiles::Gemm => BLOCK_Q,
        Tiles::Avx2 | Tiles::Avx512 => AVX2_BLOCK_Q,
    };
    let block = l.div_ceil(l.div_ceil(block));
    // The multiply-adds: a decoder step's attention is short enough that
    // handing it to the pool is a large part of it.
    let work = b * h * l * s * (d + dv);
    let units: Vec<(usize, usize, usize)> = (0..b)
        .flat_map(|bi| (0..h).flat_map(move |hi| (0..l).step_by(block).map(move |i0| (bi, hi, i0))))
        .collect();
    let guards = parts
        .iter()
        .map(|p| p.tensor().storage_and_layout())
        .collect::<Vec<_>>();
    let part_views = parts
        .iter()
        .zip(&guards)
        .map(|(part, (storage, layout))| PartView::new(part, storage, layout))
        .collect::<Result<Vec<_>>>()?;
    with_view(&q, "q", |qv| {
        with_view(&k, "k", |kv| {
            with_view(&v, "v", |vv| {
                let problem = Problem {
                    q: &qv,
                    k: &kv,
                    v: &vv,
                    parts: &part_views,
                    heads_per_kv: h / kh,
                    dims: (l, s, d, dv),
                    scale: scale as f32,
                    causal,
                    window: mask.window,
                    alibi,
                    masked_keys,
                };
                let out_ptr = SyncPtr(out.as_mut_ptr());
                // Rows (bi, i0..i0+rows, hi, ..) of the (B, L, H, Dv) output;
                // every unit writes a disjoint set of rows.
                let unit = |bi: usize, hi: usize, i0: usize| Unit {
                    bi,
                    hi,
                    i0,
                    rows: block.min(l - i0),
                    out: out_ptr,
                    base: (bi * l + i0) * h * dv + hi * dv,
                    out_rs: h * dv,
                };
                #[cfg(target_arch = "x86_64")]
                if let Some(kernels) = match tiles {
                    Tiles::Avx2 => Some(avx2::Kernels::Avx2),
                    Tiles::Avx512 => Some(avx2::Kernels::Avx512),
                    Tiles::Gemm => None,
                } {
                    let packing = packing.unwrap_or_else(|| Packing::best(&problem, b * kh));
                    let run = |packed: &avx2::Packed, (bi, hi, i0): (usize, usize, usize)| {
                        // SAFETY: `Tiles::Avx2` and `Tiles::Avx512` are only
                        // chosen (or forced by tests) where the processor
                        // runs them; `packed` holds the unit's keys and
                        // values; the unit's rows are its own.
                        if !unsafe { avx2::run_block(&problem, packed, unit(bi, hi, i0), kernels) } {
                            non_finite.store(true, Ordering::Relaxed);
                        }
                    };
                    match packing {
                        Packing::Shared => {
                            // SAFETY: as above.
                            let packed = unsafe { avx2::Packed::new(&problem, b, kh) };
                            super::par_for(units.len(), work, |u| run(&packed, units[u]));
                        }
                        Packing::PerThread => {
                            let call = CALLS.fetch_add(1, Ordering::Relaxed);
                            super::par_for(units.len(), work, |u| {
                                let (bi, hi, _) = units[u];
                                let pack = bi * kh + hi / (h / kh);
                                HEAD_PACK.with(|kept| {
                                    // A thread runs consecutive units (those
                                    // of a head, then of the next) as a rule,
                                    // so it packs each (batch, kv-head) it
                                    // meets about once.
                                    let packed = match kept.take() {
                                        Some((c, packed)) if c == call && packed.holds(pack) => packed,
                                        // SAFETY: as above.
                                        kept => unsafe {
                                            avx2::Packed::one(
                                                &problem,
                                                kh,
                                                pack,
                                                kept.map(|(_, p)| p.release()),
                                            )
                                        },
                                    };
                                    run(&packed, units[u]);
                                    kept.set(Some((call, packed)));
                                });
                            });
                        }
                    }
                    return Ok(());
                }
                // Only the packed tiles (x86-64) pack.
                #[cfg(not(target_arch = "x86_64"))]
                let _ = packing;
                super::par_for(units.len(), work, |u| {
                    let (bi, hi, i0) = units[u];
                    if !problem.run_block(unit(bi, hi, i0)) {
                        non_finite.store(true, Ordering::Relaxed);
                    }
                });
                Ok(())
            })
        })
    })?;
    drop(part_views);
    drop(guards);
    // SAFETY: the units wrote all `b * l * h * dv` floats (`write_rows`).
    unsafe { out.set_len(b * l * h * dv) };
    // A non-finite output comes from a query whose row is NaN (a NaN or
    // +inf score: right as it is) or from a non-finite value; the latter
    // may sit in a hidden key that a tile still multiplied by its zero
    // weight, so the reference path, which reads no hidden value, decides.
    if non_finite.into_inner() && !all_finite_tensor(&v)? {
        return Ok(crate::sdpa::sdpa_reference(&q, &k, &v, mask, appended, Some(scale), None)?.0);
    }
    Tensor::from_vec(out, (b, l, h, dv), q.device())?.transpose(1, 2)
}

/// Whether every element of a CPU f32 tensor is finite.
fn all_finite_tensor(t: &Tensor) -> Result<bool> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("cpu attention kernel: tensor is not on the CPU")
    };
    Ok(simd::all_finite(
        &cpu.as_slice::<f32>()?[layout.start_offset()..][..t.elem_count()],
    ))
}

/// A mask part's data as the kernel reads it, with its element strides
/// over (batch, head, query, key); a broadcast dim has stride 0.
struct PartView<'a> {
    data: PartData<'a>,
    stride: [usize; 4],
}

#[derive(Clone, Copy)]
enum PartData<'a> {
    HideWhereNonZero(&'a [u8]),
    HideWhereZero(&'a [u8]),
    Additive(&'a [f32]),
}

impl<'a> PartView<'a> {
    fn new(part: &MaskPart, storage: &'a Storage, layout: &Layout) -> Result<Self> {
        let Storage::Cpu(cpu) = storage else {
            bail!("cpu attention kernel: mask is not on the CPU")
        };
        let dims = layout.dims();
        let [_, d1, d2, d3] = *dims else {
            bail!("cpu attention kernel: mask part must be 4-D, found {dims:?}")
        };
        // Parts are contiguous in their own shape (`Mask::tensor_parts`).
        let dense = [d1 * d2 * d3, d2 * d3, d3, 1];
        let mut stride = [0; 4];
        for i in 0..4 {
            stride[i] = if dims[i] > 1 { dense[i] } else { 0 };
        }
        let start = layout.start_offset();
        let data = match part {
            MaskPart::HideWhereNonZero(_) => PartData::HideWhereNonZero(&cpu.as_slice::<u8>()?[start..]),
            MaskPart::HideWhereZero(_) => PartData::HideWhereZero(&cpu.as_slice::<u8>()?[start..]),
            MaskPart::Additive(_) => PartData::Additive(&cpu.as_slice::<f32>()?[start..]),
        };
        Ok(Self { data, stride })
    }
}

/// A raw output pointer shared by the work units, which write disjoint rows.
#[derive(Clone, Copy)]
pub(super) struct SyncPtr(pub(super) *mut f32);
// SAFETY: units write disjoint rows (see `run_block`); the pointer outlives
// the parallel loop, which joins before the buffer is used.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer; a method, so that closures capture the `SyncPtr`
    /// (`Send + Sync`), not its raw field.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// One work unit: query rows `i0..i0 + rows` of head `hi` in batch `bi`,
/// row `r` written to `out[base + r * out_rs ..][..v_head_dim]`. Units
/// write disjoint rows.
#[derive(Clone, Copy)]
pub(super) struct Unit {
    pub(super) bi: usize,
    pub(super) hi: usize,
    pub(super) i0: usize,
    pub(super) rows: usize,
    pub(super) out: SyncPtr,
    pub(super) base: usize,
    pub(super) out_rs: usize,
}

pub(super) struct Problem<'a> {
    pub(super) q: &'a View<'a>,
    pub(super) k: &'a View<'a>,
    pub(super) v: &'a View<'a>,
    /// Key padding and attention masks, over the first `masked_keys` keys.
    parts: &'a [PartView<'a>],
    pub(super) heads_per_kv: usize,
    /// (q_len, kv_len, head_dim, v_head_dim)
    pub(super) dims: (usize, usize, usize, usize),
    pub(super) scale: f32,
    /// Key `j < masked_keys` is visible to query `i` iff `j <= i + offset`.
    pub(super) causal: Option<isize>,
    /// With `causal`: and iff `j > i + offset - window`.
    window: Option<usize>,
    /// ALiBi: per-head slopes and the offset of the diagonal distances
    /// are measured from.
    alibi: Option<(&'a [f32], isize)>,
    /// Keys past this (`add_bias_kv`, `add_zero_attn`) are never masked.
    pub(super) masked_keys: usize,
}

impl Problem<'_> {
    /// One past the last masked key query `i` may see by the causal rule.
    fn causal_end(&self, i: usize) -> usize {
        match self.causal {
            Some(off) => (i as isize + off + 1).clamp(0, self.masked_keys as isize) as usize,
            None => self.masked_keys,
        }
    }

    /// The first key query `i` may see by the sliding window (0 without
    /// one): tiles before it are skipped.
    pub(super) fn keys_start(&self, i: usize) -> usize {
        match (self.causal, self.window) {
            (Some(off), Some(w)) => (i as isize + off + 1)
                .saturating_sub(crate::mask::window_isize(w))
                .clamp(0, self.masked_keys as isize) as usize,
            _ => 0,
        }
    }

    /// One past the last key query `i` sees: the keys a unit or group
    /// whose last row is `i` must visit.
    #[inline]
    pub(super) fn keys_end(&self, i: usize) -> usize {
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
    pub(super) fn sees_all_as_scored(&self, i: usize, j0: usize, cols: usize) -> bool {
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
    pub(super) fn mask_row(&self, row: &mut [f32], bi: usize, hi: usize, i: usize, j0: usize) {
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
        let at = |p: &PartView| bi * p.stride[0] + hi * p.stride[1] + i * p.stride[2] + j0 * p.stride[3];
        for p in self.parts {
            if let PartData::Additive(data) = p.data {
                let off = at(p);
                match p.stride[3] {
                    0 => simd::add_visible(row, &[data[off]], true),
                    _ => simd::add_visible(row, &data[off..off + masked], false),
                }
            }
        }
        for p in self.parts {
            let off = at(p);
            match (p.data, p.stride[3]) {
                (PartData::Additive(data), 0) => simd::hide_where_neg_inf(row, &[data[off]], true),
                (PartData::Additive(data), _) => {
                    simd::hide_where_neg_inf(row, &data[off..off + masked], false)
                }
                (PartData::HideWhereNonZero(data), 0) => simd::hide_where(row, &[data[off]], true, true),
                (PartData::HideWhereNonZero(data), _) => {
                    simd::hide_where(row, &data[off..off + masked], true, false)
                }
                (PartData::HideWhereZero(data), 0) => simd::hide_where(row, &[data[off]], false, true),
                (PartData::HideWhereZero(data), _) => {
                    simd::hide_where(row, &data[off..off + masked], false, false)
                }
            }
        }
        let visible = self.causal_end(i).saturating_sub(j0).min(masked);
        row[visible..].fill(f32::NEG_INFINITY);
        let before = self.keys_start(i).saturating_sub(j0).min(visible);
        row[..before].fill(f32::NEG_INFINITY);
    }

    /// Attention for one unit's query rows, written to its output rows;
    /// whether every output is finite.
    fn run_block(&self, unit: Unit) -> bool {
        let Unit { bi, hi, i0, rows, .. } = unit;
        let (_, _, d, dv) = self.dims;
        let kvh = hi / self.heads_per_kv;
        // The keys any row of this block may see.
        let kv_end = self.keys_end(i0 + rows - 1);
        let mut acc = vec![0f32; rows * dv];
        let mut row_max = vec![f32::NEG_INFINITY; rows];
        let mut row_sum = vec![0f32; rows];
        let bk = BLOCK_K.min(kv_end.max(1));
        let mut tile = vec![0f32; rows * bk];
        let q_off = self.q.offset(bi, hi, i0);
        // Decode-sized blocks (too few rows for `gemm` to pay for its
        // packing) take the products read in place (`lanes.rs`).
        let lanes = if rows < DIRECT_ROWS {
            super::isa::current()
        } else {
            Isa::Portable
        };
        let mut j0 = self.keys_start(i0);
        while j0 < kv_end {
            let cols = bk.min(kv_end - j0);
            let k_off = self.k.offset(bi, kvh, j0);
            // SAFETY: the offsets and strides come from the tensors' own
            // layouts and stay inside their data for these row/col counts;
            // `lanes` is at most what the processor runs.
            unsafe {
                let (q, k) = (self.q.data.as_ptr().add(q_off), self.k.data.as_ptr().add(k_off));
                let (q_rs, k_rs) = (self.q.stride[2], self.k.stride[2]);
                match lanes {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => lanes::zmm::scores(rows, q, q_rs, k, k_rs, cols, d, self.scale, &mut tile),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => lanes::ymm::scores(rows, q, q_rs, k, k_rs, cols, d, self.scale, &mut tile),
                    // tile (rows, cols) = scale · Q (rows, d) · Kᵀ (d, cols)
                    _ => gemm(
                        rows,
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
                    ),
                }
            }
            for r in 0..rows {
                let row = &mut tile[r * cols..(r + 1) * cols];
                self.mask_row(row, bi, hi, i0 + r, j0);
                let acc_row = &mut acc[r * dv..(r + 1) * dv];
                simd::online_softmax_row(row, &mut row_max[r], &mut row_sum[r], acc_row);
            }
            let v_off = self.v.offset(bi, kvh, j0);
            // SAFETY: as above.
            unsafe {
                let (v, v_rs) = (self.v.data.as_ptr().add(v_off), self.v.stride[2]);
                match lanes {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => lanes::zmm::weighted_values(rows, &tile, cols, v, v_rs, dv, &mut acc),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => lanes::ymm::weighted_values(rows, &tile, cols, v, v_rs, dv, &mut acc),
                    // acc (rows, dv) += P (rows, cols) · V (cols, dv)
                    _ => gemm(
                        rows,
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
                    ),
                }
            }
            j0 += cols;
        }
        write_rows(&acc, dv, dv, &row_sum, unit)
    }
}

/// Writes the unit's normalised rows: row `r`'s first `dv` accumulators
/// (of `acc_rs`) over its sum to the unit's output row `r`; whether every
/// output is finite.
pub(super) fn write_rows(acc: &[f32], acc_rs: usize, dv: usize, row_sum: &[f32], unit: Unit) -> bool {
    let mut finite = true;
    for (r, &sum) in row_sum.iter().enumerate() {
        // A row that saw no key keeps sum 0 and an all-zero accumulator; a
        // NaN row (`simd::poison`) keeps sum NaN and NaN accumulators.
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

#[cfg(test)]
mod tests {
    use candle::{Device, Result, Tensor};

    use super::{sdpa_cpu_with, Packing, Tiles};
    use crate::cpu::testing::{randn, rel_err};
    use crate::mask::{Alibi, AttnMask, Causal, KeyPaddingMask, Mask};
    use crate::sdpa::sdpa_reference;

    /// Every tile implementation the processor runs under the current ISA,
    /// the packed ones with each packing.
    fn runnable_tiles() -> Vec<(Tiles, Packing)> {
        use crate::cpu::isa::{current, Isa};
        let mut tiles = vec![(Tiles::Gemm, Packing::Shared)];
        let mut packed = |t| tiles.extend([(t, Packing::Shared), (t, Packing::PerThread)]);
        if cfg!(target_arch = "x86_64") && current() >= Isa::Avx2 {
            packed(Tiles::Avx2);
        }
        if cfg!(target_arch = "x86_64") && current() >= Isa::Avx512 {
            packed(Tiles::Avx512);
        }
        tiles
    }

    /// Every tile implementation this CPU runs, forced, under every
    /// instruction set it runs, equals the reference path, including shapes
    /// `Tiles::best` would not give it: single query rows for the
    /// micro-kernels, partial row groups, key counts off the panel and
    /// block sizes, value widths off the panel width; decode-sized blocks
    /// (the `lanes.rs` products) with dims off the vector widths.
    #[test]
    fn every_tile_implementation_equals_reference() -> Result<()> {
        use crate::cpu::isa::{force, supported, FORCE_LOCK};
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            every_tile_implementation_equals_reference_under(isa)?;
        }
        force(None);
        Ok(())
    }

    fn every_tile_implementation_equals_reference_under(isa: crate::cpu::isa::Isa) -> Result<()> {
        let tiles = runnable_tiles();
        // (batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim)
        let shapes = [
            (1, 2, 2, 1, 300, 64, 64),
            (2, 3, 1, 7, 17, 8, 8),
            (1, 4, 2, 3, 530, 37, 75),
            (1, 2, 2, 100, 257, 64, 24),
            (2, 4, 2, 37, 530, 40, 72),
            (1, 1, 1, 200, 5, 256, 256),
        ];
        for (b, h, kh, l, s, d, dv) in shapes {
            let (q, k, v) = (
                randn(&[b, h, l, d])?,
                randn(&[b, kh, s, d])?,
                randn(&[b, kh, s, dv])?,
            );
            let lengths: Vec<usize> = (0..b).map(|i| s - i * s / 2).collect();
            let masks = [
                Mask::new(),
                Mask::causal(Causal::TopLeft),
                Mask::causal(Causal::BottomRight),
                Mask::causal(Causal::Offset(2)),
                Mask::causal(Causal::TopLeft)
                    .with_attn(AttnMask::Additive(randn(&[l, s])?))
                    .with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &Device::Cpu)?),
                // Windows narrower and wider than a key block and a panel.
                Mask::causal(Causal::BottomRight).with_window(3),
                Mask::causal(Causal::BottomRight)
                    .with_window(70)
                    .with_alibi(Alibi::new(h)),
                Mask::new().with_alibi(Alibi::new(h)),
            ];
            for (m, mask) in masks.iter().enumerate() {
                let scale = 0.7 / (d as f64).sqrt().max(1.);
                let reference = sdpa_reference(&q, &k, &v, mask, 0, Some(scale), None)?.0;
                for &(t, packing) in &tiles {
                    let ours = sdpa_cpu_with(&q, &k, &v, mask, 0, scale, Some(t), Some(packing))?;
                    let err = rel_err(&ours, &reference)?;
                    let what = format!(
                        "{isa:?} {t:?} {packing:?} shape {:?} mask {m}",
                        (b, h, kh, l, s, d, dv)
                    );
                    assert!(err < 1e-5, "{what}: relative error {err:e}");
                }
            }
        }
        Ok(())
    }

    /// Scores far from 0 (hundreds, all negative for some rows) give the
    /// reference's result on every tile implementation and instruction
    /// set: the row max the AVX-512 scores kernel keeps must be the row's
    /// (a max off by more than about 87 turns every weight to 0 or `inf`),
    /// and must leave out the zero-padded keys of a last panel. Scores this
    /// large carry absolute rounding errors of about 1e-5 between summation
    /// orders, so the weights agree to about that, not to 1e-7; a wrong max
    /// is off by orders of magnitude more.
    #[test]
    fn far_from_zero_scores_equal_reference_on_every_variant() -> Result<()> {
        use crate::cpu::isa::{force, supported, FORCE_LOCK};
        let _lock = FORCE_LOCK.lock();
        // (batch, heads, q_len, kv_len, head_dim): key counts off the panel.
        for (b, h, l, s, d) in [(1, 2, 40, 37, 64), (2, 1, 30, 300, 16)] {
            let offset = |t: Tensor, by: f64| -> Result<Tensor> { t.affine(1., by) };
            let cases = [
                // Every score about -17.5·√d (-140 at d = 64): all negative.
                (
                    offset(randn(&[b, h, l, d])?, 5.)?,
                    offset(randn(&[b, h, s, d])?, -5.)?,
                ),
                // Scores of either sign, hundreds apart.
                ((randn(&[b, h, l, d])? * 8.)?, (randn(&[b, h, s, d])? * 8.)?),
            ];
            let v = randn(&[b, h, s, d])?;
            for (c, (q, k)) in cases.iter().enumerate() {
                for mask in [Mask::new(), Mask::causal(Causal::BottomRight)] {
                    let scale = 0.7 / (d as f64).sqrt();
                    let reference = sdpa_reference(q, k, &v, &mask, 0, Some(scale), None)?.0;
                    for isa in supported() {
                        force(Some(isa));
                        for (t, packing) in runnable_tiles() {
                            let ours = sdpa_cpu_with(q, k, &v, &mask, 0, scale, Some(t), Some(packing))?;
                            let err = rel_err(&ours, &reference)?;
                            let what = format!(
                                "{isa:?} {t:?} {packing:?} case {c} {:?} causal {:?}",
                                (b, h, l, s, d),
                                mask.causal
                            );
                            assert!(err < 1e-3, "{what}: relative error {err:e}");
                        }
                    }
                    force(None);
                }
            }
        }
        Ok(())
    }

    /// Whether `a` and `b` have NaN and infinities (with their signs) in
    /// the same places and finite values within `tol` of `b`'s largest
    /// finite magnitude; the first difference otherwise.
    fn nan_aware_diff(a: &Tensor, b: &Tensor, tol: f32) -> Result<Option<String>> {
        let a = a.flatten_all()?.to_vec1::<f32>()?;
        let b = b.flatten_all()?.to_vec1::<f32>()?;
        let scale = b
            .iter()
            .filter(|x| x.is_finite())
            .fold(1e-30f32, |m, x| m.max(x.abs()));
        for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
            let same = if x.is_finite() && y.is_finite() {
                (x - y).abs() <= tol * scale
            } else {
                (x.is_nan() && y.is_nan()) || x == y
            };
            if !same {
                return Ok(Some(format!("element {i}: {x} vs reference {y}")));
            }
        }
        Ok(None)
    }

    /// NaN and infinities in q, k, v and additive masks give the same
    /// result on every tile implementation and instruction set, at decode
    /// and prefill lengths, as the reference path, NaN for NaN: a hidden
    /// key takes no part, visible pairs follow IEEE arithmetic.
    #[test]
    fn non_finite_inputs_equal_reference_on_every_variant() -> Result<()> {
        use crate::cpu::isa::{force, supported, FORCE_LOCK};
        let _lock = FORCE_LOCK.lock();
        let dev = Device::Cpu;
        let (b, h, kh, s, d, dv) = (2, 2, 1, 40, 16, 24);
        let tiles = runnable_tiles();
        // (tensor, flat index, value): q is (b, h, l, d), k (b, kh, s, d),
        // v (b, kh, s, dv), the additive mask (l, s). Key 33 is padding in
        // batch 0 (length 30) and past the causal diagonal of early rows.
        let pokes: &[(&str, [usize; 4], f32)] = &[
            ("q", [0, 1, 2, 3], f32::NAN),
            ("q", [1, 0, 0, 0], f32::INFINITY),
            ("k", [0, 0, 5, 1], f32::NAN),
            ("k", [1, 0, 9, 2], f32::INFINITY),
            ("k", [0, 0, 33, 0], f32::NAN),
            ("k", [1, 0, 3, 4], f32::NEG_INFINITY),
            ("v", [0, 0, 5, 2], f32::NAN),
            ("v", [1, 0, 7, 0], f32::INFINITY),
            ("v", [0, 0, 33, 1], f32::NAN),
            ("v", [0, 0, 2, 5], f32::NEG_INFINITY),
            ("mask", [0, 0, 1, 4], f32::NAN),
            ("mask", [0, 0, 0, 2], f32::INFINITY),
            ("mask", [0, 0, 3, 6], f32::NEG_INFINITY),
        ];
        let poke = |t: &Tensor, at: [usize; 4], x: f32| -> Result<Tensor> {
            let dims = t.dims4()?;
            let mut data = t.flatten_all()?.to_vec1::<f32>()?;
            let i = ((at[0] * dims.1 + at[1]) * dims.2 + at[2]) * dims.3 + at[3];
            data[i] = x;
            Tensor::from_vec(data, dims, &dev)
        };
        let mut checked = 0;
        for l in [1, 3, 20, 40] {
            let (q0, k0, v0) = (
                randn(&[b, h, l, d])?,
                randn(&[b, kh, s, d])?,
                randn(&[b, kh, s, dv])?,
            );
            let m0 = randn(&[1, 1, l, s])?;
            for &(what, at, x) in pokes {
                let at = [
                    at[0],
                    at[1],
                    at[2].min(if what == "q" || what == "mask" {
                        l - 1
                    } else {
                        s - 1
                    }),
                    at[3],
                ];
                let (mut q, mut k, mut v, mut m) = (q0.clone(), k0.clone(), v0.clone(), m0.clone());
                match what {
                    "q" => q = poke(&q, at, x)?,
                    "k" => k = poke(&k, at, x)?,
                    "v" => v = poke(&v, at, x)?,
                    _ => m = poke(&m, at, x)?,
                }
                let padding = KeyPaddingMask::from_lengths(&[30, s], s, &dev)?;
                let masks = [
                    Mask::new(),
                    Mask::causal(Causal::BottomRight),
                    Mask::new().with_key_padding(padding.clone()),
                    Mask::causal(Causal::TopLeft)
                        .with_key_padding(padding)
                        .with_attn(AttnMask::Additive(m.clone())),
                    Mask::new().with_attn(AttnMask::IgnoreWhereTrue(m.ge(1.)?)),
                ];
                for (mi, mask) in masks.iter().enumerate() {
                    let reference = sdpa_reference(&q, &k, &v, mask, 0, Some(0.5), None)?.0;
                    for isa in supported() {
                        force(Some(isa));
                        for &(t, packing) in &tiles {
                            // Under a forced ISA, only the tiles it runs.
                            if !runnable_tiles().contains(&(t, packing)) {
                                continue;
                            }
                            let ours = sdpa_cpu_with(&q, &k, &v, mask, 0, 0.5, Some(t), Some(packing))?;
                            if let Some(diff) = nan_aware_diff(&ours, &reference, 1e-5)? {
                                force(None);
                                panic!("{isa:?} {t:?} {packing:?} q_len {l}, {what}{at:?} = {x}, mask {mi}: {diff}");
                            }
                            checked += 1;
                        }
                    }
                    force(None);
                }
            }
        }
        assert!(checked > 0);
        Ok(())
    }

    /// Zero-width heads take the path that handles them: scores of 0 (a
    /// plain average of the values), and an empty output.
    #[test]
    fn zero_width_heads_equal_reference() -> Result<()> {
        for (d, dv) in [(0, 8), (8, 0), (0, 0)] {
            let (q, k, v) = (
                randn(&[1, 2, 20, d])?,
                randn(&[1, 2, 7, d])?,
                randn(&[1, 2, 7, dv])?,
            );
            let mask = Mask::causal(Causal::TopLeft);
            let reference = sdpa_reference(&q, &k, &v, &mask, 0, Some(1.), None)?.0;
            let ours = sdpa_cpu_with(&q, &k, &v, &mask, 0, 1., None, None)?;
            assert_eq!(ours.dims(), reference.dims());
            if dv > 0 {
                assert!(rel_err(&ours, &reference)? < 1e-6, "head dims ({d}, {dv})");
            }
        }
        Ok(())
    }
}
