//! The panels of the formats of 32 (`panels.rs`) with AVX512-VNNI on
//! 256-bit vectors (AVX512-VL): `vpdpbusd` multiplies a step's `u8`
//! values by 4 inputs and adds them to the feature's `i32` lane in one
//! instruction (AVX2's `vpmaddubsw`, `vpmaddwd` and add), and AVX-512's 32
//! registers hold 8 input rows' sums at once. The k-quants keep AVX2's
//! code (`avx2.rs`): their per-16 scales would cost `vpdpbusd` a multiply
//! of its own.

use std::arch::x86_64::*;

use super::avx2::{fifth_bits, load32, PREFETCH};
use super::format::BlockFormat;
use super::inputs::InputRow;

/// The formats of 32 as `panel_32`'s const parameter.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;

/// A panel of 8 features (`nb` blocks) times input rows `rows`, into
/// `out` (8 a row): 8 rows at a time (then 4, 2, 1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn dot_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    if format.block_elems() == 256 {
        return k_panel(format, panel, nb, rows, out);
    }
    let mut at = 0;
    while at < rows.len() {
        let n = match rows.len() - at {
            8.. => 8,
            4..=7 => 4,
            2..=3 => 2,
            _ => 1,
        };
        let (rows, out) = (&rows[at..at + n], &mut out[8 * at..8 * (at + n)]);
        macro_rules! by_rows {
            ($f:expr) => {
                match n {
                    8 => panel_32::<$f, 8>(panel, nb, rows, out),
                    4 => panel_32::<$f, 4>(panel, nb, rows, out),
                    2 => panel_32::<$f, 2>(panel, nb, rows, out),
                    _ => panel_32::<$f, 1>(panel, nb, rows, out),
                }
            };
        }
        match format {
            BlockFormat::Q4_0 => by_rows!(Q4_0),
            BlockFormat::Q4_1 => by_rows!(Q4_1),
            BlockFormat::Q5_0 => by_rows!(Q5_0),
            _ => by_rows!(Q5_1),
        }
        at += n;
    }
}

/// A k-quant's panel times input rows, 4 at a time (then 2, 1).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn k_panel(format: BlockFormat, panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    use super::avx2_k::{panel_k4_vnni, panel_q6k_vnni};
    let mut at = 0;
    while at < rows.len() {
        let n = match rows.len() - at {
            4.. => 4,
            2..=3 => 2,
            _ => 1,
        };
        let (rows, out) = (&rows[at..at + n], &mut out[8 * at..8 * (at + n)]);
        match (format, n) {
            (BlockFormat::Q4_K, 4) => panel_k4_vnni::<false, 4>(panel, nb, rows, out),
            (BlockFormat::Q4_K, 2) => panel_k4_vnni::<false, 2>(panel, nb, rows, out),
            (BlockFormat::Q4_K, _) => panel_k4_vnni::<false, 1>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 4) => panel_k4_vnni::<true, 4>(panel, nb, rows, out),
            (BlockFormat::Q5_K, 2) => panel_k4_vnni::<true, 2>(panel, nb, rows, out),
            (BlockFormat::Q5_K, _) => panel_k4_vnni::<true, 1>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 4) => panel_q6k_vnni::<4>(panel, nb, rows, out),
            (BlockFormat::Q6_K, 2) => panel_q6k_vnni::<2>(panel, nb, rows, out),
            (_, _) => panel_q6k_vnni::<1>(panel, nb, rows, out),
        }
        at += n;
    }
}

/// `R` rows times one panel of format `F`, as `avx2::panel_32` computes
/// it (the same integer sums, then the same f32 steps).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn panel_32<const F: u8, const R: usize>(panel: &[u8], nb: usize, rows: &[InputRow], out: &mut [f32]) {
    let (pb, m_at, qh_at, qs_at) = match F {
        Q4_0 => (144, 0, 0, 16),
        Q4_1 => (160, 16, 0, 32),
        Q5_0 => (176, 0, 16, 48),
        _ => (192, 16, 32, 64),
    };
    let rows: &[InputRow; R] = rows.try_into().expect("R rows");
    assert!(panel.len() >= nb * pb && out.len() >= 8 * R);
    for row in rows {
        assert!(row.q.len() >= 32 * nb && row.d.len() >= nb && row.dsums.len() >= nb);
    }
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let blk = &panel[b * pb..b * pb + pb];
        for line in (0..pb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH + line).cast());
        }
        // SAFETY: `blk` holds `pb` bytes, past every offset read below.
        let (d, dmin, qh) = unsafe {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().cast()));
            let dmin = match F {
                Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(8.)),
                Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(16.)),
                _ => _mm256_sub_ps(
                    _mm256_setzero_ps(),
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.as_ptr().add(m_at).cast())),
                ),
            };
            let qh = match F {
                Q5_0 | Q5_1 => _mm256_loadu_si256(blk.as_ptr().add(qh_at).cast()),
                _ => _mm256_setzero_si256(),
            };
            (d, dmin, qh)
        };
        let mut isum = [_mm256_setzero_si256(); R];
        for g in 0..4 {
            let v = load32(blk, qs_at + 32 * g);
            let mut lo = _mm256_and_si256(v, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if F == Q5_0 || F == Q5_1 {
                lo = _mm256_or_si256(lo, fifth_bits(qh, 4 * g as i32));
                hi = _mm256_or_si256(hi, fifth_bits(qh, 16 + 4 * g as i32));
            }
            for r in 0..R {
                let q = &rows[r].q[32 * b..32 * b + 32];
                let x = |at: usize| super::avx2_k::x4(q, at);
                isum[r] = _mm256_dpbusd_epi32(isum[r], lo, _mm256_set1_epi32(x(4 * g)));
                isum[r] = _mm256_dpbusd_epi32(isum[r], hi, _mm256_set1_epi32(x(16 + 4 * g)));
            }
        }
        for r in 0..R {
            let row = &rows[r];
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(row.d[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
            acc[r] = _mm256_fnmadd_ps(dmin, _mm256_set1_ps(row.dsums[b]), acc[r]);
        }
    }
    for (acc, out) in acc.iter().zip(out.chunks_exact_mut(8)) {
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}
