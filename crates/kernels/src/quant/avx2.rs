//! The block products with AVX2: each block unpacked once (`u` bytes, the
//! per-16 scales and mins; Q4_0, Q4_1 and the 4-, 5- and 6-bit k-quants
//! with vector code, the others as `format.rs` unpacks them), then
//! multiplied into every input row of the call with `vpmaddubsw`
//! (`u8 · i8` pairs, below `2·63·127` so never saturating) and
//! `vpmaddwd` by the scales, the sums kept in `i32` lanes to the block's
//! end and in f32 lanes to the row's, as ggml's AVX2 `vec_dot`s do.

use std::arch::x86_64::*;
use std::ops::Range;

use super::format::{unpack, BlockFormat, Unpacked};
use super::inputs::QuantizedInputs;

/// Input rows a weight row's blocks are unpacked for at a time.
const ROWS: usize = 8;

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight lanes' sum.
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Q4_K's and Q5_K's 8 scales and 8 mins from their 12 bytes (ggml's
/// `utmp` shuffle), each written twice (per 16 elements).
fn k4_scales(s: &[u8], p: &mut Unpacked) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a, b, c) = (w(0), w(1), w(2));
    let sc = [a & KMASK1, (c & KMASK2) | (((a >> 6) & KMASK3) << 4)];
    let mn = [b & KMASK1, ((c >> 4) & KMASK2) | (((b >> 6) & KMASK3) << 4)];
    for i in 0..8 {
        let (scale, min) = (
            (sc[i / 4] >> (8 * (i % 4))) as u8,
            (mn[i / 4] >> (8 * (i % 4))) as u8,
        );
        p.sc[2 * i] = i16::from(scale);
        p.sc[2 * i + 1] = i16::from(scale);
        p.m[2 * i] = i16::from(min);
        p.m[2 * i + 1] = i16::from(min);
    }
}

/// A block unpacked, with vector code where the format has it.
#[target_feature(enable = "avx2,fma")]
fn unpack_block(format: BlockFormat, b: &[u8], p: &mut Unpacked) {
    let low = _mm256_set1_epi8(0x0F);
    let store = |u: &mut [u8; 256], at: usize, v: __m256i| {
        // SAFETY: `at + 32 <= 256` at every call below.
        unsafe { _mm256_storeu_si256(u.as_mut_ptr().add(at).cast(), v) }
    };
    let load = |at: usize| {
        assert!(at + 32 <= b.len());
        // SAFETY: checked just above.
        unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
    };
    match format {
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            p.d = f16_at(b, 0);
            p.dmin = f16_at(b, 2);
            k4_scales(&b[4..16], p);
            let (qh, qs) = match format {
                BlockFormat::Q5_K => (Some(load(16)), 48),
                _ => (None, 16),
            };
            for g in 0..4 {
                let v = load(qs + 32 * g);
                let mut lo = _mm256_and_si256(v, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if let Some(h) = qh {
                    let fifth = |bit: i32| {
                        let mask = _mm256_set1_epi8(1 << bit);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, mask), mask);
                        _mm256_and_si256(set, _mm256_set1_epi8(16))
                    };
                    lo = _mm256_or_si256(lo, fifth(2 * g as i32));
                    hi = _mm256_or_si256(hi, fifth(2 * g as i32 + 1));
                }
                store(&mut p.u, 64 * g, lo);
                store(&mut p.u, 64 * g + 32, hi);
            }
        }
        BlockFormat::Q6_K => {
            p.d = f16_at(b, 208);
            p.dmin = p.d;
            let two = _mm256_set1_epi8(0x30);
            for n in 0..2 {
                let (ql0, ql1, h) = (load(64 * n), load(64 * n + 32), load(128 + 32 * n));
                let quarters = [
                    (_mm256_and_si256(ql0, low), _mm256_slli_epi16(h, 4)),
                    (_mm256_and_si256(ql1, low), _mm256_slli_epi16(h, 2)),
                    (_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), h),
                    (
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                        _mm256_srli_epi16(h, 2),
                    ),
                ];
                for (j, (l, hb)) in quarters.into_iter().enumerate() {
                    store(
                        &mut p.u,
                        128 * n + 32 * j,
                        _mm256_or_si256(l, _mm256_and_si256(hb, two)),
                    );
                }
            }
            for h in 0..16 {
                p.sc[h] = i16::from(b[192 + h] as i8);
                p.m[h] = 32 * p.sc[h];
            }
        }
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let (at, min) = match format {
                BlockFormat::Q4_0 => (2, None),
                _ => (4, Some(f16_at(b, 2))),
            };
            p.d = f16_at(b, 0);
            p.dmin = min.map_or(8. * p.d, |m| -m);
            assert!(at + 16 <= b.len());
            // SAFETY: checked just above; `u` holds 256.
            unsafe {
                let v = _mm_loadu_si128(b.as_ptr().add(at).cast());
                let low = _mm_set1_epi8(0x0F);
                _mm_storeu_si128(p.u.as_mut_ptr().cast(), _mm_and_si128(v, low));
                _mm_storeu_si128(
                    p.u.as_mut_ptr().add(16).cast(),
                    _mm_and_si128(_mm_srli_epi16(v, 4), low),
                );
            }
            p.sc[..2].fill(1);
            p.m[..2].fill(1);
        }
        _ => unpack(format, b, p),
    }
}

