//! The block products in plain Rust: the integer form of `format.rs`
//! written out, the definition the vector kernels are tested against.

use super::format::{unpack, BlockFormat, Unpacked};
use super::inputs::InputRow;
use super::repack::{block_of, Layout, PANEL};

/// `Σ_h sc_h Σ u·q` and `Σ_h m_h·sums_h` of one block of `n` elements.
pub(crate) fn block_sums(p: &Unpacked, n: usize, q: &[i8], sums: &[i16]) -> (i32, i32) {
    let mut isum = 0i32;
    for (h, (u, q)) in p.u[..n].chunks_exact(16).zip(q.chunks_exact(16)).enumerate() {
        let s: i32 = u.iter().zip(q).map(|(&u, &q)| i32::from(u) * i32::from(q)).sum();
        isum += i32::from(p.sc[h]) * s;
    }
    let msum = p.m[..n / 16]
        .iter()
        .zip(sums)
        .map(|(&m, &s)| i32::from(m) * i32::from(s))
        .sum();
    (isum, msum)
}

/// Weight row `w` (its blocks' bytes) times input rows `rows`, into
/// `out` (one per row).
pub(crate) fn dot_rows(format: BlockFormat, w: &[u8], rows: &[InputRow], out: &mut [f32]) {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    out.fill(0.);
    let mut p = Unpacked::default();
    for (b, block) in w.chunks_exact(bb).enumerate() {
        unpack(format, block, &mut p);
        for (o, row) in out.iter_mut().zip(rows) {
            let q = &row.q[b * be..][..be];
            let (isum, msum) = block_sums(&p, be, q, &row.sums[b * be / 16..][..be / 16]);
            *o += row.d[b] * (p.d * isum as f32 - p.dmin * msum as f32);
        }
    }
}

/// A panel of 8 features (`repack.rs`, `nb` blocks) times input rows
/// `rows`, into `out` (8 a row): each feature's blocks as ggml stores
/// them, then as [`dot_rows`].
pub(crate) fn dot_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    let Some(l) = Layout::of(format) else {
        unreachable!("{} is kept in rows", format.name())
    };
    let mut w = vec![0u8; nb * l.block];
    let mut col = vec![0f32; rows.len()];
    for c in 0..PANEL {
        for (b, block) in w.chunks_exact_mut(l.block).enumerate() {
            block_of(l, panel, nb, c, b, block);
        }
        dot_rows(format, &w, rows, &mut col);
        for (r, &y) in col.iter().enumerate() {
            out[PANEL * r + c] = y;
        }
    }
}
