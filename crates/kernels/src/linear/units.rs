//! How a packed layer's call is cut into work units: blocks of panels by
//! blocks of row groups, and the reduction into slices whose panels stay
//! in L2 (see `tiles.rs`'s module doc).

use crate::runtime::isa::Isa;

/// Inputs per slice of the reduction, at most, for `isa` and panels of
/// `elem_bytes` an element: a row group's slice of inputs stays in L1
/// while the unit's panel slices (`slice · UNIT_FEATURES` elements)
/// stream past it from L2. The panel slices fill half of the core's L2,
/// from 384 inputs up to 4 KiB of a feature's elements (1024 f32, 2048
/// bf16 or f16); 384 where the processor does not report its L2.
///
/// Slices past L2 stream the panels from L3 or memory once per row group;
/// much shorter ones add a pass over the outputs per slice. With L2s of
/// 2 MiB (Sapphire Rapids) that is 1024 f32 inputs, 1 MiB (Zen 4) 512,
/// and 384 for the AVX2-only parts' 256-512 KiB; twice as many in half
/// precision.
pub(super) fn slice_len(isa: Isa, elem_bytes: usize) -> usize {
    const DEFAULT: usize = 384;
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2 => crate::runtime::isa::l2_bytes().map_or(DEFAULT, |l2| {
            (l2 / 2 / (UNIT_FEATURES * elem_bytes)).clamp(DEFAULT, 4096 / elem_bytes)
        }),
        _ => DEFAULT,
    }
}

/// Output features per work unit, at most.
const UNIT_FEATURES: usize = 256;

/// Row groups per work unit, at most, where the threads share a call whose
/// reduction is one slice: a unit's panels stay in L2 from one unit of
/// rows to the next, and the thread that finishes its share first takes
/// the later units of the other's (`runtime::pool::par_for`). On a shared
/// host one core can run a third slower than the other for seconds at a
/// time, and a call split into equal halves waits for the slow one.
const CHUNK_GROUPS: usize = 8;

/// Work units per thread, at least, where the reduction is in slices:
/// rows are not split there (a later slice adds to the rows' outputs, and
/// a unit's panels for all its slices would not stay in L2 between units
/// of rows), so panel blocks are halved down to one tile instead. Each
/// unit then reads all the rows' inputs, so fewer, wider units read them
/// fewer times; 4 a thread still lets a thread that finishes first take
/// over part of the other's share.
const SLICED_UNITS_PER_THREAD: usize = 4;

/// `(panels, row groups)` per work unit for `panels` panels of `nr`
/// features, `groups` row groups and `threads` threads, a tile covering
/// `tp` panels, the reduction `sliced` or not: panel blocks are halved
/// (down to one tile) and then the row groups split until the units share
/// out evenly over the threads, or there are 8 a thread; with more than
/// one thread, panel blocks are halved further until there are
/// [`SLICED_UNITS_PER_THREAD`] a thread where the reduction is sliced, and
/// units take at most [`CHUNK_GROUPS`] row groups where it is not.
pub(super) fn unit_shape(
    panels: usize,
    groups: usize,
    nr: usize,
    tp: usize,
    threads: usize,
    sliced: bool,
) -> (usize, usize) {
    let mut ppu = (UNIT_FEATURES / nr).max(tp);
    let uneven = |blocks: usize| !blocks.is_multiple_of(threads) && blocks < 8 * threads;
    let few = |blocks: usize| threads > 1 && sliced && blocks < SLICED_UNITS_PER_THREAD * threads;
    while ppu > tp && (uneven(panels.div_ceil(ppu)) || few(panels.div_ceil(ppu))) {
        ppu = (ppu / 2).div_ceil(tp) * tp;
    }
    let blocks = panels.div_ceil(ppu);
    // Groups per unit for `chunks` chunks, and the units they make.
    let gpu = |chunks: usize| groups.div_ceil(chunks);
    let units = |chunks: usize| blocks * groups.div_ceil(gpu(chunks));
    let mut chunks = 1;
    while chunks < groups && uneven(units(chunks)) {
        chunks += 1;
    }
    if threads > 1 && !sliced && gpu(chunks) > CHUNK_GROUPS {
        // Units of rows as even as they go: 33 groups make 7, 7, 7, 7, 5.
        return (ppu, gpu(groups.div_ceil(CHUNK_GROUPS)));
    }
    (ppu, gpu(chunks))
}

#[cfg(test)]
mod tests {
    use super::{unit_shape, CHUNK_GROUPS, SLICED_UNITS_PER_THREAD, UNIT_FEATURES};

    /// Units are whole tiles of at most `UNIT_FEATURES` features. With
    /// more than one thread: where the reduction is one slice, at most
    /// `CHUNK_GROUPS` row groups; where it is sliced, at least
    /// `SLICED_UNITS_PER_THREAD` panel blocks a thread (or one tile's
    /// panels), and units that share out evenly over the threads (or
    /// number 8 a thread, or can be split no further), as every call's do
    /// with one thread.
    #[test]
    fn units_share_out_evenly() {
        for (nr, tp) in [(16, 1), (32, 1), (32, 2)] {
            for threads in 1..=5 {
                for panels in 1..80 {
                    for groups in 1..40 {
                        for sliced in [false, true] {
                            let (ppu, gpu) = unit_shape(panels, groups, nr, tp, threads, sliced);
                            let what = format!(
                                "nr {nr} tp {tp}, {threads} threads, {panels} panels, {groups} groups, \
                                 sliced {sliced}: {ppu} panels by {gpu} groups a unit"
                            );
                            assert!(
                                ppu >= tp && ppu.is_multiple_of(tp) && ppu * nr <= UNIT_FEATURES,
                                "{what}"
                            );
                            assert!((1..=groups).contains(&gpu), "{what}");
                            if threads > 1 && !sliced {
                                assert!(gpu <= CHUNK_GROUPS, "{what}");
                                // As even as they go: the last unit of
                                // rows is not much shorter than the others.
                                let n = groups.div_ceil(gpu);
                                assert!(gpu * n - groups < n, "{what}");
                                continue;
                            }
                            let blocks = panels.div_ceil(ppu);
                            if threads > 1 {
                                assert!(blocks >= SLICED_UNITS_PER_THREAD * threads || ppu == tp, "{what}");
                            }
                            let units = blocks * groups.div_ceil(gpu);
                            let finest = ppu == tp && gpu == 1;
                            assert!(
                                units.is_multiple_of(threads) || units >= 8 * threads || finest,
                                "{what}"
                            );
                        }
                    }
                }
            }
        }
    }
}
