//! ggml's block formats: their sizes, their reference dequantization (a
//! port of ggml's `dequantize_row_*` in `ggml-quants.c`), and the one
//! integer form every kernel computes them in ([`Unpacked`]).
//!
//! # Layouts (ggml's `ggml-common.h`)
//! - `block_q4_0` (18 bytes / 32): `d` f16, `qs[16]`: element `j` is
//!   `qs[j] & 15`, element `j + 16` is `qs[j] >> 4`; `w = d·(q − 8)`.
//! - `block_q4_1` (20 / 32): `d`, `m` f16, `qs[16]`; `w = d·q + m`.
//! - `block_q5_0` (22 / 32): `d`, `qh` (u32, bit `j` the fifth bit of
//!   element `j`), `qs[16]`; `w = d·(q − 16)`.
//! - `block_q5_1` (24 / 32): `d`, `m`, `qh`, `qs[16]`; `w = d·q + m`.
//! - `block_q8_0` (34 / 32): `d`, `qs[32]` i8; `w = d·q`.
//! - `block_q2_K` (84 / 256): `scales[16]` (low nibble the scale, high
//!   the min of 16 elements), `qs[64]` (2 bits), `d`, `dmin`;
//!   `w = d·sc·q − dmin·m`.
//! - `block_q3_K` (110 / 256): `hmask[32]`, `qs[64]`, `scales[12]` (16
//!   6-bit scales, biased by 32), `d`; `w = d·(sc − 32)·(q − 4·!h)`.
//! - `block_q4_K` (144 / 256): `d`, `dmin`, `scales[12]` (8 6-bit scales
//!   and 8 6-bit mins, one pair per 32 elements), `qs[128]`;
//!   `w = d·sc·q − dmin·m`.
//! - `block_q5_K` (176 / 256): `d`, `dmin`, `scales[12]`, `qh[32]`,
//!   `qs[128]`; as Q4_K with a fifth bit.
//! - `block_q6_K` (210 / 256): `ql[128]`, `qh[64]`, `scales[16]` i8, `d`;
//!   `w = d·sc·(q − 32)`.
//!
//! # The integer form
//! Every format's block (a "super-block" of [`BlockFormat::block_elems`]
//! elements: 256 for the k-quants, 32 for the others) is, exactly,
//! `w_i = d·sc_h·u_i − dmin·m_h` for `i` in group `h` of 16 elements, with
//! `u_i` unsigned (below 64), `sc_h` and `m_h` small integers and two
//! floats: Q4_0 is `d·1·u − (8d)·1`, Q6_K `d·sc·u − d·(32·sc)`, Q4_1
//! `d·1·u − (−m)·1`. With inputs quantized per block as `x_i = dx·q_i`,
//! a block's share of a dot product is
//!
//! `dx · (d · Σ_h sc_h Σ_{i∈h} u_i q_i − dmin · Σ_h m_h Σ_{i∈h} q_i)`,
//!
//! both sums exact in `i32` (at most 63·127·127·256 < 2³¹) — what ggml's
//! `ggml_vec_dot_*_q8_K` computes, with the inputs' per-16 sums (`bsums`)
//! precomputed once per call.

use half::f16;

/// ggml's block-quantized weight formats (`ggml_type`), as GGUF files
/// store them.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 4-bit, one f16 scale per 32 (`GGML_TYPE_Q4_0`).
    Q4_0,
    /// 4-bit, a scale and a min per 32 (`GGML_TYPE_Q4_1`).
    Q4_1,
    /// 5-bit, one scale per 32 (`GGML_TYPE_Q5_0`).
    Q5_0,
    /// 5-bit, a scale and a min per 32 (`GGML_TYPE_Q5_1`).
    Q5_1,
    /// 8-bit, one scale per 32 (`GGML_TYPE_Q8_0`).
    Q8_0,
    /// 2-bit k-quant, 4-bit scales and mins per 16 (`GGML_TYPE_Q2_K`).
    Q2_K,
    /// 3-bit k-quant, 6-bit scales per 16 (`GGML_TYPE_Q3_K`).
    Q3_K,
    /// 4-bit k-quant, 6-bit scales and mins per 32 (`GGML_TYPE_Q4_K`).
    Q4_K,
    /// 5-bit k-quant, 6-bit scales and mins per 32 (`GGML_TYPE_Q5_K`).
    Q5_K,
    /// 6-bit k-quant, 8-bit scales per 16 (`GGML_TYPE_Q6_K`).
    Q6_K,
}

impl BlockFormat {
    /// Every format, in ggml's type order.
    pub const ALL: [BlockFormat; 10] = [
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q5_0,
        BlockFormat::Q5_1,
        BlockFormat::Q8_0,
        BlockFormat::Q2_K,
        BlockFormat::Q3_K,
        BlockFormat::Q4_K,
        BlockFormat::Q5_K,
        BlockFormat::Q6_K,
    ];

