//! The formats of 32 (Q4_0, Q4_1, Q5_0, Q5_1) repacked at load into
//! panels of [`PANEL`] output features, as ggml-cpu's `repack.cpp` does
//! for Q4_0: the same bytes, reordered, so that one vector holds a block's
//! values for the panel's 8 features and a step's products land in one
//! lane per feature (no horizontal sums, one scale load for 8 features).
//!
//! Panel `p`'s block `b` (features `8p..8p+8`, past `n` zeros) is at
//! `(p·nb + b)·8·block_bytes`: the 8 features' `d` (f16), then their `m`
//! (Q4_1, Q5_1), then their `qh` (u32; Q5_0, Q5_1), then 128 bytes of
//! nibbles, byte `32·g + 4·c + t` being feature `c`'s `qs[4g + t]`: its
//! low nibble is element `4g + t` of the block, its high one `16 + 4g + t`.

use super::format::BlockFormat;

/// Output features per panel.
pub(crate) const PANEL: usize = 8;

/// Where a panel block keeps each part.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// The ggml block's size.
    pub(crate) block: usize,
    /// Offsets in the panel block: `m` and `qh` where the format has them.
    pub(crate) m: Option<usize>,
    pub(crate) qh: Option<usize>,
    pub(crate) qs: usize,
}

impl Layout {
    /// The layout of `format`'s panels; `None` for formats kept in rows.
    pub(crate) fn of(format: BlockFormat) -> Option<Layout> {
        let (m, qh) = match format {
            BlockFormat::Q4_0 => (false, false),
            BlockFormat::Q4_1 => (true, false),
            BlockFormat::Q5_0 => (false, true),
            BlockFormat::Q5_1 => (true, true),
            _ => return None,
        };
        let m = m.then_some(16);
        let qh = qh.then_some(16 + 16 * usize::from(m.is_some()));
        let qs = qh.map_or(m.map_or(16, |m| m + 16), |h| h + 32);
        Some(Layout {
            block: format.block_bytes(),
            m,
            qh,
            qs,
        })
    }

    /// Bytes of a panel block.
    pub(crate) fn bytes(self) -> usize {
        PANEL * self.block
    }

    /// Where the ggml block keeps `m`, `qh` and `qs`.
    fn ggml(self) -> (Option<usize>, Option<usize>, usize) {
        let m = self.m.map(|_| 2);
        let qh = self.qh.map(|_| 2 + 2 * usize::from(m.is_some()));
        (m, qh, self.block - 16)
    }
}

/// `data`, `n` rows of `nb` ggml blocks, as panels.
pub(crate) fn repack(l: Layout, data: &[u8], n: usize, nb: usize) -> Vec<u8> {
    let panels = n.div_ceil(PANEL);
    let mut out = vec![0u8; panels * nb * l.bytes()];
    let (gm, gqh, gqs) = l.ggml();
    for j in 0..n {
        let (p, c) = (j / PANEL, j % PANEL);
        for b in 0..nb {
            let src = &data[(j * nb + b) * l.block..][..l.block];
            let dst = &mut out[(p * nb + b) * l.bytes()..][..l.bytes()];
            dst[2 * c..2 * c + 2].copy_from_slice(&src[..2]);
            if let (Some(m), Some(gm)) = (l.m, gm) {
                dst[m + 2 * c..m + 2 * c + 2].copy_from_slice(&src[gm..gm + 2]);
            }
            if let (Some(qh), Some(gqh)) = (l.qh, gqh) {
                dst[qh + 4 * c..qh + 4 * c + 4].copy_from_slice(&src[gqh..gqh + 4]);
            }
            for (i, &q) in src[gqs..gqs + 16].iter().enumerate() {
                dst[l.qs + 32 * (i / 4) + 4 * c + i % 4] = q;
            }
        }
    }
    out
}

/// Feature `j`'s block `b` as ggml stores it, from the panels (of `nb`
/// blocks a feature), into `out` (`l.block` bytes).
pub(crate) fn block_of(l: Layout, panels: &[u8], nb: usize, j: usize, b: usize, out: &mut [u8]) {
    let (p, c) = (j / PANEL, j % PANEL);
    let src = &panels[(p * nb + b) * l.bytes()..][..l.bytes()];
    let (gm, gqh, gqs) = l.ggml();
    out[..2].copy_from_slice(&src[2 * c..2 * c + 2]);
    if let (Some(m), Some(gm)) = (l.m, gm) {
        out[gm..gm + 2].copy_from_slice(&src[m + 2 * c..m + 2 * c + 2]);
    }
    if let (Some(qh), Some(gqh)) = (l.qh, gqh) {
        out[gqh..gqh + 4].copy_from_slice(&src[qh + 4 * c..qh + 4 * c + 4]);
    }
    for (i, q) in out[gqs..gqs + 16].iter_mut().enumerate() {
        *q = src[l.qs + 32 * (i / 4) + 4 * c + i % 4];
    }
}
