//! A packed weight's panels in one element type: the packing (plain, or
//! in input pairs for AVX512-BF16), joining, and reading a feature back.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::elem::PanelElem;
use crate::runtime::pool::{par_chunks_mut, par_for};

/// `x` as an `E`: rounded, or, where `S` is `E`, itself (a bf16 weight
/// packed as bf16 is copied, not widened and rounded back).
#[inline(always)]
fn convert<S: PanelElem, E: PanelElem>(x: S) -> E {
    if std::any::TypeId::of::<S>() == std::any::TypeId::of::<E>() {
        // SAFETY: S and E are the same type.
        unsafe { std::mem::transmute_copy::<S, E>(&x) }
    } else {
        E::from_f32(x.to_f32())
    }
}

/// Where input `e` of feature `c` lies from the start of a panel of `nr`
/// features: `e·nr + c`, or, `paired`, in the input pairs of
/// `avx512bf16.rs`.
fn panel_index(paired: bool, e: usize, c: usize, nr: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if paired {
        return super::avx512bf16::pair_index(e, c);
    }
    debug_assert!(!paired);
    e * nr + c
}

/// A weight's panels in one element type, 64-byte aligned from `start`,
/// so that a panel row's loads never straddle a cache line.
pub(crate) struct Panels<E> {
    data: Vec<E>,
    start: usize,
}

impl<E: PanelElem> Panels<E> {
    /// `w`, `n` rows of `k` elements, as panels of `nr` features, each
    /// element rounded to `E`, its inputs `paired` or not.
    pub(super) fn pack<S: PanelElem>(w: &[S], n: usize, k: usize, nr: usize, paired: bool) -> Self {
        let np = n.div_ceil(nr) * nr;
        // 64 bytes of slack to align the start.
        let slack = 64 / size_of::<E>();
        let data = crate::runtime::pages::filled(np * k + slack, E::default());
        let start = data.as_ptr().align_offset(64).min(slack);
        let mut panels = Panels { data, start };
        panels.fill(w, n, k, nr, paired);
        panels
    }

    /// [`Panels::pack`] again into these panels, packed before from a
    /// weight of the same `n`, `k`, `nr` and pairing: a weight that
    /// changed (a training step) takes no new buffer, whose pages would
    /// each be faulted in and cleared again.
    pub(super) fn repack<S: PanelElem>(&mut self, w: &[S], n: usize, k: usize, nr: usize, paired: bool) {
        self.fill(w, n, k, nr, paired);
    }

    /// Writes `w`'s features into their panel places; the panels' tail
    /// past `n` features keeps what it holds (zeros).
    fn fill<S: PanelElem>(&mut self, w: &[S], n: usize, k: usize, nr: usize, paired: bool) {
        let np = n.div_ceil(nr) * nr;
        let start = self.start;
        par_chunks_mut(
            &mut self.data[start..start + np * k],
            k * nr,
            np * k,
            |p, panel| {
                // In blocks of inputs whose panel rows stay in L1 while every
                // feature's inputs are written into them.
                const BLOCK: usize = 64;
                for e0 in (0..k).step_by(BLOCK) {
                    let e1 = (e0 + BLOCK).min(k);
                    for c in 0..nr.min(n.saturating_sub(p * nr)) {
                        let row = &w[(p * nr + c) * k..][e0..e1];
                        for (e, &x) in (e0..).zip(row) {
                            panel[panel_index(paired, e, c, nr)] = convert(x);
                        }
                    }
                }
            },
        );
    }

    pub(super) fn get(&self) -> &[E] {
        &self.data[self.start..]
    }

    /// Its first `la` elements, then `b`'s first `lb`, realigned as
    /// [`Panels::pack`] aligns them: the buffer grown in place where the
    /// allocator can, so that joining holds one copy of `b` beside it.
    pub(super) fn extend(mut self, la: usize, b: &Self, lb: usize) -> Self {
        let slack = 64 / size_of::<E>();
        let old = self.start;
        self.data.truncate(old + la);
        self.data.resize(slack + la + lb, E::default());
        let start = self.data.as_ptr().align_offset(64).min(slack);
        self.data.copy_within(old..old + la, start);
        self.data[start + la..][..lb].copy_from_slice(&b.get()[..lb]);
        Panels {
            data: self.data,
            start,
        }
    }

