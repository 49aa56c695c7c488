//! A call of a [`Q8Weight`]: the inputs quantized, the work cut into
//! units over the pool, each unit's tiles, and its outputs written with
//! the bias and the residual (the module docs of `mod.rs` say how).

use super::quantize::{Quantized, QK};
#[cfg(target_arch = "x86_64")]
use super::{avx2, vnni};
use super::{
    portable, quantize_rows, Kernel, Q8Weight, BLOCK_BYTES, NR, QUANTIZE_TASK, SLICE_BLOCKS, UNIT_PANELS,
    UNIT_ROWS,
};
use crate::runtime::pool::{par_each, par_for, threads, SyncPtr, PARALLEL_FROM};

impl Q8Weight {
    /// `x`'s `m` rows of `k` floats quantized, in parallel over rows where
    /// they are many.
    pub(super) fn quantize_inputs(&self, x: &[f32], m: usize) -> Quantized {
        let (k, nb) = (self.k, self.k / QK);
        let mut xq = Quantized {
            q: vec![0; m * k],
            d: vec![0.; m * nb],
            off: vec![0; m * nb],
        };
        let rows = (QUANTIZE_TASK / k).max(1);
        let tasks =
            xq.q.chunks_mut(rows * k)
                .zip(xq.d.chunks_mut(rows * nb))
                .zip(xq.off.chunks_mut(rows * nb));
        let kernel = self.kernel;
        if m > rows {
            let tasks: Vec<_> = tasks.zip(x.chunks(rows * k)).collect();
            par_each(tasks, PARALLEL_FROM.max(m * k), |(((q, d), off), x)| {
                quantize_rows(kernel, x, q, d, off)
            });
        } else {
            for (((q, d), off), x) in tasks.zip(x.chunks(rows * k)) {
                quantize_rows(kernel, x, q, d, off);
            }
        }
        xq
    }

