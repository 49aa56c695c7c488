//! The backward pass of [`sdpa`](super::sdpa): FlashAttention-2's backward
//! (Dao, 2023, Algorithm 2).
//!
//! The forward that keeps what it needs,
//! [`sdpa_saving_lse`](super::sdpa_saving_lse), is `sdpa` keeping, beside
//! the output `O`, each query row's log-sum-exp `lse` of its scores. The backward
//! ([`sdpa_backward`]) never holds the `(q_len, kv_len)` probabilities: it
//! recomputes them a tile at a time, `P = exp(S − lse)`, from the queries,
//! the keys and the mask as the forward reads it ([`Problem::mask_row`]),
//! and with `Dᵢ = rowsum(dOᵢ ∘ Oᵢ)`:
//!
//! ```text
//! dV += Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D) ∘ (1 − tanh²)
//! dQ += scale · dS K               dK += scale · dSᵀ Q
//! ```
//!
//! (`1 − tanh²` only where the scores are soft-capped: the derivative of
//! `cap · tanh(s / cap)`).
//!
//! No two threads write the same rows, and none waits on another. Where
//! there are enough (batch, kv-head) pairs to keep every thread busy
//! ([`UNITS_PER_THREAD`]), a unit takes one and computes all its
//! gradients in one pass: key block by key block, each tile that sees the
//! block adds to its dK and dV and to its query rows' dQ, all of them the
//! unit's own (grouped-query heads sum there). With fewer pairs the work
//! splits finer, in two passes that each recompute a tile's scores and
//! `dO Vᵀ`: a unit of the first takes one (batch, kv-head, key block) and
//! accumulates the block's dK and dV over every query head of the group
//! and every query block that sees one of its keys; a unit of the second
//! takes one (batch, head, query block) and accumulates its dQ over the
//! key blocks it sees. A tile is [`BLOCK`] × [`BLOCK`] f32 (three of
//! them, 64 KiB each, stay in L2); the products go through `gemm`, as the
//! forward's [`Tiles::Gemm`](super::Tiles::Gemm) do, the probabilities
//! and `dS` through the rows' vector `exp`. Tiles the causal rule or the
//! window hide whole are skipped.

use candle::{bail, DType, Result, Tensor};
use gemm::{gemm, Parallelism};

use super::mask::{part_storages, part_views, Masking};
use super::problem::{last_dim_contiguous, with_view, Problem, View};
use crate::rows::simd;
use crate::rows::softmax::prob_grads_exact;
use crate::runtime::isa::{current, runnable, Isa};
use crate::runtime::pool::{par_for, threads, SyncPtr};

/// Query rows and keys of a backward tile.
const BLOCK: usize = 128;

/// (batch, kv-head) units a thread takes at least for the one-pass
/// backward; with fewer, the two passes split the work finer.
const UNITS_PER_THREAD: usize = 4;

/// The gradients [`sdpa_backward`] returns, each in the shape of its
/// input, contiguous.
#[derive(Debug, Clone)]
pub struct Gradients {
    /// `(batch, heads, q_len, head_dim)`
    pub q: Tensor,
    /// `(batch, kv_heads, kv_len, head_dim)`: summed over the query heads
    /// of each kv-head.
    pub k: Tensor,
    /// `(batch, kv_heads, kv_len, v_head_dim)`: the same.
    pub v: Tensor,
}

