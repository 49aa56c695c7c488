//! The 8-bit layers' tests: llama.cpp's quantization rules on hand-made
//! blocks, the inputs' and the weights' quantization on every kernel,
//! every kernel against the reference loop, rows and unpacking, ggml's
//! blocks back through a dequantization, and the errors.

use half::{bf16, f16};

use super::{Kernel, Q8Weight, QK};
use crate::runtime::isa::{supported, Isa};

/// `quantize_row_q8_0_ref` (ggml-quants.c) as written there, one
/// block of finite values: `amax` by its `MAX` macro, `d = amax / 127`,
/// `id = d ? 1/d : 0`, `q = roundf(x · id)`, the scale stored as f16;
/// a non-finite `x · id` (C leaves its conversion undefined) is 0, as
/// x86's `cvttss2si` truncated to a byte gives.
fn llama_block(x: &[f32]) -> (f16, [i8; 32]) {
    let mut amax = 0f32;
    for &v in x {
        amax = if amax > v.abs() { amax } else { v.abs() };
    }
    let d = amax / 127.;
    let id = if d != 0. { 1. / d } else { 0. };
    let q = std::array::from_fn(|j| {
        let y = (x[j] * id).round();
        if y.is_finite() {
            y as i8
        } else {
            0
        }
    });
    (f16::from_f32(d), q)
}

/// Rows of `k` values in llama.cpp's blocks.
fn llama_rows(x: &[f32], k: usize) -> Vec<(f16, [i8; 32])> {
    x.chunks_exact(k)
        .flat_map(|row| row.chunks_exact(QK).map(llama_block))
        .collect()
}

/// `ggml_vec_dot_q8_0_q8_0`'s reference loop for each row of `x` and
/// feature `j` of `w`, then `+ bias`: `sumf += sumi * (d_w * d_x)`.
fn reference(w: &[f32], x: &[f32], (m, n, k): (usize, usize, usize), bias: Option<&[f32]>) -> Vec<f32> {
    let (wq, xq, nb) = (llama_rows(w, k), llama_rows(x, k), k / QK);
    let mut y = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let mut sumf = 0f32;
            for b in 0..nb {
                let ((dw, qw), (dx, qx)) = (&wq[j * nb + b], &xq[r * nb + b]);
                let sumi: i32 = qw
                    .iter()
                    .zip(qx)
                    .map(|(&a, &b)| i32::from(a) * i32::from(b))
                    .sum();
                sumf += sumi as f32 * (dw.to_f32() * dx.to_f32());
            }
            y[r * n + j] = bias.map_or(sumf, |b| sumf + b[j]);
        }
    }
    y
}

fn randn(len: usize) -> Vec<f32> {
    crate::testing::randn(&[len]).and_then(|t| t.to_vec1()).unwrap()
}

/// The bits of each float, so that a mismatch prints both values.
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: output {i} is {g:e}, expected {w:e}"
        );
    }
}

/// Hand-made blocks, quantized as `quantize_row_q8_0_ref` rules:
/// written out, then through the layer (a weight of one row).
#[test]
fn blocks_quantize_as_llama_cpp() {
    // (values, expected scale as f32 before the f16 rounding, expected
    // values); positions past those listed are 0.
    let mut cases: Vec<(Vec<f32>, f32, Vec<i8>)> = vec![
        // max 127 maps to 127 with d = 1 exactly; .5 goes away from
        // zero either side.
        (
            vec![127., -63.5, 0.5, -0.5, 2.5, 1.49, -126.6, 3.],
            1.,
            vec![127, -64, 1, -1, 3, 1, -127, 3],
        ),
        // A zero block: scale 0, inverse scale 0, all zeros.
        (vec![0.; 4], 0., vec![0; 4]),
        // The largest magnitude negative: -254 → d = 2, -127; 3/2 and
        // -1/2 round away from zero.
        (vec![-254., 3., -1., 127., 100.], 2., vec![-127, 2, -1, 64, 50]),
        // d = 1/127 is rounded to f16 (0.0078735), but the values use
        // the f32 inverse of the unrounded d (127 exactly): 0.5 → 63.5
        // → 64, and 0.99603 → 126.4958 → 126 (127 by the f16 scale).
        (vec![1., 0.5, -0.25, 0.99603], 1. / 127., vec![127, 64, -32, 126]),
    ];
    for (x, d, q) in &mut cases {
        x.resize(QK, 0.);
        q.resize(QK, 0);
        let (got_d, got_q) = llama_block(x);
        assert_eq!(got_d, f16::from_f32(*d), "{x:?}");
        assert_eq!(&got_q[..], &q[..], "{x:?}");
        let mut ours = [0i8; QK];
        let (our_d, sum) = super::quantize_block(x.as_slice().try_into().unwrap(), &mut ours);
        assert_eq!((f16::from_f32(our_d), ours), (got_d, got_q), "{x:?}");
        assert_eq!(sum, q.iter().map(|&q| i32::from(q)).sum::<i32>());
        for isa in supported() {
            let layer = Q8Weight::quantize(x, 1, QK, None, isa).unwrap();
            let want: Vec<f32> = q.iter().map(|&q| got_d.to_f32() * f32::from(q)).collect();
            assert_same(&layer.rows(&[0]), &want, &format!("{isa:?} {x:?}"));
        }
    }
    // A NaN sticks to the block's scale whatever its position.
    for at in [0, 7, 16, 31] {
        let mut x = [1f32; QK];
        x[at] = f32::NAN;
        let (d, _) = super::quantize_block(&x, &mut [0; QK]);
        assert!(d.is_nan(), "NaN at {at}");
    }
}

