//! Vectorised row operations: the online softmax of a row, its
//! soft-capping and an attention backward's probabilities and their
//! gradients (`softmax.rs` on the instruction set's lanes), the mask
//! application, the exact and tanh GELUs and SiLU with their derivatives, SiLU times a gate's other
//! half, a finiteness check, LayerNorm's rows. Each is written once as plain
//! Rust and compiled for AVX-512, AVX2+FMA and the baseline; each call
//! takes the instruction set it runs with (at most what the processor
//! has: `runtime/isa.rs`).

use crate::rows::softmax::{exp, online_softmax_block, prob_grads, softcap_row as softcap_lanes};
use crate::runtime::isa::Isa;

/// Lanes of the explicit reductions: float sums and maxes only
/// vectorise when their order is spelled out as independent lanes.
const LANES: usize = 16;

/// `f(x, entry)` for each score of `row` and its mask entry: `entries`
/// holds one per score, or one for all (a mask broadcast along the keys).
#[inline(always)]
fn each_entry<T: Copy>(row: &mut [f32], entries: &[T], f: impl Fn(&mut f32, T)) {
    match entries {
        [one] => row.iter_mut().for_each(|x| f(x, *one)),
        _ => row.iter_mut().zip(entries).for_each(|(x, &e)| f(x, e)),
    }
}

/// `row[j] += data[j]` where `data[j]` is not `-inf` (a hiding entry,
/// applied by `hide_where_neg_inf`).
#[inline(always)]
fn add_visible_impl(row: &mut [f32], data: &[f32]) {
    each_entry(row, data, |x, b| {
        *x += if b == f32::NEG_INFINITY { 0. } else { b }
    });
}

/// `row[j] = -inf` where `data[j]` is `-inf`.
#[inline(always)]
fn hide_where_neg_inf_impl(row: &mut [f32], data: &[f32]) {
    each_entry(row, data, |x, b| *x = if b == f32::NEG_INFINITY { b } else { *x });
}

/// `row[j] = -inf` where `bytes[j]` is non-zero.
#[inline(always)]
fn hide_where_nonzero_impl(row: &mut [f32], bytes: &[u8]) {
    each_entry(row, bytes, |x, b| {
        *x = if b != 0 { f32::NEG_INFINITY } else { *x }
    });
}

/// `row[j] = -inf` where `bytes[j]` is zero.
#[inline(always)]
fn hide_where_zero_impl(row: &mut [f32], bytes: &[u8]) {
    each_entry(row, bytes, |x, b| {
        *x = if b == 0 { f32::NEG_INFINITY } else { *x }
    });
}

/// `max(x, 0)` in place, NaN kept (PyTorch's `relu`); a select, not a
/// branch, so that it vectorises.
#[inline(always)]
fn relu_impl(xs: &mut [f32]) {
    for x in xs {
        *x = if *x < 0. { 0. } else { *x };
    }
}

/// `dx = dy` where `x > 0`, else 0 (NaN included), ReLU's gradient as
/// PyTorch's `threshold_backward` gives it. A select, not a branch.
#[inline(always)]
fn relu_grad_impl(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
        *d = if x > 0. { g } else { 0. };
    }
}

/// `x · Φ(x)` in place, the exact GELU: `Φ(x) = (1 + erf(x / √2)) / 2`
/// with Abramowitz and Stegun's 7.1.26 for `erf` (absolute error below
/// 1.5e-7), written so that `1 + erf` for negative `x` is computed as
/// the small `erfc`, not as a difference. Branch-free, so it
/// vectorises; NaN stays NaN.
#[inline(always)]
fn gelu_erf_impl(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = 0.5 * *x * one_plus_erf(*x);
    }
}

/// `1 + erf(x / √2)`, `2 · Φ(x)`, for [`gelu_erf_impl`] and its
/// derivative.
#[inline(always)]
fn one_plus_erf(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_8, -1.453_152, 1.061_405_4];
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1. / (1. + P * z);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    // erfc(z) for z >= 0.
    let erfc = poly * exp(-z * z);
    if x < 0. {
        erfc
    } else {
        2. - erfc
    }
}

/// `dx = dy · gelu_erf'(x)`, `gelu_erf'(x) = Φ(x) + x · φ(x)` (`φ` the
/// standard normal density). Branch-free, so it vectorises.
#[inline(always)]
fn gelu_erf_grad_impl(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    // 1 / √(2π)
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
        *d = g * (0.5 * one_plus_erf(x) + x * INV_SQRT_2PI * exp(-0.5 * x * x));
    }
}

