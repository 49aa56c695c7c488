//! The two products of a decode-sized attention tile (fewer query rows
//! than the packed micro-kernels want, `tile::MIN_Q_LEN`), read in place,
//! each key and value row once; written once over the vector width
//! ([`Lanes`]) and instantiated for `ymm` (AVX2+FMA+F16C) and `zmm`
//! (AVX-512F). Keys and values are f32, bf16 or f16 ([`PanelElem`]), as
//! a cache stores them, widened as they load; queries, scores and sums
//! are f32.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

use crate::elem::PanelElem;
use crate::rows::lanes::Lanes;

/// Keys ahead of the one in use whose rows are prefetched into L1.
const PF_KEYS: usize = 16;

/// `Σₑ a[e] · b[e]` over `d` elements, two accumulators of lanes and a
/// scalar tail.
///
/// # Safety
/// The instruction set of `V` is enabled; `a` and `b` hold `d` elements.
#[inline(always)]
unsafe fn dot<V: Lanes, E: PanelElem>(a: *const f32, b: *const E, d: usize) -> f32 {
    // SAFETY: (the block) e + N <= d inside the loops.
    unsafe {
        let (mut s0, mut s1) = (V::zero(), V::zero());
        let mut e = 0;
        while e + 2 * V::N <= d {
            s0 = s0.fmadd(V::load(a.add(e)), V::load_elem(b.add(e)));
            s1 = s1.fmadd(V::load(a.add(e + V::N)), V::load_elem(b.add(e + V::N)));
            e += 2 * V::N;
        }
        if e + V::N <= d {
            s0 = s0.fmadd(V::load(a.add(e)), V::load_elem(b.add(e)));
            e += V::N;
        }
        let mut s = s0.add(s1).sum();
        for e in e..d {
            s += *a.add(e) * (*b.add(e)).to_f32();
        }
        s
    }
}

/// `tile[r·cols + j] = scale · q_r · k_j` for `rows` query rows (row stride
/// `q_rs`) and `cols` keys (row stride `k_rs`), `d` dims each: `N` keys at
/// a time into `N` accumulators summed by one transposing tree
/// ([`Lanes::sums`]) where `d` is a whole number of vectors, one key at a
/// time otherwise and for the last keys.
///
/// # Safety
/// The instruction set of `V` is enabled; the pointers cover the extents.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn scores<V: Lanes, E: PanelElem>(
    rows: usize,
    q: *const f32,
    q_rs: usize,
    k: *const E,
    k_rs: usize,
    cols: usize,
    d: usize,
    scale: f32,
    tile: &mut [f32],
) {
    let prefetch = |j: usize| {
        if j + PF_KEYS < cols {
            // SAFETY: key j + PF_KEYS < cols is in bounds.
            let ahead = unsafe { k.add((j + PF_KEYS) * k_rs) };
            for l in (0..d).step_by(64 / size_of::<E>()) {
                // SAFETY: within the key's d elements.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.add(l) as *const i8) };
            }
        }
    };
    let mut j = 0;
    if d.is_multiple_of(V::N) {
        // SAFETY: (the block) keys j..j + N < cols and row r < rows, d
        // dims each; the tile holds rows · cols.
        unsafe {
            let scale = V::splat(scale);
            while j + V::N <= cols {
                for i in 0..V::N {
                    prefetch(j + i);
                }
                for r in 0..rows {
                    let q = q.add(r * q_rs);
                    // Room for the widest vector's N (16) accumulators.
                    let mut acc = [V::zero(); 16];
                    for e in (0..d).step_by(V::N) {
                        let qv = V::load(q.add(e));
                        for (i, acc) in acc[..V::N].iter_mut().enumerate() {
                            *acc = acc.fmadd(qv, V::load_elem(k.add((j + i) * k_rs + e)));
                        }
                    }
                    V::sums(&acc)
                        .mul(scale)
                        .store(tile.as_mut_ptr().add(r * cols + j));
                }
                j += V::N;
            }
        }
    }
    for j in j..cols {
        prefetch(j);
        for r in 0..rows {
            // SAFETY: row r < rows, key j < cols, d dims each.
            tile[r * cols + j] = scale * unsafe { dot::<V, E>(q.add(r * q_rs), k.add(j * k_rs), d) };
        }
    }
}