/// Weight row `w` times input rows `rows` of `x`, into `out`: the AVX2
/// form of `portable::dot_rows` (Q8_0 goes there: its `u` can be 255).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot_rows(
    format: BlockFormat,
    w: &[u8],
    x: &QuantizedInputs,
    rows: Range<usize>,
    out: &mut [f32],
) {
    if format == BlockFormat::Q8_0 {
        return super::portable::dot_rows(format, w, x, rows, out);
    }
    let (be, bb) = (format.block_elems(), format.block_bytes());
    let mut p = Unpacked::default();
    let end = rows.end;
    for (rows, out) in rows
        .step_by(ROWS)
        .map(|r| r..(r + ROWS).min(end))
        .zip(out.chunks_mut(ROWS))
    {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let mut off = [0f32; ROWS];
        for (b, block) in w.chunks_exact(bb).enumerate() {
            unpack_block(format, block, &mut p);
            if be == 256 {
                // Per 32 elements, the two groups' scales in the halves.
                let sc: [__m256i; 8] = std::array::from_fn(|c| {
                    _mm256_set_m128i(_mm_set1_epi16(p.sc[2 * c + 1]), _mm_set1_epi16(p.sc[2 * c]))
                });
                // SAFETY: `m` holds 16 `i16`.
                let m = unsafe { _mm256_loadu_si256(p.m.as_ptr().cast()) };
                for (acc, r) in acc.iter_mut().zip(rows.clone()) {
                    let (q, d, sums) = x.row(r);
                    let (q, sums) = (&q[b * 256..][..256], &sums[b * 16..][..16]);
                    let mut isum = _mm256_setzero_si256();
                    for (c, sc) in sc.iter().enumerate() {
                        // SAFETY: `u` and `q` hold 256 from `32·c < 256`.
                        let (u, q) = unsafe {
                            (
                                _mm256_loadu_si256(p.u.as_ptr().add(32 * c).cast()),
                                _mm256_loadu_si256(q.as_ptr().add(32 * c).cast()),
                            )
                        };
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), *sc));
                    }
                    // SAFETY: `sums` holds 16 `i16`.
                    let msum = _mm256_madd_epi16(m, unsafe { _mm256_loadu_si256(sums.as_ptr().cast()) });
                    let dx = d[b];
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dx * p.d), *acc);
                    *acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dx * p.dmin), *acc);
                }
            } else {
                let ones = _mm256_set1_epi16(1);
                // SAFETY: `u` holds 256.
                let u = unsafe { _mm256_loadu_si256(p.u.as_ptr().cast()) };
                for ((acc, off), r) in acc.iter_mut().zip(&mut off).zip(rows.clone()) {
                    let (q, d, sums) = x.row(r);
                    // SAFETY: the row holds `b·32 + 32` values.
                    let q = unsafe { _mm256_loadu_si256(q[b * 32..][..32].as_ptr().cast()) };
                    let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
                    let dx = d[b];
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dx * p.d), *acc);
                    *off += dx * p.dmin * f32::from(sums[2 * b] + sums[2 * b + 1]);
                }
            }
        }
        for ((o, acc), off) in out.iter_mut().zip(acc).zip(off) {
            *o = hsum(acc) - off;
        }
    }
}