/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`, the tanh GELU
/// (PyTorch's `approximate='tanh'`, HF's `gelu_new`), as `x · σ(2u)` with
/// `u` the tanh's argument and `σ` from `z = e^-|2u|` as in
/// [`silu_mul_impl`]: no cancellation for negative `x`. Branch-free, so
/// the loops over it vectorise; NaN stays NaN.
#[inline(always)]
fn gelu_tanh_one(x: f32) -> f32 {
    let t = GELU_TWO_C * x * (1. + GELU_A * x * x);
    let z = exp(-t.abs());
    let num = if t < 0. { z } else { 1. };
    x * num / (1. + z)
}

/// `2 · √(2/π)` and the cubic's coefficient of the tanh GELU.
const GELU_TWO_C: f32 = 1.595_769;
const GELU_A: f32 = 0.044_715;

/// `σ(t) = 1 / (1 + e^-t)` from `z = e^-|t|`, so that `exp` only sees
/// non-positive arguments. Branch-free.
#[inline(always)]
fn sigmoid(t: f32) -> f32 {
    let z = exp(-t.abs());
    let num = if t < 0. { z } else { 1. };
    num / (1. + z)
}

/// `dx = dy · gelu_tanh'(x)`: with `s = σ(2u)` ([`gelu_tanh_one`]),
/// `s + x · s · (1 - s) · 2√(2/π) · (1 + 3 · 0.044715 · x²)`.
#[inline(always)]
fn gelu_tanh_grad_impl(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
        let s = sigmoid(GELU_TWO_C * x * (1. + GELU_A * x * x));
        *d = g * (s + x * s * (1. - s) * GELU_TWO_C * (1. + 3. * GELU_A * x * x));
    }
}

/// `x · σ(x)` in place, SiLU ([`sigmoid`]). Branch-free.
#[inline(always)]
fn silu_impl(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x *= sigmoid(*x);
    }
}

/// `dx = dy · silu'(x)`, `silu'(x) = σ(x) · (1 + x · (1 - σ(x)))`.
#[inline(always)]
fn silu_grad_impl(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
        let s = sigmoid(x);
        *d = g * s * (1. + x * (1. - s));
    }
}

/// [`gelu_tanh_one`] in place.
#[inline(always)]
fn gelu_tanh_impl(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = gelu_tanh_one(*x);
    }
}

/// `silu(g) · u` elementwise, `silu(g) = g · σ(g)` with `σ(g) = 1 / (1 +
/// e^-g)` from `z = e^-|g|` (`σ = 1 / (1 + z)` for `g >= 0`, `z / (1 + z)`
/// below), so that `exp` only sees non-positive arguments. Branch-free, so
/// it vectorises; NaN stays NaN.
#[inline(always)]
fn silu_mul_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let z = exp(-g.abs());
        let num = if g < 0. { z } else { 1. };
        *o = g * num / (1. + z) * u;
    }
}

/// `gelu_tanh(g) · u` elementwise ([`gelu_tanh_one`]).
#[inline(always)]
fn gelu_tanh_mul_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh_one(g) * u;
    }
}

/// Whether every element is finite: `x · 0` is 0 for finite `x` and
/// NaN otherwise, summed in independent lanes.
#[inline(always)]
fn all_finite_impl(xs: &[f32]) -> bool {
    let mut lanes = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x * 0.;
        }
    }
    tail.iter().all(|x| x.is_finite()) && lanes.iter().all(|&s| s == 0.)
}

