//! The memory-efficient attention kernel.
//!
//! FlashAttention's algorithm (Dao et al., 2022) on the CPU: queries are cut
//! into blocks of rows, keys into blocks of columns; each query block keeps a
//! running row max, row sum and output accumulator, so the `(q_len, kv_len)`
//! score matrix never exists, only one tile per thread. The two products per
//! tile go, on x86-64, through register-blocked micro-kernels over packed
//! keys and values (`tiles.rs` drives them, `avx2.rs`, `avx512.rs` and the shared
//! `panel/avx2.rs` hold them); decode-sized blocks take the products read
//! in place (`decode.rs`);
//! elsewhere they go through the `gemm` crate (the one candle's CPU matmul
//! uses). Work is spread over the threads by (batch, head, query block)
//! (`runtime/pool.rs`'s `par_for`); a decode step over a long cache takes the
//! query heads of a kv-head in one unit, so that they read its keys and
//! values once.
//!
//! Inputs are read in place through their strides (only the last dim must be
//! contiguous), so `(batch, seq, heads, head_dim)` views from a projection
//! need no transposing copy; the output is written as
//! `(batch, q_len, heads, v_head_dim)`, the layout the output projection
//! wants. Masks are read in their own broadcast shapes ([`MaskPart`]); the
//! causal rule and the sliding window stay rules, so tiles they hide
//! whole are skipped. A unit's run over its key blocks is `problem.rs`.
//!
//! For training, [`sdpa_saving_lse`] also keeps each query row's
//! log-sum-exp, from which [`sdpa_backward`] (`backward.rs`,
//! FlashAttention-2's backward) recomputes the probabilities a tile at a
//! time for dQ, dK and dV.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod backward;
#[cfg(target_arch = "x86_64")]
mod decode;
mod dropout;
mod mask;
mod problem;
#[cfg(target_arch = "x86_64")]
mod tiles;

use std::sync::atomic::{AtomicBool, Ordering};

use candle::{bail, DType, Result, Storage, Tensor};
use half::{bf16, f16};

use crate::rows::simd;
use crate::runtime::isa::{current, runnable, Isa};
use crate::runtime::pool::{par_for, threads, SyncPtr};
pub use backward::{sdpa_backward, sdpa_backward_packed, Gradients};
pub use dropout::Dropout;
use mask::{part_storages, part_views};
pub use mask::{window_isize, MaskPart, Masking};
use problem::{last_dim_contiguous, with_view, KvElem, Problem, Unit, BLOCK_K, DIRECT_ROWS};

/// Bytes of one (batch, kv-head)'s packed keys and values up to which
/// threads pack their own ([`Packing::PerThread`]): half of a 2 MiB L2.
#[cfg(target_arch = "x86_64")]
const HEAD_PACK_MAX: usize = 1 << 20;

thread_local! {
    /// The (batch, kv-head) a thread packed last, and the call it was for.
    #[cfg(target_arch = "x86_64")]
    static HEAD_PACK: std::cell::Cell<Option<(usize, tiles::Packed)>> = const { std::cell::Cell::new(None) };
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
/// Keys from which a decode-sized call's units take the query heads of a
/// kv-head together: fewer stay in L2 while each head reads them again,
/// and units of one head share out more evenly between the threads.
const GROUP_FROM_KEYS: usize = BLOCK_K;

/// Whether the kernel can serve these inputs: CPU tensors of f32, f16 or
/// bf16.
pub fn supports(q: &Tensor) -> bool {
    q.device().is_cpu() && matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// How a tile's two products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    /// `gemm` calls on the strided inputs: any CPU, and decode-sized calls.
    Gemm,
    /// AVX2+FMA micro-kernels on packed keys and values.
    Avx2,
    /// AVX-512F micro-kernels on the same packed keys and values.
    Avx512,
}

impl Tiles {
    /// The faster choice on `isa` for `q_len` query rows and these head
    /// dims (the packed layout needs both non-zero).
    fn best(isa: Isa, q_len: usize, head_dim: usize, v_head_dim: usize) -> Tiles {
        #[cfg(target_arch = "x86_64")]
        if q_len >= tiles::MIN_Q_LEN && head_dim > 0 && v_head_dim > 0 {
            match isa {
                Isa::Avx512 | Isa::Avx512Bf16 => return Tiles::Avx512,
                Isa::Avx2 => return Tiles::Avx2,
                Isa::Portable => {}
            }
        }
        let _ = (isa, q_len, head_dim, v_head_dim);
        Tiles::Gemm
    }
}

/// Where the micro-kernels' packed keys and values are packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// Every (batch, kv-head) at once, in parallel, before the units run;
    /// the units read them from wherever they are by then (L3 or memory
    /// once they outgrow L2).
    Shared,
    /// By each thread, for the (batch, kv-head) of the unit it runs, kept
    /// for its next units: a (batch, kv-head)'s packed keys and values are
    /// written and read from the thread's own L2.
    PerThread,
}

