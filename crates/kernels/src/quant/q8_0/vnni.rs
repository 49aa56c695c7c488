//! The AVX512-VNNI micro-kernel of the 8-bit linear layers: `vpdpbusd`
//! multiplies 64 unsigned bytes by 64 signed ones and adds each lane's
//! four products to an i32 lane, so one instruction takes a whole group
//! of 4 inputs for a panel's 16 features.
//!
//! `vpdpbusd` wants one side unsigned: the weights are stored as `q + 128`
//! (`u8`) and the inputs stay `i8`, so a lane sums `Σ (q_w + 128) · q_x =
//! Σ q_w · q_x + 128 · Σ q_x`; each row's block starts its i32 sums at
//! `-128 · Σ q_x` (computed as the inputs are quantized), which leaves the
//! exact integer dot product and costs nothing in the loop.

use std::arch::x86_64::*;

use half::f16;

use crate::elem::PanelElem;

/// Rows per tile of a call of several rows: each group of weights loaded
/// feeds 4 rows, in 8 i32 and 8 f32 accumulators.
pub(crate) const MR: usize = 4;
/// Panels per tile: 16 features each, one `zmm` per group of 4 inputs.
pub(crate) const NP: usize = 2;

/// The sums of a tile of 1..=4 rows by 1..=2 panels:
/// `out[r·out_rs + 16·p + c] += (d_w · d_x) · isum_b` for the blocks `b`
/// of `blocks` (within `0..nb`) in order, each product and sum rounded to
/// f32 (the sums run on from `out`, so a reduction cut into slices of
/// blocks adds in the same order), where `isum_b` is block `b`'s exact dot
/// product of row `r`'s and feature `16·p + c`'s values, `d_w` the
/// feature's block scale and `d_x` the row's.
///
/// The layout (`mod.rs`): for `nb` blocks, panel `p`'s block `b` holds 512
/// bytes at `w + (p·nb + b)·512`, group `g`'s (inputs `4g..4g + 4`) 64 at
/// `64·g`, feature `c`'s four at `4·c`, each `q + 128`; its 16 scales are
/// f16 bits at `d + (p·nb + b)·16`. Row `r`'s inputs are `nb·32` bytes at
/// `x + r·nb·32`, its block scales and starts (`-128 · Σ q_x`) `nb` values
/// at `xd + r·nb` and `xoff + r·nb`.
///
/// # Safety
/// AVX-512F, AVX512BW and AVX512-VNNI; the pointers cover those extents,
/// `out` `rows` rows of `16 · panels` floats `out_rs` apart.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    rows: usize,
    panels: usize,
    (nb, blocks): (usize, std::ops::Range<usize>),
    x: *const i8,
    (xd, xoff): (*const f32, *const i32),
    w: *const u8,
    d: *const u16,
    out: *mut f32,
    out_rs: usize,
) {
    macro_rules! go {
        ($($r:literal $p:literal),*) => {
            match (rows, panels) {
                $(($r, $p) => tile_rows::<$r, $p>(nb, blocks.clone(), x, xd, xoff, w, d, out, out_rs),)*
                _ => unreachable!("tiles are at most 4 rows by 2 panels"),
            }
        };
    }
    if (rows, panels) == (1, 1) {
        // SAFETY: forwarded.
        return unsafe { one_panel(blocks, x, xd, xoff, w, d, out) };
    }
    // SAFETY: forwarded.
    unsafe { go!(1 2, 2 1, 2 2, 3 1, 3 2, 4 1, 4 2) }
}

/// [`one_panel`] over `panels` panels in turn, from panel 0 of `w` and
/// `d` on, into `out`'s `16 · panels` floats: a thread's run of panels in
/// one call, every block of each.
///
/// # Safety
/// As [`tile`]'s, for one row, `panels` panels and the blocks `0..nb`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn one_row(
    panels: usize,
    nb: usize,
    x: *const i8,
    (xd, xoff): (*const f32, *const i32),
    w: *const u8,
    d: *const u16,
    out: *mut f32,
) {
    for p in 0..panels {
        // SAFETY: panel p's blocks, scales and outputs, inside the extents.
        unsafe {
            one_panel(
                0..nb,
                x,
                xd,
                xoff,
                w.add(p * nb * 512),
                d.add(p * nb * 16),
                out.add(16 * p),
            )
        }
    }
}