/// `acc[r·dv + c] += Σⱼ p[r·cols + j] · v[j·v_rs + c]` for `rows` rows,
/// `cols` keys and `dv` columns: blocks of up to 4 vectors of columns kept
/// in two sets of accumulators (even and odd keys) across the keys, or on
/// `ymm` blocks of 8 in one set (with 16 registers, AVX2 keeps a row's 64
/// columns in one pass over the keys rather than two).
///
/// # Safety
/// The instruction set of `V` is enabled; `v` covers `cols` rows of `dv`.
#[inline(always)]
unsafe fn weighted_values<V: Lanes, E: PanelElem>(
    rows: usize,
    p: &[f32],
    cols: usize,
    v: *const E,
    v_rs: usize,
    dv: usize,
    acc: &mut [f32],
) {
    /// Columns `c0..c0 + NV·N` of row r, in `SETS` sets of accumulators
    /// (set `s` takes keys `s`, `s + SETS`, …): two for up to 4 vectors,
    /// one for 8 `ymm` vectors (64 columns), where two sets would take all
    /// 16 registers, so that each value row is read in one pass rather
    /// than in two of half a row each.
    #[inline(always)]
    unsafe fn block<V: Lanes, E: PanelElem, const NV: usize, const SETS: usize>(
        p: &[f32],
        v: *const E,
        v_rs: usize,
        c0: usize,
        acc: *mut f32,
    ) {
        const { assert!(SETS == 1 || SETS == 2) };
        // SAFETY: (the block) the caller's extents.
        unsafe {
            let mut a: [[V; NV]; SETS] = [[V::zero(); NV]; SETS];
            a[0] = std::array::from_fn(|i| V::load(acc.add(c0 + i * V::N)));
            let mut keys = p.chunks_exact(SETS);
            let mut row = v.add(c0);
            for (step, pj) in (&mut keys).enumerate() {
                if SETS * step + PF_KEYS < p.len() {
                    for l in (0..NV * V::N).step_by(64 / size_of::<E>()) {
                        for s in 0..SETS {
                            let ahead = row.wrapping_add((PF_KEYS + s) * v_rs + l);
                            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                        }
                    }
                }
                for (s, a) in a.iter_mut().enumerate() {
                    let ps = V::splat(pj[s]);
                    for (i, a) in a.iter_mut().enumerate() {
                        *a = a.fmadd(ps, V::load_elem(row.add(s * v_rs + i * V::N)));
                    }
                }
                row = row.wrapping_add(SETS * v_rs);
            }
            // One key left at most (`SETS` is 1 or 2).
            if let Some(&pj) = keys.remainder().first() {
                let p0 = V::splat(pj);
                for (i, a) in a[0].iter_mut().enumerate() {
                    *a = a.fmadd(p0, V::load_elem(row.add(i * V::N)));
                }
            }
            for i in 0..NV {
                let sum = a[1..].iter().fold(a[0][i], |t, set| t.add(set[i]));
                sum.store(acc.add(c0 + i * V::N));
            }
        }
    }
    for r in 0..rows {
        let (p, acc) = (&p[r * cols..][..cols], &mut acc[r * dv..][..dv]);
        let mut c0 = 0;
        // SAFETY: blocks stay within dv columns.
        unsafe {
            // 64 columns a pass: 4 `zmm` vectors (two sets), 8 `ymm`.
            while V::N == 8 && c0 + 8 * V::N <= dv {
                block::<V, E, 8, 1>(p, v, v_rs, c0, acc.as_mut_ptr());
                c0 += 8 * V::N;
            }
            while c0 + 4 * V::N <= dv {
                block::<V, E, 4, 2>(p, v, v_rs, c0, acc.as_mut_ptr());
                c0 += 4 * V::N;
            }
            while c0 + V::N <= dv {
                block::<V, E, 1, 2>(p, v, v_rs, c0, acc.as_mut_ptr());
                c0 += V::N;
            }
        }
        for (c, a) in acc.iter_mut().enumerate().skip(c0) {
            // SAFETY: key j < cols, column c < dv.
            *a += p
                .iter()
                .enumerate()
                .map(|(j, &pj)| pj * unsafe { *v.add(j * v_rs + c) }.to_f32())
                .sum::<f32>();
        }
    }
}

/// The instances of the generic kernels for one lane type, each compiled
/// with its instruction set enabled.
macro_rules! instances {
    ($(#[$doc:meta])* $name:ident, $lanes:ty, $features:literal) => {
        $(#[$doc])*
        pub(crate) mod $name {
            /// [`super::scores`] on these lanes.
            ///
            /// # Safety
            /// The instruction set; as [`super::scores`].
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn scores<E: crate::elem::PanelElem>(
                rows: usize,
                q: *const f32,
                q_rs: usize,
                k: *const E,
                k_rs: usize,
                cols: usize,
                d: usize,
                scale: f32,
                tile: &mut [f32],
            ) {
                // SAFETY: forwarded.
                unsafe { super::scores::<$lanes, E>(rows, q, q_rs, k, k_rs, cols, d, scale, tile) }
            }

            /// [`super::weighted_values`] on these lanes.
            ///
            /// # Safety
            /// The instruction set; as [`super::weighted_values`].
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn weighted_values<E: crate::elem::PanelElem>(
                rows: usize,
                p: &[f32],
                cols: usize,
                v: *const E,
                v_rs: usize,
                dv: usize,
                acc: &mut [f32],
            ) {
                // SAFETY: forwarded.
                unsafe { super::weighted_values::<$lanes, E>(rows, p, cols, v, v_rs, dv, acc) }
            }
        }
    };
}

instances!(
    /// The AVX-512F instances.
    zmm, crate::rows::lanes::Zmm, "avx512f"
);
instances!(
    /// The AVX2+FMA+F16C instances.
    ymm, crate::rows::lanes::Ymm, "avx2,fma,f16c"
);
