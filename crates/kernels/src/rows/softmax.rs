//! The online softmax and its `exp`, written once over the vector width
//! ([`Lanes`]): the tiled attention's rows go through them as `ymm` and
//! `zmm` lanes (`attention/tiles.rs`, and `simd.rs` for the decode-sized path), or one
//! lane at a time without AVX2.

use crate::rows::lanes::Lanes;

/// `e^x` for `x <= 0` (and `-inf`), per lane: `x = n·ln2 + r` with `|r| <=
/// ln2/2` and a degree-5 polynomial for `e^r` (fitted for relative error
/// over that range, constant term exactly 1); relative error < 5e-7,
/// `e^0 = 1` exactly, exactly 0 below -87, NaN stays NaN.
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn exp_nonpositive<V: Lanes>(x: V) -> V {
    // SAFETY: (the block) the caller's.
    unsafe {
        // n = round(x / ln2): adding 1.5·2²³ rounds to an integer.
        let magic = V::splat(12_582_912.0);
        let n = magic.fmadd(x, V::splat(std::f32::consts::LOG2_E)).sub(magic);
        // One FMA suffices: f32's ln2 is 1.9e-9 off and |n| <= 126.
        let r = x.fmadd(n, V::splat(-std::f32::consts::LN_2));
        let mut p = V::splat(8.290_317e-3);
        for c in [4.189_793e-2, 1.666_763_6e-1, 4.999_915e-1, 9.999_997e-1, 1.0] {
            p = V::splat(c).fmadd(p, r);
        }
        V::scale_pow2(p, n, x)
    }
}

/// `e^x` for one `x <= 0`: [`exp_nonpositive`] on one lane.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // SAFETY: f32 lanes need no instruction set.
    unsafe { exp_nonpositive::<f32>(x) }
}

/// `tanh(x)` per lane: the odd rational minimax approximation of degrees
/// 13 over 6 that Eigen (`ptanh_float`), XLA and ONNX Runtime's MLAS use,
/// on `x` clamped to ±7.90531 (past which f32's `tanh` rounds to ±1).
/// Odd, so small arguments keep their relative accuracy (where `1 - 2 /
/// (e^2x + 1)` would cancel); relative error < 4e-7; `±inf` gives ±1,
/// NaN stays NaN.
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn tanh<V: Lanes>(x: V) -> V {
    const CLAMP: f32 = 7.905_311;
    // Numerator coefficients of x^13, x^11, ..., x; denominator's of x^6,
    // x^4, x^2, 1.
    const ALPHA: [f32; 7] = [
        -2.760_768_5e-16,
        2.000_188e-13,
        -8.604_672e-11,
        5.122_297e-8,
        1.485_722_4e-5,
        6.372_619_3e-4,
        4.893_524_6e-3,
    ];
    const BETA: [f32; 4] = [1.198_258_4e-6, 1.185_347_1e-4, 2.268_434_6e-3, 4.893_525e-3];
    // SAFETY: (the block) the caller's.
    unsafe {
        // `min` and `max` return their second operand where either is NaN:
        // `x` goes second, so that a NaN passes the clamp.
        let x = V::splat(-CLAMP).max(V::splat(CLAMP).min(x));
        let x2 = x.mul(x);
        let mut p = V::splat(ALPHA[0]);
        for a in &ALPHA[1..] {
            p = V::splat(*a).fmadd(p, x2);
        }
        let mut q = V::splat(BETA[0]);
        for b in &BETA[1..] {
            q = V::splat(*b).fmadd(q, x2);
        }
        p.mul(x).div(q)
    }
}

/// `row[j] = cap · tanh(row[j] / cap)` in place: Gemma 2's logit
/// soft-capping (HF's `attn_logit_softcapping`), whole vectors, then the
/// tail one lane at a time. Monotonic, so a row's largest capped score is
/// [`softcap`] of its largest score.
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn softcap_row<V: Lanes>(row: &mut [f32], cap: f32) {
    let whole = row.len() / V::N * V::N;
    let x = row.as_mut_ptr();
    // SAFETY: (the block) whole vectors inside `row`; the caller's set.
    unsafe {
        let (c, inv) = (V::splat(cap), V::splat(1. / cap));
        for j in (0..whole).step_by(V::N) {
            c.mul(tanh(V::load(x.add(j)).mul(inv))).store(x.add(j));
        }
    }
    for y in &mut row[whole..] {
        *y = softcap(*y, cap);
    }
}