/// [`tile`] of one row by one panel: the panel's blocks are one stream,
/// each block's 8 groups summed in two chains (even and odd groups; the
/// integer sum is exact in any order), then added as `tile_rows` adds.
///
/// # Safety
/// As [`tile`]'s, for one row and one panel.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn one_panel(
    blocks: std::ops::Range<usize>,
    x: *const i8,
    xd: *const f32,
    xoff: *const i32,
    w: *const u8,
    d: *const u16,
    out: *mut f32,
) {
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        let mut acc = _mm512_loadu_ps(out);
        for b in blocks {
            let (wb, xb) = (w.add(b * 512), x.add(b * 32));
            let mut sums = [_mm512_set1_epi32(*xoff.add(b)), _mm512_setzero_si512()];
            for g in 0..8 {
                let xv = _mm512_set1_epi32(xb.add(4 * g).cast::<i32>().read_unaligned());
                let wv = _mm512_loadu_si512(wb.add(64 * g).cast());
                sums[g % 2] = _mm512_dpbusd_epi32(sums[g % 2], wv, xv);
            }
            let s = _mm512_add_epi32(sums[0], sums[1]);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(d.add(b * 16).cast()));
            let dx = _mm512_set1_ps(*xd.add(b));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx)));
        }
        _mm512_storeu_ps(out, acc);
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_rows<const R: usize, const P: usize>(
    nb: usize,
    blocks: std::ops::Range<usize>,
    x: *const i8,
    xd: *const f32,
    xoff: *const i32,
    w: *const u8,
    d: *const u16,
    out: *mut f32,
    out_rs: usize,
) {
    let (x_rs, w_ps, d_ps) = (nb * 32, nb * 512, nb * 16);
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        let mut acc: [[__m512; P]; R] =
            std::array::from_fn(|r| std::array::from_fn(|p| _mm512_loadu_ps(out.add(r * out_rs + 16 * p))));
        for b in blocks {
            // Each block's sums start from its rows' offset corrections,
            // so that they end as the exact signed dot products.
            let mut isum: [[__m512i; P]; R] =
                std::array::from_fn(|r| [_mm512_set1_epi32(*xoff.add(r * nb + b)); P]);
            let wb = w.add(b * 512);
            for g in 0..8 {
                let wv: [__m512i; P] =
                    std::array::from_fn(|p| _mm512_loadu_si512(wb.add(p * w_ps + 64 * g).cast()));
                for (r, isum) in isum.iter_mut().enumerate() {
                    // Inputs 4g..4g + 4 of row r, in every lane.
                    let xv =
                        _mm512_set1_epi32(x.add(r * x_rs + b * 32 + 4 * g).cast::<i32>().read_unaligned());
                    for (s, &wv) in isum.iter_mut().zip(&wv) {
                        *s = _mm512_dpbusd_epi32(*s, wv, xv);
                    }
                }
            }
            let dw: [__m512; P] =
                std::array::from_fn(|p| _mm512_cvtph_ps(_mm256_loadu_si256(d.add(p * d_ps + b * 16).cast())));
            for (r, (acc, isum)) in acc.iter_mut().zip(&isum).enumerate() {
                let dx = _mm512_set1_ps(*xd.add(r * nb + b));
                for ((acc, &s), &dw) in acc.iter_mut().zip(isum).zip(&dw) {
                    // llama.cpp's `sumf += sumi * (d_w * d_x)`: a product
                    // and a sum, each rounded, not a fused multiply-add.
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx)));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (p, &acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * out_rs + 16 * p), acc);
            }
        }
    }
}

