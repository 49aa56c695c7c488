//! Weights quantized into ggml's blocks at load, by ggml's reference
//! rules (`quantize_row_*_ref` in `ggml-quants.c`): Q4_0 and Q5_0 bit for
//! bit gguf-py's `quants.quantize` on the same floats, Q4_K bit for bit
//! ggml's own `quantize_row_q4_K_ref` (what `llama-quantize` writes
//! without an importance matrix; gguf-py has no Q4_K quantizer): a float
//! folder kept in 4 bits without llama.cpp's tools. The arithmetic is
//! ggml's, operation for operation in f32 without fused multiply-adds, so
//! that every rounding is the reference's.

use half::f16;

use crate::elem::PanelElem;

/// A block of 32 values widened to f32 (exactly, from bf16 or f16).
fn widened<S: PanelElem>(src: &[S]) -> [f32; 32] {
    std::array::from_fn(|i| src[i].to_f32())
}

/// The value of largest magnitude in `block`, the first of equals (0 for
/// all zeros): the legacy quantizers' `max`.
fn signed_max(block: &[f32; 32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in block {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Row `x` (a multiple of 32 values, read in its own dtype and widened
/// exactly) as Q4_0 blocks into `out` (18 bytes a block): per block, the
/// value of largest magnitude `max` (the first of equals), `d = max / -8`
/// (stored as f16), `q = min(15, trunc(x · (1 / d) + 8.5))` (0 where `d`
/// is), the first 16 in the low nibbles.
pub(crate) fn quantize_row_q4_0<S: PanelElem>(x: &[S], out: &mut [u8]) {
    for (src, dst) in x.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
        let block = widened(src);
        let d = signed_max(&block) / -8.;
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

/// Row `x` (a multiple of 32 values, widened exactly) as Q5_0 blocks into
/// `out` (22 bytes a block: f16 `d`, 32 fifth bits, 16 bytes of low
/// nibbles): per block, `d = max / -16` with `max` the value of largest
/// magnitude (the first of equals), `q = min(31, trunc(x · (1 / d) +
/// 16.5))` (0 where `d` is).
pub(crate) fn quantize_row_q5_0<S: PanelElem>(x: &[S], out: &mut [u8]) {
    for (src, dst) in x.chunks_exact(32).zip(out.chunks_exact_mut(22)) {
        let block = widened(src);
        let d = signed_max(&block) / -16.;
        let id = if d != 0. { 1. / d } else { 0. };
        dst[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        let mut qh = 0u32;
        for j in 0..16 {
            // ggml converts through `int8_t`; `as` saturates where C's
            // conversion would be undefined (a NaN becomes 0).
            let lo = ((block[j] * id + 16.5).trunc() as i8).min(31) as u8;
            let hi = ((block[16 + j] * id + 16.5).trunc() as i8).min(31) as u8;
            dst[6 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
            qh |= u32::from(lo >> 4) << j;
            qh |= u32::from(hi >> 4) << (j + 16);
        }
        dst[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// ggml's `nearest_int`: `v` rounded to the nearest integer, ties to even,
/// through the float trick (exact for `|v|` up to 2²²).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `make_qkx2_quants(32, 15, x, weights, L, &min, Laux, -1, 0.1,
/// 20, false)`: the 4-bit levels of a sub-block of 32 into `levels`, and
/// its scale and (negated) min, the pair of least weighted squared error
/// over 21 trial scales around `15 / (max - min)`, each refined by least
/// squares.
fn make_qkx2_quants(x: &[f32; 32], weights: &[f32; 32], levels: &mut [u8]) -> (f32, f32) {
    const NMAX: f32 = 15.;
    const RMIN: f32 = -1.;
    const RDELTA: f32 = 0.1;
    const NSTEP: i32 = 20;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..32 {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0. {
        min = 0.;
    }
    if max == min {
        levels.fill(0);
        return (0., -min);
    }
    let mut iscale = NMAX / (max - min);
    let mut scale = 1. / iscale;
    let mut best_error = 0f32;
    for i in 0..32 {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, 15);
        levels[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut trial = [0u8; 32];
    for is in 0..=NSTEP {
        iscale = (RMIN + RDELTA * is as f32 + NMAX) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..32 {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, 15);
            trial[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0. {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0. {
                this_min = 0.;
                this_scale = sum_xl / sum_l2;
            }
            let mut error = 0f32;
            for i in 0..32 {
                let diff = this_scale * trial[i] as f32 + this_min - x[i];
                error += weights[i] * (diff * diff);
            }
            if error < best_error {
                levels.copy_from_slice(&trial);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Row `x` (a multiple of 256 values, widened exactly) as Q4_K blocks
/// into `out` (144 bytes a block: f16 `d` and `dmin`, 12 bytes of 6-bit
/// scales and mins, 128 of 4-bit levels), as `quantize_row_q4_K_ref`:
/// each sub-block of 32 fitted by [`make_qkx2_quants`] with weights
/// `rms + |x|`, its scale and min coded in 6 bits against the block's
/// largest, then every level recomputed against the coded pair.
pub(crate) fn quantize_row_q4_k<S: PanelElem>(x: &[S], out: &mut [u8]) {
    let mut block = [0f32; 256];
    for (src, dst) in x.chunks_exact(256).zip(out.chunks_exact_mut(144)) {
        for (b, v) in block.iter_mut().zip(src) {
            *b = v.to_f32();
        }
        let mut levels = [0u8; 256];
        let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..8 {
            let xs: &[f32; 32] = block[32 * j..32 * j + 32].try_into().expect("32 values");
            let mut sum_x2 = 0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.).sqrt();
            let weights: [f32; 32] = std::array::from_fn(|l| av_x + xs[l].abs());
            (scales[j], mins[j]) = make_qkx2_quants(xs, &weights, &mut levels[32 * j..32 * j + 32]);
            max_scale = if scales[j] > max_scale {
                scales[j]
            } else {
                max_scale
            };
            max_min = if mins[j] > max_min { mins[j] } else { max_min };
        }
        let inv_scale = if max_scale > 0. { 63. / max_scale } else { 0. };
        let inv_min = if max_min > 0. { 63. / max_min } else { 0. };
        let mut packed = [0u8; 12];
        for j in 0..8 {
            // ggml stores `nearest_int` in a `uint8_t` (wrapping) before
            // capping at 63.
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                packed[j] = ls;
                packed[j + 4] = lm;
            } else {
                packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
                packed[j - 4] |= (ls >> 4) << 6;
                packed[j] |= (lm >> 4) << 6;
            }
        }
        let (d, dmin) = (f16::from_f32(max_scale / 63.), f16::from_f32(max_min / 63.));
        dst[..2].copy_from_slice(&d.to_le_bytes());
        dst[2..4].copy_from_slice(&dmin.to_le_bytes());
        dst[4..16].copy_from_slice(&packed);
        for j in 0..8 {
            let (sc, m) = super::format::scale_min_k4(j, &packed);
            let d = d.to_f32() * f32::from(sc);
            if d == 0. {
                continue;
            }
            let dm = dmin.to_f32() * f32::from(m);
            for i in 0..32 {
                levels[32 * j + i] = nearest_int((block[32 * j + i] + dm) / d).clamp(0, 15) as u8;
            }
        }
        // Each 32 bytes: a chunk of 64 levels, the first 32 in the low
        // nibbles.
        for (chunk, q) in levels.chunks_exact(64).zip(dst[16..].chunks_exact_mut(32)) {
            for i in 0..32 {
                q[i] = chunk[i] | (chunk[32 + i] << 4);
            }
        }
    }
}