impl Packing {
    /// Per thread where a (batch, kv-head) packs into half of L2 and there
    /// are enough of them (`packs`) that threads seldom pack the same one.
    #[cfg(target_arch = "x86_64")]
    fn best<KV: KvElem>(p: &Problem<KV>, packs: usize) -> Packing {
        if packs >= 2 * threads() && tiles::Packed::bytes_per_head(p) <= HEAD_PACK_MAX {
            Packing::PerThread
        } else {
            Packing::Shared
        }
    }
}

/// The instruction set, the tile products and the packing, where a
/// caller forces them (tests and benchmarks); `None` takes the best for
/// the call and the processor. A choice the processor cannot run falls
/// back to the best it can.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileOptions {
    /// How the tile products are computed.
    pub tiles: Option<Tiles>,
    /// Where the micro-kernels' packed keys and values are packed.
    pub packing: Option<Packing>,
    /// The instruction set every part of the call runs with (capped at
    /// what the processor runs, [`isa::runnable`](crate::isa::runnable));
    /// `None`: [`isa::current`](crate::isa::current).
    pub isa: Option<Isa>,
}

/// `softmax(q kᵀ · scale + mask) v` (with the scores soft-capped first
/// where [`Masking::softcap`] asks) without materialising the scores, for
/// `q` `(batch, heads, q_len, head_dim)`, `k` `(batch, kv_heads, kv_len,
/// head_dim)` and `v` `(batch, kv_heads, kv_len, v_head_dim)` (`heads` a
/// multiple of `kv_heads`; shapes validated by the caller), the last
/// `appended` keys outside the mask. Returns `(batch, heads, q_len,
/// v_head_dim)` in `q`'s dtype, a view of a `(batch, q_len, heads,
/// v_head_dim)` buffer; f16 and bf16 are computed in f32.
///
/// Keys and values may be in another dtype than `q` (a bf16 or f16 cache
/// beside f32 queries). bf16 or f16 keys and values (of one dtype) are
/// read in place, never copied whole to f32: the direct products of a
/// decode-sized call widen each row as they load it, the packed tiles as
/// they pack a (batch, kv-head), `gemm` one tile of keys at a time.
///
/// `None` where an output came out non-finite and a value is non-finite:
/// the value may sit in a key the mask hides, which a tile still
/// multiplied by its zero weight, so a path that reads no hidden value
/// must decide.
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    options: TileOptions,
) -> Result<Option<Tensor>> {
    let dtype = q.dtype();
    let q32 = q.to_dtype(DType::F32)?;
    let in_place = k.dtype() == v.dtype();
    let out = match k.dtype() {
        DType::BF16 if in_place => sdpa_in::<bf16>(&q32, k, v, masking, appended, scale, options, false)?,
        DType::F16 if in_place => sdpa_in::<f16>(&q32, k, v, masking, appended, scale, options, false)?,
        _ => {
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            sdpa_in::<f32>(&q32, &f(k)?, &f(v)?, masking, appended, scale, options, false)?
        }
    };
    out.map(|(t, _)| t.to_dtype(dtype)).transpose()
}

