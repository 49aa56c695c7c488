//! NaN and infinity counted in a tensor's stored bytes, read in place:
//! the value scan of the pre-flight, for safetensors files
//! ([`super::Checkpoint::non_finite`]) and GGUF files
//! ([`super::GgufFile::non_finite`]).

use rayon::prelude::*;
use safetensors::Dtype;

use super::gguf::Q8_0_BLOCK_BYTES;

/// Bytes a task of the scan takes: a large model's scan is a pass over
/// its whole file, spread over the threads.
const SCAN_TASK: usize = 1 << 20;

/// `(NaN, ±Inf)` counts of `data`, a tensor's bytes in `dtype`, over
/// rayon's pool.
pub(crate) fn par_count_non_finite(dtype: Dtype, data: &[u8]) -> (usize, usize) {
    data.par_chunks(SCAN_TASK)
        .map(|c| count_non_finite(dtype, c))
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// `(NaN, ±Inf)` counts of the values Q8_0 blocks `data` dequantize to
/// (`d · q`, as `dequantize_q8_0` computes them), over rayon's pool. Only
/// the f16 scales can be non-finite: a NaN scale makes its block's 32
/// values NaN; an infinite one makes its non-zero values ±Inf and its
/// zeros NaN (`∞ · 0`). A trailing partial block is not counted (the
/// reader has checked that there is none).
pub(crate) fn par_count_non_finite_q8_0(data: &[u8]) -> (usize, usize) {
    data.par_chunks(Q8_0_BLOCK_BYTES * (SCAN_TASK / Q8_0_BLOCK_BYTES))
        .map(count_non_finite_q8_0)
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

fn count_non_finite_q8_0(data: &[u8]) -> (usize, usize) {
    let (mut nan, mut inf) = (0, 0);
    for block in data.chunks_exact(Q8_0_BLOCK_BYTES) {
        let d = u16::from_le_bytes([block[0], block[1]]);
        if d & 0x7c00 != 0x7c00 {
            continue;
        }
        if d & 0x03ff != 0 {
            nan += block.len() - 2;
        } else {
            let zeros = block[2..].iter().filter(|&&q| q == 0).count();
            nan += zeros;
            inf += block.len() - 2 - zeros;
        }
    }
    (nan, inf)
}

/// `(NaN, ±Inf)` counts of little-endian float `data`; `(0, 0)` for
/// dtypes that are not F64, F32, F16 or BF16.
fn count_non_finite(dtype: Dtype, data: &[u8]) -> (usize, usize) {
    // A float is non-finite when its exponent bits are all ones; NaN when
    // its mantissa is then non-zero. The first count is branch-free, so it
    // vectorises: a model's pre-flight scans its whole file.
    macro_rules! count {
        ($t:ty, $exp:expr, $man:expr) => {{
            const N: usize = size_of::<$t>();
            // Counted in u16 lanes, blocks short enough not to wrap.
            let bad_in = |words: &[$t]| -> usize {
                words
                    .chunks(u16::MAX as usize)
                    .map(|b| usize::from(b.iter().fold(0u16, |n, &w| n + u16::from(w & $exp == $exp))))
                    .sum()
            };
            // SAFETY: every bit pattern is a valid integer.
            let bad = match unsafe { data.align_to::<$t>() } {
                (&[], words, rest) if cfg!(target_endian = "little") && rest.len() < N => bad_in(words),
                _ => data
                    .chunks_exact(N)
                    .map(|c| usize::from(<$t>::from_le_bytes(c.try_into().expect("N bytes")) & $exp == $exp))
                    .sum(),
            };
            if bad == 0 {
                return (0, 0);
            }
            let nan = data
                .chunks_exact(N)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("N bytes")))
                .filter(|&w| w & $exp == $exp && w & $man != 0)
                .count();
            (nan, bad - nan)
        }};
    }
    match dtype {
        Dtype::F64 => count!(u64, 0x7ff0_0000_0000_0000, 0x000f_ffff_ffff_ffff),
        Dtype::F32 => count!(u32, 0x7f80_0000, 0x007f_ffff),
        Dtype::F16 => count!(u16, 0x7c00, 0x03ff),
        Dtype::BF16 => count!(u16, 0x7f80, 0x007f),
        _ => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_non_finite_in_every_float_dtype() {
        let f32s: Vec<u8> = [1f32, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F32, &f32s), (1, 2));
        let f64s: Vec<u8> = [f64::NAN, 2.].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(count_non_finite(Dtype::F64, &f64s), (1, 0));
        // f16: 0x7c00 = +Inf, 0x7e00 = NaN, 0x3c00 = 1.0.
        let f16s: Vec<u8> = [0x7c00u16, 0x7e00, 0x3c00]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F16, &f16s), (1, 1));
        // bf16: 0xff80 = -Inf, 0x7fc0 = NaN, 0x3f80 = 1.0.
        let bf16s: Vec<u8> = [0xff80u16, 0x7fc0, 0x3f80]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::BF16, &bf16s), (1, 1));
        assert_eq!(count_non_finite(Dtype::I32, &f32s), (0, 0));
    }

    /// Q8_0's counts are those of the values its blocks dequantize to:
    /// a finite scale none, a NaN scale 32 NaN, an infinite scale ±Inf
    /// where `q` is not 0 and NaN where it is; counted alike when the
    /// blocks are cut into several tasks.
    #[test]
    fn counts_q8_0_as_the_values_it_dequantizes_to() {
        let block = |d: u16, zeros: usize| -> Vec<u8> {
            let mut b = d.to_le_bytes().to_vec();
            b.extend((0..32).map(|i| if i < zeros { 0 } else { (i as u8) | 1 }));
            b
        };
        // f16: 0x3c00 = 1.0, 0x7e00 = NaN, 0xfc00 = -Inf.
        let data: Vec<u8> = [block(0x3c00, 3), block(0x7e00, 5), block(0xfc00, 7)].concat();
        assert_eq!(count_non_finite_q8_0(&data), (32 + 7, 32 - 7));
        let many: Vec<u8> = (0..SCAN_TASK / Q8_0_BLOCK_BYTES * 3)
            .flat_map(|i| block(if i % 1000 == 0 { 0x7c00 } else { 0x3c00 }, 2))
            .collect();
        let blocks = many.len() / Q8_0_BLOCK_BYTES;
        let infinite = blocks.div_ceil(1000);
        assert_eq!(par_count_non_finite_q8_0(&many), (2 * infinite, 30 * infinite));
    }
}
