//! A packed weight's panels in one element type: the packing (plain, or
//! in input pairs for AVX512-BF16), joining, and reading a feature back.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::elem::PanelElem;
#[cfg(target_arch = "x86_64")]
use crate::panel::avx2::transpose_into;
#[cfg(target_arch = "x86_64")]
use crate::runtime::isa::runnable;
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_chunks_mut, par_for};

/// Whether `A` is `B`.
fn same<A: 'static, B: 'static>() -> bool {
    std::any::TypeId::of::<A>() == std::any::TypeId::of::<B>()
}

/// `x` as an `E`: rounded, or, where `S` is `E`, itself (a bf16 weight
/// packed as bf16 is copied, not widened and rounded back).
#[inline(always)]
fn convert<S: PanelElem, E: PanelElem>(x: S) -> E {
    if same::<S, E>() {
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
    /// element rounded to `E`, its inputs `paired` or not, for a layer of
    /// `isa`.
    pub(super) fn pack<S: PanelElem>(w: &[S], n: usize, k: usize, nr: usize, paired: bool, isa: Isa) -> Self {
        let np = n.div_ceil(nr) * nr;
        // 64 bytes of slack to align the start.
        let slack = 64 / size_of::<E>();
        let data = crate::runtime::pages::filled(np * k + slack, E::default());
        let start = data.as_ptr().align_offset(64).min(slack);
        let mut panels = Panels { data, start };
        panels.fill(w, n, k, nr, paired, isa);
        panels
    }

    /// [`Panels::pack`] again into these panels, packed before from a
    /// weight of the same `n`, `k`, `nr` and pairing: a weight that
    /// changed (a training step) takes no new buffer, whose pages would
    /// each be faulted in and cleared again.
    pub(super) fn repack<S: PanelElem>(
        &mut self,
        w: &[S],
        n: usize,
        k: usize,
        nr: usize,
        paired: bool,
        isa: Isa,
    ) {
        self.fill(w, n, k, nr, paired, isa);
    }

    /// Writes `w`'s features into their panel places; the panels' tail
    /// past `n` features keeps what it holds (zeros). An f32 weight packed
    /// as f32 for AVX2 or AVX-512 goes 8 × 8 values at a time through a
    /// register transpose (`panel/avx2.rs`), the values' bits unchanged;
    /// else value by value.
    fn fill<S: PanelElem>(&mut self, w: &[S], n: usize, k: usize, nr: usize, paired: bool, isa: Isa) {
        let np = n.div_ceil(nr) * nr;
        let start = self.start;
        #[cfg(target_arch = "x86_64")]
        let transposes = !paired
            && nr.is_multiple_of(8)
            && same::<S, f32>()
            && same::<E, f32>()
            && matches!(runnable(isa), Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = isa;
        par_chunks_mut(
            &mut self.data[start..start + np * k],
            k * nr,
            np * k,
            |p, panel| {
                // In blocks of inputs whose panel rows stay in L1 while every
                // feature's inputs are written into them.
                const BLOCK: usize = 64;
                let features = nr.min(n.saturating_sub(p * nr));
                #[cfg(target_arch = "x86_64")]
                if transposes {
                    // SAFETY: S and E are f32 (`same`); the CPU runs AVX2
                    // (`runnable`).
                    unsafe {
                        let w = std::slice::from_raw_parts(w.as_ptr().cast::<f32>(), w.len());
                        let panel =
                            std::slice::from_raw_parts_mut(panel.as_mut_ptr().cast::<f32>(), panel.len());
                        transpose_panel(&w[p * nr * k..], panel, features, k, nr, BLOCK);
                    }
                    return;
                }
                for e0 in (0..k).step_by(BLOCK) {
                    let e1 = (e0 + BLOCK).min(k);
                    for c in 0..features {
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

/// Features `0..features` of a panel of `nr` (a multiple of 8), each `k`
/// inputs, from `w`'s rows into `panel` (`k` rows of `nr`), 8 features
/// by 8 inputs a register transpose, in blocks of `block` inputs.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_panel(w: &[f32], panel: &mut [f32], features: usize, k: usize, nr: usize, block: usize) {
    assert!(nr.is_multiple_of(8) && features <= nr && w.len() >= features * k && panel.len() >= k * nr);
    for e0 in (0..k).step_by(block) {
        let e1 = (e0 + block).min(k);
        for c0 in (0..features).step_by(8) {
            let c1 = (c0 + 8).min(features);
            let mut rows: [&[f32]; 8] = [&[]; 8];
            for (c, row) in (c0..c1).zip(&mut rows) {
                *row = &w[c * k..][e0..e1];
            }
            // SAFETY: AVX2 (the caller's); rows of `e1 - e0` values; the
            // panel holds inputs `e0..e1` of features `c0..c0 + 8` at
            // `e·nr + c` (`c0 + 8 <= nr`, asserted above).
            unsafe {
                transpose_into(
                    &rows[..c1 - c0],
                    e1 - e0,
                    1.,
                    panel[e0 * nr + c0..].as_mut_ptr(),
                    nr,
                    8,
                )
            };
        }
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

#[cfg(test)]
mod tests {
    use super::Panels;
    use crate::runtime::isa::{supported, Isa};

    /// An f32 weight packs into the same bits on every instruction set
    /// (the register transposes of AVX2 and AVX-512, value by value on
    /// the portable code), features and inputs off the 8 × 8 blocks and
    /// the input blocks, packing anew into used panels included; a NaN's
    /// payload, a signalling one's, and -0 keep their bits.
    #[test]
    fn f32_weights_pack_into_the_same_bits_on_every_isa() {
        for (n, k) in [(1, 1), (7, 9), (8, 64), (21, 70), (33, 131), (64, 200)] {
            let mut w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.37).sin()).collect();
            w[0] = -0.;
            w[n * k / 2] = f32::from_bits(0x7f80_0001);
            w[n * k - 1] = f32::from_bits(0xffc0_1234);
            for nr in [16, 32] {
                let want = Panels::<f32>::pack(&w, n, k, nr, false, Isa::Portable);
                for isa in supported() {
                    let mut got = Panels::<f32>::pack(&w, n, k, nr, false, isa);
                    let len = n.div_ceil(nr) * nr * k;
                    let bits = |p: &Panels<f32>| -> Vec<u32> {
                        p.get()[..len].iter().map(|x| x.to_bits()).collect()
                    };
                    assert_eq!(bits(&got), bits(&want), "{isa:?} ({n}, {k}) in panels of {nr}");
                    // Again into the used panels, from another weight.
                    let v: Vec<f32> = w.iter().map(|x| x * 2.).collect();
                    got.repack(&v, n, k, nr, false, isa);
                    let want_v = Panels::<f32>::pack(&v, n, k, nr, false, Isa::Portable);
                    assert_eq!(bits(&got), bits(&want_v), "{isa:?} ({n}, {k}) packed anew");
                }
            }
        }
    }
}
