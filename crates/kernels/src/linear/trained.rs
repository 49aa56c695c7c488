//! A linear layer whose weight trains (a `VarMap`'s variables): `x · wᵀ + b`
//! as a candle custom op whose forward and input gradient run on the
//! packed micro-kernels (`tiles.rs`), so that gradients flow.
//!
//! For `y = x · Wᵀ + b`, `x` `m` rows of `k`, `W` `(n, k)`:
//! - forward: `W` packed as an inference layer packs it, its bias fused;
//! - `dX = dY · W`: `Wᵀ` packed as a layer of `k` features over `n` inputs
//!   (`PackedWeight::from_columns`: each panel row a piece of one of `W`'s
//!   rows, so packing it is a copy), `dY`'s rows through it;
//! - `dW = dYᵀ · X`: `X` packed as the columns of a layer of `k` features
//!   over the `m` rows (a copy, as for `Wᵀ`, into one of a few buffers the
//!   calls share), `dY`'s `n` columns through it, which the AVX-512 tiles
//!   read in place, a step a row of `dY`, so that `dY` is never copied; on
//!   AVX2, through a transposed copy of `dY` (the AVX2 tiles read rows);
//! - `db = Σ dY` over the rows.
//!
//! Each is computed only for the arguments that track gradients (not `dX`
//! of a batch of data).
//!
//! An optimizer writes a variable's storage in place (`Var::set`), so
//! neither the storage nor the tensor's id says that the weight changed: a
//! packed copy of `W` (or of `Wᵀ`) is reused only where it holds the
//! weight's values now, bit for bit. The comparison stops at the first
//! difference, so after a step it costs next to nothing before the weight
//! is packed anew; where nothing changed (evaluation, gradients summed over
//! several batches) it reads the weight once instead of packing it.

use std::sync::{Arc, Mutex};

use candle::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::weight::{Epilogue, PackedWeight};
use crate::elem::{f32_data, is_broadcast, with_f32_data};
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_for, SyncPtr};

/// A packed copy of a weight, held while it is current.
type Cache = Mutex<Option<Arc<PackedWeight>>>;

/// Caches by the range of output features `lo..hi` whose weight rows
/// they pack.
type RangeCaches = Mutex<Vec<((usize, usize), Arc<Cache>)>>;

/// A weight `(n, k)` and bias `(n)` that track gradients, f32 on the CPU,
/// and their packed copies for the instruction set the layer was built
/// for.
pub(crate) struct TrainedWeight {
    weight: Tensor,
    bias: Option<Tensor>,
    isa: Isa,
    /// `W` and its bias, for the forward.
    forward: Cache,
    /// `W[lo..hi]ᵀ` by the range of output features `lo..hi` it is of,
    /// for `dX` (the whole weight's, or a fused projection's parts).
    transposed: RangeCaches,
    /// Copies packed into new buffers, either cache.
    #[cfg(test)]
    fresh: std::sync::atomic::AtomicUsize,
}

impl TrainedWeight {
    /// The packed copy the forward holds now, if any.
    #[cfg(test)]
    pub(super) fn packed_forward(&self) -> Option<Arc<PackedWeight>> {
        self.forward.lock().ok()?.clone()
    }

    /// How many copies were packed into new buffers so far.
    #[cfg(test)]
    pub(super) fn fresh_packs(&self) -> usize {
        self.fresh.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl std::fmt::Debug for TrainedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainedWeight")
            .field("weight", &self.weight.shape())
            .field("bias", &self.bias.is_some())
            .field("isa", &self.isa)
            .finish()
    }
}