/// The inputs' quantizers of every kernel (AVX-512, AVX2, scalar) give
/// llama.cpp's blocks: random values, ties at .5 either side, a zero
/// block, magnitudes so small that `1 / d` overflows (zeros), and a
/// NaN or an infinity (a NaN or infinite scale, zeros); VNNI's block
/// starts are `-128 · Σ q`.
#[test]
fn inputs_quantize_as_llama_cpp_on_every_kernel() {
    let mut blocks: Vec<[f32; QK]> = (0..3).map(|_| randn(QK).try_into().unwrap()).collect();
    let ties: [f32; QK] = std::array::from_fn(|i| if i == 0 { 127. } else { i as f32 * 3.5 - 56. });
    blocks.extend([
        ties,
        ties.map(|x| -x),
        [0.; QK],
        [1e-38; QK],
        std::array::from_fn(|i| i as f32 * -1e-39),
    ]);
    let (mut nan, mut inf) = (blocks[0], blocks[1]);
    nan[9] = f32::NAN;
    inf[30] = f32::NEG_INFINITY;
    let x: Vec<f32> = blocks.iter().chain([&nan, &inf]).flatten().copied().collect();
    let (m, k) = (2, x.len() / 2);
    for isa in supported() {
        let layer = Q8Weight::quantize(&vec![0f32; k], 1, k, None, isa).unwrap();
        let xq = layer.quantize_inputs(&x, m);
        for (b, xb) in x.chunks_exact(QK).enumerate() {
            let what = format!("{isa:?} block {b}: {xb:?}");
            let q = &xq.q[b * QK..][..QK];
            if b < blocks.len() {
                let (d, want) = llama_block(xb);
                assert_eq!(xq.d[b].to_bits(), d.to_f32().to_bits(), "{what}");
                assert_eq!(q, want, "{what}");
            } else {
                assert!(!xq.d[b].is_finite() && q.iter().all(|&q| q == 0), "{what}");
            }
            if layer.kernel != Kernel::Avx2 {
                assert_eq!(
                    xq.off[b],
                    -128 * q.iter().map(|&q| i32::from(q)).sum::<i32>(),
                    "{what}"
                );
            }
        }
    }
}

