//! AVX512-BF16's linear micro-kernels: bf16 weights times bf16-rounded
//! inputs with `vdpbf16ps`, which adds two bf16 products to each of 16
//! f32 accumulators: two inputs a step, twice the products of an f32 FMA
//! per instruction. They are `avx512.rs`'s tiles and row kernel
//! (written once over [`Dot`]) with [`Pairs`] for their step.
//!
//! The inputs are rounded to bf16 (to nearest, ties to even) before the
//! products, as PyTorch's CPU bf16 autocast rounds a linear layer's input;
//! the sums stay in f32, and the outputs are not rounded. Both
//! instructions take denormals as zero.
//!
//! `vdpbf16ps` takes a lane's two products from adjacent bf16 pairs of
//! both operands, so the panels interleave their inputs in pairs: panel
//! row `e / 2` (even `e`) holds `LINEAR_NR` features' inputs `e` and `e +
//! 1`, feature `c`'s at `32·(c / 16) + 2·(c % 16)`, the same bytes as two
//! rows of the plain layout, so every offset at an even input is the
//! plain layout's (`weight.rs` packs bf16 weights this way for
//! [`crate::runtime::isa::Isa::Avx512Bf16`] where the inputs are even in number).

use std::arch::x86_64::*;

use half::bf16;

use super::avx512::{one_row_body, tile_rows, Dot, Row, Tile, LINEAR_NR};

/// `vdpbf16ps` over bf16 inputs and panels of input pairs.
pub(crate) struct Pairs;

impl Dot for Pairs {
    type X = bf16;
    type W = bf16;
    type A = __m512bh;
    type Wv = __m512bh;
    const STEP: usize = 2;
    const HALF: usize = 32;
    /// 1 KiB, as for f32 panels: the distance that streamed a decoder
    /// step's linears fastest.
    const PREFETCH: usize = 1024;
    #[inline(always)]
    unsafe fn broadcast(x: *const bf16) -> __m512bh {
        // SAFETY: as the trait says; the two inputs are one 32-bit lane.
        unsafe {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(x.cast::<i32>().read_unaligned()))
        }
    }
    #[inline(always)]
    unsafe fn load(w: *const bf16) -> __m512bh {
        // SAFETY: as the trait says.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(w.cast())) }
    }
    #[inline(always)]
    unsafe fn madd(a: __m512bh, w: __m512bh, c: __m512) -> __m512 {
        // SAFETY: as the trait says.
        unsafe { _mm512_dpbf16_ps(c, a, w) }
    }
    unsafe fn tile_rows<const R: usize, const V: usize>(t: &Tile<Self>) {
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn entry<const R: usize, const V: usize>(t: &Tile<Pairs>) {
            // SAFETY: forwarded, with the features it needs.
            unsafe { tile_rows::<R, V, Pairs>(t) }
        }
        // SAFETY: forwarded; the caller vouched for the features.
        unsafe { entry::<R, V>(t) }
    }
    unsafe fn one_row(r: &Row<Self>) {
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn entry(r: &Row<Pairs>) {
            // SAFETY: forwarded, with the features it needs.
            unsafe { one_row_body(r) }
        }
        // SAFETY: forwarded; the caller vouched for the features.
        unsafe { entry(r) }
    }
}

/// Where input `e` of feature `c` of a panel of `LINEAR_NR` features lies
/// in the pair layout, from the panel's start.
pub(crate) fn pair_index(e: usize, c: usize) -> usize {
    (e & !1) * LINEAR_NR + 32 * (c / 16) + 2 * (c % 16) + (e & 1)
}

