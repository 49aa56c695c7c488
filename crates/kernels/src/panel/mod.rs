//! The panel layout both operations share: the attention tiles
//! (`attention/tiles.rs`) pack keys and values into panels of [`NR`], the
//! AVX2 linear layers (`linear/weight.rs`) their weights, and both run
//! the one AVX2 micro-kernel of rows by such panels (`avx2.rs`); the
//! attention's AVX-512 kernels read the same panels. A neutral module:
//! it imports neither operation, and both import it.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

/// Keys (or value columns, or a linear layer's output features) per
/// panel: two `ymm` registers, one `zmm`.
pub(crate) const NR: usize = 16;
/// Rows per call of the AVX2 micro-kernels (`avx2.rs`, and the
/// attention's `P · V` in `attention/avx2.rs`): 12 `ymm` accumulators
/// for a panel of 16.
pub(crate) const MR: usize = 6;
/// Keys per block: packed K and V of a block (2 · 512 keys · 64 dims · 4
/// bytes = 256 KiB at head_dim 64) stay in L2 across a unit's row groups,
/// and a group's score strip (12 rows of 528 floats, 25 KiB, for the
/// AVX-512 kernels) in L1.
pub(crate) const BLOCK_K: usize = 512;
/// Row stride of a group's score strip: one panel past [`BLOCK_K`], so
/// that its rows (read together by the `P · V` kernels) fall in different
/// L1 sets instead of every 4 KiB.
pub(crate) const STRIP_RS: usize = BLOCK_K + NR;
