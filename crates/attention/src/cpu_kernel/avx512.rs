//! The AVX-512F register-blocked micro-kernel of the packed linear layers
//! (`linear.rs`): an `MR × NR` block of outputs in 24 `zmm` accumulators,
//! 24 FMAs per 2 panel loads and 12 broadcasts (folded into the FMAs as
//! embedded broadcasts), over a weight packed into panels of [`NR`] output
//! features.

use std::arch::x86_64::*;

/// Rows per micro-kernel.
pub(super) const MR: usize = 12;
/// Output features per panel: two `zmm` registers.
pub(super) const NR: usize = 32;

/// Packs `rows` (1..=MR) rows of `kc` inputs (row `r` at `x[r·x_rs..]`)
/// into `dst`, input-major: input `e` of row `r` at `dst[e·MR + r]`, zero
/// for rows past `rows`; so that the kernel's 12 broadcasts per input read
/// one cache line at fixed offsets.
pub(super) fn pack_rows(dst: &mut [f32], x: &[f32], x_rs: usize, rows: usize, kc: usize) {
    for (e, d) in dst[..kc * MR].chunks_exact_mut(MR).enumerate() {
        for (r, v) in d.iter_mut().enumerate() {
            *v = if r < rows { x[r * x_rs + e] } else { 0. };
        }
    }
}

/// `out[r·out_rs + c] += Σₑ a[e·MR + r] · w[e·NR + c]` for `rows`
/// (1..=MR) rows, `kc` inputs (rows packed by [`pack_rows`]) and one
/// panel's `NR` columns.
///
/// # Safety
/// AVX-512F; the pointers cover those extents.
pub(super) unsafe fn panel(
    rows: usize,
    a: *const f32,
    kc: usize,
    w: *const f32,
    out: *mut f32,
    out_rs: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        match rows {
            1 => panel_rows::<1>(a, kc, w, out, out_rs),
            2 => panel_rows::<2>(a, kc, w, out, out_rs),
            3 => panel_rows::<3>(a, kc, w, out, out_rs),
            4 => panel_rows::<4>(a, kc, w, out, out_rs),
            5 => panel_rows::<5>(a, kc, w, out, out_rs),
            6 => panel_rows::<6>(a, kc, w, out, out_rs),
            7 => panel_rows::<7>(a, kc, w, out, out_rs),
            8 => panel_rows::<8>(a, kc, w, out, out_rs),
            9 => panel_rows::<9>(a, kc, w, out, out_rs),
            10 => panel_rows::<10>(a, kc, w, out, out_rs),
            11 => panel_rows::<11>(a, kc, w, out, out_rs),
            _ => panel_rows::<MR>(a, kc, w, out, out_rs),
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn panel_rows<const R: usize>(a: *const f32, kc: usize, w: *const f32, out: *mut f32, out_rs: usize) {
    // SAFETY: (here and below) inside the extents the caller vouched for.
    unsafe {
        let mut c = [[_mm512_setzero_ps(); 2]; R];
        for (r, c) in c.iter_mut().enumerate() {
            let src = out.add(r * out_rs);
            *c = [_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16))];
        }
        for e in 0..kc {
            let w0 = _mm512_loadu_ps(w.add(e * NR));
            let w1 = _mm512_loadu_ps(w.add(e * NR + 16));
            let a = a.add(e * MR);
            for (r, c) in c.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*a.add(r));
                c[0] = _mm512_fmadd_ps(x, w0, c[0]);
                c[1] = _mm512_fmadd_ps(x, w1, c[1]);
            }
        }
        for (r, c) in c.iter().enumerate() {
            let dst = out.add(r * out_rs);
            _mm512_storeu_ps(dst, c[0]);
            _mm512_storeu_ps(dst.add(16), c[1]);
        }
    }
}
