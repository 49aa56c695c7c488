//! How half-precision weights run fastest on this processor, measured
//! once. Whether AVX512-BF16's `vdpbf16ps` pays for bf16 weights: it
//! multiplies two bf16 pairs a lane where an FMA multiplies one f32, so on
//! cores that issue it as fast as an FMA a bf16 layer runs at about twice
//! its f32 rate; on cores that issue it at half that rate or worse,
//! widening the bf16 panels to f32 lanes and multiplying with FMAs is the
//! faster path. And, where they are widened, whether once a work unit
//! into f32 panels (the f32 layer's speed, less one pass) or by each tile
//! as it loads them (half the bytes in the caches, a conversion per row
//! group). No processor family list decides either: a layer of
//! ViT-B/16's width is timed both ways, taking turns.

use std::sync::OnceLock;
use std::time::Instant;

use candle::DType;
use half::bf16;

use super::weight::{Epilogue, PackedWeight};
use crate::runtime::isa::Isa;

/// Rounds of each path, taking turns; the medians decide.
const ROUNDS: usize = 7;

/// `(rows, inputs, outputs)` of the timed product: ViT-B/16's qkv over
/// a quarter of an image's tokens, about 1 ms a round on two cores.
const SHAPE: (usize, usize, usize) = (48, 768, 2304);

/// Whether bf16 weights on a processor with AVX512-BF16 take
/// `vdpbf16ps` ([`Isa::Avx512Bf16`]) rather than being widened to f32
/// lanes for FMAs ([`Isa::Avx512`]): the first is kept unless it measures
/// slower. Measured at the first call, a few milliseconds.
pub(crate) fn bf16_dot_pays() -> bool {
    static PAYS: OnceLock<bool> = OnceLock::new();
    *PAYS.get_or_init(|| {
        let (_, k, n) = SHAPE;
        let w = weights();
        let pack = |isa| PackedWeight::new(&w, n, k, None, isa, DType::BF16);
        let (Ok(dot), Ok(widen)) = (pack(Isa::Avx512Bf16), pack(Isa::Avx512)) else {
            return true;
        };
        first_no_slower(&dot, &widen)
    })
}

/// Whether half-precision panels on `isa` (AVX-512 or AVX2, which widen
/// them) are widened once a work unit rather than by the tiles as they
/// load them: the second is kept unless it measures slower. Measured at
/// the first call of several rows for each, a few milliseconds.
pub(crate) fn widening_once_pays(isa: Isa) -> bool {
    static PAYS: [OnceLock<bool>; 2] = [OnceLock::new(), OnceLock::new()];
    let (slot, isa) = match isa {
        Isa::Avx2 => (0, Isa::Avx2),
        _ => (1, Isa::Avx512),
    };
    *PAYS[slot].get_or_init(|| {
        let (_, k, n) = SHAPE;
        let w = weights();
        let pack = |once| PackedWeight::new(&w, n, k, None, isa, DType::BF16).map(|l| l.widening_once(once));
        let (Ok(as_loaded), Ok(once)) = (pack(false), pack(true)) else {
            return false;
        };
        !first_no_slower(&as_loaded, &once)
    })
}

/// The weights of the timed product. Any values will do: the time of a
/// product does not depend on them. A fixed pattern keeps the runs alike.
fn weights() -> Vec<bf16> {
    let (_, k, n) = SHAPE;
    (0..n * k)
        .map(|i| bf16::from_f32(((i % 97) as f32 - 48.) / 64.))
        .collect()
}

/// The inputs of the timed product, as [`weights`].
fn inputs() -> Vec<f32> {
    let (m, k, _) = SHAPE;
    (0..m * k).map(|i| ((i % 89) as f32 - 44.) / 32.).collect()
}

/// Whether `a`'s median time over [`ROUNDS`] products of [`SHAPE`],
/// taking turns with `b`, is no more than `b`'s.
fn first_no_slower(a: &PackedWeight, b: &PackedWeight) -> bool {
    let (m, _, n) = SHAPE;
    let x = inputs();
    let time = |layer: &PackedWeight| {
        let start = Instant::now();
        std::hint::black_box(layer.forward(&x, m, (0, n), Epilogue::Identity, None));
        start.elapsed()
    };
    // One call each first: the pool's threads and buffers warm.
    time(a);
    time(b);
    let (mut ta, mut tb) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        ta.push(time(a));
        tb.push(time(b));
    }
    ta.sort();
    tb.sort();
    ta[ROUNDS / 2] <= tb[ROUNDS / 2]
}