/// The gradients of `O = sdpa(q, k, v)` with respect to q, k and v, given
/// `d_out`, the gradient of a loss with respect to `O`, and what
/// [`sdpa_saving_lse`](super::sdpa_saving_lse) returned for the same
/// inputs, mask, `appended` and `scale` (`out` and `lse`). f32 CPU
/// tensors; `out` and `d_out` are
/// `(batch, heads, q_len, v_head_dim)`, any strides with a contiguous last
/// dim. The work runs on `isa` (`None`: [`current`]) for the mask's row
/// operations, on `gemm` for the products.
///
/// A pair the mask hides takes no part: its gradient is 0 even where its
/// value is not finite. A row that sees no key (`lse = -inf`, a zero
/// output) has zero gradients.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
) -> Result<Gradients> {
    let (b, h, kh, l, s, d, dv) = check(q, k, v, out, lse, d_out)?;
    let mut dq = vec![0f32; b * h * l * d];
    let mut dk = vec![0f32; b * kh * s * d];
    let mut dvs = vec![0f32; b * kh * s * dv];
    let dsts = [
        Dst::contiguous(&mut dq, h, l, d),
        Dst::contiguous(&mut dk, kh, s, d),
        Dst::contiguous(&mut dvs, kh, s, dv),
    ];
    backward_into(q, k, v, out, lse, d_out, masking, appended, scale, isa, dsts)?;
    let dev = q.device();
    Ok(Gradients {
        q: Tensor::from_vec(dq, (b, h, l, d), dev)?,
        k: Tensor::from_vec(dk, (b, kh, s, d), dev)?,
        v: Tensor::from_vec(dvs, (b, kh, s, dv), dev)?,
    })
}

/// [`sdpa_backward`] of self-attention whose q, k and v are the heads of
/// one projection `(batch, len, heads + 2 · kv_heads, head_dim)` (q's
/// heads, then k's, then v's): the three gradients in one tensor of that
/// shape, as the projection's gradient. q, k and v have one length and
/// one head dim.
#[allow(clippy::too_many_arguments)]
pub fn sdpa_backward_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
) -> Result<Tensor> {
    let (b, h, kh, l, s, d, dv) = check(q, k, v, out, lse, d_out)?;
    if s != l || dv != d {
        bail!(
            "attention backward: packed gradients need one length and one head dim, found q_len {l}, kv_len {s}, \
             head dims {d} and {dv}"
        )
    }
    let width = h + 2 * kh;
    let mut grads = vec![0f32; b * l * width * d];
    let ptr = grads.as_mut_ptr();
    // Element (b, head, row, ·) of each at b·(l·width·d) + row·(width·d) +
    // head·d past its first head.
    let stride = [l * width * d, d, width * d];
    let dsts = [0, h, h + kh].map(|first| Dst {
        ptr: SyncPtr(ptr.wrapping_add(first * d)),
        stride,
    });
    backward_into(q, k, v, out, lse, d_out, masking, appended, scale, isa, dsts)?;
    Tensor::from_vec(grads, (b, l, width, d), q.device())
}

/// The dims of a backward's arguments, `(batch, heads, kv_heads, q_len,
/// kv_len, head_dim, v_head_dim)`, or an error naming the one that does
/// not fit.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
) -> Result<(usize, usize, usize, usize, usize, usize, usize)> {
    let inputs = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("out", out),
        ("lse", lse),
        ("d_out", d_out),
    ];
    for (name, t) in inputs {
        if t.dtype() != DType::F32 || !t.device().is_cpu() {
            bail!(
                "attention backward: {name} must be an f32 CPU tensor, found {:?} on {:?}",
                t.dtype(),
                t.device()
            )
        }
    }
    let (b, h, l, d) = q.dims4()?;
    let (kb, kh, s, kd) = k.dims4()?;
    let (vb, vh, vs, dv) = v.dims4()?;
    if (kb, kd) != (b, d) || (vb, vh, vs) != (b, kh, s) {
        bail!(
            "attention backward: q {:?}, k {:?} and v {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if out.dims() != [b, h, l, dv] || d_out.dims() != [b, h, l, dv] || lse.dims() != [b, h, l] {
        bail!(
            "attention backward: out {:?}, d_out {:?} and lse {:?} must be {:?}, {:?} and {:?}",
            out.dims(),
            d_out.dims(),
            lse.dims(),
            [b, h, l, dv],
            [b, h, l, dv],
            [b, h, l]
        )
    }
    if kh == 0 || h % kh != 0 {
        bail!("attention backward: q heads ({h}) must be a multiple of k/v heads ({kh})")
    }
    Ok((b, h, kh, l, s, d, dv))
}