    /// Output feature `j`'s `k` weights as f32, into `row`, its inputs
    /// `paired` or not.
    pub(super) fn row_into(&self, j: usize, nr: usize, paired: bool, row: &mut [f32]) {
        let k = row.len();
        let panel = &self.get()[(j / nr) * k * nr..];
        for (e, x) in row.iter_mut().enumerate() {
            *x = panel[panel_index(paired, e, j % nr, nr)].to_f32();
        }
    }
}

impl Panels<f32> {
    /// The panels of the weight `aᵀ`, `a` being `r` rows of `c` floats:
    /// `c` features of `r` inputs, so that the layer's product of rows of
    /// `r` floats is their product with `a`. Input `e` of a panel is the
    /// panel's `nr` columns of `a`'s row `e`, so each is one copy of a
    /// piece of a row.
    pub(super) fn pack_columns(a: &[f32], r: usize, c: usize, nr: usize) -> Self {
        let np = c.div_ceil(nr) * nr;
        let slack = 64 / size_of::<f32>();
        let data = crate::runtime::pages::filled(np * r + slack, 0f32);
        let start = data.as_ptr().align_offset(64).min(slack);
        let mut panels = Panels { data, start };
        panels.repack_columns(a, r, c, nr);
        panels
    }

    /// [`Panels::pack_columns`] again into these panels, packed before
    /// from an `a` of the same `r`, `c` and `nr` ([`Panels::repack`]).
    pub(super) fn repack_columns(&mut self, a: &[f32], r: usize, c: usize, nr: usize) {
        let np = c.div_ceil(nr) * nr;
        let start = self.start;
        par_chunks_mut(
            &mut self.data[start..start + np * r],
            r * nr,
            np * r,
            |p, panel| {
                let (lo, hi) = (p * nr, ((p + 1) * nr).min(c));
                for (e, to) in panel.chunks_exact_mut(nr).enumerate() {
                    to[..hi - lo].copy_from_slice(&a[e * c..][lo..hi]);
                }
            },
        );
    }

    /// Whether the panels hold `w`, `n` rows of `k` floats, bit for bit,
    /// as [`Panels::pack`] packs them unpaired in panels of `nr`. Stops at
    /// the first difference.
    pub(super) fn holds_rows(&self, w: &[f32], n: usize, k: usize, nr: usize) -> bool {
        w.len() == n * k
            && all_panels(&self.get()[..n.div_ceil(nr) * nr * k], k * nr, |p, panel| {
                (0..nr.min(n - p * nr)).all(|c| {
                    let row = &w[(p * nr + c) * k..][..k];
                    (0..k).all(|e| panel[e * nr + c].to_bits() == row[e].to_bits())
                })
            })
    }

    /// Whether the panels hold `aᵀ`, `a` being `r` rows of `c` floats, bit
    /// for bit, as [`Panels::pack_columns`] packs it. Stops at the first
    /// difference.
    pub(super) fn holds_columns(&self, a: &[f32], r: usize, c: usize, nr: usize) -> bool {
        let bits = |xs: &[f32], ys: &[f32]| xs.iter().zip(ys).all(|(x, y)| x.to_bits() == y.to_bits());
        a.len() == r * c
            && all_panels(&self.get()[..c.div_ceil(nr) * nr * r], r * nr, |p, panel| {
                let (lo, hi) = (p * nr, ((p + 1) * nr).min(c));
                panel
                    .chunks_exact(nr)
                    .enumerate()
                    .all(|(e, from)| bits(&from[..hi - lo], &a[e * c..][lo..hi]))
            })
    }
}

/// Whether `holds(p, panel)` for every `len`-long panel `p` of `panels`,
/// over the threads; a panel that does not stops the panels not yet begun.
fn all_panels(panels: &[f32], len: usize, holds: impl Fn(usize, &[f32]) -> bool + Sync) -> bool {
    let differs = AtomicBool::new(false);
    par_for(panels.len().div_ceil(len), panels.len(), |p| {
        if !differs.load(Ordering::Relaxed) && !holds(p, &panels[p * len..][..len]) {
            differs.store(true, Ordering::Relaxed);
        }
    });
    !differs.into_inner()
}