/// One block of 32 values quantized as `mod.rs`'s `quantize_block` does
/// (the same values, bit for bit): its scale rounded to f16 (the bits),
/// and its values as i32 lanes, 16 in each half. Rounding half away from
/// zero is `trunc(y + copysign(0.5 - 2⁻²⁵, y))`, exact for every float; a
/// block whose scale or its inverse is not finite gets zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
fn quantize_block(v: [__m512; 2]) -> (u16, [__m512i; 2]) {
    let sign = _mm512_set1_epi32(i32::MIN);
    let half = _mm512_castps_si512(_mm512_set1_ps(0.5 - f32::EPSILON / 4.));
    let a = v.map(|v| _mm512_abs_ps(v));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a[0], a[1]);
    let amax = if nan != 0 {
        f32::NAN
    } else {
        _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]))
    };
    let scale = amax / 127.;
    let id = if scale != 0. { 1. / scale } else { 0. };
    let bits = _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(scale))) as u16;
    if !(scale.is_finite() && id.is_finite()) {
        return (bits, [_mm512_setzero_si512(); 2]);
    }
    let idv = _mm512_set1_ps(id);
    (
        bits,
        v.map(|v| {
            let y = _mm512_mul_ps(v, idv);
            let away = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(y), sign), half);
            _mm512_cvttps_epi32(_mm512_add_ps(y, _mm512_castsi512_ps(away)))
        }),
    )
}

/// One row of `nb` blocks of inputs quantized as `mod.rs`'s
/// `quantize_block` does ([`quantize_block`]): the block's values into
/// `q + 32·b`, its scale rounded to f16 and widened into `d[b]`, and
/// `-128 · Σ q` into `off[b]`.
///
/// # Safety
/// AVX-512F, AVX512BW and F16C; `x` and `q` hold `32·nb` values, `d` and `off`
/// `nb`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(crate) unsafe fn quantize_row(x: *const f32, nb: usize, q: *mut i8, d: *mut f32, off: *mut i32) {
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        for b in 0..nb {
            let v = [
                _mm512_loadu_ps(x.add(32 * b)),
                _mm512_loadu_ps(x.add(32 * b + 16)),
            ];
            let (bits, values) = quantize_block(v);
            *d.add(b) = f16::from_bits(bits).to_f32();
            for (h, &i) in values.iter().enumerate() {
                _mm_storeu_si128(q.add(32 * b + 16 * h).cast(), _mm512_cvtepi32_epi8(i));
            }
            *off.add(b) = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(values[0], values[1]));
        }
    }
}

/// Feature `c`'s row of `nb` blocks of weights `w` quantized as
/// [`quantize_row`] quantizes inputs, straight into its panel (`mod.rs`'s
/// layout): value `i` of block `b` stored as `q + 128` at `qs + b·512 +
/// (i / 4)·64 + 4·c + i % 4`, the scale's f16 bits at `d + b·16 + c`.
///
/// # Safety
/// AVX-512F, AVX512BW and F16C; `w` holds `32·nb` elements, `qs` `512·nb`
/// bytes, `d` `16·nb` scales; `c < 16`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(crate) unsafe fn quantize_weight_row<S: PanelElem>(
    w: *const S,
    nb: usize,
    c: usize,
    qs: *mut u8,
    d: *mut u16,
) {
    let flip = _mm512_set1_epi32(0x80);
    // SAFETY: (the block) inside the extents the caller vouched for.
    unsafe {
        for b in 0..nb {
            let v = [0, 16].map(|at| S::loadu_zmm(w.add(32 * b + at)));
            let (bits, values) = quantize_block(v);
            *d.add(b * 16 + c) = bits;
            // `q + 128` is `q`'s byte with its top bit flipped.
            let mut bytes = [0u8; 32];
            for (h, &i) in values.iter().enumerate() {
                let stored = _mm512_cvtepi32_epi8(_mm512_xor_si512(i, flip));
                _mm_storeu_si128(bytes.as_mut_ptr().add(16 * h).cast(), stored);
            }
            for (g, four) in bytes.as_chunks::<4>().0.iter().enumerate() {
                qs.add(b * 512 + g * 64 + 4 * c)
                    .cast::<[u8; 4]>()
                    .write_unaligned(*four);
            }
        }
    }
}