/// Every kernel the processor runs equals the reference loop above bit
/// for bit (the same quantization, exact integer dots, the same f32
/// block order), on every shape of m = 1, 3, 13, 40 rows, k = 32, 96,
/// 896, 4864 inputs and n = 1, 17, 100, 896 features (off the tiles'
/// rows and panels, one unit and several, serial and parallel), with
/// and without a bias, with a residual, and for a range of features
/// off the panels; cut for 3 threads, so that units share out unevenly.
#[test]
fn every_kernel_equals_the_reference() {
    let mut case = 0;
    for k in [32, 96, 896, 4864] {
        for n in [1, 17, 100, 896] {
            let w = randn(n * k);
            let bias = randn(n);
            let bias = (case % 2 == 0).then_some(&bias[..]);
            case += 1;
            for m in [1, 3, 13, 40] {
                let x = randn(m * k);
                let want = reference(&w, &x, (m, n, k), bias);
                let (lo, hi) = (n / 3, n - n / 5);
                let part: Vec<f32> = want.chunks(n).flat_map(|row| &row[lo..hi]).copied().collect();
                let residual = randn(m * (hi - lo));
                let with_residual: Vec<f32> = part.iter().zip(&residual).map(|(y, r)| y + r).collect();
                for isa in supported() {
                    let what = format!("{isa:?} m {m} k {k} n {n} bias {}", bias.is_some());
                    let layer = Q8Weight::quantize(&w, n, k, bias, isa).unwrap();
                    assert_eq!(layer.kernel, Kernel::for_isa(isa), "{what}");
                    assert_eq!(layer.dims(), (n, k));
                    crate::with_threads(3, || {
                        assert_same(&layer.forward(&x, m, (0, n), None), &want, &what);
                        let y = layer.forward(&x, m, (lo, hi), Some(&residual));
                        assert_same(
                            &y,
                            &with_residual,
                            &format!("{what} features {lo}..{hi}, residual"),
                        );
                    });
                }
            }
        }
    }
}

/// A NaN input makes every output of its row NaN (its block's scale
/// is NaN), and no other row's, on every kernel.
#[test]
fn a_nan_input_reaches_its_row_only() {
    let (m, n, k) = (3, 40, 96);
    let mut x = randn(m * k);
    x[k + 50] = f32::NAN;
    for isa in supported() {
        let layer = Q8Weight::quantize(&randn(n * k), n, k, Some(&randn(n)), isa).unwrap();
        let y = layer.forward(&x, m, (0, n), None);
        assert!(y[n..2 * n].iter().all(|y| y.is_nan()), "{isa:?}");
        assert!(y[..n].iter().chain(&y[2 * n..]).all(|y| y.is_finite()), "{isa:?}");
    }
}

/// An instruction set picks its kernel: AVX-512 with VNNI where the
/// processor has it (else AVX2's), AVX2, portable.
#[test]
fn an_isa_picks_its_kernel() {
    for isa in supported() {
        let layer = Q8Weight::quantize(&randn(64), 2, 32, None, isa).unwrap();
        let want = match isa {
            Isa::Portable => Kernel::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Kernel::Avx2,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16
                if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw") =>
            {
                Kernel::Vnni
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 => Kernel::Avx2,
            #[cfg(not(target_arch = "x86_64"))]
            _ => Kernel::Portable,
        };
        assert_eq!(layer.kernel, want, "{isa:?}");
    }
}

/// `rows` and `unpack` give `d · q` of llama.cpp's blocks, for each
/// kernel's layout (a last panel cut short), from f32, bf16 and f16
/// weights (the halves widened exactly first); the bias comes back as
/// given; `bytes` counts 34 bytes per 32 weights and the bias.
#[test]
fn rows_and_unpack_are_the_dequantized_blocks() {
    let (n, k) = (37, 96);
    let w = randn(n * k);
    let bias = randn(n);
    let wb: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    let wh: Vec<f16> = w.iter().map(|&x| f16::from_f32(x)).collect();
    let dequantized = |w: &[f32]| -> Vec<f32> {
        llama_rows(w, k)
            .iter()
            .flat_map(|(d, q)| q.map(|q| d.to_f32() * f32::from(q)))
            .collect()
    };
    for isa in supported() {
        let sources = [
            (Q8Weight::quantize(&w, n, k, Some(&bias), isa).unwrap(), w.clone()),
            (
                Q8Weight::quantize(&wb, n, k, None, isa).unwrap(),
                wb.iter().map(|x| x.to_f32()).collect(),
            ),
            (
                Q8Weight::quantize(&wh, n, k, None, isa).unwrap(),
                wh.iter().map(|x| x.to_f32()).collect(),
            ),
        ];
        for (i, (layer, wide)) in sources.iter().enumerate() {
            let what = format!("{isa:?} source {i}");
            let want = dequantized(wide);
            let (got, b) = layer.unpack();
            assert_same(&got, &want, &what);
            assert_eq!(b.is_some(), i == 0, "{what}");
            let ids = [36u32, 0, 17, 16, 36];
            let rows: Vec<f32> = ids
                .iter()
                .flat_map(|&j| &want[j as usize * k..][..k])
                .copied()
                .collect();
            assert_same(&layer.rows(&ids), &rows, &format!("{what} rows"));
            let bias_bytes = if i == 0 { 4 * n } else { 0 };
            let (lo, hi) = (34 * n * k / 32, 34 * n.next_multiple_of(16) * k / 32 + 63);
            assert!(
                (lo + bias_bytes..=hi + bias_bytes).contains(&layer.bytes()),
                "{what}"
            );
        }
        assert_same(&sources[0].0.unpack().1.unwrap(), &bias, "bias");
    }
}

/// ggml's `block_q8_0` bytes of `blocks` (scale, values) in order.
fn ggml_bytes(blocks: &[(f16, [i8; QK])]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|(d, q)| d.to_le_bytes().into_iter().chain(q.map(|q| q as u8)))
        .collect()
}

