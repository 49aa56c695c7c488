//! The panels (`repack.rs`) with AVX512-VNNI on 256-bit vectors
//! (AVX512-VL): `vpdpbusd` multiplies a step's `u8` values by 4 inputs
//! and adds them to the feature's `i32` lane in one instruction (AVX2's
//! `vpmaddubsw`, `vpmaddwd` and add), and AVX-512's 32 registers hold 8
//! input rows' sums at once. The kernels' bodies are
//! AVX2's (`avx2.rs`, `avx2_k.rs`), instantiated with this step; here
//! the dispatch by format and rows.

use super::avx2::{panel_32_vnni as panel_32, Q4_0, Q4_1, Q5_0, Q5_1};
use super::format::BlockFormat;
use super::inputs::{row_groups, InputRow};

/// A panel of 8 features (`nb` blocks) times input rows `rows`, into
/// `out` (8 a row): 8 rows at a time (then 4, 2, 1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn dot_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    if format.block_elems() == 256 {
        return k_panel(format, panel, nb, rows, out);
    }
    for (at, n) in row_groups(rows.len(), 8) {
        let (rows, out) = (&rows[at..at + n], &mut out[8 * at..8 * (at + n)]);
        macro_rules! by_rows {
            ($f:expr) => {
                match n {
                    8 => panel_32::<$f, 8>(panel, nb, rows, out),
                    4 => panel_32::<$f, 4>(panel, nb, rows, out),
                    2 => panel_32::<$f, 2>(panel, nb, rows, out),
                    _ => panel_32::<$f, 1>(panel, nb, rows, out),
                }
            };
        }
        match format {
            BlockFormat::Q4_0 => by_rows!(Q4_0),
            BlockFormat::Q4_1 => by_rows!(Q4_1),
            BlockFormat::Q5_0 => by_rows!(Q5_0),
            _ => by_rows!(Q5_1),
        }
    }
}

/// A k-quant's panel times input rows, 8 at a time (then 4, 2, 1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn k_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    use super::avx2_k::{panel_k4_vnni, panel_q6k_vnni};
    use super::avx2_k23::panel_k23_vnni;
    for (at, n) in row_groups(rows.len(), 8) {
        let (rows, out) = (&rows[at..at + n], &mut out[8 * at..8 * (at + n)]);
        match (format, n) {
            (BlockFormat::Q4_K, 8) => panel_k4_vnni::<false, 8>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 8) => panel_k4_vnni::<true, 8>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 8) => panel_q6k_vnni::<8>(panel, nb, rows, out),
            (BlockFormat::Q2_K, 8) => panel_k23_vnni::<false, 8>(panel, nb, rows, out),
            (BlockFormat::Q2_K, 4) => panel_k23_vnni::<false, 4>(panel, nb, rows, out),
            (BlockFormat::Q2_K, 2) => panel_k23_vnni::<false, 2>(panel, nb, rows, out),
            (BlockFormat::Q2_K, _) => panel_k23_vnni::<false, 1>(panel, nb, rows, out),
            (BlockFormat::Q3_K, 8) => panel_k23_vnni::<true, 8>(panel, nb, rows, out),
            (BlockFormat::Q3_K, 4) => panel_k23_vnni::<true, 4>(panel, nb, rows, out),
            (BlockFormat::Q3_K, 2) => panel_k23_vnni::<true, 2>(panel, nb, rows, out),
            (BlockFormat::Q3_K, _) => panel_k23_vnni::<true, 1>(panel, nb, rows, out),
            (BlockFormat::Q4_K, 4) => panel_k4_vnni::<false, 4>(panel, nb, rows, out),
            (BlockFormat::Q4_K, 2) => panel_k4_vnni::<false, 2>(panel, nb, rows, out),
            (BlockFormat::Q4_K, _) => panel_k4_vnni::<false, 1>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 4) => panel_k4_vnni::<true, 4>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 2) => panel_k4_vnni::<true, 2>(panel, nb, rows, out),
            (BlockFormat::Q5_K, _) => panel_k4_vnni::<true, 1>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 4) => panel_q6k_vnni::<4>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 2) => panel_q6k_vnni::<2>(panel, nb, rows, out),
            (_, _) => panel_q6k_vnni::<1>(panel, nb, rows, out),
        }
    }
}
