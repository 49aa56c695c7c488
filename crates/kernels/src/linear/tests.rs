//! The packed linear layers against candle's, on every instruction set the
//! processor runs.

use candle::{Module, Result, Tensor};

use super::{PackFormat, PackOptions, PackedLinear};
use crate::runtime::isa::{supported, Isa};
use crate::testing::{randn, rel_err};

/// `w` and `b` packed in `format` for `isa`.
fn packed(w: &Tensor, b: Option<Tensor>, format: PackFormat, isa: Isa) -> Result<PackedLinear> {
    PackedLinear::with_options(w.clone(), b, &on(isa).with_format(format))
}

/// Packing as stored for `isa`.
fn on(isa: Isa) -> PackOptions {
    PackOptions::new().with_isa(isa)
}

/// Packed for every instruction set the processor runs, the layer
/// equals candle's `Linear` (and `gelu_erf`, `gelu`, `relu` or a
/// residual's add after it) on shapes off the
/// row group, panel, unit and reduction-slice sizes, with and without
/// bias, for the whole output and for panel-aligned feature ranges,
/// single rows included; cut for 3 threads, so that units split the row
/// groups as well as the panels.
#[test]
fn packed_equals_candle_linear_on_every_isa() -> Result<()> {
    let shapes = [
        (2, 97, 33, 37, true),
        (1, 197, 768, 2304, true),
        (3, 250, 300, 16, false),
        // Past one unit's 256 features, a last panel of 8 features
        // (AVX-512's 32-wide panels), two slices on AVX2.
        (1, 400, 600, 200, true),
        // Three slices on AVX-512 too (at most 1024 inputs each); 12
        // rows (one tall group) and 13.
        (1, 12, 2100, 300, true),
        (1, 13, 2100, 300, false),
        (2, 5, 40, 70, true),
        (1, 1, 8, 96, true),
        // One row (a decode step): each set's one-row kernel, one task
        // and two, with columns off the panels and the vector lanes,
        // and inputs off the four a step.
        (1, 1, 130, 261, false),
        (1, 1, 512, 1408, true),
        (1, 1, 300, 7, true),
        (1, 1, 7, 21, true),
    ];
    crate::with_threads(3, || -> Result<()> {
        for isa in supported() {
            for (batch, rows, k, n, bias) in shapes {
                let x = randn(&[batch, rows, k])?;
                let (w, b) = (randn(&[n, k])?, bias.then(|| randn(&[n])).transpose()?);
                let expected = candle_nn::Linear::new(w.clone(), b.clone()).forward(&x)?;
                let ours = packed(&w, b, PackFormat::AsStored, isa)?;
                assert_eq!(ours.is_packed(), isa != Isa::Portable, "{isa:?}");
                let what = format!("{isa:?} ({batch}, {rows}, {k}) x ({n}, {k})");
                let y = ours.forward(&x)?;
                assert_eq!(y.dims(), expected.dims(), "{what}");
                assert!(
                    rel_err(&y, &expected)? < 1e-5,
                    "{what}: {:e}",
                    rel_err(&y, &expected)?
                );
                // The activations' error against the linear's output
                // scale: where every output is far below zero (7
                // outputs, one run in about 128), both sides are zero
                // but for rounding (ours -5e-13, candle's -0.0), and a
                // ratio to their own largest magnitude compares noise.
                let scale = expected.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                let act_err = |a: &Tensor, b: &Tensor| -> Result<f32> {
                    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? / scale)
                };
                let g = ours.forward_gelu(&x)?;
                assert!(act_err(&g, &expected.gelu_erf()?)? < 1e-5, "{what} gelu");
                let g = ours.forward_gelu_tanh(&x)?;
                assert!(act_err(&g, &expected.gelu()?)? < 1e-5, "{what} gelu tanh");
                let r = ours.forward_relu(&x)?;
                assert!(act_err(&r, &expected.relu()?)? < 1e-5, "{what} relu");
                let residual = randn(expected.dims())?;
                let a = ours.forward_add(&x, &residual)?;
                assert!(rel_err(&a, &(&expected + &residual)?)? < 1e-5, "{what} residual");
                // The unpacked weight is the weight.
                assert_eq!(ours.weight()?.dims(), [n, k]);
                if n >= 64 {
                    let part = ours.forward_features(&x, 32, 64)?;
                    assert!(
                        rel_err(&part, &expected.narrow(2, 32, 32)?)? < 1e-5,
                        "{what} features 32..64"
                    );
                }
                let tail = ours.forward_features(&x, n - 5, n)?;
                assert!(
                    rel_err(&tail, &expected.narrow(2, n - 5, 5)?)? < 1e-5,
                    "{what} last 5 features"
                );
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// bf16 and f16 weights are packed as they are, and the layer equals
/// the f32 layer over the same weights widened, on every instruction
/// set (the portable one through candle, over the widened weight;
/// AVX512-BF16's bf16 weights over an even number of inputs over the
/// inputs rounded to bf16): single rows, the tall and wide tiles, sliced
/// reductions (an odd number of inputs a slice, which pairs round up)
/// and a last panel cut short, a fused residual and a range of features,
/// an odd number of inputs (which does not pair). The
/// unpacked weight and a tied table's rows are the stored values
/// exactly. Half-precision inputs come back in their dtype, equal to
/// the f32 result rounded to it.
#[test]
fn half_precision_weights_equal_the_f32_layer_over_them() -> Result<()> {
    use candle::DType;
    let shapes = [
        (1, 300, 7, true),
        (1, 512, 1408, false),
        (5, 40, 70, true),
        (13, 2100, 300, true),
        (40, 96, 200, false),
        (13, 1538, 100, true),
        // Sliced wherever the L2 is (at most 2048 half-precision inputs
        // a slice), three slices of an odd 1367.
        (13, 4100, 40, false),
        (3, 41, 70, true),
        (1, 41, 40, false),
        // Units of several row groups.
        (100, 300, 70, true),
    ];
    for isa in supported() {
        for dtype in [DType::BF16, DType::F16] {
            for (m, k, n, bias) in shapes {
                let what = format!("{isa:?} {dtype:?} ({m}, {k}) x ({n}, {k})");
                let x = randn(&[m, k])?;
                let w = randn(&[n, k])?.to_dtype(dtype)?;
                let b = bias.then(|| randn(&[n])).transpose()?;
                let wide = w.to_dtype(DType::F32)?;
                let paired = isa == Isa::Avx512Bf16 && dtype == DType::BF16 && k % 2 == 0;
                let x_seen = match paired {
                    true => x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
                    false => x.clone(),
                };
                let expected = candle_nn::Linear::new(wide.clone(), b.clone()).forward(&x_seen)?;
                let ours = packed(&w, b, PackFormat::AsStored, isa)?;
                assert_eq!(ours.is_packed(), isa != Isa::Portable, "{what}");
                assert_eq!(ours.dtype(), dtype, "{what}");
                let y = ours.forward(&x)?;
                assert_eq!(y.dtype(), DType::F32, "{what}");
                assert!(
                    rel_err(&y, &expected)? < 1e-5,
                    "{what}: {:e}",
                    rel_err(&y, &expected)?
                );
                let residual = randn(expected.dims())?;
                let a = ours.forward_add(&x, &residual)?;
                assert!(rel_err(&a, &(&expected + &residual)?)? < 1e-5, "{what} residual");
                let tail = ours.forward_features(&x, n - 5, n)?;
                assert!(
                    rel_err(&tail, &expected.narrow(1, n - 5, 5)?)? < 1e-5,
                    "{what} tail"
                );
                let back = ours.weight()?;
                assert_eq!(back.dtype(), dtype, "{what}");
                assert_eq!(rel_err(&back.to_dtype(DType::F32)?, &wide)?, 0., "{what} weight");
                if ours.is_packed() {
                    let ids = Tensor::new(&[0u32, n as u32 - 1, n as u32 / 2], &candle::Device::Cpu)?;
                    let rows = ours.embed(&ids)?;
                    assert_eq!(rel_err(&rows, &wide.index_select(&ids, 0)?)?, 0., "{what} rows");
                }
                let xh = x.to_dtype(dtype)?;
                let yh = ours.forward(&xh)?;
                assert_eq!(yh.dtype(), dtype, "{what} half input");
                let want = candle_nn::Linear::new(wide, ours.bias()?)
                    .forward(&xh.to_dtype(DType::F32)?)?
                    .to_dtype(dtype)?;
                let err = rel_err(&yh.to_dtype(DType::F32)?, &want.to_dtype(DType::F32)?)?;
                assert!(err < 1e-2, "{what} half input: {err:e}");
            }
        }
    }
    Ok(())
}

/// Half-precision panels widened once a work unit and widened by the
/// tiles as they load them give the f32 layer's products over the widened
/// weights exactly, on AVX-512 and AVX2: calls of several row groups, in
/// one slice of the reduction and in several, the last panel cut short.
#[test]
fn both_widenings_equal_the_f32_layer() -> Result<()> {
    use super::weight::{Epilogue, PackedWeight};
    use candle::DType;
    for isa in supported()
        .into_iter()
        .filter(|&i| i == Isa::Avx512 || i == Isa::Avx2)
    {
        for (m, k, n) in [(13, 300, 70), (100, 2100, 40), (40, 96, 200)] {
            let x = randn(&[m, k])?.flatten_all()?.to_vec1::<f32>()?;
            for dtype in [DType::BF16, DType::F16] {
                let what = format!("{isa:?} {dtype:?} ({m}, {k}) x ({n}, {k})");
                let w = randn(&[n, k])?.to_dtype(dtype)?.to_dtype(DType::F32)?;
                let wide = w.flatten_all()?.to_vec1::<f32>()?;
                let want = PackedWeight::new(&wide, n, k, None, isa, DType::F32)?.forward(
                    &x,
                    m,
                    (0, n),
                    Epilogue::Identity,
                    None,
                );
                for once in [false, true] {
                    let half = PackedWeight::new(&wide, n, k, None, isa, dtype)?.widening_once(once);
                    let got = half.forward(&x, m, (0, n), Epilogue::Identity, None);
                    assert_eq!(got, want, "{what}, widened once a unit: {once}");
                }
            }
        }
    }
    Ok(())
}

/// `cat` of layers packed one at a time equals the layer packed from
/// the concatenated weights and biases (a missing bias as zeros), bit
/// for bit, on every instruction set and in f32, bf16, Q8_0, Q4_0 and Q4_K: parts
/// filling whole panels are joined without unpacking, others (a first
/// part cut short of a panel, mixed formats) unpacked and packed again.
#[test]
fn cat_equals_the_layer_over_the_concatenated_weights() -> Result<()> {
    use candle::DType;
    for isa in supported() {
        for (dtype, format) in [
            (DType::F32, PackFormat::AsStored),
            (DType::BF16, PackFormat::AsStored),
            (DType::F32, PackFormat::Q8_0),
        ] {
            // 64 and 96 fill whole panels (16 or 32 wide); 20 does not.
            for (n1, n2, k) in [(64, 40, 96), (96, 7, 64), (20, 33, 64)] {
                let what = format!("{isa:?} {dtype:?} {format:?} ({n1} + {n2}, {k})");
                let w1 = randn(&[n1, k])?.to_dtype(dtype)?;
                let w2 = randn(&[n2, k])?.to_dtype(dtype)?;
                let b2 = randn(&[n2])?;
                let pack = |w: &Tensor, b: Option<Tensor>| packed(w, b, format, isa);
                let ours =
                    PackedLinear::cat_with(vec![pack(&w1, None)?, pack(&w2, Some(b2.clone()))?], &on(isa))?;
                let bias = Tensor::cat(&[&Tensor::zeros(n1, DType::F32, w1.device())?, &b2], 0)?;
                let want = pack(&Tensor::cat(&[&w1, &w2], 0)?, Some(bias))?;
                assert_eq!(ours.dims()?, (n1 + n2, k), "{what}");
                assert_eq!(ours.is_quantized(), want.is_quantized(), "{what}");
                assert_eq!(ours.q8_0_blocks(), want.q8_0_blocks(), "{what}");
                let flat = |t: Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                assert_eq!(flat(ours.weight()?)?, flat(want.weight()?)?, "{what} weight");
                for rows in [1, 5] {
                    let x = randn(&[rows, k])?;
                    assert_eq!(
                        flat(ours.forward(&x)?)?,
                        flat(want.forward(&x)?)?,
                        "{what} {rows} rows"
                    );
                }
            }
        }
        // ggml blocks in three parts, as q, k and v join (Q4_0, and Q4_K
        // on its 256 inputs), each part's buffer kept by the joined layer.
        for (format, k) in [(PackFormat::Q4_0, 96), (PackFormat::Q4_K, 256)] {
            let what = format!("{isa:?} {format:?} (64 + 16 + 24, {k})");
            let ws = [randn(&[64, k])?, randn(&[16, k])?, randn(&[24, k])?];
            let parts = ws
                .iter()
                .map(|w| packed(w, None, format, isa))
                .collect::<Result<Vec<_>>>()?;
            let ours = PackedLinear::cat_with(parts, &on(isa))?;
            let want = packed(&Tensor::cat(&ws, 0)?, None, format, isa)?;
            assert_eq!(ours.dims()?, (104, k), "{what}");
            let flat = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
            assert_eq!(flat(ours.weight()?)?, flat(want.weight()?)?, "{what} weight");
            for rows in [1, 5, 9] {
                let x = randn(&[rows, k])?;
                assert_eq!(
                    flat(ours.forward(&x)?)?,
                    flat(want.forward(&x)?)?,
                    "{what} {rows} rows"
                );
                let x = randn(&[rows, k])?;
                let range = ours.forward_features(&x, 56, 88)?;
                assert_eq!(
                    flat(range)?,
                    flat(want.forward(&x)?.narrow(1, 56, 32)?)?,
                    "{what} {rows} rows, 56..88"
                );
            }
        }
        // Mixed formats: Q8_0 with a plain part, quantized together.
        let (w1, w2) = (randn(&[32, 64])?, randn(&[16, 64])?);
        let q = packed(&w1, None, PackFormat::Q8_0, isa)?;
        let mixed = PackedLinear::cat_with(
            vec![q.clone(), packed(&w2, None, PackFormat::AsStored, isa)?],
            &on(isa),
        )?;
        let want = packed(
            &Tensor::cat(&[&q.weight()?, &w2], 0)?,
            None,
            PackFormat::Q8_0,
            isa,
        )?;
        assert_eq!(mixed.q8_0_blocks(), want.q8_0_blocks(), "{isa:?} mixed");
        let other = packed(&randn(&[16, 32])?, None, PackFormat::AsStored, isa)?;
        let err = PackedLinear::cat_with(vec![q, other], &on(isa)).unwrap_err();
        assert!(err.to_string().contains("different input sizes"), "{err}");
    }
    Ok(())
}

/// Packed in Q8_0, layers whose input size is a multiple of 32 are
/// quantized (on every instruction set, the portable one included): the
/// forward, the fused residual and GELU and a range of features equal
/// candle's layer over the dequantized weight within the inputs'
/// quantization error, a tied table's rows are the dequantized rows;
/// other layers pack as stored, as every layer packed as stored does.
#[test]
fn q8_0_packing_quantizes_what_it_can() -> Result<()> {
    for isa in supported() {
        let (w, b) = (randn(&[70, 96])?, Some(randn(&[70])?));
        let layer = packed(&w, b.clone(), PackFormat::Q8_0, isa)?;
        let odd = packed(&randn(&[8, 40])?, None, PackFormat::Q8_0, isa)?;
        let after = packed(&w, b.clone(), PackFormat::AsStored, isa)?;
        assert!(
            layer.is_quantized() && !odd.is_quantized() && !after.is_quantized(),
            "{isa:?}"
        );
        let deq = layer.weight()?;
        assert!(rel_err(&deq, &w)? < 1e-2 && rel_err(&deq, &w)? > 0., "{isa:?}");
        // The blocks are the weight's: each d · q is its value.
        let blocks = layer.q8_0_blocks().expect("quantized");
        let from_blocks: Vec<f32> = blocks
            .chunks_exact(34)
            .flat_map(|b| {
                let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                b[2..].iter().map(move |&q| d * f32::from(q as i8))
            })
            .collect();
        assert_eq!(
            from_blocks,
            deq.flatten_all()?.to_vec1::<f32>()?,
            "{isa:?} blocks"
        );
        assert!(odd.q8_0_blocks().is_none() && after.q8_0_blocks().is_none());
        let x = randn(&[2, 5, 96])?;
        let want = candle_nn::Linear::new(deq.clone(), layer.bias()?).forward(&x)?;
        let y = layer.forward(&x)?;
        assert!(rel_err(&y, &want)? < 2e-2, "{isa:?}: {:e}", rel_err(&y, &want)?);
        let residual = randn(want.dims())?;
        let a = layer.forward_add(&x, &residual)?;
        assert_eq!(rel_err(&a, &(&y + &residual)?)?, 0., "{isa:?} residual");
        assert!(
            rel_err(&layer.forward_gelu(&x)?, &y.gelu_erf()?)? < 1e-5,
            "{isa:?} gelu"
        );
        let tail = layer.forward_features(&x, 65, 70)?;
        assert_eq!(rel_err(&tail, &y.narrow(2, 65, 5)?)?, 0., "{isa:?} tail");
        let ids = Tensor::new(&[3u32, 69], &candle::Device::Cpu)?;
        assert_eq!(
            rel_err(&layer.embed(&ids)?, &deq.index_select(&ids, 0)?)?,
            0.,
            "{isa:?} rows"
        );
    }
    Ok(())
}

/// A NaN input reaches every output of its row through the fused ReLU,
/// as through PyTorch's `relu`, on every instruction set.
#[test]
fn fused_relu_keeps_nan() -> Result<()> {
    for isa in supported() {
        let mut x = randn(&[3, 40])?.to_vec2::<f32>()?;
        x[1][7] = f32::NAN;
        let x = candle::Tensor::new(x, &candle::Device::Cpu)?;
        let layer = packed(&randn(&[70, 40])?, Some(randn(&[70])?), PackFormat::AsStored, isa)?;
        let y = layer.forward_relu(&x)?.to_vec2::<f32>()?;
        assert!(y[1].iter().all(|v| v.is_nan()), "{isa:?}");
        assert!(y[0].iter().chain(&y[2]).all(|&v| v >= 0.), "{isa:?}");
    }
    Ok(())
}

/// Weights that track gradients are never packed: a training step
/// changes them in place, and a packed copy would go stale.
#[test]
fn variables_are_not_packed_and_inputs_with_gradients_get_them() -> Result<()> {
    let w = candle::Var::from_tensor(&randn(&[8, 4])?)?;
    let lin = PackedLinear::new(w.as_tensor().clone(), None)?;
    assert!(!lin.is_packed());
    let x = randn(&[3, 4])?;
    let before = lin.forward(&x)?;
    w.set(&(w.as_tensor() * 2.)?)?;
    let after = lin.forward(&x)?;
    assert!(
        rel_err(&after, &(before * 2.)?)? < 1e-6,
        "the layer must see the updated variable"
    );
    // A packed layer under an input that tracks gradients.
    let packed = PackedLinear::new(randn(&[8, 4])?, Some(randn(&[8])?))?;
    let xv = candle::Var::from_tensor(&x)?;
    let grads = packed.forward(xv.as_tensor())?.sum_all()?.backward()?;
    assert!(
        grads.get(xv.as_tensor()).is_some(),
        "no gradient reached the input"
    );
    Ok(())
}

/// A tied embedding's lookup through the packed layer equals the
/// table's own rows, on every ISA, for ids in any shape (row counts off
/// the panel width); an id past the table is an error. A broadcast
/// weight (the pre-flight's placeholder) is neither packed nor copied.
#[test]
fn packed_rows_equal_the_table() -> Result<()> {
    for isa in supported().into_iter().filter(|&isa| isa != Isa::Portable) {
        let w = randn(&[70, 40])?;
        let layer = packed(&w, None, PackFormat::AsStored, isa)?;
        assert!(layer.is_packed());
        let ids = Tensor::new(&[[0u32, 69, 33], [64, 1, 65]], &candle::Device::Cpu)?;
        let want = candle_nn::Embedding::new(w, 40).forward(&ids)?;
        let got = layer.embed(&ids)?;
        assert_eq!(got.dims(), [2, 3, 40]);
        assert_eq!(rel_err(&got, &want)?, 0., "{isa:?}");
        let err = layer.embed(&Tensor::new(&[70u32], &candle::Device::Cpu)?);
        assert!(err.is_err_and(|e| e.to_string().contains("id 70 is out of range for 70 rows")));
    }
    let placeholder =
        Tensor::zeros(1, candle::DType::F32, &candle::Device::Cpu)?.broadcast_as((4096, 4096))?;
    assert!(super::is_broadcast(&placeholder));
    assert!(!PackedLinear::new(placeholder, None)?.is_packed());
    assert!(!super::is_broadcast(&randn(&[3, 4])?));
    Ok(())
}

/// A scale folded into the weights equals the layer followed by the
/// scale, on every ISA, with and without bias, through a fused residual
/// too; a weight or scale that trains is not folded; a wrong-shaped
/// scale is an error that names it.
#[test]
fn scaled_outputs_equal_the_layer_then_the_scale() -> Result<()> {
    use candle::Var;
    for isa in supported().into_iter().filter(|&isa| isa != Isa::Portable) {
        for bias in [true, false] {
            let (w, b) = (randn(&[70, 40])?, bias.then(|| randn(&[70])).transpose()?);
            let layer = packed(&w, b, PackFormat::AsStored, isa)?;
            let gamma = randn(&[70])?;
            let scaled = layer
                .scaled_outputs(&gamma)?
                .expect("a packed layer folds a plain scale");
            let x = randn(&[2, 30, 40])?;
            let expected = layer.forward(&x)?.broadcast_mul(&gamma)?;
            let what = format!("{isa:?} bias {bias}");
            assert!(rel_err(&scaled.forward(&x)?, &expected)? < 1e-6, "{what}");
            let residual = randn(expected.dims())?;
            let fused = scaled.forward_add(&x, &residual)?;
            assert!(
                rel_err(&fused, &(&expected + &residual)?)? < 1e-6,
                "{what} residual"
            );
        }
    }
    let layer = PackedLinear::new(randn(&[8, 4])?, None)?;
    let trained = Var::from_tensor(&randn(&[8])?)?;
    assert!(layer.scaled_outputs(trained.as_tensor())?.is_none());
    let variables = PackedLinear::new(Var::from_tensor(&randn(&[8, 4])?)?.as_tensor().clone(), None)?;
    assert!(variables.scaled_outputs(&randn(&[8])?)?.is_none());
    for layer in [&layer, &variables] {
        let err = layer.scaled_outputs(&Tensor::ones(3, candle::DType::F32, &candle::Device::Cpu)?);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("gamma") && err.contains("(8,)"), "{err}");
    }
    Ok(())
}

/// Blocks lent through a placeholder are taken by the layer built over it
/// in options that hold them (the layer's products equal the dequantized
/// weight's within the inputs' rounding), and by no other; blocks left
/// untaken are an error `all_taken` names; two lenders, two models'
/// loads, keep apart.
#[test]
fn lent_blocks_are_taken_by_their_layer() -> Result<()> {
    use crate::{BlockFormat, LentBlocks};
    // Two features of 32 Q4_0 weights: d = 1 and 0.5, q = i % 16.
    let mut data = Vec::new();
    for d in [1f32, 0.5] {
        data.extend(half::f16::from_f32(d).to_le_bytes());
        data.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    }
    let dev = candle::Device::Cpu;
    let (lent, other) = (LentBlocks::new(), LentBlocks::new());
    let w = lent.lend(BlockFormat::Q4_0, data.clone(), (2, 32), &dev)?;
    let options = PackOptions::new().with_lent(lent.clone());
    assert!(lent.is_lent(&w) && options.is_lent(&w) && !other.is_lent(&w));
    // Options without these blocks see a broadcast placeholder: left as a
    // view, neither packed nor taken.
    let elsewhere = PackedLinear::with_options(w.clone(), None, &PackOptions::new().with_lent(other))?;
    assert!(!elsewhere.is_packed() && lent.is_lent(&w));
    assert!(lent.all_taken().unwrap_err().to_string().contains("1 weight(s)"));
    let layer = PackedLinear::with_options(w.clone(), None, &options)?;
    assert!(!lent.is_lent(&w) && lent.untaken() == 0);
    lent.all_taken()?;
    assert_eq!(layer.block_format(), Some(BlockFormat::Q4_0));
    let x = Tensor::ones((1, 32), candle::DType::F32, &dev)?;
    let want = x.matmul(&layer.weight()?.t()?)?;
    let got = layer.forward(&x)?;
    assert!(rel_err(&got, &want)? < 1e-5, "{got} vs {want}");
    assert!(lent
        .lend(BlockFormat::Q4_0, data[..20].to_vec(), (2, 32), &dev)
        .is_err());
    Ok(())
}

/// By default a bf16 layer takes AVX512-BF16's `vdpbf16ps` only where the
/// one-time measurement found it no slower than widening (and an f32 or
/// f16 layer never does); an instruction set asked for is kept. The
/// default layer computes what the layer packed explicitly for the chosen
/// set computes.
#[test]
fn bf16_layers_take_the_measured_path_by_default() -> Result<()> {
    use crate::runtime::isa::current;
    let w = randn(&[40, 64])?;
    let x = randn(&[3, 64])?;
    let pays = super::calibrate::bf16_dot_pays();
    eprintln!("vdpbf16ps pays here: {pays} (default {:?})", current());
    let want = match current() {
        Isa::Avx512Bf16 if !pays => Isa::Avx512,
        isa => isa,
    };
    let half = w.to_dtype(candle::DType::BF16)?;
    let default = PackedLinear::with_options(half.clone(), None, &PackOptions::new())?;
    assert_eq!(default.isa(), Some(want));
    let explicit = PackedLinear::with_options(half.clone(), None, &PackOptions::new().with_isa(want))?;
    assert_eq!(
        default.forward(&x)?.to_vec2::<f32>()?,
        explicit.forward(&x)?.to_vec2::<f32>()?
    );
    for isa in supported().into_iter().filter(|&i| i != Isa::Portable) {
        let asked = PackedLinear::with_options(half.clone(), None, &PackOptions::new().with_isa(isa))?;
        assert_eq!(asked.isa(), Some(isa));
    }
    let full = PackedLinear::with_options(w, None, &PackOptions::new())?;
    assert_eq!(full.isa(), Some(current()));
    Ok(())
}

/// Layers whose weights train (`trained.rs`).
mod trained {
    use candle::{Module, Result, Tensor, Var};
    use candle_nn::{Optimizer, SGD};

    use super::super::trained::TrainedWeight;
    use super::super::{Inner, PackOptions, PackedLinear};
    use crate::runtime::isa::{supported, Isa};
    use crate::testing::{randn, rel_err};

    /// A weight stored `(in, out)` that trains (GPT-2's `Conv1D`) follows
    /// its variable across a step, as candle's `Linear` over its transpose
    /// does, and its gradient reaches the variable.
    #[test]
    fn an_in_out_weight_trains_in_place() -> Result<()> {
        let (k, n) = (24, 40);
        let x = randn(&[3, k])?;
        let w = Var::from_tensor(&randn(&[k, n])?)?;
        let ours = PackedLinear::from_in_out(w.as_tensor().clone(), None)?;
        let mut sgd = SGD::new(vec![w.clone()], 0.5)?;
        for step in 0..2 {
            let y = ours.forward(&x)?;
            let expected = x.matmul(w.as_tensor())?;
            assert!(rel_err(&y, &expected)? < 1e-5, "step {step}");
            let grads = y.sqr()?.sum_all()?.backward()?;
            assert!(grads.get(w.as_tensor()).is_some(), "step {step}: no gradient");
            sgd.step(&grads)?;
        }
        Ok(())
    }

    /// The loss `Σ y ∘ r`, whose gradient at `y` is `r`, and its gradients
    /// at `ts`.
    fn grads_of(y: &Tensor, r: &Tensor, ts: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
        let grads = (y * r)?.sum_all()?.backward()?;
        Ok(ts.iter().map(|t| grads.get(t).cloned()).collect())
    }

    /// Layers over variables, packed for every instruction set the
    /// processor runs, give candle's `Linear`'s output and its autograd's
    /// `dX`, `dW` and `db`, on shapes off the panels, row groups and
    /// reduction slices, with batch dims and without, with a bias and
    /// without, cut for 3 threads, alone and with the fused GELU after it; an
    /// input that tracks no gradient gets none.
    #[test]
    fn gradients_equal_candle_autograd_on_every_isa() -> Result<()> {
        let shapes: [(&[usize], usize, bool); 6] = [
            (&[2, 7], 33, true),
            (&[97], 37, false),
            (&[3, 5, 13], 70, true),
            (&[1], 300, true),
            (&[400], 129, false),
            (&[2, 150], 1100, true),
        ];
        crate::with_threads(3, || -> Result<()> {
            for isa in supported() {
                for &(rows, n, bias) in &shapes {
                    let k = [37, 64, 300, 1030][n % 4];
                    let mut xs = rows.to_vec();
                    xs.push(k);
                    let x = Var::from_tensor(&randn(&xs)?)?;
                    let w = Var::from_tensor(&randn(&[n, k])?)?;
                    let b = bias.then(|| Var::from_tensor(&randn(&[n])?)).transpose()?;
                    let bt = b.as_ref().map(|b| b.as_tensor().clone());
                    let ours = PackedLinear::with_options(
                        w.as_tensor().clone(),
                        bt.clone(),
                        &PackOptions::new().with_isa(isa),
                    )?;
                    assert_eq!(
                        matches!(ours.inner, Inner::Trained(_)),
                        isa != Isa::Portable,
                        "{isa:?}"
                    );
                    let reference = candle_nn::Linear::new(w.as_tensor().clone(), bt.clone());
                    let what = format!("{isa:?} {xs:?} x ({n}, {k}) bias {bias}");
                    let y = ours.forward(x.as_tensor())?;
                    let expected = reference.forward(x.as_tensor())?;
                    assert!(rel_err(&y, &expected)? < 1e-5, "{what}: forward");
                    let r = randn(y.dims())?;
                    let mut ts = vec![x.as_tensor(), w.as_tensor()];
                    ts.extend(bt.as_ref());
                    let got = grads_of(&y, &r, &ts)?;
                    let want = grads_of(&expected, &r, &ts)?;
                    for ((g, e), name) in got.iter().zip(&want).zip(["dX", "dW", "db"]) {
                        let (Some(g), Some(e)) = (g, e) else {
                            panic!("{what}: no {name}")
                        };
                        assert_eq!(g.dims(), e.dims(), "{what}: {name}");
                        assert!(rel_err(g, e)? < 1e-5, "{what}: {name} {:e}", rel_err(g, e)?);
                    }
                    // The fused GELU's layer: its op's backward.
                    let got = grads_of(&ours.forward_gelu(x.as_tensor())?, &r, &ts)?;
                    let want_gelu = grads_of(&expected.gelu_erf()?, &r, &ts)?;
                    for (g, e) in got.iter().zip(&want_gelu) {
                        let (g, e) = (g.as_ref().unwrap(), e.as_ref().unwrap());
                        assert!(rel_err(g, e)? < 1e-5, "{what}: gelu {:e}", rel_err(g, e)?);
                    }
                    // Data, not a variable: the weight's gradient only
                    // (candle's autograd computes the other too).
                    let data = x.as_tensor().detach();
                    let got = grads_of(&ours.forward(&data)?, &r, &[&data, w.as_tensor()])?;
                    assert!(got[0].is_none() || isa == Isa::Portable, "{what}: dX of data");
                    let e = want[1].as_ref().unwrap();
                    assert!(rel_err(got[1].as_ref().unwrap(), e)? < 1e-5, "{what}: dW of data");
                }
            }
            Ok(())
        })
    }

    /// A layer over new variables, a weight `(n, k)` and a bias `(n)`,
    /// packed for `isa`.
    fn trained_layer(n: usize, k: usize, isa: Isa) -> Result<(Var, Var, PackedLinear)> {
        let w = Var::from_tensor(&randn(&[n, k])?)?;
        let b = Var::from_tensor(&randn(&[n])?)?;
        let layer = PackedLinear::with_options(
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
            &PackOptions::new().with_isa(isa),
        )?;
        Ok((w, b, layer))
    }

    /// The training weight of `layer`, which must be one.
    fn trained(layer: &PackedLinear) -> &TrainedWeight {
        match &layer.inner {
            Inner::Trained(t) => t,
            _ => panic!("not a training layer"),
        }
    }

    /// A fused projection's parts (`forward_features`, as cross-attention
    /// projects the query and the memory's keys and values apart) train on
    /// the packed op: outputs and every gradient equal candle's autograd
    /// over the narrowed weight, the weight's and bias's gradients summed
    /// over both calls, zero nowhere but where no call reaches; the parts'
    /// `Wᵀ` packed for each range of its own (fails where a range takes the
    /// whole weight's copy, or its gradient lands on other rows).
    #[test]
    fn a_fused_projection_s_parts_train_on_the_packed_op() -> Result<()> {
        let (e, k) = (64, 48);
        for isa in supported().into_iter().filter(|&i| i != Isa::Portable) {
            let (w, b, ours) = trained_layer(3 * e, k, isa)?;
            let t = trained(&ours);
            let (q, mem) = (
                Var::from_tensor(&randn(&[2, 5, k])?)?,
                Var::from_tensor(&randn(&[2, 9, k])?)?,
            );
            let ts = [q.as_tensor(), mem.as_tensor(), w.as_tensor(), b.as_tensor()];
            let (rq, rkv) = (randn(&[2, 5, e])?, randn(&[2, 9, 2 * e])?);
            let loss = |yq: &Tensor, ykv: &Tensor| -> Result<Vec<Option<Tensor>>> {
                let grads = ((yq * &rq)?.sum_all()? + (ykv * &rkv)?.sum_all()?)?.backward()?;
                Ok(ts.iter().map(|t| grads.get(t).cloned()).collect())
            };
            let (yq, ykv) = (
                ours.forward_features(q.as_tensor(), 0, e)?,
                ours.forward_features(mem.as_tensor(), e, 3 * e)?,
            );
            let part = |lo: usize, len: usize| -> Result<candle_nn::Linear> {
                Ok(candle_nn::Linear::new(
                    w.as_tensor().narrow(0, lo, len)?,
                    Some(b.as_tensor().narrow(0, lo, len)?),
                ))
            };
            let (wq, wkv) = (
                part(0, e)?.forward(q.as_tensor())?,
                part(e, 2 * e)?.forward(mem.as_tensor())?,
            );
            assert!(rel_err(&yq, &wq)? < 1e-5, "{isa:?}: q");
            assert!(rel_err(&ykv, &wkv)? < 1e-5, "{isa:?}: kv");
            let (got, want) = (loss(&yq, &ykv)?, loss(&wq, &wkv)?);
            for ((g, w), name) in got.iter().zip(&want).zip(["dq", "dmemory", "dW", "db"]) {
                let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
                assert!(rel_err(g, w)? < 1e-5, "{isa:?}: {name} {:e}", rel_err(g, w)?);
            }
            // The packed op, not candle's matmul over a narrowed weight:
            // one forward copy and one `Wᵀ` a range.
            assert!(t.packed_forward().is_some(), "{isa:?}");
            assert_eq!(t.fresh_packs(), 3, "{isa:?}");
        }
        Ok(())
    }

    /// A weight an optimizer step (or `Var::set`) changes in place gives
    /// the new weight's outputs and gradients, never the packed copy's of
    /// the old one, packed again into the copy's own buffers; an unchanged
    /// one keeps its packed copy.
    #[test]
    fn a_changed_weight_is_packed_again() -> Result<()> {
        for isa in supported().into_iter().filter(|&i| i != Isa::Portable) {
            let (n, k) = (40, 50);
            // An input that trains too, so that the backward packs Wᵀ.
            let xv = Var::from_tensor(&randn(&[6, k])?)?;
            let x = xv.as_tensor().clone();
            let (w, b, ours) = trained_layer(n, k, isa)?;
            let t = trained(&ours);
            let reference = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
            let mut sgd = SGD::new(vec![w.clone(), b.clone()], 0.5)?;
            let packed = |t: &TrainedWeight| t.packed_forward().unwrap();
            for step in 0..3 {
                let y = ours.forward(&x)?;
                let first = packed(t);
                // Changed by the step before (nothing else holding the
                // copies): packed again in the same buffers, the first
                // step's copies of W and Wᵀ the only new ones.
                assert_eq!(
                    t.fresh_packs(),
                    1.min(step) + 1,
                    "{isa:?} step {step}: new copies"
                );
                // Unchanged: the same copy.
                let again = ours.forward(&x)?;
                assert!(std::sync::Arc::ptr_eq(&first, &packed(t)), "{isa:?} step {step}");
                assert_eq!(again.to_vec2::<f32>()?, y.to_vec2::<f32>()?);
                let expected = reference.forward(&x)?;
                assert!(rel_err(&y, &expected)? < 1e-5, "{isa:?} step {step}: forward");
                let loss = y.sqr()?.sum_all()?;
                let grads = loss.backward()?;
                let want = expected.sqr()?.sum_all()?.backward()?;
                for v in [&w, &b, &xv] {
                    let (g, e) = (
                        grads.get(v.as_tensor()).unwrap(),
                        want.get(v.as_tensor()).unwrap(),
                    );
                    assert!(rel_err(g, e)? < 1e-5, "{isa:?} step {step}: gradient");
                }
                sgd.step(&grads)?;
                // Only the bias changed: the weight and bias are packed again.
                if step == 1 {
                    b.set(&b.as_tensor().affine(1., 0.25)?)?;
                }
            }
            // A new value of the same storage, and one equal to the old.
            w.set(&randn(&[n, k])?)?;
            let y = ours.forward(&x)?;
            assert!(rel_err(&y, &reference.forward(&x)?)? < 1e-5, "{isa:?}: after set");
            let first = packed(t);
            w.set(&w.as_tensor().copy()?)?;
            ours.forward(&x)?;
            assert!(
                std::sync::Arc::ptr_eq(&first, &packed(t)),
                "{isa:?}: an equal value"
            );
        }
        Ok(())
    }
}