/// `d · q` of each block of ggml bytes, in f32 (exact: 11 bits by 8).
fn ggml_dequantize(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2 + QK)
        .flat_map(|b| {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            b[2..].iter().map(move |&q| d * f32::from(q as i8))
        })
        .collect()
}

/// Blocks as llama.cpp writes them (a positive finite f16 scale `d`,
/// normal or subnormal, from 2⁻²⁴ to 65504; values `q` in -127..=127 with
/// ±127 at the largest magnitude, as `quantize_row_q8_0_ref` always
/// gives), dequantized to f32 (`d · q`, exact) and quantized again, give
/// back the same bytes (`Q8Weight::blocks`), on every kernel, and through
/// the reference quantizer above. Exact because the largest magnitude is
/// `127 · d` exactly (`d` has 11 significant bits, `127 · d` 18, inside
/// f32's 24), so the new scale `127 · d / 127` is `d` exactly and its f16
/// rounding changes nothing; and `(d · q) · fl(1 / d)` is `q` within two
/// f32 roundings, far from a tie. A zero scale's values are all 0: it
/// comes back with its `q` zeroed.
#[test]
fn ggml_blocks_round_trip_exactly() {
    let (n, k) = (37, 128);
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut blocks: Vec<(f16, [i8; QK])> = (0..n * k / QK)
        .map(|i| {
            let bits = match i {
                // The smallest subnormal, the largest subnormal, the
                // largest finite.
                0 => 0x0001,
                1 => 0x03ff,
                2 => 0x7bff,
                // Any other positive finite f16.
                _ => loop {
                    let bits = (next() as u16) & 0x7fff;
                    if bits != 0 && bits & 0x7c00 != 0x7c00 {
                        break bits;
                    }
                },
            };
            let mut q: [i8; QK] = std::array::from_fn(|_| ((next() % 255) as i16 - 127) as i8);
            q[(next() % QK as u64) as usize] = if next() % 2 == 0 { 127 } else { -127 };
            (f16::from_bits(bits), q)
        })
        .collect();
    let file = ggml_bytes(&blocks);
    let w = ggml_dequantize(&file);
    assert_eq!(ggml_bytes(&llama_rows(&w, k)), file, "the reference quantizer");
    // A zero scale with values left in its block.
    blocks[5].0 = f16::ZERO;
    let zeroed = ggml_bytes(&blocks);
    let w_zero = ggml_dequantize(&zeroed);
    blocks[5].1 = [0; QK];
    let want_zero = ggml_bytes(&blocks);
    for isa in supported() {
        // Straight from the file's bytes (`from_blocks`, what a GGUF file
        // kept in its blocks loads): the same blocks back, the same values.
        let direct = Q8Weight::from_blocks(&file, n, k, None, isa).unwrap();
        assert_eq!(direct.blocks(), file, "{isa:?}: from_blocks");
        assert_eq!(direct.unpack().0, w, "{isa:?}: from_blocks' values");
        for (w, want, what) in [(&w, &file, "blocks"), (&w_zero, &want_zero, "a zero scale")] {
            let got = Q8Weight::quantize(w, n, k, None, isa).unwrap().blocks();
            assert_eq!(got.len(), want.len());
            let bad = got
                .chunks_exact(2 + QK)
                .zip(want.chunks_exact(2 + QK))
                .position(|(g, w)| g != w);
            assert_eq!(bad, None, "{isa:?} {what}: first block that differs");
        }
    }
}

