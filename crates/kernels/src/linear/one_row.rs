//! A single row (a decoder's step): each instruction set's `one_row`
//! streams each panel once with 8 accumulators and a software prefetch (on
//! AVX2 of half-precision panels only: f32 ones are left to the hardware
//! prefetcher), the panels split into one run per thread of
//! [`crate::runtime::pool::par_for`].

use half::bf16;

use super::weight::PackedWeight;
use crate::elem::PanelElem;
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_for, threads, SyncPtr, PARALLEL_FROM};

impl PackedWeight {
    /// `x · wᵀ + b` for one row and output features `lo..hi` over
    /// `panels`, `hi - lo` floats: the panels split into one run per
    /// thread; `xb` is `x` rounded to bf16 where the panels are paired.
    pub(super) fn one_row<E: PanelElem>(
        &self,
        panels: &[E],
        x: &[f32],
        xb: Option<&[bf16]>,
        (lo, hi): (usize, usize),
    ) -> Vec<f32> {
        let (nr, k, width) = (self.nr(), self.k, hi - lo);
        let mut out: Vec<f32> = Vec::with_capacity(width);
        let n_panels = width.div_ceil(nr);
        let tasks = if width * k > PARALLEL_FROM {
            threads().min(n_panels)
        } else {
            1
        };
        let per_task = n_panels.div_ceil(tasks) * nr;
        let out_ptr = SyncPtr(out.as_mut_ptr());
        par_for(width.div_ceil(per_task), width * k, |t| {
            let c0 = t * per_task;
            let (w, cols) = (
                panels[(lo + c0) / nr * k * nr..].as_ptr(),
                per_task.min(width - c0),
            );
            let (bias, out) = (self.bias[lo + c0..].as_ptr(), out_ptr.get().wrapping_add(c0));
            // SAFETY: this task's columns c0.. of the output are its own;
            // x holds k floats; panels from (lo + c0) / nr on cover the
            // columns, and the bias their panels' floats; `self.isa`, AVX2
            // (with FMA and F16C), AVX-512 or AVX512-BF16 (which paired
            // panels need), was detected when packed.
            unsafe {
                use super::avx512::{Dot, Row, Widen};
                let init = bias;
                match (self.isa, xb) {
                    // Paired panels are bf16 over an even `k`.
                    (_, Some(xb)) => super::avx512bf16::Pairs::one_row(&Row {
                        x: xb.as_ptr(),
                        k,
                        w: w.cast(),
                        cols,
                        init,
                        out,
                    }),
                    (Isa::Avx512 | Isa::Avx512Bf16, None) => Widen::<E>::one_row(&Row {
                        x: x.as_ptr(),
                        k,
                        w,
                        cols,
                        init,
                        out,
                    }),
                    _ => super::avx2::one_row(x.as_ptr(), k, w, cols, init, out),
                }
            };
        });
        // SAFETY: the runs wrote the row's `width` floats.
        unsafe { out.set_len(width) };
        out
    }
}