/// Where one gradient goes: element `(batch, head, row, 0)` at `ptr +
/// batch · stride[0] + head · stride[1] + row · stride[2]`, the rest of the
/// row after it.
#[derive(Clone, Copy)]
struct Dst {
    ptr: SyncPtr,
    stride: [usize; 3],
}

impl Dst {
    /// `buf` as `(batch, heads, rows, width)`, contiguous.
    fn contiguous(buf: &mut [f32], heads: usize, rows: usize, width: usize) -> Dst {
        Dst {
            ptr: SyncPtr(buf.as_mut_ptr()),
            stride: [heads * rows * width, rows * width, width],
        }
    }

    /// The first element of row `row` of head `head` (batch `b`).
    ///
    /// # Safety
    /// The element lies inside the buffer.
    unsafe fn at(self, b: usize, head: usize, row: usize) -> *mut f32 {
        // SAFETY: as the caller promises.
        unsafe {
            self.ptr
                .get()
                .add(b * self.stride[0] + head * self.stride[1] + row * self.stride[2])
        }
    }
}

/// The backward of checked arguments (`check`) into `dsts` (dQ, dK, dV),
/// zeroed buffers that outlive the call and that nothing else touches
/// meanwhile.
#[allow(clippy::too_many_arguments)]
fn backward_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    masking: &Masking,
    appended: usize,
    scale: f64,
    isa: Option<Isa>,
    [dq, dk, dv_dst]: [Dst; 3],
) -> Result<()> {
    let (b, h, l, d) = q.dims4()?;
    let (_, kh, s, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let lse = lse.flatten_all()?.to_vec1::<f32>()?;
    let (q, k, v, out, d_out) = (
        last_dim_contiguous(q)?,
        last_dim_contiguous(k)?,
        last_dim_contiguous(v)?,
        last_dim_contiguous(out)?,
        last_dim_contiguous(d_out)?,
    );
    let Masking {
        parts,
        causal,
        window,
        alibi,
        softcap,
        dropout,
    } = masking;
    let guards = part_storages(parts);
    let part_views = part_views(parts, &guards)?;
    with_view::<f32, _>(&q, "q", |qv| {
        with_view::<f32, _>(&k, "k", |kv| {
            with_view::<f32, _>(&v, "v", |vv| {
                with_view::<f32, _>(&d_out, "d_out", |dov| {
                    with_view::<f32, _>(&out, "out", |ov| {
                        let delta = deltas(&ov, &dov, (b, h, l, dv));
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
                            masked_keys: s.saturating_sub(appended),
                            dropout: *dropout,
                            isa: isa.map_or_else(current, runnable),
                        };
                        let pass = Backward {
                            p: &problem,
                            d_out: &dov,
                            lse: &lse,
                            delta: &delta,
                            heads: h,
                        };
                        pass.run(b, [dq, dk, dv_dst]);
                        Ok(())
                    })
                })
            })
        })
    })?;
    drop(part_views);
    drop(guards);
    Ok(())
}

/// `Dᵢ = rowsum(dOᵢ ∘ Oᵢ)` of every query row, `(batch, heads, q_len)`.
fn deltas(out: &View, d_out: &View, (b, h, l, dv): (usize, usize, usize, usize)) -> Vec<f32> {
    let mut delta = vec![0f32; b * h * l];
    let dst = SyncPtr(delta.as_mut_ptr());
    par_for(b * h, b * h * l * dv, |u| {
        let (bi, hi) = (u / h, u % h);
        for i in 0..l {
            let (o, g) = (
                &out.data[out.offset(bi, hi, i)..][..dv],
                &d_out.data[d_out.offset(bi, hi, i)..][..dv],
            );
            let dot = o.iter().zip(g).map(|(o, g)| o * g).sum::<f32>();
            // SAFETY: rows `u · l..(u + 1) · l` of `delta` are this
            // unit's alone, and `delta` outlives the loop.
            unsafe { *dst.get().add(u * l + i) = dot };
        }
    });
    delta
}

/// One backward call as its units read it: the forward's problem, `dO`,
/// and each query row's `lse` and `D`, `(batch, heads, q_len)`.
struct Backward<'a> {
    p: &'a Problem<'a>,
    d_out: &'a View<'a>,
    lse: &'a [f32],
    delta: &'a [f32],
    heads: usize,
}

