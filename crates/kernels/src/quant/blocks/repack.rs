//! Weights repacked at load into panels of [`PANEL`] output features, as
//! ggml-cpu's `repack.cpp` does for Q4_0, Q2_K and Q4_K: the same bytes,
//! reordered, so that one vector holds a step's values for the panel's 8
//! features and its products land in one lane per feature (no horizontal
//! sums; one load for the 8 features' scales).
//!
//! Panel `p`'s block `b` (features `8p..8p+8`, past `n` zeros) is at
//! `(p·nb + b)·8·block_bytes`. Each part of ggml's block (a [`Segment`]:
//! `d`, `m`, `qh`, `scales`, `qs`, in ggml's order but Q6_K's `d` and
//! scales first) is interleaved in units of its element (2 bytes for an
//! f16, 4 for the rest): the parts follow one another, 8 times their ggml
//! size each, and a part's unit `i` holds the 8 features' units `i` one
//! after another. So feature `c`'s `qs[4i + t]` is at `start + 32·i +
//! 4·c + t`: a 32-byte load is a step of 4 values for each of the 8
//! features.

use super::format::BlockFormat;

/// Output features per panel.
pub(crate) const PANEL: usize = 8;

/// A part of a ggml block: its offset, its length and the unit it is
/// interleaved in.
type Segment = (usize, usize, usize);

/// How a format's blocks are laid out in panels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// The ggml block's size.
    pub(crate) block: usize,
    segments: &'static [Segment],
}

impl Layout {
    /// The layout of `format`'s panels; `None` for Q8_0, kept in rows (its
    /// layers take kernels of their own).
    pub(crate) fn of(format: BlockFormat) -> Option<Layout> {
        let segments: &'static [Segment] = match format {
            BlockFormat::Q4_0 => &[(0, 2, 2), (2, 16, 4)],
            BlockFormat::Q4_1 => &[(0, 2, 2), (2, 2, 2), (4, 16, 4)],
            BlockFormat::Q5_0 => &[(0, 2, 2), (2, 4, 4), (6, 16, 4)],
            BlockFormat::Q5_1 => &[(0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)],
            BlockFormat::Q4_K => &[(0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 4)],
            BlockFormat::Q5_K => &[(0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 32, 4), (48, 128, 4)],
            // `d` and the scales first, so that a block's loads go in
            // address order.
            BlockFormat::Q6_K => &[(208, 2, 2), (192, 16, 4), (0, 128, 4), (128, 64, 4)],
            BlockFormat::Q2_K => &[(80, 2, 2), (82, 2, 2), (0, 16, 4), (16, 64, 4)],
            BlockFormat::Q3_K => &[(108, 2, 2), (96, 12, 4), (0, 32, 4), (32, 64, 4)],
            _ => return None,
        };
        Some(Layout {
            block: format.block_bytes(),
            segments,
        })
    }

    /// Bytes of a panel block.
    pub(crate) fn bytes(self) -> usize {
        PANEL * self.block
    }

    /// The segments with where each starts in a panel block.
    fn placed(self) -> impl Iterator<Item = (Segment, usize)> {
        self.segments.iter().scan(0, |start, &seg| {
            let at = *start;
            *start += PANEL * seg.1;
            Some((seg, at))
        })
    }

    /// Where feature `c`'s byte `at` of a ggml block is in the panel block.
    fn place(self, c: usize, at: usize) -> usize {
        let ((o, _, unit), start) = self
            .placed()
            .find(|&((o, len, _), _)| (o..o + len).contains(&at))
            .expect("the segments cover the block");
        let (i, t) = ((at - o) / unit, (at - o) % unit);
        start + PANEL * unit * i + unit * c + t
    }
}

/// `data`, `n` rows of `nb` ggml blocks, as panels (in parallel over
/// panels): in place where the features fill whole panels (a panel takes
/// the bytes of its 8 rows), else into a new buffer, the last panel's
/// missing features zeros.
pub(crate) fn repack(l: Layout, mut data: Vec<u8>, n: usize, nb: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let panel_bytes = nb * l.bytes();
    if n.is_multiple_of(PANEL) {
        data.par_chunks_mut(panel_bytes)
            .for_each_init(Vec::new, |rows: &mut Vec<u8>, panel| {
                rows.clear();
                rows.extend_from_slice(panel);
                fill_panel(l, rows, nb, panel);
            });
        return data;
    }
    let panels = n.div_ceil(PANEL);
    let mut out = crate::runtime::pages::filled(panels * panel_bytes, 0u8);
    out.par_chunks_mut(panel_bytes)
        .enumerate()
        .for_each(|(p, panel)| {
            let rows = &data[p * panel_bytes..][..(n - p * PANEL).min(PANEL) * nb * l.block];
            fill_panel(l, rows, nb, panel);
        });
    out
}

/// Panel `panel` from `rows`, up to 8 features' rows of `nb` ggml blocks.
fn fill_panel(l: Layout, rows: &[u8], nb: usize, panel: &mut [u8]) {
    for (c, row) in rows.chunks_exact(nb * l.block).enumerate() {
        for (src, dst) in row.chunks_exact(l.block).zip(panel.chunks_exact_mut(l.bytes())) {
            for ((o, len, unit), start) in l.placed() {
                for (i, from) in src[o..o + len].chunks_exact(unit).enumerate() {
                    let to = start + PANEL * unit * i + unit * c;
                    dst[to..to + unit].copy_from_slice(from);
                }
            }
        }
    }
}

/// Feature `j`'s block `b` as ggml stores it, from the panels (of `nb`
/// blocks a feature), into `out` (`l.block` bytes).
pub(crate) fn block_of(l: Layout, panels: &[u8], nb: usize, j: usize, b: usize, out: &mut [u8]) {
    let (p, c) = (j / PANEL, j % PANEL);
    let src = &panels[(p * nb + b) * l.bytes()..][..l.bytes()];
    for (at, o) in out[..l.block].iter_mut().enumerate() {
        *o = src[l.place(c, at)];
    }
}