/// `Σ f(x)` over `xs`, in 16 interleaved partial sums (so that it
/// vectorises) added at the end: the same order, so the same sum, whatever
/// the vector width.
#[inline(always)]
fn lane_sum(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for chunk in chunks {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += f(x);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// One row of `torch.nn.LayerNorm`: `out = (x - mean) / √(var + eps) · w
/// + bias` for `x = a` (or `a + b`), the mean and the biased variance in
/// two passes over the row as it sits in `out`. Every slice is the row's
/// length (a panic otherwise); `out` may start uninitialised.
#[inline(always)]
fn layer_norm_row_impl(
    a: &[f32],
    b: Option<&[f32]>,
    w: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    let d = out.len();
    assert!(
        a.len() == d && b.is_none_or(|b| b.len() == d) && w.len() == d && bias.len() == d,
        "layer_norm_row: slices of unequal lengths"
    );
    match b {
        Some(b) => {
            for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
                o.write(a + b);
            }
        }
        None => {
            for (o, &a) in out.iter_mut().zip(a) {
                o.write(a);
            }
        }
    }
    // SAFETY: the loop above wrote every float of `out` (`a` and `b` are
    // its length, asserted above).
    let out = unsafe { &mut *(out as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
    let mean = lane_sum(out, |x| x) / d as f32;
    let var = lane_sum(out, |x| (x - mean) * (x - mean)) / d as f32;
    let inv = 1. / (var + eps).sqrt();
    for ((o, w), b) in out.iter_mut().zip(w).zip(bias) {
        *o = (*o - mean) * inv * w + b;
    }
}

/// One key block of a row's online softmax ([`online_softmax_block`]) on
/// the widest lanes `isa` has (any row length: whole vectors, then the
/// tail one lane at a time).
pub(crate) fn online_softmax_row(isa: Isa, row: &mut [f32], m: &mut f32, l: &mut f32, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::rows::lanes::{Ymm, Zmm};
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(row: &mut [f32], m: &mut f32, l: &mut f32, acc: &mut [f32]) {
            // SAFETY: this function's set.
            unsafe { online_softmax_block::<Zmm>(row, m, l, acc, None) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(row: &mut [f32], m: &mut f32, l: &mut f32, acc: &mut [f32]) {
            // SAFETY: this function's set.
            unsafe { online_softmax_block::<Ymm>(row, m, l, acc, None) }
        }
        match isa {
            // SAFETY: `isa` never exceeds what was detected.
            Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512(row, m, l, acc) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(row, m, l, acc) },
            Isa::Portable => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: one-lane f32 needs no instruction set.
    unsafe { online_softmax_block::<f32>(row, m, l, acc, None) }
}

/// `row[j] = cap · tanh(row[j] / cap)` in place ([`softcap_row`]) on
/// the widest lanes `isa` has.
pub(crate) fn softcap_row(isa: Isa, row: &mut [f32], cap: f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::rows::lanes::{Ymm, Zmm};
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(row: &mut [f32], cap: f32) {
            // SAFETY: this function's set.
            unsafe { softcap_lanes::<Zmm>(row, cap) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(row: &mut [f32], cap: f32) {
            // SAFETY: this function's set.
            unsafe { softcap_lanes::<Ymm>(row, cap) }
        }
        match isa {
            // SAFETY: `isa` never exceeds what was detected.
            Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512(row, cap) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(row, cap) },
            Isa::Portable => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: one-lane f32 needs no instruction set.
    unsafe { softcap_lanes::<f32>(row, cap) }
}

/// One row of an attention backward's tile ([`prob_grads`]) on the
/// widest lanes `isa` has: whether every gradient came out finite.
pub(crate) fn prob_grads_row(isa: Isa, p: &mut [f32], ds: &mut [f32], lse: f32, delta: f32) -> bool {
    assert!(ds.len() >= p.len(), "prob_grads_row: ds shorter than p");
    #[cfg(target_arch = "x86_64")]
    {
        use crate::rows::lanes::{Ymm, Zmm};
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(p: &mut [f32], ds: &mut [f32], lse: f32, delta: f32) -> bool {
            // SAFETY: this function's set; the lengths checked above.
            unsafe { prob_grads::<Zmm>(p, ds, lse, delta) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(p: &mut [f32], ds: &mut [f32], lse: f32, delta: f32) -> bool {
            // SAFETY: as above.
            unsafe { prob_grads::<Ymm>(p, ds, lse, delta) }
        }
        match isa {
            // SAFETY: `isa` never exceeds what was detected.
            Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512(p, ds, lse, delta) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(p, ds, lse, delta) },
            Isa::Portable => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: one-lane f32 needs no instruction set; the lengths as above.
    unsafe { prob_grads::<f32>(p, ds, lse, delta) }
}

/// `$name(isa, args)`: `$impl(args)` compiled for the widest lanes `isa`
/// has (at most what the processor runs).
macro_rules! dispatch {
    ($name:ident, $impl:ident, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        pub(crate) fn $name(isa: Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $impl($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $impl($($arg),*)
                }
                match isa {
                    // SAFETY: `isa` never exceeds what was detected.
                    Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Portable => {}
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            $impl($($arg),*)
        }
    };
}

dispatch!(add_visible, add_visible_impl, (row: &mut [f32], data: &[f32]));
dispatch!(hide_where_neg_inf, hide_where_neg_inf_impl, (row: &mut [f32], data: &[f32]));
dispatch!(hide_where_nonzero, hide_where_nonzero_impl, (row: &mut [f32], bytes: &[u8]));
dispatch!(hide_where_zero, hide_where_zero_impl, (row: &mut [f32], bytes: &[u8]));
dispatch!(all_finite, all_finite_impl, (xs: &[f32]) -> bool);
dispatch!(layer_norm_row, layer_norm_row_impl, (a: &[f32], b: Option<&[f32]>, w: &[f32], bias: &[f32], eps: f32, out: &mut [std::mem::MaybeUninit<f32>]));
dispatch!(gelu_erf, gelu_erf_impl, (xs: &mut [f32]));
dispatch!(gelu_tanh, gelu_tanh_impl, (xs: &mut [f32]));
dispatch!(silu, silu_impl, (xs: &mut [f32]));
dispatch!(gelu_erf_grad, gelu_erf_grad_impl, (x: &[f32], dy: &[f32], dx: &mut [f32]));
dispatch!(gelu_tanh_grad, gelu_tanh_grad_impl, (x: &[f32], dy: &[f32], dx: &mut [f32]));
dispatch!(silu_grad, silu_grad_impl, (x: &[f32], dy: &[f32], dx: &mut [f32]));
dispatch!(relu, relu_impl, (xs: &mut [f32]));
dispatch!(relu_grad, relu_grad_impl, (x: &[f32], dy: &[f32], dx: &mut [f32]));
dispatch!(silu_mul, silu_mul_impl, (gate: &[f32], up: &[f32], out: &mut [f32]));
dispatch!(gelu_tanh_mul, gelu_tanh_mul_impl, (gate: &[f32], up: &[f32], out: &mut [f32]));

#[cfg(test)]
mod tests {
    use crate::runtime::isa::{supported, Isa};

    /// `f`'s worst error against `exact` (in f64) over `-12..=12` in steps
    /// of 1e-3, relative to `max(1, |x|)`; and `f` of NaN, -inf, +inf, 0;
    /// on every instruction set the processor runs, the worst of them.
    fn against(f: fn(Isa, &mut [f32]), exact: impl Fn(f64) -> f64) -> (f64, [f32; 4]) {
        let mut all = supported()
            .into_iter()
            .map(|isa| against_on(|xs| f(isa, xs), &exact));
        let first = all.next().expect("portable code runs everywhere");
        all.fold(first, |(worst, special), (w, s)| {
            let same = special
                .iter()
                .zip(&s)
                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
            assert!(
                same,
                "special values differ by instruction set: {special:?} vs {s:?}"
            );
            (worst.max(w), special)
        })
    }

    fn against_on(f: impl Fn(&mut [f32]), exact: impl Fn(f64) -> f64) -> (f64, [f32; 4]) {
        let xs: Vec<f32> = (-12_000..=12_000).map(|i| i as f32 / 1000.).collect();
        let mut ys = xs.clone();
        f(&mut ys);
        let worst = xs.iter().zip(&ys).fold(0f64, |worst, (&x, &y)| {
            let x = x as f64;
            worst.max((y as f64 - exact(x)).abs() / x.abs().max(1.))
        });
        let mut special = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.];
        f(&mut special);
        (worst, special)
    }

    /// Against `x · (1 + erf(x / √2)) / 2` in f64, with `erf` from its
    /// Taylor series (|x| <= 3) and continued fraction (beyond).
    #[test]
    fn gelu_matches_the_exact_gelu() {
        fn erf(x: f64) -> f64 {
            if x.abs() <= 3. {
                // erf(x) = 2/√π Σ (-1)^n x^(2n+1) / (n! (2n+1))
                let (mut term, mut sum) = (x, x);
                for n in 1..200 {
                    term *= -x * x / n as f64;
                    sum += term / (2 * n + 1) as f64;
                }
                sum * 2. / std::f64::consts::PI.sqrt()
            } else {
                // erfc(x) = e^(-x²)/√π · 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...))))
                let a = x.abs();
                let mut f = a;
                for n in (1..60).rev() {
                    f = a + (n as f64 / 2.) / f;
                }
                let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / f;
                x.signum() * (1. - erfc)
            }
        }
        let (worst, special) = against(super::gelu_erf, |x| {
            0.5 * x * (1. + erf(x / std::f64::consts::SQRT_2))
        });
        assert!(worst < 1e-6, "worst error {worst:e} (relative to max(1, |x|))");
        // -inf · 0 is NaN, as candle's `gelu_erf` gives.
        assert!(special[0].is_nan() && special[1].is_nan());
        assert_eq!(special[2..], [f32::INFINITY, 0.]);
    }

    /// Against `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` in
    /// f64 (std's `tanh`), and on NaN and infinities as candle's `gelu`.
    #[test]
    fn gelu_tanh_matches_its_formula() {
        let (worst, special) = against(super::gelu_tanh, |x| {
            let u = (2. / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1. + u.tanh())
        });
        assert!(worst < 1e-6, "worst error {worst:e} (relative to max(1, |x|))");
        assert!(special[0].is_nan() && special[1].is_nan());
        assert_eq!(special[2..], [f32::INFINITY, 0.]);
    }

    #[test]
    fn exp_matches_std_on_its_range() {
        let mut worst = 0f64;
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.;
            let (a, b) = (super::exp(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 1e-6, "worst relative error {worst:e}");
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.);
        assert_eq!(super::exp(-100.), 0.);
    }
}
