//! The 8-bit linear layers' kernel in plain Rust: the sums `vnni::tile`
//! computes (the same layout, order and rounding), from weights stored as
//! `q` (`i8`), for processors without AVX2 and for forced runs.

use half::f16;

use super::quantize::{quantize_block, QK};
use crate::elem::PanelElem;

/// Rows per tile of a call of several rows.
pub(crate) const MR: usize = 4;
/// Panels per tile.
pub(crate) const NP: usize = 1;

/// The sums of a tile of `rows` rows and `panels` panels over `blocks`,
/// added to `out` as `vnni::tile` adds them and laid out as it lays them
/// out: row `r`'s inputs `x[r·nb·32..]` and scales
/// `xd[r·nb..]`, the panels' bytes from `w[0]` and scales from `d[0]`,
/// `out[r·out_rs + 16·p + c]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile(
    rows: usize,
    panels: usize,
    (nb, blocks): (usize, std::ops::Range<usize>),
    x: &[i8],
    xd: &[f32],
    w: &[u8],
    d: &[f16],
    out: &mut [f32],
    out_rs: usize,
) {
    for p in 0..panels {
        for r in 0..rows {
            let acc = &mut out[r * out_rs + 16 * p..][..16];
            for b in blocks.clone() {
                let wb = &w[(p * nb + b) * 512..][..512];
                let xb = &x[r * nb * 32 + b * 32..][..32];
                let mut isum = [0i32; 16];
                for (g, xg) in xb.chunks_exact(4).enumerate() {
                    for (c, s) in isum.iter_mut().enumerate() {
                        let wc = &wb[64 * g + 4 * c..][..4];
                        *s += wc
                            .iter()
                            .zip(xg)
                            .map(|(&w, &x)| i32::from(w as i8) * i32::from(x))
                            .sum::<i32>();
                    }
                }
                let dx = xd[r * nb + b];
                let dw = &d[(p * nb + b) * 16..][..16];
                for ((acc, &s), dw) in acc.iter_mut().zip(&isum).zip(dw) {
                    *acc += s as f32 * (dw.to_f32() * dx);
                }
            }
        }
    }
}

/// Feature `c`'s row of weights `w` (whole blocks) quantized by `mod.rs`'s
/// `quantize_block` into its panel, as `vnni::tile` reads it (stored as
/// `q`): value `i` of block `b` at `qs[b·512 + (i / 4)·64 + 4·c + i % 4]`,
/// the scale at `d[b·16 + c]`.
pub(crate) fn quantize_weight_row<S: PanelElem>(w: &[S], c: usize, qs: &mut [u8], d: &mut [f16]) {
    let (mut x, mut q) = ([0f32; QK], [0i8; QK]);
    for (b, src) in w.as_chunks::<QK>().0.iter().enumerate() {
        S::widen(src, &mut x);
        let (scale, _) = quantize_block(&x, &mut q);
        d[b * 16 + c] = f16::from_f32(scale);
        let block = &mut qs[b * 512..][..512];
        for (g, four) in q.as_chunks::<4>().0.iter().enumerate() {
            block[g * 64 + 4 * c..][..4].copy_from_slice(&four.map(|q| q as u8));
        }
    }
}
