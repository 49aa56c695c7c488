//! The attention tiles' two products as AVX-512F micro-kernels, over the
//! same packed keys and values as the AVX2 ones (`avx2.rs`, panels of 16):
//! a group of [`MR`] query rows against two panels at a time, 24 `zmm`
//! accumulators, 24 FMAs per 2 panel loads and 12 broadcasts. The online
//! softmax between them is the AVX2 one (`avx2::online_softmax`).

use std::arch::x86_64::*;

use super::avx2::NR;

/// Query rows per micro-kernel.
pub(super) const MR: usize = 12;

/// Picks the micro-kernel instance for a group of `rows` (1..=MR).
macro_rules! by_rows {
    ($rows:expr, $f:ident$(::<_, $acc:tt>)?($($arg:expr),*)) => {
        match $rows {
            1 => $f::<1 $(, $acc)?>($($arg),*),
            2 => $f::<2 $(, $acc)?>($($arg),*),
            3 => $f::<3 $(, $acc)?>($($arg),*),
            4 => $f::<4 $(, $acc)?>($($arg),*),
            5 => $f::<5 $(, $acc)?>($($arg),*),
            6 => $f::<6 $(, $acc)?>($($arg),*),
            7 => $f::<7 $(, $acc)?>($($arg),*),
            8 => $f::<8 $(, $acc)?>($($arg),*),
            9 => $f::<9 $(, $acc)?>($($arg),*),
            10 => $f::<10 $(, $acc)?>($($arg),*),
            11 => $f::<11 $(, $acc)?>($($arg),*),
            _ => $f::<MR $(, $acc)?>($($arg),*),
        }
    };
}

/// `out[r·out_rs + c] = Σₑ q[r·q_rs + e] · Kᵀ[e, c]` for `rows` rows, `d`
/// dims and `panels · NR` keys.
///
/// # Safety
/// AVX-512F; the pointers cover those extents.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores(
    rows: usize,
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const f32,
    panels: usize,
    out: *mut f32,
    out_rs: usize,
) {
    // SAFETY: forwarded.
    unsafe { by_rows!(rows, scores_rows(q, q_rs, d, kt, panels, out, out_rs)) }
}

#[target_feature(enable = "avx512f")]
unsafe fn scores_rows<const R: usize>(
    q: *const f32,
    q_rs: usize,
    d: usize,
    kt: *const f32,
    panels: usize,
    out: *mut f32,
    out_rs: usize,
) {
    let mut pi = 0;
    // SAFETY: (here and below) inside the extents the caller vouched for.
    unsafe {
        while pi + 2 <= panels {
            let (k0, k1) = (kt.add(pi * d * NR), kt.add((pi + 1) * d * NR));
            let mut c = [[_mm512_setzero_ps(); 2]; R];
            for e in 0..d {
                let w0 = _mm512_loadu_ps(k0.add(e * NR));
                let w1 = _mm512_loadu_ps(k1.add(e * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*q.add(r * q_rs + e));
                    c[0] = _mm512_fmadd_ps(a, w0, c[0]);
                    c[1] = _mm512_fmadd_ps(a, w1, c[1]);
                }
            }
            for (r, c) in c.iter().enumerate() {
                let dst = out.add(r * out_rs + pi * NR);
                _mm512_storeu_ps(dst, c[0]);
                _mm512_storeu_ps(dst.add(NR), c[1]);
            }
            pi += 2;
        }
        if pi < panels {
            let k0 = kt.add(pi * d * NR);
            let mut c = [_mm512_setzero_ps(); R];
            for e in 0..d {
                let w0 = _mm512_loadu_ps(k0.add(e * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    *c = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(r * q_rs + e)), w0, *c);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * out_rs + pi * NR), *c);
            }
        }
    }
}

/// `acc[r·dvp + p·NR + c] += Σⱼ strip[r·strip_rs + j] · v[p·panel + j·NR
/// + c]` for `rows` rows, `cols` keys and all `dvp / NR` panels.
///
/// # Safety
/// AVX-512F; the pointers cover those extents.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn weighted_values(
    rows: usize,
    strip: *const f32,
    strip_rs: usize,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe {
        by_rows!(
            rows,
            weighted_values_rows(strip, strip_rs, v, panel, dvp, cols, acc)
        )
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn weighted_values_rows<const R: usize>(
    strip: *const f32,
    strip_rs: usize,
    v: *const f32,
    panel: usize,
    dvp: usize,
    cols: usize,
    acc: *mut f32,
) {
    let panels = dvp / NR;
    let mut pi = 0;
    // SAFETY: (here and below) inside the extents the caller vouched for.
    unsafe {
        while pi + 2 <= panels {
            let (v0p, v1p) = (v.add(pi * panel), v.add((pi + 1) * panel));
            let mut c = [[_mm512_setzero_ps(); 2]; R];
            for (r, c) in c.iter_mut().enumerate() {
                let src = acc.add(r * dvp + pi * NR);
                *c = [_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(NR))];
            }
            for j in 0..cols {
                let v0 = _mm512_loadu_ps(v0p.add(j * NR));
                let v1 = _mm512_loadu_ps(v1p.add(j * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*strip.add(r * strip_rs + j));
                    c[0] = _mm512_fmadd_ps(a, v0, c[0]);
                    c[1] = _mm512_fmadd_ps(a, v1, c[1]);
                }
            }
            for (r, c) in c.iter().enumerate() {
                let dst = acc.add(r * dvp + pi * NR);
                _mm512_storeu_ps(dst, c[0]);
                _mm512_storeu_ps(dst.add(NR), c[1]);
            }
            pi += 2;
        }
        if pi < panels {
            let v0p = v.add(pi * panel);
            let mut c = [_mm512_setzero_ps(); R];
            for (r, c) in c.iter_mut().enumerate() {
                *c = _mm512_loadu_ps(acc.add(r * dvp + pi * NR));
            }
            for j in 0..cols {
                let v0 = _mm512_loadu_ps(v0p.add(j * NR));
                for (r, c) in c.iter_mut().enumerate() {
                    *c = _mm512_fmadd_ps(_mm512_set1_ps(*strip.add(r * strip_rs + j)), v0, *c);
                }
            }
            for (r, c) in c.iter().enumerate() {
                _mm512_storeu_ps(acc.add(r * dvp + pi * NR), *c);
            }
        }
    }
}