impl TrainedWeight {
    /// The layer over `weight` `(n, k)` and `bias` `(n)` for `isa` (one
    /// [`PackedWeight::isa_for`] serves), where the packed path takes
    /// them: f32 CPU tensors, the weight not a broadcast, `n, k > 0`, and
    /// at least one tracking gradients (else the layer is packed once, as
    /// for inference). `None` otherwise.
    pub(crate) fn new(weight: &Tensor, bias: Option<&Tensor>, isa: Isa) -> Result<Option<Self>> {
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
        let (n, k) = weight.dims2()?;
        let takes = f32_cpu(weight)
            && bias.is_none_or(f32_cpu)
            && (weight.track_op() || bias.is_some_and(Tensor::track_op))
            && !is_broadcast(weight)
            && n > 0
            && k > 0;
        Ok(takes.then(|| TrainedWeight {
            weight: weight.clone(),
            bias: bias.cloned(),
            isa,
            forward: Mutex::new(None),
            transposed: Mutex::new(Vec::new()),
            #[cfg(test)]
            fresh: Default::default(),
        }))
    }

    /// The instruction set the layer runs with.
    pub(crate) fn isa(&self) -> Isa {
        self.isa
    }

    /// The weight `(n, k)` itself.
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `(n)` itself, if any.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `(out_features, in_features)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        let d = self.weight.dims();
        (d[0], d[1])
    }

    /// `x · w[lo..hi]ᵀ + b[lo..hi]` (output features `lo..hi`; all of
    /// them for a plain layer, a part of a fused projection's) through the
    /// packed kernels, gradients flowing to `x`, the weight and the bias;
    /// `None` where `x` is not an f32 CPU tensor or the packed weight does
    /// not serve the range ([`PackedWeight::serves_range`]).
    ///
    /// # Shapes
    /// - `x`: `(..., k)`
    /// - returns `(..., hi - lo)`
    pub(crate) fn forward(self: &Arc<Self>, x: &Tensor, (lo, hi): (usize, usize)) -> Result<Option<Tensor>> {
        let served = super::weight::serves_range(self.isa, self.dims().0, (lo, hi));
        if !(x.device().is_cpu() && x.dtype() == DType::F32 && served) {
            return Ok(None);
        }
        let op = TrainedLinear {
            weight: Arc::clone(self),
            range: (lo, hi),
        };
        let (x, w) = (x.contiguous()?, self.weight.contiguous()?);
        let y = match &self.bias {
            Some(b) => x.apply_op3(&w, &b.contiguous()?, op)?,
            None => x.apply_op2(&w, op)?,
        };
        Ok(Some(y))
    }

    /// The copy in `cache` where `holds` says it is current; else the
    /// cached copy packed anew in place by `repack` where nothing else
    /// holds it and `repack` can (a step changed the weight's values, not
    /// its shape: no new buffer to fault in); else `pack`'s, which the
    /// cache then keeps.
    fn current(
        &self,
        cache: &Cache,
        holds: impl FnOnce(&PackedWeight) -> bool,
        repack: impl FnOnce(&mut PackedWeight) -> bool,
        pack: impl FnOnce() -> Result<PackedWeight>,
    ) -> Result<Arc<PackedWeight>> {
        let Ok(mut cache) = cache.lock() else {
            bail!("PackedLinear: a thread panicked while it packed this layer's weight")
        };
        if let Some(p) = cache.as_ref().filter(|p| holds(p)) {
            return Ok(Arc::clone(p));
        }
        if let Some(p) = cache.as_mut() {
            if Arc::get_mut(p).is_some_and(repack) {
                return Ok(Arc::clone(p));
            }
        }
        // Dropped first, so that the layer never holds two copies.
        *cache = None;
        #[cfg(test)]
        self.fresh.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = Arc::new(pack()?);
        *cache = Some(Arc::clone(&p));
        Ok(p)
    }

    /// `x · w[lo..hi]ᵀ + b[lo..hi]` over plain slices: `x` `m` rows of `k`,
    /// `w` and `b` the weight's and bias's data now.
    fn forward_slices(
        &self,
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        range: (usize, usize),
    ) -> Result<Vec<f32>> {
        let (n, k) = self.dims();
        let packed = self.current(
            &self.forward,
            |p| p.holds(w, b),
            |p| p.repack(w, b),
            || PackedWeight::new(w, n, k, b, self.isa, DType::F32),
        )?;
        Ok(packed.forward(x, x.len() / k, range, Epilogue::Identity, None))
    }

    /// The cache of `W[lo..hi]ᵀ`, made empty where there is none yet.
    fn transposed_cache(&self, range: (usize, usize)) -> Result<Arc<Cache>> {
        let Ok(mut caches) = self.transposed.lock() else {
            bail!("PackedLinear: a thread panicked while it packed this layer's weight")
        };
        if let Some((_, c)) = caches.iter().find(|(r, _)| *r == range) {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(Mutex::new(None));
        caches.push((range, Arc::clone(&c)));
        Ok(c)
    }

    /// The gradients of `x`, the weight and the bias (each where it tracks
    /// gradients) given `dy`, the gradient of output features `lo..hi`:
    /// the weight's and the bias's are zero outside those features.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        dy: &Tensor,
        (lo, hi): (usize, usize),
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k) = self.dims();
        let r = hi - lo;
        let m = x.elem_count() / k;
        let dy = dy.to_dtype(DType::F32)?.reshape((m, r))?.contiguous()?;
        let dx = if x.track_op() && m == 0 {
            Some(x.zeros_like()?)
        } else if x.track_op() {
            // dX = dY · W[lo..hi]: dY's rows through W[lo..hi]ᵀ.
            let cache = self.transposed_cache((lo, hi))?;
            let wt = with_f32(w, |w| {
                let w = &w[lo * k..hi * k];
                self.current(
                    &cache,
                    |p| p.holds_columns(w),
                    |p| p.repack_columns(w),
                    || Ok(PackedWeight::from_columns(w, r, k, self.isa)),
                )
            })?;
            let dx = with_f32(&dy, |dy| Ok(wt.forward(dy, m, (0, k), Epilogue::Identity, None)))?;
            Some(Tensor::from_vec(dx, x.shape(), x.device())?)
        } else {
            None
        };
        // The whole weight's (or bias's) gradient from that of its rows
        // `lo..hi`, zeros around them.
        let widen = |part: Vec<f32>, row: usize| -> Vec<f32> {
            if (lo, hi) == (0, n) {
                return part;
            }
            let mut full = vec![0f32; n * row];
            full[lo * row..hi * row].copy_from_slice(&part);
            full
        };
        // dW = dYᵀ · X: on the tiles (see the module doc), else (no SIMD
        // tiles) on candle's matmul.
        let dw = if w.track_op() {
            Some(match m {
                0 => w.zeros_like()?,
                _ => {
                    let x = x.to_dtype(DType::F32)?.reshape((m, k))?.contiguous()?;
                    let dw = with_f32(&x, |xs| {
                        with_f32(&dy, |dys| Ok(weight_grad(xs, dys, (m, r, k), self.isa)))
                    })?;
                    match dw {
                        Some(dw) => Tensor::from_vec(widen(dw, k), (n, k), w.device())?,
                        None => dy.t()?.matmul(&x)?.pad_with_zeros(0, lo, n - hi)?,
                    }
                }
            })
        } else {
            None
        };
        let db = match b {
            Some(b) if b.track_op() => {
                let db = with_f32(&dy, |dy| Ok(column_sums(dy, m, r)))?;
                Some(Tensor::from_vec(widen(db, 1), n, dy.device())?)
            }
            _ => None,
        };
        Ok((dx, dw, db))
    }
}

/// Packed inputs that [`weight_grad`] calls lend one another, the last
/// few, so that a step's backward packs each layer's input in place
/// rather than into fresh pages faulted in for every layer.
static INPUTS: Mutex<Vec<PackedWeight>> = Mutex::new(Vec::new());

/// How many packed inputs [`INPUTS`] keeps.
const KEPT_INPUTS: usize = 4;

/// `dW = dYᵀ · X`, `(n, k)`, for `x` `m` rows of `k` and `dy` `m` rows of
/// `n`, on the tiles: `X` packed as the columns of a layer of `k` features
/// over `m` inputs ([`PackedWeight::from_columns`], into a kept buffer of
/// its shape where there is one), `dY`'s columns through it (in place on
/// AVX-512, a transposed copy on AVX2). `None` without SIMD tiles.
fn weight_grad(x: &[f32], dy: &[f32], (m, n, k): (usize, usize, usize), isa: Isa) -> Option<Vec<f32>> {
    if !matches!(isa, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16) {
        return None;
    }
    let kept = {
        let mut kept = INPUTS.lock().unwrap_or_else(|e| e.into_inner());
        let at = kept.iter().position(|p| p.dims() == (k, m) && p.isa == isa);
        at.map(|at| kept.swap_remove(at))
    };
    let layer = match kept {
        Some(mut p) => match p.repack_columns(x) {
            true => p,
            false => PackedWeight::from_columns(x, m, k, isa),
        },
        None => PackedWeight::from_columns(x, m, k, isa),
    };
    let dw = layer.forward_transposed(dy, n);
    let mut kept = INPUTS.lock().unwrap_or_else(|e| e.into_inner());
    if kept.len() == KEPT_INPUTS {
        kept.remove(0);
    }
    kept.push(layer);
    dw
}

/// Columns a unit of [`column_sums`] takes: four cache lines of a row.
const SUM_COLUMNS: usize = 64;

/// The sums of the columns of `dy`, `m` rows of `n` (the bias's gradient):
/// each column summed over the rows in order, as candle's `sum(0)` does,
/// with the threads on column ranges of their own.
fn column_sums(dy: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    let dst = SyncPtr(out.as_mut_ptr());
    par_for(n.div_ceil(SUM_COLUMNS), m * n, |u| {
        let (c0, cols) = (u * SUM_COLUMNS, SUM_COLUMNS.min(n - u * SUM_COLUMNS));
        let mut acc = [0f32; SUM_COLUMNS];
        for row in dy.chunks_exact(n).take(m) {
            for (a, x) in acc.iter_mut().zip(&row[c0..c0 + cols]) {
                *a += x;
            }
        }
        // SAFETY: columns `c0..c0 + cols` of `out` are this unit's alone,
        // and `out` outlives the loop.
        let dst = unsafe { dst.slice_mut(c0, cols) };
        dst.copy_from_slice(&acc[..cols]);
    });
    out
}

/// `f` over the data of a contiguous f32 CPU tensor, borrowed in place.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    with_f32_data([t], "PackedLinear", |[data]| f(data))
}

/// The op `x · w[lo..hi]ᵀ (+ b[lo..hi])` of one [`TrainedWeight`]: its
/// arguments are `x`, the whole weight and (as a third) the whole bias,
/// all contiguous.
struct TrainedLinear {
    weight: Arc<TrainedWeight>,
    range: (usize, usize),
}

impl TrainedLinear {
    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k) = self.weight.dims();
        if x.1.dims().last() != Some(&k) || w.1.dims() != [n, k] {
            bail!(
                "PackedLinear: input {:?} and weight {:?} for a layer of ({n}, {k})",
                x.1.dims(),
                w.1.dims()
            )
        }
        let b = b.map(|(s, l)| f32_data(s, l, "PackedLinear")).transpose()?;
        let y = self.weight.forward_slices(
            f32_data(x.0, x.1, "PackedLinear")?,
            f32_data(w.0, w.1, "PackedLinear")?,
            b,
            self.range,
        )?;
        let mut shape = x.1.dims().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.range.1 - self.range.0;
        }
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }
}

impl CustomOp2 for TrainedLinear {
    fn name(&self) -> &'static str {
        "packed-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.weight.backward(x, w, None, dy, self.range)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for TrainedLinear {
    fn name(&self) -> &'static str {
        "packed-linear-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.weight.backward(x, w, Some(b), dy, self.range)
    }
}