/// A tile's buffers, `rows × cols` each: the probabilities, `dS`, the
/// soft-capping's derivative where the scores are capped, and a row's
/// dropout factors where the weights are dropped out.
struct TileBufs {
    p: Vec<f32>,
    ds: Vec<f32>,
    capped: Vec<f32>,
    kept: Vec<f32>,
}

impl TileBufs {
    fn new(p: &Problem, len: usize) -> Self {
        Self {
            p: vec![0.; len],
            ds: vec![0.; len],
            capped: if p.softcap.is_some() {
                vec![0.; len]
            } else {
                Vec::new()
            },
            kept: if p.dropout.is_some() {
                vec![0.; len]
            } else {
                Vec::new()
            },
        }
    }
}

impl Backward<'_> {
    /// Every gradient of the call's `b` batches into `dq`, `dk`, `dv`: in
    /// one pass over (batch, kv-head) units where there are enough of
    /// them, else in two over tiles.
    fn run(&self, b: usize, [dq, dk, dv]: [Dst; 3]) {
        let p = self.p;
        let (l, s, d, dvd) = p.dims;
        let (h, kh) = (self.heads, self.heads / p.heads_per_kv);
        if b * kh >= UNITS_PER_THREAD * threads() {
            // Each tile's two products and its three gradients' products.
            let work = b * h * l * s * (3 * d + 2 * dvd);
            par_for(b * kh, work, |u| self.kv_group(u / kh, u % kh, [dq, dk, dv]));
            return;
        }
        // Each pass computes both products of every tile, and one or two more.
        let work = 2 * b * h * l * s * (d + dvd);
        let key_units: Vec<(usize, usize, usize)> = (0..b)
            .flat_map(|bi| (0..kh).flat_map(move |kvh| (0..s).step_by(BLOCK).map(move |j0| (bi, kvh, j0))))
            .collect();
        par_for(key_units.len(), work, |u| {
            let (bi, kvh, j0) = key_units[u];
            self.keys_block(bi, kvh, j0, BLOCK.min(s - j0), dk, dv);
        });
        let query_units: Vec<(usize, usize, usize)> = (0..b)
            .flat_map(|bi| (0..h).flat_map(move |hi| (0..l).step_by(BLOCK).map(move |i0| (bi, hi, i0))))
            .collect();
        par_for(query_units.len(), work, |u| {
            let (bi, hi, i0) = query_units[u];
            self.queries_block(bi, hi, i0, BLOCK.min(l - i0), dq);
        });
    }

    /// The tile of query rows `i0..i0 + rows` of head `hi` (batch `bi`)
    /// and keys `j0..j0 + cols`: `P` into `t.p` and `dS` (without the
    /// `scale` the products apply) into `t.ds`, `cols` apart.
    #[allow(clippy::too_many_arguments)]
    fn tile(&self, bi: usize, hi: usize, i0: usize, rows: usize, j0: usize, cols: usize, t: &mut TileBufs) {
        let p = self.p;
        self.products(bi, hi, i0, rows, j0, cols, t);
        let exact = self.grad_rows(bi, hi, i0, rows, j0, cols, t, |p_row, ds_row, lse, delta| {
            if lse == f32::NEG_INFINITY {
                // The row sees no key: no weight, no gradient.
                p_row.fill(0.);
                ds_row.fill(0.);
                return true;
            }
            simd::prob_grads_row(p.isa, p_row, ds_row, lse, delta)
        });
        if !exact {
            // A gradient came out not finite: the tile again, one score
            // at a time, so that a hidden key takes no part even where its
            // value is not finite.
            self.products(bi, hi, i0, rows, j0, cols, t);
            self.grad_rows(bi, hi, i0, rows, j0, cols, t, |p_row, ds_row, lse, delta| {
                prob_grads_exact(p_row, ds_row, lse, delta);
                true
            });
        }
    }

    /// The tile's rows after [`Self::products`]: each masked as the
    /// forward masks it, then `grads(p_row, ds_row, lse, delta)` makes the
    /// probabilities and `dS`, times the soft-capping's derivative where
    /// the scores are capped. Whether every call returned true.
    #[allow(clippy::too_many_arguments)]
    fn grad_rows(
        &self,
        bi: usize,
        hi: usize,
        i0: usize,
        rows: usize,
        j0: usize,
        cols: usize,
        t: &mut TileBufs,
        grads: impl Fn(&mut [f32], &mut [f32], f32, f32) -> bool,
    ) -> bool {
        let p = self.p;
        let row0 = (bi * self.heads + hi) * p.dims.0 + i0;
        let mut all = true;
        for r in 0..rows {
            let (p_row, ds_row) = (&mut t.p[r * cols..][..cols], &mut t.ds[r * cols..][..cols]);
            p.mask_row(p_row, bi, hi, i0 + r, j0);
            // Dropout: the forward's output is `(P ∘ Z) V` with `Z` the
            // mask's factors, so `dP` is `Z ∘ dO Vᵀ`, and `dV` reads
            // `P ∘ Z`.
            let kept = p.dropout.is_some().then(|| {
                let kept = &mut t.kept[..cols];
                kept.fill(1.);
                p.drop_row(kept, bi, hi, i0 + r, j0);
                scale_by(ds_row, kept);
                &*kept
            });
            all &= grads(p_row, ds_row, self.lse[row0 + r], self.delta[row0 + r]);
            if let Some(kept) = kept {
                scale_by(p_row, kept);
            }
            if p.softcap.is_some() {
                for (g, c) in ds_row.iter_mut().zip(&t.capped[r * cols..][..cols]) {
                    *g *= c;
                }
            }
        }
        all
    }

    /// The tile's two products: the scores (soft-capped where the problem
    /// asks, their derivative kept in `t.capped`) into `t.p` and `dO · Vᵀ`
    /// into `t.ds`, `cols` apart.
    #[allow(clippy::too_many_arguments)]
    fn products(
        &self,
        bi: usize,
        hi: usize,
        i0: usize,
        rows: usize,
        j0: usize,
        cols: usize,
        t: &mut TileBufs,
    ) {
        let p = self.p;
        let (_, _, d, dv) = p.dims;
        let kvh = hi / p.heads_per_kv;
        let n = rows * cols;
        // SAFETY: the offsets and strides come from the tensors' own
        // layouts and stay inside their data for these row and key counts;
        // the tile buffers hold at least `rows × cols`.
        unsafe {
            // P (rows, cols) ← scale · Q (rows, d) · Kᵀ (d, cols)
            product(
                (rows, cols, d),
                (t.p.as_mut_ptr(), cols as isize),
                false,
                Mat {
                    ptr: p.q.data.as_ptr().add(p.q.offset(bi, hi, i0)),
                    rs: p.q.stride[2] as isize,
                    cs: 1,
                },
                Mat {
                    ptr: p.k.data.as_ptr().add(p.k.offset(bi, kvh, j0)),
                    rs: 1,
                    cs: p.k.stride[2] as isize,
                },
                p.scale,
            );
            // dP (rows, cols) ← dO (rows, dv) · Vᵀ (dv, cols)
            product(
                (rows, cols, dv),
                (t.ds.as_mut_ptr(), cols as isize),
                false,
                Mat {
                    ptr: self.d_out.data.as_ptr().add(self.d_out.offset(bi, hi, i0)),
                    rs: self.d_out.stride[2] as isize,
                    cs: 1,
                },
                Mat {
                    ptr: p.v.data.as_ptr().add(p.v.offset(bi, kvh, j0)),
                    rs: 1,
                    cs: p.v.stride[2] as isize,
                },
                1.,
            );
        }
        if let Some(cap) = p.softcap {
            // The forward's scores are `cap · tanh(s / cap)`; their
            // derivative `1 − tanh²` is kept for dS.
            for (x, g) in t.p[..n].iter_mut().zip(&mut t.capped[..n]) {
                let th = (*x / cap).tanh();
                *x = cap * th;
                *g = 1. - th * th;
            }
        }
    }

    /// Every gradient of kv-head `kvh` (batch `bi`): dK and dV of its keys
    /// and dQ of its query heads' rows, written to those rows of `dq`, `dk`
    /// and `dv`, which no other unit writes. Key block by key
    /// block, so that the block's rows of dK and dV stay in cache while
    /// every tile that sees them adds to them.
    fn kv_group(&self, bi: usize, kvh: usize, [dq, dk, dv]: [Dst; 3]) {
        let p = self.p;
        let (l, s, _, _) = p.dims;
        let mut t = TileBufs::new(p, BLOCK.min(l) * BLOCK.min(s));
        for j0 in (0..s).step_by(BLOCK) {
            let cols = BLOCK.min(s - j0);
            for hi in kvh * p.heads_per_kv..(kvh + 1) * p.heads_per_kv {
                for i0 in (0..l).step_by(BLOCK) {
                    let rows = BLOCK.min(l - i0);
                    if !self.sees(i0, rows, j0, cols) {
                        continue;
                    }
                    self.tile(bi, hi, i0, rows, j0, cols, &mut t);
                    // SAFETY: as in `keys_block` and `queries_block`: the
                    // rows written are this unit's.
                    unsafe {
                        self.add_key_grads(bi, hi, i0, rows, j0, cols, &t, dk, dv);
                        self.add_query_grads(bi, hi, i0, rows, j0, cols, &t, dq);
                    }
                }
            }
        }
    }

    /// Whether any of query rows `i0..i0 + rows` sees one of keys `j0..j0 +
    /// cols`: the rows see keys `keys_start(i0)..keys_end(last)` at most
    /// (both grow with the row).
    fn sees(&self, i0: usize, rows: usize, j0: usize, cols: usize) -> bool {
        self.p.keys_end(i0 + rows - 1) > j0 && self.p.keys_start(i0) < j0 + cols
    }

    /// dK and dV of keys `j0..j0 + cols` of kv-head `kvh` (batch `bi`),
    /// over every query head of the kv-head and every query block that
    /// sees one of them, written to those rows of `dk` and `dv`, which no
    /// other unit writes.
    fn keys_block(&self, bi: usize, kvh: usize, j0: usize, cols: usize, dk: Dst, dv: Dst) {
        let p = self.p;
        let l = p.dims.0;
        let mut t = TileBufs::new(p, BLOCK.min(l) * cols);
        for hi in kvh * p.heads_per_kv..(kvh + 1) * p.heads_per_kv {
            for i0 in (0..l).step_by(BLOCK) {
                let rows = BLOCK.min(l - i0);
                if !self.sees(i0, rows, j0, cols) {
                    continue;
                }
                self.tile(bi, hi, i0, rows, j0, cols, &mut t);
                // SAFETY: rows `j0..j0 + cols` of the kv-head's dK and dV
                // are this unit's alone.
                unsafe { self.add_key_grads(bi, hi, i0, rows, j0, cols, &t, dk, dv) };
            }
        }
    }

    /// dQ of query rows `i0..i0 + rows` of head `hi` (batch `bi`), over the
    /// key blocks they see, written to those rows of `dq`, which no other
    /// unit writes.
    fn queries_block(&self, bi: usize, hi: usize, i0: usize, rows: usize, dq: Dst) {
        let p = self.p;
        let end = p.keys_end(i0 + rows - 1);
        let mut t = TileBufs::new(p, rows * BLOCK.min(end.max(1)));
        let mut j0 = p.keys_start(i0);
        while j0 < end {
            let cols = BLOCK.min(end - j0);
            self.tile(bi, hi, i0, rows, j0, cols, &mut t);
            // SAFETY: rows `i0..i0 + rows` of the head's dQ are this unit's
            // alone.
            unsafe { self.add_query_grads(bi, hi, i0, rows, j0, cols, &t, dq) };
            j0 += cols;
        }
    }

    /// A tile's share of dK and dV: `dV += Pᵀ dO` and `dK += scale · dSᵀ
    /// Q` into rows `j0..j0 + cols` of head `hi`'s kv-head.
    ///
    /// # Safety
    /// Those rows of `dk` and `dv` are the caller's alone; `t` holds the
    /// tile of query rows `i0..i0 + rows` and keys `j0..j0 + cols`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_key_grads(
        &self,
        bi: usize,
        hi: usize,
        i0: usize,
        rows: usize,
        j0: usize,
        cols: usize,
        t: &TileBufs,
        dk: Dst,
        dv_out: Dst,
    ) {
        let p = self.p;
        let (_, _, d, dv) = p.dims;
        let kvh = hi / p.heads_per_kv;
        // SAFETY: the caller's rows of dK and dV; the other operands as in
        // `products`.
        unsafe {
            let q = p.q.data.as_ptr().add(p.q.offset(bi, hi, i0));
            let d_out = self.d_out.data.as_ptr().add(self.d_out.offset(bi, hi, i0));
            // dV (cols, dv) += Pᵀ (cols, rows) · dO (rows, dv)
            product(
                (cols, dv, rows),
                (dv_out.at(bi, kvh, j0), dv_out.stride[2] as isize),
                true,
                Mat {
                    ptr: t.p.as_ptr(),
                    rs: 1,
                    cs: cols as isize,
                },
                Mat {
                    ptr: d_out,
                    rs: self.d_out.stride[2] as isize,
                    cs: 1,
                },
                1.,
            );
            // dK (cols, d) += scale · dSᵀ (cols, rows) · Q (rows, d)
            product(
                (cols, d, rows),
                (dk.at(bi, kvh, j0), dk.stride[2] as isize),
                true,
                Mat {
                    ptr: t.ds.as_ptr(),
                    rs: 1,
                    cs: cols as isize,
                },
                Mat {
                    ptr: q,
                    rs: p.q.stride[2] as isize,
                    cs: 1,
                },
                p.scale,
            );
        }
    }

    /// A tile's share of dQ: `dQ += scale · dS K` into rows `i0..i0 + rows`
    /// of head `hi`.
    ///
    /// # Safety
    /// Those rows of `dq` are the caller's alone; `t` holds the tile of
    /// query rows `i0..i0 + rows` and keys `j0..j0 + cols`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_query_grads(
        &self,
        bi: usize,
        hi: usize,
        i0: usize,
        rows: usize,
        j0: usize,
        cols: usize,
        t: &TileBufs,
        dq: Dst,
    ) {
        let p = self.p;
        let d = p.dims.2;
        let kvh = hi / p.heads_per_kv;
        // SAFETY: the caller's rows of dQ; the other operands as in
        // `products`.
        unsafe {
            // dQ (rows, d) += scale · dS (rows, cols) · K (cols, d)
            product(
                (rows, d, cols),
                (dq.at(bi, hi, i0), dq.stride[2] as isize),
                true,
                Mat {
                    ptr: t.ds.as_ptr(),
                    rs: cols as isize,
                    cs: 1,
                },
                Mat {
                    ptr: p.k.data.as_ptr().add(p.k.offset(bi, kvh, j0)),
                    rs: p.k.stride[2] as isize,
                    cs: 1,
                },
                p.scale,
            );
        }
    }
}

/// `x ∘ factors`, a zero factor giving 0 whatever `x` is.
fn scale_by(x: &mut [f32], factors: &[f32]) {
    for (x, &f) in x.iter_mut().zip(factors) {
        *x = if f == 0. { 0. } else { *x * f };
    }
}

/// A matrix at `ptr`, its row and column strides in elements.
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

/// `dst (m, n) = [dst +] beta · a (m, k) · b (k, n)` on this thread, `dst`
/// row-major with rows `dst_rs` apart; `add` keeps what `dst` holds.
///
/// # Safety
/// Every element the shapes and strides reach lies inside its buffer, and
/// no other thread touches `dst`'s.
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, isize),
    add: bool,
    a: Mat,
    b: Mat,
    beta: f32,
) {
    // SAFETY: as the caller promises.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            add,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if add { 1. } else { 0. },
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}
