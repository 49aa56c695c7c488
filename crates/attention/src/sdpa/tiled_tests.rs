//! The tiled CPU path against the reference path, on every instruction set,
//! tile implementation and packing the processor runs.

use candle::{DType, Device, Result, Tensor};

use multihead_kernels::attention::{Packing, TileOptions, Tiles};
use multihead_kernels::isa::{supported, Isa};
use multihead_test_support::compare::rel_err;
use multihead_test_support::random::randn;

use super::sdpa_tiled_with;
use crate::mask::{Alibi, AttnMask, Causal, KeyPaddingMask, Mask};
use crate::sdpa::sdpa_reference;

/// [`sdpa_tiled_with`] with the instruction set, the tiles and the
/// packing forced.
#[allow(clippy::too_many_arguments)]
fn forced(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
    isa: Isa,
    tiles: Tiles,
    packing: Packing,
) -> Result<Tensor> {
    let options = TileOptions {
        tiles: Some(tiles),
        packing: Some(packing),
        isa: Some(isa),
    };
    sdpa_tiled_with(q, k, v, mask, 0, scale, options, None)
}

/// Every tile implementation `isa` runs, the packed ones with each
/// packing.
fn runnable_tiles(isa: Isa) -> Vec<(Tiles, Packing)> {
    let mut tiles = vec![(Tiles::Gemm, Packing::Shared)];
    let mut packed = |t| tiles.extend([(t, Packing::Shared), (t, Packing::PerThread)]);
    if cfg!(target_arch = "x86_64") && isa >= Isa::Avx2 {
        packed(Tiles::Avx2);
    }
    if cfg!(target_arch = "x86_64") && isa >= Isa::Avx512 {
        packed(Tiles::Avx512);
    }
    tiles
}

/// Every tile implementation this CPU runs, forced, under every
/// instruction set it runs, equals the reference path, including shapes
/// `Tiles::best` would not give it: single query rows for the
/// micro-kernels, partial row groups, key counts off the panel and
/// block sizes, value widths off the panel width; decode-sized blocks
/// (the kernels' `attention/decode.rs` products) with dims off the vector widths,
/// grouped heads taken together.
#[test]
fn every_tile_implementation_equals_reference() -> Result<()> {
    for isa in supported() {
        every_tile_implementation_equals_reference_under(isa)?;
    }
    Ok(())
}

fn every_tile_implementation_equals_reference_under(isa: Isa) -> Result<()> {
    let tiles = runnable_tiles(isa);
    // (batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim)
    let shapes = [
        (1, 2, 2, 1, 300, 64, 64),
        (2, 3, 1, 7, 17, 8, 8),
        (1, 4, 2, 3, 530, 37, 75),
        (1, 2, 2, 100, 257, 64, 24),
        (2, 4, 2, 37, 530, 40, 72),
        (1, 1, 1, 200, 5, 256, 256),
        // Decode-sized grouped heads, which a unit takes together (one
        // row a head, or several) on up to 4, 8 and 64 threads.
        (2, 6, 2, 1, 530, 64, 64),
        (2, 8, 4, 2, 600, 40, 24),
        (2, 64, 32, 1, 520, 16, 16),
    ];
    for (b, h, kh, l, s, d, dv) in shapes {
        // The queries as a projection's heads are: a view of (B, L, H,
        // D), rows H·D apart, heads D.
        let (q, k, v) = (
            randn(&[b, l, h, d])?.transpose(1, 2)?,
            randn(&[b, kh, s, d])?,
            randn(&[b, kh, s, dv])?,
        );
        let lengths: Vec<usize> = (0..b).map(|i| s - i * s / 2).collect();
        let masks = [
            Mask::new(),
            Mask::causal(Causal::TopLeft),
            Mask::causal(Causal::BottomRight),
            Mask::causal(Causal::Offset(2)),
            Mask::causal(Causal::TopLeft)
                .with_attn(AttnMask::Additive(randn(&[l, s])?))
                .with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &Device::Cpu)?),
            // Windows narrower and wider than a key block and a panel.
            Mask::causal(Causal::BottomRight).with_window(3),
            Mask::causal(Causal::BottomRight)
                .with_window(70)
                .with_alibi(Alibi::new(h)),
            Mask::new().with_alibi(Alibi::new(h)),
            // Soft-capped: tight (most scores on the tanh's bend), with
            // every other kind of part, and Gemma 2's 50.
            Mask::new().with_softcap(1.5),
            Mask::causal(Causal::BottomRight)
                .with_window(70)
                .with_alibi(Alibi::new(h))
                .with_attn(AttnMask::Additive(randn(&[l, s])?))
                .with_softcap(0.7),
            Mask::causal(Causal::TopLeft)
                .with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &Device::Cpu)?)
                .with_softcap(50.),
        ];
        for (m, mask) in masks.iter().enumerate() {
            let scale = 0.7 / (d as f64).sqrt().max(1.);
            let reference = sdpa_reference(&q, &k, &v, mask, 0, Some(scale), None)?.0;
            for &(t, packing) in &tiles {
                let ours = forced(&q, &k, &v, mask, scale, isa, t, packing)?;
                let err = rel_err(&ours, &reference)?;
                let what = format!(
                    "{isa:?} {t:?} {packing:?} shape {:?} mask {m}",
                    (b, h, kh, l, s, d, dv)
                );
                assert!(err < 1e-5, "{what}: relative error {err:e}");
            }
        }
    }
    Ok(())
}

