//! Linear layers whose weight is packed once, when the layer is built, into
//! the micro-kernels' panel layout: `x · wᵀ + b` without the per-call
//! packing a general GEMM does, with the bias and optionally the exact GELU
//! applied while the output block is still in cache.
//!
//! Two layouts, by instruction set:
//! - **AVX2**: the weight `(n, k)` (PyTorch's `(out, in)`) becomes
//!   `ceil(n / 16)` panels of `k × 16` floats, output feature `p·16 + c`'s
//!   input `e` at `p·k·16 + e·16 + c`, zero past `n`, for the attention's
//!   6 × 16 micro-kernel (`avx2.rs`). A work unit is a block of rows by a
//!   block of panels; inside it, each panel's slice of [`KC`] inputs stays
//!   in L1 while the unit's row groups stream past it from L2. Units run on
//!   rayon's pool. `gemm` has no AVX2 kernel that beats this one.
//! - **AVX-512**: the weight transposed once to a contiguous `(k, n)`,
//!   multiplied by `gemm`'s AVX-512 kernels (the fastest measured here: a
//!   12 × 32 `zmm` kernel of ours over packed panels reached about 0.8×
//!   of them on the Xeon, so it is not kept),
//!   with the bias pre-filled into the output (`dst = dst + x · wᵀ`). What
//!   it saves over candle's `Linear` is the strided read of the `(n, k)`
//!   weight and the separate bias and GELU passes.

use rayon::prelude::*;

use super::attention::SyncPtr;
use super::isa::Isa;
use super::simd;

/// Output features per panel of the AVX2 layout (the transposed AVX-512
/// layout pads only its bias to it).
const NR: usize = 16;
// The AVX2 kernel reads panels of its own width.
#[cfg(target_arch = "x86_64")]
const _: () = assert!(NR == super::avx2::NR);
/// Inputs per slice of the reduction: a panel slice of `KC · NR` floats
/// (16 KiB) stays in L1.
const KC: usize = 256;
/// Row groups and panels per work unit, at most: a unit reads each of its
/// panels' weights once from L3 and reuses it from L1 across up to 32
/// row groups (192 rows), whose inputs stay in L2.
const GROUPS_PER_UNIT: usize = 32;
const PANELS_PER_UNIT: usize = 4;

/// What the write-out applies after the bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// Nothing.
    Identity,
    /// `x · Φ(x)`, the exact GELU (PyTorch's `approximate='none'`).
    GeluErf,
}

/// A weight and bias in panel layout, for the instruction set it was
/// packed for.
pub(crate) struct PackedWeight {
    /// The panels (or the transposed weight) start at `data[start]`; panels
    /// are 64-byte aligned, so that a panel row's two loads never straddle
    /// a cache line.
    data: Vec<f32>,
    start: usize,
    /// `np` floats, zero past `n` (all zero without a bias).
    bias: Vec<f32>,
    has_bias: bool,
    n: usize,
    k: usize,
    isa: Isa,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("out", &self.n)
            .field("in", &self.k)
            .field("bias", &self.has_bias)
            .field("isa", &self.isa)
            .finish()
    }
}

impl PackedWeight {
    /// The instruction set a weight packed now would run with, if any
    /// kernel serves this processor.
    pub(crate) fn isa() -> Option<Isa> {
        match super::isa::current() {
            Isa::Portable => None,
            isa => Some(isa),
        }
    }

    /// Whether this weight is `(k, n)` for `gemm` rather than panels.
    fn transposed(&self) -> bool {
        self.isa == Isa::Avx512
    }