    /// `x · wᵀ + b` for output features `lo..hi` (any range of `0..n`),
    /// plus `residual` where given: `x` is `m` rows of `k` floats,
    /// `residual` `m` rows of `hi - lo`; returns `m` rows of `hi - lo`
    /// floats, as the module docs compute them. Panics where `lo..hi` is
    /// not in `0..n`, `x` is shorter or `residual` another length.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        m: usize,
        (lo, hi): (usize, usize),
        residual: Option<&[f32]>,
    ) -> Vec<f32> {
        let (k, nb, width) = (self.k, self.k / QK, hi - lo);
        assert!(
            lo < hi && hi <= self.n,
            "Q8Weight: features {lo}..{hi} out of 0..{}",
            self.n
        );
        assert!(x.len() >= m * k && residual.is_none_or(|r| r.len() == m * width));
        let mut out = vec![0f32; m * width];
        if m == 0 {
            return out;
        }
        let xq = self.quantize_inputs(&x[..m * k], m);
        let (mr, np) = self.kernel.tile_shape();
        let (p_lo, p_hi) = (lo / NR, hi.div_ceil(NR));
        let groups = m.div_ceil(mr);
        let work = m * width * k;
        let threads = if work > PARALLEL_FROM { threads() } else { 1 };
        // A single row: one run of whole tiles a thread. More: units of
        // UNIT_PANELS panels by UNIT_ROWS rows.
        let (ppu, gpu) = if m == 1 {
            ((p_hi - p_lo).div_ceil(threads).next_multiple_of(np), 1)
        } else {
            (UNIT_PANELS.next_multiple_of(np), (UNIT_ROWS / mr).max(1))
        };
        let units: Vec<(usize, usize)> = (p_lo..p_hi)
            .step_by(ppu)
            .flat_map(|p0| (0..groups).step_by(gpu).map(move |g0| (p0, g0)))
            .collect();
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let run = |u: usize| {
            let (p0, g0) = units[u];
            let (p1, g1) = ((p0 + ppu).min(p_hi), (g0 + gpu).min(groups));
            let (r0, r1, cols) = (g0 * mr, (g1 * mr).min(m), (p1 - p0) * NR);
            // The unit's running sums, its rows by its panels' features.
            let mut acc = vec![0f32; (r1 - r0) * cols];
            // Where the unit has several row groups, the reduction goes in
            // slices whose panel slices stay in L1 while the groups pass.
            let slice = if g1 - g0 > 1 { SLICE_BLOCKS } else { nb };
            // One row goes through the unit in one call where the kernel
            // has one; else tile by tile below.
            let done = m == 1 && self.one_row(p0, p1, &xq, &mut acc);
            let blocks_left = if done { 0..0 } else { 0..nb };
            for b0 in blocks_left.step_by(slice) {
                let blocks = b0..(b0 + slice).min(nb);
                for p in (p0..p1).step_by(np) {
                    for g in g0..g1 {
                        let rows = mr.min(m - g * mr);
                        let at = (g * mr - r0) * cols + (p - p0) * NR;
                        self.tile(
                            rows,
                            np.min(p1 - p),
                            blocks.clone(),
                            &xq,
                            g * mr,
                            p,
                            &mut acc[at..],
                            cols,
                        );
                    }
                }
            }
            // The unit's columns inside lo..hi, with the bias, then the
            // residual.
            let (c0, c1) = (lo.max(p0 * NR), hi.min(p1 * NR));
            for (r, sums) in (r0..r1).zip(acc.chunks_exact(cols)) {
                let at = r * width + c0 - lo;
                // SAFETY: rows r0..r1 and columns c0 - lo..c1 - lo of the
                // m × width output are this unit's alone (units cover
                // disjoint panels and row groups).
                let dst = unsafe { out_ptr.slice_mut(at, c1 - c0) };
                dst.copy_from_slice(&sums[c0 - p0 * NR..c1 - p0 * NR]);
                if let Some(bias) = &self.bias {
                    for (y, b) in dst.iter_mut().zip(&bias[c0..c1]) {
                        *y += b;
                    }
                }
                if let Some(residual) = residual {
                    for (y, r) in dst.iter_mut().zip(&residual[at..]) {
                        *y += r;
                    }
                }
            }
        };
        if units.len() > 1 && threads > 1 {
            par_for(units.len(), work, run);
        } else {
            (0..units.len()).for_each(run);
        }
        out
    }

    /// One row through panels `p0..p1` into `acc` in one call of the
    /// kernel, where it has such a call (VNNI: the run streams past
    /// without a call a panel); false where it has not, and `acc` is left.
    fn one_row(&self, p0: usize, p1: usize, xq: &Quantized, acc: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.kernel == Kernel::Vnni {
            let (k, nb) = (self.k, self.k / QK);
            let panels = p1 - p0;
            let w = &self.panels()[p0 * nb * BLOCK_BYTES..][..panels * nb * BLOCK_BYTES];
            let d = &self.d[p0 * nb * NR..][..panels * nb * NR];
            assert!(acc.len() >= panels * NR && xq.q.len() >= k && xq.d.len() >= nb && xq.off.len() >= nb);
            // SAFETY: the slices hold the panels' values and scales, the
            // row's inputs, scales and offsets, and the panels' outputs;
            // the kernel was picked for a processor with VNNI.
            unsafe {
                vnni::one_row(
                    panels,
                    nb,
                    xq.q.as_ptr(),
                    (xq.d.as_ptr(), xq.off.as_ptr()),
                    w.as_ptr(),
                    d.as_ptr().cast(),
                    acc.as_mut_ptr(),
                )
            };
            return true;
        }
        let _ = (p0, p1, xq, acc);
        false
    }

    /// The kernel's sums over `blocks` for `rows` rows from `r0` and
    /// `panels` panels from `p`, added to `tile` (rows `tile_rs` apart).
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        rows: usize,
        panels: usize,
        blocks: std::ops::Range<usize>,
        xq: &Quantized,
        r0: usize,
        p: usize,
        tile: &mut [f32],
        tile_rs: usize,
    ) {
        let (k, nb) = (self.k, self.k / QK);
        assert!(blocks.end <= nb);
        let x = &xq.q[r0 * k..][..rows * k];
        let (xd, xoff) = (&xq.d[r0 * nb..][..rows * nb], &xq.off[r0 * nb..][..rows * nb]);
        let w = &self.panels()[p * nb * BLOCK_BYTES..][..panels * nb * BLOCK_BYTES];
        let d = &self.d[p * nb * NR..][..panels * nb * NR];
        assert!(tile.len() >= (rows - 1) * tile_rs + panels * NR && tile_rs >= panels * NR);
        match self.kernel {
            Kernel::Portable => portable::tile(rows, panels, (nb, blocks), x, xd, w, d, tile, tile_rs),
            // SAFETY: the slices above hold the extents the kernel reads
            // (`rows` rows of inputs and scales, `panels` panels of values
            // and scales) and the tile the `rows` rows it writes; the
            // kernel was picked for an instruction set the processor has.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe {
                avx2::tile(
                    rows,
                    panels,
                    (nb, blocks),
                    x.as_ptr(),
                    xd.as_ptr(),
                    w.as_ptr(),
                    d.as_ptr().cast(),
                    tile.as_mut_ptr(),
                    tile_rs,
                )
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe {
                vnni::tile(
                    rows,
                    panels,
                    (nb, blocks),
                    x.as_ptr(),
                    (xd.as_ptr(), xoff.as_ptr()),
                    w.as_ptr(),
                    d.as_ptr().cast(),
                    tile.as_mut_ptr(),
                    tile_rs,
                )
            },
        }
    }
}