    /// llama.cpp's name (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::Q4_0 => "Q4_0",
            BlockFormat::Q4_1 => "Q4_1",
            BlockFormat::Q5_0 => "Q5_0",
            BlockFormat::Q5_1 => "Q5_1",
            BlockFormat::Q8_0 => "Q8_0",
            BlockFormat::Q2_K => "Q2_K",
            BlockFormat::Q3_K => "Q3_K",
            BlockFormat::Q4_K => "Q4_K",
            BlockFormat::Q5_K => "Q5_K",
            BlockFormat::Q6_K => "Q6_K",
        }
    }

    /// Elements per block: 256 for the k-quants, 32 for the others.
    pub fn block_elems(self) -> usize {
        match self {
            BlockFormat::Q2_K
            | BlockFormat::Q3_K
            | BlockFormat::Q4_K
            | BlockFormat::Q5_K
            | BlockFormat::Q6_K => 256,
            _ => 32,
        }
    }

    /// Bytes per block (ggml's `sizeof(block_*)`).
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q5_1 => 24,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q2_K => 84,
            BlockFormat::Q3_K => 110,
            BlockFormat::Q4_K => 144,
            BlockFormat::Q5_K => 176,
            BlockFormat::Q6_K => 210,
        }
    }

    /// Bytes of a row of `k` elements (`k` a multiple of the block).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_elems() * self.block_bytes()
    }

    /// Where a block keeps its f16 scales and mins (byte offsets).
    pub fn f16_fields(self) -> &'static [usize] {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
            BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4_K | BlockFormat::Q5_K => &[0, 2],
            BlockFormat::Q2_K => &[80, 82],
            BlockFormat::Q3_K => &[108],
            BlockFormat::Q6_K => &[208],
        }
    }

    /// Bits per weight, as llama.cpp prints them.
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_elems() as f64
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's and Q5_K's `get_scale_min_k4`: scale and min `j` (0..8) of the
/// 12 packed bytes.
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q3_K's 16 scales (6 bits, still biased by 32) from its 12 bytes, as
/// ggml's `kmask` words unpack them: scale `j`'s low 4 bits are a nibble
/// of byte `j % 8` (the high nibble from 8 on), its high 2 bits are bits
/// `2·(j / 4)` of byte `8 + j % 4`.
pub(super) fn q3k_scales(s: &[u8]) -> [u8; 16] {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, a2) = (word(0), word(1), word(2));
    let (low, high) = (0x0F0F_0F0F, 0x0303_0303);
    let words = [
        (a0 & low) | ((a2 & high) << 4),
        (a1 & low) | (((a2 >> 2) & high) << 4),
        ((a0 >> 4) & low) | (((a2 >> 4) & high) << 4),
        ((a1 >> 4) & low) | (((a2 >> 6) & high) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// One block as the integer form of the module docs: `u` (the block's
/// elements), per 16 elements `sc` and `m`, and `d`, `dmin`.
#[derive(Clone, Debug)]
pub(crate) struct Unpacked {
    pub(crate) u: [u8; 256],
    pub(crate) sc: [i16; 16],
    pub(crate) m: [i16; 16],
    pub(crate) d: f32,
    pub(crate) dmin: f32,
}

impl Default for Unpacked {
    fn default() -> Self {
        Unpacked {
            u: [0; 256],
            sc: [0; 16],
            m: [0; 16],
            d: 0.,
            dmin: 0.,
        }
    }
}

/// Fills `out` (the first `format.block_elems()` of `u`, and of `sc`, `m`
/// one per 16) from one block's bytes.
pub(crate) fn unpack(format: BlockFormat, b: &[u8], out: &mut Unpacked) {
    let Unpacked { u, sc, m, d, dmin } = out;
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let (scale, min, qh, qs) = match format {
                BlockFormat::Q4_0 => (f16_at(b, 0), None, None, &b[2..18]),
                BlockFormat::Q4_1 => (f16_at(b, 0), Some(f16_at(b, 2)), None, &b[4..20]),
                BlockFormat::Q5_0 => (f16_at(b, 0), None, Some(&b[2..6]), &b[6..22]),
                _ => (f16_at(b, 0), Some(f16_at(b, 2)), Some(&b[4..8]), &b[8..24]),
            };
            let qh = qh.map(|h| u32::from_le_bytes([h[0], h[1], h[2], h[3]]));
            for j in 0..16 {
                let (mut lo, mut hi) = (qs[j] & 0xF, qs[j] >> 4);
                if let Some(h) = qh {
                    lo |= (((h >> j) & 1) << 4) as u8;
                    hi |= (((h >> (j + 16)) & 1) << 4) as u8;
                }
                u[j] = lo;
                u[j + 16] = hi;
            }
            *d = scale;
            // Symmetric formats centre at 8 or 16: `d·(u − c) = d·u − (c·d)`.
            *dmin = match (min, qh) {
                (Some(mn), _) => -mn,
                (None, None) => 8. * scale,
                (None, Some(_)) => 16. * scale,
            };
            sc[..2].fill(1);
            m[..2].fill(1);
        }
        BlockFormat::Q8_0 => {
            // `u = q + 128`, which no kernel's `u8 · i8` step takes
            // (`2·255·127` overflows `i16`): only the portable code and the
            // reference read this one.
            *d = f16_at(b, 0);
            *dmin = 128. * *d;
            for (u, &q) in u.iter_mut().zip(&b[2..34]) {
                *u = (q as i8 as i16 + 128) as u8;
            }
            sc[..2].fill(1);
            m[..2].fill(1);
        }
        BlockFormat::Q2_K => {
            let (scales, qs) = (&b[..16], &b[16..80]);
            *d = f16_at(b, 80);
            *dmin = f16_at(b, 82);
            for (i, u) in u.iter_mut().enumerate() {
                // Element i: half n = i / 128, shift j = (i % 128) / 32,
                // byte (i % 32) of that half's 32.
                let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
                *u = (qs[32 * n + l] >> (2 * j)) & 3;
            }
            for h in 0..16 {
                sc[h] = i16::from(scales[h] & 0xF);
                m[h] = i16::from(scales[h] >> 4);
            }
        }
        BlockFormat::Q3_K => {
            let (hmask, qs) = (&b[..32], &b[32..96]);
            let scales = q3k_scales(&b[96..108]);
            *d = f16_at(b, 108);
            *dmin = *d;
            for (i, u) in u.iter_mut().enumerate() {
                let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = (qs[32 * n + l] >> (2 * j)) & 3;
                // The high bit set means no −4: `q − 4 + 4·h = u − 4`.
                let high = (hmask[l] >> (4 * n + j)) & 1;
                *u = low | (high << 2);
            }
            for h in 0..16 {
                sc[h] = i16::from(scales[h]) - 32;
                m[h] = 4 * sc[h];
            }
        }
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            *d = f16_at(b, 0);
            *dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let (qh, qs) = match format {
                BlockFormat::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for (i, u) in u.iter_mut().enumerate() {
                // Group g of 64: low nibbles of qs[32g..] then high ones.
                let (g, half, l) = (i / 64, (i % 64) / 32, i % 32);
                let q = qs[32 * g + l] >> (4 * half) & 0xF;
                let high = qh.map_or(0, |qh| (qh[l] >> (2 * g + half)) & 1);
                *u = q | (high << 4);
            }
            for s in 0..8 {
                let (scale, min) = scale_min_k4(s, scales);
                sc[2 * s..2 * s + 2].fill(i16::from(scale));
                m[2 * s..2 * s + 2].fill(i16::from(min));
            }
        }
        BlockFormat::Q6_K => {
            let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
            *d = f16_at(b, 208);
            *dmin = *d;
            for (i, u) in u.iter_mut().enumerate() {
                // Half n of 128, quarter j of 32 in it, l the element in
                // the quarter: ql[64n + l (+32 for quarters 1, 3)], nibble
                // by quarter / 2; two bits of qh[32n + l] at 2j.
                let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = (ql[64 * n + l + 32 * (j & 1)] >> (4 * (j >> 1))) & 0xF;
                let high = (qh[32 * n + l] >> (2 * j)) & 3;
                *u = low | (high << 4);
            }
            for h in 0..16 {
                sc[h] = i16::from(scales[h] as i8);
                m[h] = 32 * sc[h];
            }
        }
    }
}