/// `cap · tanh(x / cap)` for one `x`: [`softcap_row`]'s arithmetic on one
/// lane, so that it gives the same result for the same score.
#[inline(always)]
pub(crate) fn softcap(x: f32, cap: f32) -> f32 {
    // SAFETY: f32 lanes need no instruction set.
    cap * unsafe { tanh::<f32>(x * (1. / cap)) }
}

/// The largest score of `row` (a NaN may be skipped): whole vectors, then
/// the tail one at a time.
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn row_max<V: Lanes>(row: &[f32]) -> f32 {
    let whole = row.len() / V::N * V::N;
    // SAFETY: (the block) whole vectors inside `row`; the caller's set.
    unsafe {
        let mut mx = V::splat(f32::NEG_INFINITY);
        for j in (0..whole).step_by(V::N) {
            mx = mx.max(V::load(row.as_ptr().add(j)));
        }
        row[whole..].iter().fold(mx.max_lane(), |m, &x| m.max(x))
    }
}

/// The largest of the `V::N` lanes at `m`: the maxima the AVX-512 scores
/// kernel keeps, reduced.
///
/// # Safety
/// The instruction set of `V` is enabled; `m` holds `V::N` floats.
#[inline(always)]
pub(crate) unsafe fn lanes_max<V: Lanes>(m: *const f32) -> f32 {
    // SAFETY: the caller's.
    unsafe { V::load(m).max_lane() }
}

/// `row[j] = e^(row[j] - max)` in place; the sum. Two vectors a step (the
/// `exp` is one long dependency chain), then one, then the tail.
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn exp_sub_sum<V: Lanes>(row: &mut [f32], max: f32) -> f32 {
    let (n, x) = (row.len(), row.as_mut_ptr());
    // SAFETY: (the block) whole vectors inside `row`; the caller's set.
    unsafe {
        let mv = V::splat(max);
        let (mut s0, mut s1) = (V::zero(), V::zero());
        let mut j = 0;
        while j + 2 * V::N <= n {
            let e0 = exp_nonpositive(V::load(x.add(j)).sub(mv));
            let e1 = exp_nonpositive(V::load(x.add(j + V::N)).sub(mv));
            e0.store(x.add(j));
            e1.store(x.add(j + V::N));
            s0 = s0.add(e0);
            s1 = s1.add(e1);
            j += 2 * V::N;
        }
        if j + V::N <= n {
            let e = exp_nonpositive(V::load(x.add(j)).sub(mv));
            e.store(x.add(j));
            s0 = s0.add(e);
            j += V::N;
        }
        let mut sum = s0.add(s1).sum();
        for y in &mut row[j..] {
            *y = exp(*y - max);
            sum += *y;
        }
        sum
    }
}

/// One row of an attention backward's tile, in place: the scores become
/// the probabilities `p[j] = e^(p[j] − lse)` and the products `dO · Vᵀ`
/// in `ds` become `ds[j] = p[j] · (ds[j] − delta)`, two vectors a step,
/// then one, then the tail. Whether every `ds[j]` came out finite (by
/// their sum): where one did not — a hidden key (`-inf` score, weight 0)
/// whose value is not finite gives `0 · inf` here — the caller
/// recomputes the row with [`prob_grads_exact`].
///
/// # Safety
/// The instruction set of `V` is enabled; `ds` is at least as long as `p`.
#[inline(always)]
pub(crate) unsafe fn prob_grads<V: Lanes>(p: &mut [f32], ds: &mut [f32], lse: f32, delta: f32) -> bool {
    let (n, x, g) = (p.len(), p.as_mut_ptr(), ds.as_mut_ptr());
    debug_assert!(ds.len() >= n);
    // SAFETY: (the block) whole vectors inside both rows; the caller's set.
    unsafe {
        let (lv, dv) = (V::splat(lse), V::splat(delta));
        let (mut s0, mut s1) = (V::zero(), V::zero());
        let mut j = 0;
        while j + 2 * V::N <= n {
            let w0 = exp_nonpositive(V::load(x.add(j)).sub(lv));
            let w1 = exp_nonpositive(V::load(x.add(j + V::N)).sub(lv));
            let g0 = w0.mul(V::load(g.add(j)).sub(dv));
            let g1 = w1.mul(V::load(g.add(j + V::N)).sub(dv));
            w0.store(x.add(j));
            w1.store(x.add(j + V::N));
            g0.store(g.add(j));
            g1.store(g.add(j + V::N));
            s0 = s0.add(g0);
            s1 = s1.add(g1);
            j += 2 * V::N;
        }
        if j + V::N <= n {
            let w = exp_nonpositive(V::load(x.add(j)).sub(lv));
            let gj = w.mul(V::load(g.add(j)).sub(dv));
            w.store(x.add(j));
            gj.store(g.add(j));
            s0 = s0.add(gj);
            j += V::N;
        }
        let mut sum = s0.add(s1).sum();
        for (y, gy) in p[j..].iter_mut().zip(&mut ds[j..n]) {
            *y = exp(*y - lse);
            *gy = *y * (*gy - delta);
            sum += *gy;
        }
        sum.is_finite()
    }
}