/// Weights quantized on every kernel (each instruction set) give
/// the portable kernel's blocks bit for bit, scales included, from f32,
/// bf16 and f16 (widened exactly): random blocks with magnitudes from
/// 1e-30 to 1e30, ties at .5 either side (scales 1 and 2, so that `x / d`
/// lands on them), the floats either side of a tie, a zero block, -0,
/// magnitudes so small that the scale is 0 or its inverse overflows, so
/// large that the f16 scale overflows, the largest finite floats, a NaN
/// and an infinity at several positions. Every block without a NaN is
/// llama.cpp's (`llama_block`; its `MAX` drops a NaN that is not last).
#[test]
fn weights_quantize_alike_on_every_kernel() {
    let (n, k) = (19, 96);
    let mut blocks: Vec<[f32; QK]> = Vec::new();
    let ties: [f32; QK] = std::array::from_fn(|i| if i == 0 { 127. } else { i as f32 * 3.5 - 56. });
    // Scale 1: the floats either side of each tie k + 0.5.
    let tie = |i: usize| i as f32 - 15.5;
    blocks.extend([
        ties,
        ties.map(|x| -x),
        ties.map(|x| 2. * x),
        std::array::from_fn(|i| if i == 0 { 127. } else { tie(i).next_down() }),
        std::array::from_fn(|i| if i == 0 { -127. } else { tie(i).next_up() }),
        [0.; QK],
        std::array::from_fn(|i| if i % 2 == 0 { -0. } else { 1e-3 * i as f32 }),
        [1e-38; QK],
        std::array::from_fn(|i| i as f32 * -1e-39),
        std::array::from_fn(|i| (i as f32 - 15.5) * 1e7),
        std::array::from_fn(|i| {
            if i == 3 {
                f32::MAX
            } else {
                -f32::MAX / (i + 1) as f32
            }
        }),
    ]);
    for (i, at) in [0, 13, 31].into_iter().enumerate() {
        let mut nan: [f32; QK] = randn(QK).try_into().unwrap();
        nan[at] = f32::NAN;
        let mut inf: [f32; QK] = randn(QK).try_into().unwrap();
        inf[at] = if i % 2 == 0 {
            f32::INFINITY
        } else {
            f32::NEG_INFINITY
        };
        blocks.extend([nan, inf]);
    }
    let scales = randn(n * k / QK);
    while blocks.len() < n * k / QK {
        // Magnitudes 10^-30 to 10^30.
        let e = (scales[blocks.len()] * 10.).clamp(-30., 30.);
        let r: Vec<f32> = randn(QK).iter().map(|x| x * 10f32.powf(e)).collect();
        blocks.push(r.try_into().unwrap());
    }
    let w: Vec<f32> = blocks.iter().flatten().copied().collect();
    let wb: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    let wh: Vec<f16> = w.iter().map(|&x| f16::from_f32(x)).collect();
    fn check<S: crate::elem::PanelElem>(w: &[S], (n, k): (usize, usize), what: &str) {
        let wide: Vec<f32> = w.iter().map(|x| x.to_f32()).collect();
        let want = Q8Weight::quantize(w, n, k, None, Isa::Portable).unwrap().blocks();
        for (b, (x, got)) in wide.chunks_exact(QK).zip(want.chunks_exact(2 + QK)).enumerate() {
            if !x.iter().any(|x| x.is_nan()) {
                assert_eq!(got, ggml_bytes(&[llama_block(x)]), "{what} block {b}: {x:?}");
            }
        }
        for isa in supported() {
            let got = Q8Weight::quantize(w, n, k, None, isa).unwrap().blocks();
            for (b, (g, want)) in got
                .chunks_exact(2 + QK)
                .zip(want.chunks_exact(2 + QK))
                .enumerate()
            {
                assert_eq!(g, want, "{isa:?} {what} block {b}: {:?}", &wide[b * QK..][..QK]);
            }
        }
    }
    check(&w, (n, k), "f32");
    check(&wb, (n, k), "bf16");
    check(&wh, (n, k), "f16");
}

/// A row length off the blocks is an error that names it; so are a
/// weight or bias of the wrong length.
#[test]
fn inputs_off_the_blocks_are_an_error() {
    for k in [0, 33, 100] {
        let err = Q8Weight::quantize(&vec![0f32; 2 * k], 2, k, None, Isa::Portable).unwrap_err();
        assert!(err.to_string().contains(&format!("in_features {k} ")), "{err}");
    }
    assert!(Q8Weight::quantize(&[0f32; 63], 2, 32, None, Isa::Portable).is_err());
    assert!(Q8Weight::quantize(&[0f32; 64], 2, 32, Some(&[0.]), Isa::Portable).is_err());
}