/// [`sdpa`] on f32 queries, keys and values that also returns each query
/// row's log-sum-exp of its (scaled, soft-capped, masked) scores,
/// `(batch, heads, q_len)`, `-inf` for a row that sees no key: what
/// [`sdpa_backward`] needs besides the output. `None` where `sdpa` gives
/// `None` (a non-finite value the mask may hide).
pub fn sdpa_saving_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    options: TileOptions,
) -> Result<Option<(Tensor, Tensor)>> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dtype() != DType::F32 {
            bail!(
                "attention forward saving lse: {name} must be f32, found {:?}",
                t.dtype()
            )
        }
    }
    let out = sdpa_in::<f32>(q, k, v, masking, appended, scale, options, true)?;
    Ok(out.and_then(|(out, lse)| Some((out, lse?))))
}

/// [`sdpa`] on f32 queries and keys and values of `KV`; with `save_lse`,
/// also each query row's log-sum-exp of its scores, `(batch, heads,
/// q_len)` (`-inf` for a row that sees no key).
#[allow(clippy::too_many_arguments)]
fn sdpa_in<KV: KvElem>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    options: TileOptions,
    save_lse: bool,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    let TileOptions { tiles, packing, isa } = options;
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
    let Masking {
        parts,
        causal,
        window,
        alibi,
        softcap,
        dropout,
    } = masking;
    // Set by a unit that wrote a non-finite output.
    let non_finite = AtomicBool::new(false);
    // Every (batch, row, head) slot is written by exactly one work unit.
    let mut out: Vec<f32> = Vec::with_capacity(b * l * h * dv);
    // Every (batch, head, row) slot likewise, where it is kept.
    let mut lse: Vec<f32> = Vec::with_capacity(if save_lse { b * h * l } else { 0 });
    // A forced choice the processor cannot run, or that the packed layout
    // has no room for (a zero head dim), falls back to what it can.
    let isa = isa.map_or_else(current, runnable);
    let packable = d > 0 && dv > 0;
    let tiles = match tiles.unwrap_or_else(|| Tiles::best(isa, l, d, dv)) {
        Tiles::Avx512 if packable && isa >= Isa::Avx512 => Tiles::Avx512,
        Tiles::Avx2 | Tiles::Avx512 if packable && isa >= Isa::Avx2 => Tiles::Avx2,
        _ => Tiles::Gemm,
    };
    // Query blocks of at most `block` rows, as even as the length allows.
    let block = match tiles {
        Tiles::Gemm => BLOCK_Q,
        Tiles::Avx2 | Tiles::Avx512 => AVX2_BLOCK_Q,
    };
    let block = l.div_ceil(l.div_ceil(block));
    // The multiply-adds: a decoder step's attention is short enough that
    // handing it to the pool is a large part of it.
    let work = b * h * l * s * (d + dv);
    // Decode-sized calls go through `gemm` or the direct products, which
    // read keys and values in place: over `GROUP_FROM_KEYS` keys or more, a
    // unit takes `group` query heads of one kv-head together, so that each
    // key is read once for them all (while its row of 8 keys is in L1)
    // rather than once a head; the kv-heads split into as many units as the
    // threads need.
    let hpk = h / kh;
    let group = if tiles == Tiles::Gemm && hpk > 1 && l * hpk < DIRECT_ROWS && s >= GROUP_FROM_KEYS {
        hpk.div_ceil(threads().div_ceil((b * kh).max(1)).clamp(1, hpk))
    } else {
        1
    };
    let units: Vec<(usize, usize, usize)> = (0..b)
        .flat_map(|bi| {
            (0..kh).flat_map(move |kv| {
                (kv * hpk..(kv + 1) * hpk)
                    .step_by(group)
                    .flat_map(move |hi| (0..l).step_by(block).map(move |i0| (bi, hi, i0)))
            })
        })
        .collect();
    let guards = part_storages(parts);
    let part_views = part_views(parts, &guards)?;
    with_view::<f32, _>(&q, "q", |qv| {
        with_view::<KV, _>(&k, "k", |kv| {
            with_view::<KV, _>(&v, "v", |vv| {
                let problem = Problem {
                    q: &qv,
                    k: &kv,
                    v: &vv,
                    parts: &part_views,
                    heads_per_kv: h / kh,
                    heads: h,
                    dims: (l, s, d, dv),
                    scale: scale as f32,
                    causal: *causal,
                    window: *window,
                    alibi: *alibi,
                    softcap: *softcap,
                    masked_keys,
                    dropout: *dropout,
                    isa,
                };
                let out_ptr = SyncPtr(out.as_mut_ptr());
                let lse_ptr = save_lse.then_some(SyncPtr(lse.as_mut_ptr()));
                // Rows (bi, i0..i0+rows, hi, ..) of the (B, L, H, Dv) output;
                // every unit writes a disjoint set of rows.
                let unit = |bi: usize, hi: usize, i0: usize| Unit {
                    bi,
                    hi,
                    heads: group.min((hi / hpk + 1) * hpk - hi),
                    i0,
                    rows: block.min(l - i0),
                    out: out_ptr,
                    base: (bi * l + i0) * h * dv + hi * dv,
                    out_rs: h * dv,
                    lse: lse_ptr,
                    lse_base: (bi * h + hi) * l + i0,
                };
                #[cfg(target_arch = "x86_64")]
                if let Some(kernels) = match tiles {
                    Tiles::Avx2 => Some(tiles::Kernels::Avx2),
                    Tiles::Avx512 => Some(tiles::Kernels::Avx512),
                    Tiles::Gemm => None,
                } {
                    let packing = packing.unwrap_or_else(|| Packing::best(&problem, b * kh));
                    let run = |packed: &tiles::Packed, (bi, hi, i0): (usize, usize, usize)| {
                        // SAFETY: `Tiles::Avx2` and `Tiles::Avx512` are only
                        // chosen (or forced by tests) where the processor
                        // runs them; `packed` holds the unit's keys and
                        // values; the unit's rows are its own.
                        if !unsafe { tiles::run_block(&problem, packed, unit(bi, hi, i0), kernels) } {
                            non_finite.store(true, Ordering::Relaxed);
                        }
                    };
                    match packing {
                        Packing::Shared => {
                            // SAFETY: as above.
                            let packed = unsafe { tiles::Packed::new(&problem, b, kh) };
                            par_for(units.len(), work, |u| run(&packed, units[u]));
                        }
                        Packing::PerThread => {
                            let call = CALLS.fetch_add(1, Ordering::Relaxed);
                            par_for(units.len(), work, |u| {
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
                                            tiles::Packed::one(
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
                par_for(units.len(), work, |u| {
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
    if save_lse {
        // SAFETY: and every unit wrote its rows' `b * h * l` log-sum-exps.
        unsafe { lse.set_len(b * h * l) };
    }
    // A non-finite output comes from a query whose row is NaN (a NaN or
    // +inf score: right as it is) or from a non-finite value; the latter
    // may sit in a hidden key that a tile still multiplied by its zero
    // weight, so the reference path, which reads no hidden value, decides.
    if non_finite.into_inner() && !all_finite_tensor(isa, &v.to_dtype(DType::F32)?)? {
        return Ok(None);
    }
    let out = Tensor::from_vec(out, (b, l, h, dv), q.device())?.transpose(1, 2)?;
    let lse = save_lse
        .then(|| Tensor::from_vec(lse, (b, h, l), q.device()))
        .transpose()?;
    Ok(Some((out, lse)))
}

/// Whether every element of a CPU f32 tensor is finite.
fn all_finite_tensor(isa: Isa, t: &Tensor) -> Result<bool> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("cpu attention kernel: tensor is not on the CPU")
    };
    Ok(simd::all_finite(
        isa,
        &cpu.as_slice::<f32>()?[layout.start_offset()..][..t.elem_count()],
    ))
}
