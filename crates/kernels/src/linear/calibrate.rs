//! Whether AVX512-BF16's `vdpbf16ps` pays for bf16 weights on this
//! processor, measured once. It multiplies two bf16 pairs a lane where an
//! FMA multiplies one f32, so on cores that issue it as fast as an FMA a
//! bf16 layer runs at about twice its f32 rate; on cores that issue it at
//! half that rate or worse, widening the bf16 panels to f32 lanes and
//! multiplying with FMAs is the faster path. No processor family list
//! decides it: a layer of ViT-B/16's width is timed both ways, taking
//! turns.

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
        let (m, k, n) = SHAPE;
        // Any values will do: the time of a product does not depend on
        // them. A fixed pattern keeps the runs alike.
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i % 97) as f32 - 48.) / 64.))
            .collect();
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 89) as f32 - 44.) / 32.).collect();
        let pack = |isa| PackedWeight::new(&w, n, k, None, isa, DType::BF16);
        let (Ok(dot), Ok(widen)) = (pack(Isa::Avx512Bf16), pack(Isa::Avx512)) else {
            return true;
        };
        let time = |layer: &PackedWeight| {
            let start = Instant::now();
            std::hint::black_box(layer.forward(&x, m, (0, n), Epilogue::Identity, None));
            start.elapsed()
        };
        // One call each first: the pool's threads and buffers warm.
        time(&dot);
        time(&widen);
        let (mut a, mut b) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
        for _ in 0..ROUNDS {
            a.push(time(&dot));
            b.push(time(&widen));
        }
        a.sort();
        b.sort();
        a[ROUNDS / 2] <= b[ROUNDS / 2]
    })
}
