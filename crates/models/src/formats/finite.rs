//! NaN and infinity counted in a tensor's stored bytes, read in place:
//! the value scan of the pre-flight, for safetensors files
//! ([`super::safetensors::Checkpoint::non_finite`]) and GGUF files
//! ([`super::gguf::GgufFile::non_finite`]); and the finite values too large for
//! a narrower dtype, which would become infinity when a load converts
//! them ([`super::safetensors::Checkpoint::too_large`],
//! [`super::gguf::GgufFile::too_large`]).

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

/// `(count, largest magnitude)` of the finite values of `data`, a
/// tensor's little-endian bytes in `dtype`, whose magnitude is `limit` or
/// more, over rayon's pool; `(0, 0.)` for dtypes that are not F64, F32,
/// F16 or BF16.
pub(crate) fn par_count_at_least(dtype: Dtype, data: &[u8], limit: f64) -> (usize, f64) {
    data.par_chunks(SCAN_TASK)
        .map(|c| count_at_least(dtype, c, limit))
        .reduce(|| (0, 0.), |a, b| (a.0 + b.0, a.1.max(b.1)))
}

/// [`par_count_at_least`] for the values Q8_0 blocks `data` dequantize
/// to (`d · q` in f32, as `dequantize_q8_0` computes them): an f16 scale
/// times 127 reaches past f16's range.
pub(crate) fn par_count_at_least_q8_0(data: &[u8], limit: f64) -> (usize, f64) {
    data.par_chunks(Q8_0_BLOCK_BYTES * (SCAN_TASK / Q8_0_BLOCK_BYTES))
        .map(|c| {
            c.chunks_exact(Q8_0_BLOCK_BYTES)
                .flat_map(|block| {
                    let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                    block[2..]
                        .iter()
                        .map(move |&q| f64::from((d * f32::from(q as i8)).abs()))
                })
                .filter(|&x| x.is_finite() && x >= limit)
                .fold((0, 0.), |(n, max), x| (n + 1, x.max(max)))
        })
        .reduce(|| (0, 0.), |a, b| (a.0 + b.0, a.1.max(b.1)))
}

fn count_at_least(dtype: Dtype, data: &[u8], limit: f64) -> (usize, f64) {
    // Widened to f64, which holds every value of these dtypes exactly.
    fn scan<const N: usize>(
        data: &[u8],
        limit: f64,
        reach: impl Fn(f64) -> f64,
        value: impl Fn([u8; N]) -> f64,
    ) -> (usize, f64) {
        data.as_chunks::<N>()
            .0
            .iter()
            .map(|&b| value(b).abs())
            .filter(|&x| x.is_finite() && reach(x) >= limit)
            .fold((0, 0.), |(n, max), x| (n + 1, x.max(max)))
    }
    match dtype {
        // candle narrows f64 to f16 through f32 on x86 (half's F16C path),
        // and to f32 by rounding: a value is too large when it or its f32
        // rounding reaches the limit.
        Dtype::F64 => scan(data, limit, |x| x.max(f64::from(x as f32)), f64::from_le_bytes),
        Dtype::F32 => scan(data, limit, |x| x, |b| f64::from(f32::from_le_bytes(b))),
        Dtype::F16 => scan(data, limit, |x| x, |b| f64::from(half::f16::from_le_bytes(b))),
        Dtype::BF16 => scan(data, limit, |x| x, |b| f64::from(half::bf16::from_le_bytes(b))),
        _ => (0, 0.),
    }
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

    /// Only finite values at or past the limit count, in every float dtype,
    /// and the largest is theirs; over several tasks as in one.
    #[test]
    fn counts_values_at_least_the_limit() {
        let f32s: Vec<u8> = [1f32, 65520., -1e5, f32::INFINITY, f32::NAN, 65519.99]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_at_least(Dtype::F32, &f32s, 65520.), (2, 1e5));
        let f64s: Vec<u8> = [1e300f64, 2.].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(count_at_least(Dtype::F64, &f64s, 1e39), (1, 1e300));
        // Just under the limit, but its f32 rounding is not.
        let under = f64::from_bits(65520f64.to_bits() - 1);
        assert_eq!(
            count_at_least(Dtype::F64, &under.to_le_bytes(), 65520.),
            (1, under)
        );
        // bf16: 0x4780 = 65536, 0xc7c3 = -99840, 0x7f80 = +Inf, 0x477f = 65280.
        let bf16s: Vec<u8> = [0x4780u16, 0xc7c3, 0x7f80, 0x477f]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_at_least(Dtype::BF16, &bf16s, 65520.), (2, 99840.));
        // f16: 0x7bff = 65504, its largest finite value.
        assert_eq!(
            count_at_least(Dtype::F16, &0x7bffu16.to_le_bytes(), 65520.),
            (0, 0.)
        );
        assert_eq!(count_at_least(Dtype::I32, &f32s, 0.), (0, 0.));
        // Q8_0: scale 1024 (0x6400) times q; 1024 · 127 and 1024 · -64 reach
        // 65520, 1024 · 63 does not.
        let mut block = vec![0u8; Q8_0_BLOCK_BYTES];
        block[..2].copy_from_slice(&0x6400u16.to_le_bytes());
        block[2] = 127;
        block[3] = (-64i8) as u8;
        block[4] = 63;
        assert_eq!(par_count_at_least_q8_0(&block, 65520.), (2, 1024. * 127.));
        let many: Vec<u8> = (0..SCAN_TASK)
            .flat_map(|i| if i % 100_000 == 0 { 7e4f32 + i as f32 } else { 1. }.to_le_bytes())
            .collect();
        let at = (SCAN_TASK - 1) / 100_000 * 100_000;
        assert_eq!(
            par_count_at_least(Dtype::F32, &many, 65520.),
            (SCAN_TASK.div_ceil(100_000), 7e4 + at as f64)
        );
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