/// `src` rounded to bf16 into `dst` (of the same length), to nearest, ties
/// to even, with `vcvtneps2bf16` 16 at a time (the tail through a buffer,
/// so that every element is rounded by the same instruction).
///
/// # Safety
/// AVX-512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn round(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len());
    // SAFETY: 16 floats read, 16 bf16 written.
    let sixteen = |s: &[f32], d: &mut [bf16]| unsafe {
        let h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s.as_ptr()));
        _mm256_storeu_si256(d.as_mut_ptr().cast(), std::mem::transmute::<__m256bh, __m256i>(h));
    };
    let (mut s, mut d) = (src.chunks_exact(16), dst.chunks_exact_mut(16));
    for (s, d) in (&mut s).zip(&mut d) {
        sixteen(s, d);
    }
    let (s, d) = (s.remainder(), d.into_remainder());
    if !s.is_empty() {
        let (mut sb, mut db) = ([0f32; 16], [bf16::ZERO; 16]);
        sb[..s.len()].copy_from_slice(s);
        sixteen(&sb, &mut db);
        d.copy_from_slice(&db[..s.len()]);
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::{pair_index, round, Pairs};
    use crate::linear::avx512::{linear_tile, Dot, LinearTile, Row, Tile, LINEAR_NR};
    use crate::runtime::isa::{supported, Isa};

    fn runs_here() -> bool {
        let here = supported().contains(&Isa::Avx512Bf16);
        if !here {
            eprintln!("no AVX512-BF16 here: its kernels not run");
        }
        here
    }

    /// Inputs a step off the f32 grid: halfway cases, signs, NaN, ±∞.
    fn inputs(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 11 {
                3 => f32::from_bits(0x3f80_8000 + ((i as u32 & 2) << 15)),
                5 => -((i as f32) * 0.37).cos(),
                7 if n > 40 => f32::NAN,
                9 if n > 40 => f32::INFINITY * if i % 2 == 0 { 1. } else { -1. },
                _ => ((i as f32) * 0.731).sin() * 3.,
            })
            .collect()
    }

    /// `vcvtneps2bf16` rounds as `half` does (to nearest, ties to even;
    /// NaN stays NaN), tail included.
    #[test]
    fn round_rounds_to_nearest_even() {
        if !runs_here() {
            return;
        }
        for n in [1, 16, 37, 64] {
            let x = inputs(n);
            let mut got = vec![bf16::ZERO; n];
            // SAFETY: the processor has them.
            unsafe { round(&x, &mut got) };
            for (i, (&g, &x)) in got.iter().zip(&x).enumerate() {
                let want = bf16::from_f32(x);
                assert!(
                    g == want || (g.is_nan() && want.is_nan()),
                    "{n} [{i}] {x}: {g} vs {want}"
                );
            }
        }
    }

    /// The row kernel and both tiles over panels in input pairs equal the
    /// f32 sums over the same bf16 values (finite inputs here).
    #[test]
    fn pairs_equal_the_f32_sums() {
        if !runs_here() {
            return;
        }
        let (k, n, m) = (70, 40, 7);
        let val = |i: usize| bf16::from_f32(((i as f32) * 0.377).sin());
        let w: Vec<bf16> = (0..n * k).map(|i| val(i * 7 + 1)).collect();
        let x: Vec<bf16> = (0..m * k).map(val).collect();
        let panels = n.div_ceil(LINEAR_NR);
        // 64-byte aligned panels.
        let mut buf = vec![bf16::ZERO; panels * k * LINEAR_NR + 32];
        let at = buf.as_ptr().align_offset(64);
        let p = &mut buf[at..];
        for j in 0..n {
            for e in 0..k {
                p[(j / LINEAR_NR) * k * LINEAR_NR + pair_index(e, j % LINEAR_NR)] = w[j * k + e];
            }
        }
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
        let want = |r: usize, j: usize| -> f32 {
            bias[j]
                + (0..k)
                    .map(|e| x[r * k + e].to_f32() * w[j * k + e].to_f32())
                    .sum::<f32>()
        };
        let close = |got: f32, want: f32, what: &str| {
            assert!(
                (got - want).abs() <= 1e-5 * (1. + want.abs()),
                "{what}: {got} vs {want}"
            );
        };
        let mut out = vec![0f32; n];
        // SAFETY: the processor has them; the extents are the buffers'.
        unsafe {
            Pairs::one_row(&Row {
                x: x.as_ptr(),
                k,
                w: p.as_ptr(),
                cols: n,
                init: bias.as_ptr(),
                out: out.as_mut_ptr(),
            })
        };
        for (j, &y) in out.iter().enumerate() {
            close(y, want(0, j), &format!("one row, feature {j}"));
        }
        for tile in [LinearTile::Tall, LinearTile::Wide] {
            let (rows, tp) = tile.shape();
            let rows = rows.min(m);
            let cols = (tp * LINEAR_NR).min(n);
            let mut out = vec![0f32; rows * cols];
            let t = Tile::<Pairs> {
                cols,
                kc: k,
                x: x.as_ptr(),
                x_rs: k,
                x_cs: 1,
                w: p.as_ptr(),
                w_next: k * LINEAR_NR,
                init: bias.as_ptr(),
                res: std::ptr::null(),
                res_rs: 0,
                out: out.as_mut_ptr(),
                out_rs: cols,
                pf: [std::ptr::null(); 2],
                pf_steps: 0,
            };
            // SAFETY: as above.
            unsafe { linear_tile(tile, rows, &t) };
            for r in 0..rows {
                for j in 0..cols {
                    close(
                        out[r * cols + j],
                        want(r, j),
                        &format!("{tile:?} tile, row {r}, feature {j}"),
                    );
                }
            }
        }
    }
}
