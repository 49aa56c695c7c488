//! Weights quantized into ggml's blocks at load, by ggml's reference
//! rules (`quantize_row_*_ref` in `ggml-quants.c`), bit for bit gguf-py's
//! `quants.quantize` on the same floats: a float folder kept in 4 bits
//! without llama.cpp's tools.

use half::f16;

use crate::elem::PanelElem;

/// Row `x` (a multiple of 32 values, read in its own dtype and widened
/// exactly) as Q4_0 blocks into `out` (18 bytes a block): per block, the
/// value of largest magnitude `max` (the first of equals), `d = max / -8`
/// (stored as f16), `q = min(15, trunc(x · (1 / d) + 8.5))` (0 where `d`
/// is), the first 16 in the low nibbles.
pub(crate) fn quantize_row_q4_0<S: PanelElem>(x: &[S], out: &mut [u8]) {
    let mut block = [0f32; 32];
    for (src, dst) in x.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
        for (b, v) in block.iter_mut().zip(src) {
            *b = v.to_f32();
        }
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in &block {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.;
        let id = if d != 0. { 1. / d } else { 0. };
        dst[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            // `as u8` saturates: a NaN becomes 0, as ggml's cast leaves it
            // undefined.
            let lo = ((block[j] * id + 8.5).trunc() as u8).min(15);
            let hi = ((block[16 + j] * id + 8.5).trunc() as u8).min(15);
            dst[2 + j] = lo | (hi << 4);
        }
    }
}