/// [`prob_grads`] one score at a time, exact where it gives up: a hidden
/// key (`-inf` score) has weight 0 and gradient 0, whatever its `dO · Vᵀ`
/// or the row's `lse` (`-inf` where the row sees no key).
pub(crate) fn prob_grads_exact(p: &mut [f32], ds: &mut [f32], lse: f32, delta: f32) {
    for (x, g) in p.iter_mut().zip(ds.iter_mut()) {
        let w = if *x == f32::NEG_INFINITY {
            0.
        } else {
            (*x - lse).exp()
        };
        *x = w;
        *g = if w == 0. { 0. } else { w * (*g - delta) };
    }
}

/// Marks a row NaN for good (a NaN or `+inf` score, as PyTorch's
/// softmax gives): NaN max, sum and accumulator; the tile row becomes 0
/// so that the `P · V` product adds nothing to it.
pub(crate) fn poison(row: &mut [f32], m: &mut f32, l: &mut f32, acc: &mut [f32]) {
    *m = f32::NAN;
    *l = f32::NAN;
    acc.fill(f32::NAN);
    row.fill(0.);
}

/// One key block of a row's online softmax, the logic every instruction
/// set shares: the new running max `m` takes the row's scores into account,
/// the row becomes `e^(score - m)`, the sum `l` and the accumulator `acc`
/// are rescaled to the new max and `l` gains the row's sum. A row with no
/// visible key so far becomes 0; a NaN or `+inf` score poisons the row
/// ([`poison`]). The row's max is `known_max` where the caller has it (the
/// AVX-512 scores kernel keeps it), else [`row_max`] (which may skip NaN: a
/// NaN score shows in the sum).
///
/// # Safety
/// The instruction set of `V` is enabled.
#[inline(always)]
pub(crate) unsafe fn online_softmax_block<V: Lanes>(
    row: &mut [f32],
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
    known_max: Option<f32>,
) {
    if m.is_nan() {
        row.fill(0.);
        return;
    }
    // SAFETY: (here and below) the caller's.
    let new_max = m.max(known_max.unwrap_or_else(|| unsafe { row_max::<V>(row) }));
    if new_max == f32::NEG_INFINITY {
        // Every key so far is hidden or scores -inf (weights 0), unless
        // a score is NaN.
        if row.iter().any(|x| x.is_nan()) {
            poison(row, m, l, acc);
        } else {
            row.fill(0.);
        }
        return;
    }
    if new_max == f32::INFINITY {
        poison(row, m, l, acc);
        return;
    }
    let sum = unsafe { exp_sub_sum::<V>(row, new_max) };
    if sum.is_nan() {
        poison(row, m, l, acc);
        return;
    }
    // A row's first visible keys: `l` is 0 and the accumulator holds 0
    // (or NaN from a hidden non-finite value, which a factor of 0 keeps),
    // so rescaling them changes nothing.
    if *m != new_max && *m != f32::NEG_INFINITY {
        let alpha = exp(*m - new_max);
        *l *= alpha;
        for a in acc.iter_mut() {
            *a *= alpha;
        }
    }
    *l += sum;
    *m = new_max;
}

#[cfg(test)]
mod tests {
    use super::exp_nonpositive;
    use crate::rows::lanes::Lanes;

