//! The panel layout the drivers share with the micro-kernels: the
//! attention's tile driver (`tile.rs`) packs keys and values into it, and
//! the AVX2 linear layers' weights (`packed.rs`) are packed alike; the
//! micro-kernels (`avx2.rs`, `avx512.rs`) read it.

/// Keys (or value columns) per panel: two `ymm` registers, one `zmm`.
pub(crate) const NR: usize = 16;
/// Keys per block: packed K and V of a block (2 · 512 keys · 64 dims · 4
/// bytes = 256 KiB at head_dim 64) stay in L2 across a unit's row groups,
/// and a group's score strip (12 rows of 528 floats, 25 KiB, for the
/// AVX-512 kernels) in L1.
pub(crate) const BLOCK_K: usize = 512;
/// Row stride of a group's score strip: one panel past [`BLOCK_K`], so
/// that its rows (read together by the `P · V` kernels) fall in different
/// L1 sets instead of every 4 KiB.
pub(crate) const STRIP_RS: usize = BLOCK_K + NR;