    /// Packs `w`, `n` rows of `k` floats, and `bias` (`n` floats) for `isa`
    /// (from [`PackedWeight::isa`]); `n, k > 0`.
    pub(crate) fn new(w: &[f32], n: usize, k: usize, bias: Option<&[f32]>, isa: Isa) -> Self {
        let mut b = vec![0f32; n.next_multiple_of(NR)];
        if let Some(bias) = bias {
            b[..n].copy_from_slice(bias);
        }
        if isa == Isa::Avx512 {
            // (k, n): row e holds input e of every output feature.
            let mut data = vec![0f32; k * n];
            data.par_chunks_mut(n).enumerate().for_each(|(e, row)| {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = w[j * k + e];
                }
            });
            return PackedWeight {
                data,
                start: 0,
                bias: b,
                has_bias: bias.is_some(),
                n,
                k,
                isa,
            };
        }
        let nr = NR;
        let np = n.div_ceil(nr) * nr;
        let mut data = vec![0f32; np * k + 16];
        let start = data.as_ptr().align_offset(64).min(16);
        data[start..start + np * k]
            .par_chunks_mut(k * nr)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..nr.min(n.saturating_sub(p * nr)) {
                    let row = &w[(p * nr + c) * k..][..k];
                    for (e, &x) in row.iter().enumerate() {
                        panel[e * nr + c] = x;
                    }
                }
            });
        PackedWeight {
            data,
            start,
            bias: b,
            has_bias: bias.is_some(),
            n,
            k,
            isa,
        }
    }

    /// The packed panels.
    fn panels(&self) -> &[f32] {
        &self.data[self.start..]
    }

    /// `(out_features, in_features)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The weight, `n` rows of `k` floats, and the bias.
    pub(crate) fn unpack(&self) -> (Vec<f32>, Option<Vec<f32>>) {
        let nr = NR;
        let mut w = vec![0f32; self.n * self.k];
        let bias = self.has_bias.then(|| self.bias[..self.n].to_vec());
        if self.transposed() {
            for (j, row) in w.chunks_exact_mut(self.k).enumerate() {
                for (e, x) in row.iter_mut().enumerate() {
                    *x = self.data[e * self.n + j];
                }
            }
            return (w, bias);
        }
        for (j, row) in w.chunks_exact_mut(self.k).enumerate() {
            let panel = &self.panels()[(j / nr) * self.k * nr..];
            for (e, x) in row.iter_mut().enumerate() {
                *x = panel[e * nr + j % nr];
            }
        }
        (w, bias)
    }

    /// Whether output features `lo..hi` are whole panels (or end at `n`),
    /// so that [`PackedWeight::forward`] can compute them alone.
    pub(crate) fn serves_range(&self, lo: usize, hi: usize) -> bool {
        if self.transposed() {
            return lo < hi && hi <= self.n;
        }
        let nr = NR;
        lo < hi && hi <= self.n && lo.is_multiple_of(nr) && (hi.is_multiple_of(nr) || hi == self.n)
    }

    /// `epilogue(x · wᵀ + b)` for output features `lo..hi` (see
    /// [`PackedWeight::serves_range`]): `x` is `m` rows of `k` floats;
    /// returns `m` rows of `hi - lo` floats.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        m: usize,
        (lo, hi): (usize, usize),
        epilogue: Epilogue,
    ) -> Vec<f32> {
        debug_assert!(self.serves_range(lo, hi) && x.len() >= m * self.k);
        if self.transposed() {
            return self.forward_gemm(x, m, (lo, hi), epilogue);
        }
        let nr = NR;
        let (p_lo, p_hi) = (lo / nr, hi.div_ceil(nr));
        let width = (p_hi - p_lo) * nr;
        #[cfg(target_arch = "x86_64")]
        let mr = super::avx2::MR;
        #[cfg(not(target_arch = "x86_64"))]
        let mr = 1;
        let rows_per_unit = GROUPS_PER_UNIT * mr;
        let units: Vec<(usize, usize)> = (0..m)
            .step_by(rows_per_unit)
            .flat_map(|i0| (p_lo..p_hi).step_by(PANELS_PER_UNIT).map(move |p0| (i0, p0)))
            .collect();
        let mut out: Vec<f32> = Vec::with_capacity(m * width);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let k = self.k;
        units.par_iter().for_each(|&(i0, p0)| {
            let out = out_ptr.get();
            let rows = rows_per_unit.min(m - i0);
            let p1 = (p0 + PANELS_PER_UNIT).min(p_hi);
            let cols = (p0 - p_lo) * nr..(p1 - p_lo) * nr;
            // SAFETY: rows i0..i0+rows and columns `cols` of the m × width
            // output are this unit's alone and in bounds; the kernels read
            // rows i0.. of x (m · k floats) and panels p0..p1 of the packed
            // weight; `self.isa` was current, so detected, when packing.
            unsafe {
                let block = out.add(i0 * width + cols.start);
                for r in 0..rows {
                    std::ptr::copy_nonoverlapping(
                        self.bias[p0 * nr..].as_ptr(),
                        block.add(r * width),
                        cols.len(),
                    );
                }
                for p in p0..p1 {
                    let dst = block.add((p - p0) * nr);
                    for k0 in (0..k).step_by(KC) {
                        let kc = KC.min(k - k0);
                        let w = self.panels()[p * k * nr + k0 * nr..].as_ptr();
                        for g0 in (0..rows).step_by(mr) {
                            let xs = x[(i0 + g0) * k + k0..].as_ptr();
                            self.panel(mr.min(rows - g0), xs, k, kc, w, dst.add(g0 * width), width);
                        }
                    }
                }
                if epilogue == Epilogue::GeluErf {
                    for r in 0..rows {
                        simd::gelu_erf(std::slice::from_raw_parts_mut(block.add(r * width), cols.len()));
                    }
                }
            }
        });
        // SAFETY: the units cover every (row, panel) block of the output.
        unsafe { out.set_len(m * width) };
        let skip = lo - p_lo * nr;
        if skip == 0 && width == hi - lo {
            return out;
        }
        out.chunks_exact(width)
            .flat_map(|row| &row[skip..skip + hi - lo])
            .copied()
            .collect()
    }

    /// [`PackedWeight::forward`] on the `(k, n)` weight through `gemm`:
    /// the output starts as the bias and `gemm` adds `x · wᵀ` to it.
    fn forward_gemm(&self, x: &[f32], m: usize, (lo, hi): (usize, usize), epilogue: Epilogue) -> Vec<f32> {
        let (n, k, width) = (self.n, self.k, hi - lo);
        let mut out: Vec<f32> = Vec::with_capacity(m * width);
        for _ in 0..m {
            out.extend_from_slice(&self.bias[lo..hi]);
        }
        #[cfg(target_arch = "x86_64")]
        if m == 1 {
            // One row (a decoder's step): `gemm` prepares the weight on
            // every call; streaming it once through `avx512::one_row`, one
            // run of 128-column blocks per thread, made a Llama-shaped
            // decode step about 1.5x faster (README, Figures).
            let out_ptr = SyncPtr(out.as_mut_ptr());
            let blocks = width.div_ceil(128);
            let tasks = if width * k > 1 << 16 {
                rayon::current_num_threads().min(blocks)
            } else {
                1
            };
            let per_task = blocks.div_ceil(tasks) * 128;
            (0..width.div_ceil(per_task)).into_par_iter().for_each(|t| {
                let c0 = t * per_task;
                let cols = per_task.min(width - c0);
                // SAFETY: this task's columns c0..c0+cols of the 1 × width
                // output are its own; x is k floats, the weight k × n read
                // from column lo + c0; `self.isa` is AVX-512, detected when
                // packed.
                unsafe {
                    super::avx512::one_row(
                        x.as_ptr(),
                        k,
                        self.data[lo + c0..].as_ptr(),
                        n,
                        cols,
                        out_ptr.get().add(c0),
                    )
                };
            });
            if epilogue == Epilogue::GeluErf {
                simd::gelu_erf(&mut out);
            }
            return out;
        }
        let threads = rayon::current_num_threads();
        let parallelism = if threads > 1 && m * width * k > 1 << 16 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: dst is m × width (row stride width), lhs m × k (row
        // stride k), rhs k × width read from column lo of the k × n weight
        // (row stride n); all in bounds.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                out.as_mut_ptr(),
                1,
                width as isize,
                true,
                x.as_ptr(),
                1,
                k as isize,
                self.data[lo..].as_ptr(),
                1,
                n as isize,
                1.,
                1.,
                false,
                false,
                false,
                parallelism,
            );
        }
        if epilogue == Epilogue::GeluErf {
            out.par_chunks_mut(width.max(1) * 16).for_each(simd::gelu_erf);
        }
        out
    }

    /// One micro-kernel call: `rows` rows of outputs += their `kc` inputs
    /// times one panel slice.
    ///
    /// # Safety
    /// The extents are in bounds, and `self.isa` runs on this processor.
    #[allow(clippy::too_many_arguments)]
    unsafe fn panel(
        &self,
        rows: usize,
        x: *const f32,
        x_rs: usize,
        kc: usize,
        w: *const f32,
        out: *mut f32,
        out_rs: usize,
    ) {
        // SAFETY: forwarded.
        unsafe {
            match self.isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => super::avx2::scores::<true>(rows, x, x_rs, kc, w, 1, out, out_rs),
                _ => {
                    let _ = (rows, x, x_rs, kc, w, out, out_rs);
                    unreachable!("weights are only packed for a SIMD instruction set")
                }
            }
        }
    }
}