    /// `exp_nonpositive` on `V`'s lanes against std's `exp` over `[-87,
    /// 0]`, and on the special values: -inf and everything below -87 give
    /// exactly 0, 0 gives exactly 1, NaN stays NaN.
    ///
    /// # Safety
    /// The instruction set of `V` is enabled.
    unsafe fn matches_std<V: Lanes>() {
        let mut worst = 0f64;
        let xs: Vec<f32> = (0..=87_000 + V::N)
            .map(|i| -(i.min(87_000) as f32) / 1000.)
            .collect();
        for chunk in xs.chunks_exact(V::N) {
            let mut out = vec![0f32; V::N];
            // SAFETY: the caller's set; `N` floats in and out.
            unsafe { exp_nonpositive(V::load(chunk.as_ptr())).store(out.as_mut_ptr()) };
            for (&x, &y) in chunk.iter().zip(&out) {
                let e = (x as f64).exp();
                worst = worst.max(((y as f64 - e) / e).abs());
            }
        }
        assert!(worst < 5e-7, "{} lanes: worst relative error {worst:e}", V::N);
        let special = [
            f32::NEG_INFINITY,
            -100.,
            -87.5,
            -1e30,
            0.,
            -0.,
            -1e-30,
            -88.,
            f32::NAN,
        ];
        let expected = [0., 0., 0., 0., 1., 1., 1., 0., f32::NAN];
        for (&x, &want) in special.iter().zip(&expected) {
            let (mut buf, mut out) = (vec![x; V::N], vec![0f32; V::N]);
            // SAFETY: as above.
            unsafe { exp_nonpositive(V::load(buf.as_mut_ptr())).store(out.as_mut_ptr()) };
            assert!(
                out.iter().all(|&y| y == want || (y.is_nan() && want.is_nan())),
                "{} lanes: e^{x} = {out:?}",
                V::N
            );
        }
    }

    /// `tanh` on `V`'s lanes against std's (in f64) over `[-10, 10]` in
    /// steps of 1e-4 and down to 1e-30, relative to `|tanh(x)|`; and on
    /// the special values. `softcap_row` equals `softcap` lane for lane,
    /// row tail included.
    ///
    /// # Safety
    /// The instruction set of `V` is enabled.
    unsafe fn tanh_matches_std<V: Lanes>() {
        let mut xs: Vec<f32> = (-100_000..=100_000).map(|i| i as f32 * 1e-4).collect();
        xs.extend((1..=30).flat_map(|e| [10f32.powi(-e), -(10f32.powi(-e))]));
        xs.resize(xs.len().next_multiple_of(V::N), 0.);
        let mut worst = 0f64;
        for chunk in xs.chunks_exact(V::N) {
            let mut out = vec![0f32; V::N];
            // SAFETY: the caller's set; `N` floats in and out.
            unsafe { super::tanh(V::load(chunk.as_ptr())).store(out.as_mut_ptr()) };
            for (&x, &y) in chunk.iter().zip(&out) {
                let t = (x as f64).tanh();
                if t != 0. {
                    worst = worst.max(((y as f64 - t) / t).abs());
                } else {
                    assert_eq!(y, 0., "tanh(0)");
                }
            }
        }
        assert!(worst < 4e-7, "{} lanes: worst relative error {worst:e}", V::N);
        let special = [f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 7.9, 20., f32::NAN];
        let expected = [1., -1., 1., -1., 0.999_999_76, 1., f32::NAN];
        for (&x, &want) in special.iter().zip(&expected) {
            let (buf, mut out) = (vec![x; V::N], vec![0f32; V::N]);
            // SAFETY: as above.
            unsafe { super::tanh(V::load(buf.as_ptr())).store(out.as_mut_ptr()) };
            assert!(
                out.iter()
                    .all(|&y| (y - want).abs() <= 2e-7 || (y.is_nan() && want.is_nan())),
                "{} lanes: tanh({x}) = {out:?}",
                V::N
            );
        }
        let mut row: Vec<f32> = (0..3 * V::N + 5).map(|i| (i as f32 - 20.) * 3.7).collect();
        let want: Vec<f32> = row.iter().map(|&x| super::softcap(x, 30.)).collect();
        // SAFETY: the caller's set.
        unsafe { super::softcap_row::<V>(&mut row, 30.) };
        assert_eq!(row, want, "{} lanes: softcap_row against softcap", V::N);
    }

    #[test]
    fn exp_and_tanh_match_std_on_every_lane_type() {
        // SAFETY: f32 lanes need no instruction set; the others run only
        // where the processor has theirs.
        unsafe {
            matches_std::<f32>();
            tanh_matches_std::<f32>();
        }
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn ymm() {
                unsafe {
                    matches_std::<crate::rows::lanes::Ymm>();
                    tanh_matches_std::<crate::rows::lanes::Ymm>();
                }
            }
            #[target_feature(enable = "avx512f")]
            unsafe fn zmm() {
                unsafe {
                    matches_std::<crate::rows::lanes::Zmm>();
                    tanh_matches_std::<crate::rows::lanes::Zmm>();
                }
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: checked just above.
                unsafe { ymm() };
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: as above.
                unsafe { zmm() };
            }
        }
    }
}