/// Scores far from 0 (hundreds, all negative for some rows) give the
/// reference's result on every tile implementation and instruction
/// set: the row max the AVX-512 scores kernel keeps must be the row's
/// (a max off by more than about 87 turns every weight to 0 or `inf`),
/// and must leave out the zero-padded keys of a last panel. Scores this
/// large carry absolute rounding errors of about 1e-5 between summation
/// orders, so the weights agree to about that, not to 1e-7; a wrong max
/// is off by orders of magnitude more.
#[test]
fn far_from_zero_scores_equal_reference_on_every_variant() -> Result<()> {
    // (batch, heads, q_len, kv_len, head_dim): key counts off the panel.
    for (b, h, l, s, d) in [(1, 2, 40, 37, 64), (2, 1, 30, 300, 16)] {
        let offset = |t: Tensor, by: f64| -> Result<Tensor> { t.affine(1., by) };
        let cases = [
            // Every score about -17.5·√d (-140 at d = 64): all negative.
            (
                offset(randn(&[b, h, l, d])?, 5.)?,
                offset(randn(&[b, h, s, d])?, -5.)?,
            ),
            // Scores of either sign, hundreds apart.
            ((randn(&[b, h, l, d])? * 8.)?, (randn(&[b, h, s, d])? * 8.)?),
        ];
        let v = randn(&[b, h, s, d])?;
        for (c, (q, k)) in cases.iter().enumerate() {
            // Soft-capped, the scores sit on the cap, where a capped
            // row max must still be the row's.
            let masks = [
                Mask::new(),
                Mask::causal(Causal::BottomRight),
                Mask::causal(Causal::BottomRight).with_softcap(30.),
            ];
            for mask in masks {
                let scale = 0.7 / (d as f64).sqrt();
                let reference = sdpa_reference(q, k, &v, &mask, 0, Some(scale), None)?.0;
                for isa in supported() {
                    for (t, packing) in runnable_tiles(isa) {
                        let ours = forced(q, k, &v, &mask, scale, isa, t, packing)?;
                        let err = rel_err(&ours, &reference)?;
                        let what = format!(
                            "{isa:?} {t:?} {packing:?} case {c} {:?} causal {:?}",
                            (b, h, l, s, d),
                            mask.causal
                        );
                        assert!(err < 1e-3, "{what}: relative error {err:e}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// bf16 and f16 keys and values (a half-precision cache beside f32
/// queries), read in place, give the f32 path's result over the same
/// values, bit for bit, under every instruction set and through every
/// tile implementation it runs: widened as the direct products load
/// them, as the packed tiles pack them (with each packing), or a tile
/// at a time for `gemm`. The output comes in the queries' dtype.
#[test]
fn half_precision_keys_and_values_equal_the_f32_path_over_them() -> Result<()> {
    let dev = Device::Cpu;
    // (batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim):
    // dims on and off the vector widths, grouped heads, a prefill.
    let shapes = [
        (1, 4, 2, 1, 600, 64, 64),
        (2, 3, 1, 5, 37, 37, 75),
        (2, 2, 2, 20, 40, 16, 16),
    ];
    for isa in supported() {
        for (b, h, kh, l, s, d, dv) in shapes {
            let q = randn(&[b, h, l, d])?;
            let masks = [
                Mask::new(),
                Mask::causal(Causal::BottomRight).with_window(9),
                Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&vec![s - 3; b], s, &dev)?),
            ];
            for dtype in [DType::BF16, DType::F16] {
                let (k, v) = (
                    randn(&[b, kh, s, d])?.to_dtype(dtype)?,
                    randn(&[b, kh, s, dv])?.to_dtype(dtype)?,
                );
                let (k32, v32) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
                let forced = runnable_tiles(isa)
                    .into_iter()
                    .map(|(tiles, packing)| TileOptions {
                        tiles: Some(tiles),
                        packing: Some(packing),
                        isa: Some(isa),
                    });
                let best = TileOptions {
                    isa: Some(isa),
                    ..TileOptions::default()
                };
                for options in forced.chain([best]) {
                    for mask in &masks {
                        let scale = 1. / (d as f64).sqrt();
                        let half = sdpa_tiled_with(&q, &k, &v, mask, 0, scale, options, None)?;
                        let full = sdpa_tiled_with(&q, &k32, &v32, mask, 0, scale, options, None)?;
                        assert_eq!(half.dtype(), DType::F32);
                        let diff = (half - full)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                        let what = format!(
                            "{isa:?} {dtype:?} {options:?} {:?} window {:?}",
                            (b, h, kh, l, s, d, dv),
                            mask.window
                        );
                        assert_eq!(diff, 0., "{what}: differs from the f32 path by {diff:e}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whether `a` and `b` have NaN and infinities (with their signs) in
/// the same places and finite values within `tol` of `b`'s largest
/// finite magnitude; the first difference otherwise.
fn nan_aware_diff(a: &Tensor, b: &Tensor, tol: f32) -> Result<Option<String>> {
    let a = a.flatten_all()?.to_vec1::<f32>()?;
    let b = b.flatten_all()?.to_vec1::<f32>()?;
    let scale = b
        .iter()
        .filter(|x| x.is_finite())
        .fold(1e-30f32, |m, x| m.max(x.abs()));
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        let same = if x.is_finite() && y.is_finite() {
            (x - y).abs() <= tol * scale
        } else {
            (x.is_nan() && y.is_nan()) || x == y
        };
        if !same {
            return Ok(Some(format!("element {i}: {x} vs reference {y}")));
        }
    }
    Ok(None)
}

/// NaN and infinities in q, k, v and additive masks give the same
/// result on every tile implementation and instruction set, at decode
/// and prefill lengths, as the reference path, NaN for NaN: a hidden
/// key takes no part, visible pairs follow IEEE arithmetic.
#[test]
fn non_finite_inputs_equal_reference_on_every_variant() -> Result<()> {
    let dev = Device::Cpu;
    let (b, h, kh, s, d, dv) = (2, 2, 1, 40, 16, 24);
    // (tensor, flat index, value): q is (b, h, l, d), k (b, kh, s, d),
    // v (b, kh, s, dv), the additive mask (l, s). Key 33 is padding in
    // batch 0 (length 30) and past the causal diagonal of early rows.
    let pokes: &[(&str, [usize; 4], f32)] = &[
        ("q", [0, 1, 2, 3], f32::NAN),
        ("q", [1, 0, 0, 0], f32::INFINITY),
        ("k", [0, 0, 5, 1], f32::NAN),
        ("k", [1, 0, 9, 2], f32::INFINITY),
        ("k", [0, 0, 33, 0], f32::NAN),
        ("k", [1, 0, 3, 4], f32::NEG_INFINITY),
        ("v", [0, 0, 5, 2], f32::NAN),
        ("v", [1, 0, 7, 0], f32::INFINITY),
        ("v", [0, 0, 33, 1], f32::NAN),
        ("v", [0, 0, 2, 5], f32::NEG_INFINITY),
        ("mask", [0, 0, 1, 4], f32::NAN),
        ("mask", [0, 0, 0, 2], f32::INFINITY),
        ("mask", [0, 0, 3, 6], f32::NEG_INFINITY),
    ];
    let poke = |t: &Tensor, at: [usize; 4], x: f32| -> Result<Tensor> {
        let dims = t.dims4()?;
        let mut data = t.flatten_all()?.to_vec1::<f32>()?;
        let i = ((at[0] * dims.1 + at[1]) * dims.2 + at[2]) * dims.3 + at[3];
        data[i] = x;
        Tensor::from_vec(data, dims, &dev)
    };
    let mut checked = 0;
    for l in [1, 3, 20, 40] {
        let (q0, k0, v0) = (
            randn(&[b, h, l, d])?,
            randn(&[b, kh, s, d])?,
            randn(&[b, kh, s, dv])?,
        );
        let m0 = randn(&[1, 1, l, s])?;
        for &(what, at, x) in pokes {
            let at = [
                at[0],
                at[1],
                at[2].min(if what == "q" || what == "mask" {
                    l - 1
                } else {
                    s - 1
                }),
                at[3],
            ];
            let (mut q, mut k, mut v, mut m) = (q0.clone(), k0.clone(), v0.clone(), m0.clone());
            match what {
                "q" => q = poke(&q, at, x)?,
                "k" => k = poke(&k, at, x)?,
                "v" => v = poke(&v, at, x)?,
                _ => m = poke(&m, at, x)?,
            }
            let padding = KeyPaddingMask::from_lengths(&[30, s], s, &dev)?;
            let masks = [
                Mask::new(),
                Mask::causal(Causal::BottomRight),
                Mask::new().with_key_padding(padding.clone()),
                Mask::causal(Causal::TopLeft)
                    .with_key_padding(padding)
                    .with_attn(AttnMask::Additive(m.clone())),
                Mask::new().with_attn(AttnMask::IgnoreWhereTrue(m.ge(1.)?)),
            ];
            for (mi, mask) in masks.iter().enumerate() {
                let reference = sdpa_reference(&q, &k, &v, mask, 0, Some(0.5), None)?.0;
                for isa in supported() {
                    for (t, packing) in runnable_tiles(isa) {
                        let ours = forced(&q, &k, &v, mask, 0.5, isa, t, packing)?;
                        if let Some(diff) = nan_aware_diff(&ours, &reference, 1e-5)? {
                            panic!(
                                "{isa:?} {t:?} {packing:?} q_len {l}, {what}{at:?} = {x}, mask {mi}: {diff}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 0);
    Ok(())
}

/// Zero-width heads take the path that handles them: scores of 0 (a
/// plain average of the values), and an empty output.
#[test]
fn zero_width_heads_equal_reference() -> Result<()> {
    for (d, dv) in [(0, 8), (8, 0), (0, 0)] {
        let (q, k, v) = (
            randn(&[1, 2, 20, d])?,
            randn(&[1, 2, 7, d])?,
            randn(&[1, 2, 7, dv])?,
        );
        let mask = Mask::causal(Causal::TopLeft);
        let reference = sdpa_reference(&q, &k, &v, &mask, 0, Some(1.), None)?.0;
        let ours = sdpa_tiled_with(&q, &k, &v, &mask, 0, 1., TileOptions::default(), None)?;
        assert_eq!(ours.dims(), reference.dims());
        if dv > 0 {
            assert!(rel_err(&ours, &reference)? < 1e-6, "head dims ({d}, {dv})");
        }
    }
    Ok(())
}