/// One block dequantized into `out` (`format.block_elems()` floats) as
/// ggml's `dequantize_row_*` computes it: each weight `d·sc·q − dmin·m`
/// in that order of f32 operations (`d·sc` first, as ggml forms `dl`).
pub(crate) fn dequantize_block(format: BlockFormat, b: &[u8], out: &mut [f32]) {
    let mut p = Unpacked::default();
    unpack(format, b, &mut p);
    let n = format.block_elems();
    match format {
        // ggml: `(q − c)·d` and `q·d + m` with the integer first.
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => {
            let c = match format {
                BlockFormat::Q4_0 => 8,
                BlockFormat::Q5_0 => 16,
                _ => 128,
            };
            for (o, &u) in out[..n].iter_mut().zip(&p.u) {
                *o = (i32::from(u) - c) as f32 * p.d;
            }
        }
        BlockFormat::Q4_1 | BlockFormat::Q5_1 => {
            for (o, &u) in out[..n].iter_mut().zip(&p.u) {
                *o = f32::from(u) * p.d - p.dmin;
            }
        }
        BlockFormat::Q3_K | BlockFormat::Q6_K => {
            let c = if format == BlockFormat::Q3_K { 4 } else { 32 };
            for (i, o) in out[..n].iter_mut().enumerate() {
                let dl = p.d * f32::from(p.sc[i / 16]);
                *o = dl * (i32::from(p.u[i]) - c) as f32;
            }
        }
        BlockFormat::Q2_K | BlockFormat::Q4_K | BlockFormat::Q5_K => {
            for (i, o) in out[..n].iter_mut().enumerate() {
                let dl = p.d * f32::from(p.sc[i / 16]);
                let ml = p.dmin * f32::from(p.m[i / 16]);
                *o = dl * f32::from(p.u[i]) - ml;
            }
        }
    }
}

/// A row of `out.len()` elements (a multiple of the block) dequantized
/// from its blocks.
pub fn dequantize_row(format: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(format, b, o);
    }
}
