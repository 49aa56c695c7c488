use candle::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0,
    GgmlType,
};
use half::f16;

use super::inputs::quantize_inputs;
use super::{dequantize_row, BlockFormat, BlockWeight};
use crate::runtime::isa::{self, Isa};

/// SplitMix64: the tests' bytes, the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `blocks` random blocks: every byte random (every bit pattern of the
/// values and packed scales), the f16 fields finite, 1e-3..1 in
/// magnitude, either sign.
fn random_blocks(format: BlockFormat, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = format.block_bytes();
    let mut data: Vec<u8> = (0..blocks * bb).map(|_| rng.next() as u8).collect();
    for block in data.chunks_exact_mut(bb) {
        for &at in format.f16_fields() {
            let mag = 1e-3f32 * 1000f32.powf(rng.unit());
            let v = if rng.next() & 1 == 1 { -mag } else { mag };
            block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    data
}

/// candle's port of ggml's `dequantize_row_*` over the same bytes: an
/// independent reading of the layouts.
fn candle_dequantize(format: BlockFormat, data: &[u8]) -> Vec<f32> {
    fn read<B: GgmlType>(data: &[u8], bb: usize) -> Vec<f32> {
        assert_eq!(size_of::<B>(), bb);
        let blocks: Vec<B> = data
            .chunks_exact(bb)
            // SAFETY: `B` is ggml's `#[repr(C)]` block of `bb` bytes, of
            // integers and f16s, every bit pattern a value.
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr().cast::<B>()) })
            .collect();
        let mut out = vec![0f32; blocks.len() * B::BLCK_SIZE];
        B::to_float(&blocks, &mut out);
        out
    }
    let bb = format.block_bytes();
    match format {
        BlockFormat::Q4_0 => read::<BlockQ4_0>(data, bb),
        BlockFormat::Q4_1 => read::<BlockQ4_1>(data, bb),
        BlockFormat::Q5_0 => read::<BlockQ5_0>(data, bb),
        BlockFormat::Q5_1 => read::<BlockQ5_1>(data, bb),
        BlockFormat::Q8_0 => read::<BlockQ8_0>(data, bb),
        BlockFormat::Q2_K => read::<BlockQ2K>(data, bb),
        BlockFormat::Q3_K => read::<BlockQ3K>(data, bb),
        BlockFormat::Q4_K => read::<BlockQ4K>(data, bb),
        BlockFormat::Q5_K => read::<BlockQ5K>(data, bb),
        BlockFormat::Q6_K => read::<BlockQ6K>(data, bb),
    }
}

#[test]
fn dequantization_equals_candles_port_of_ggml() {
    let mut rng = Rng(7);
    for format in BlockFormat::ALL {
        let data = random_blocks(format, 64, &mut rng);
        let mut ours = vec![0f32; 64 * format.block_elems()];
        dequantize_row(format, &data, &mut ours);
        let theirs = candle_dequantize(format, &data);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a - b).abs() <= 1e-6 * b.abs(),
                "{}: element {i}: {a} vs candle's {b}",
                format.name()
            );
        }
    }
}

/// ggml's reference dequantization of gguf-py's random blocks
/// (`scripts/make_quant_fixtures.py`), bit for bit.
#[test]
fn dequantization_equals_gguf_py() -> candle::Result<()> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant/blocks.safetensors"
    );
    let tensors = candle::safetensors::load(path, &candle::Device::Cpu)?;
    let mut checked = 0;
    for format in BlockFormat::ALL {
        for kind in ["", "real_"] {
            let (Some(blocks), Some(values)) = (
                tensors.get(&format!("{}.{kind}blocks", format.name())),
                tensors.get(&format!("{}.{kind}values", format.name())),
            ) else {
                continue;
            };
            let data: Vec<u8> = blocks.flatten_all()?.to_vec1()?;
            let want: Vec<f32> = values.flatten_all()?.to_vec1()?;
            let mut ours = vec![0f32; want.len()];
            dequantize_row(format, &data, &mut ours);
            for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a - b).abs() <= 1e-6 * b.abs(),
                    "{} {kind}: element {i}: {a} vs gguf-py's {b}",
                    format.name()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked >= BlockFormat::ALL.len(),
        "only {checked} cases in {path}"
    );
    Ok(())
}

/// Every kernel the processor runs, every format: each output equals the
/// exact (f64) sum of the dequantized weights times the quantized inputs
/// within float rounding, and the unquantized product within the inputs'
/// quantization error; the bias and the residual added; a feature range.
#[test]
fn products_equal_the_dequantized_sums_on_every_isa() -> candle::Result<()> {
    let mut rng = Rng(11);
    for format in BlockFormat::ALL {
        let (n, k) = (37, 2 * 256);
        let data = random_blocks(format, n * k / format.block_elems(), &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.unit() - 0.5).collect();
        let mut w = vec![0f32; n * k];
        dequantize_row(format, &data, &mut w);
        for m in [1, 3, 5, 11, 37] {
            let x: Vec<f32> = (0..m * k).map(|_| 2. * rng.unit() - 1.).collect();
            let residual: Vec<f32> = (0..m * n).map(|_| rng.unit()).collect();
            let xq = quantize_inputs(Isa::Portable, &x, m, k, format.block_elems());
            let xrows = xq.rows();
            for isa in isa::supported() {
                let weight = BlockWeight::new(format, data.clone(), n, k, Some(bias.clone()), isa)?;
                let y = weight.forward(&x, m, (0, n), Some(&residual));
                let part = weight.forward(&x, m, (5, 21), None);
                for r in 0..m {
                    let (q, d) = (xrows[r].q, xrows[r].d);
                    for j in 0..n {
                        let (mut exact, mut mag, mut plain) = (0f64, 0f64, 0f64);
                        for i in 0..k {
                            let xi = f64::from(d[i / format.block_elems()]) * f64::from(q[i]);
                            let t = f64::from(w[j * k + i]) * xi;
                            exact += t;
                            mag += t.abs();
                            plain += f64::from(w[j * k + i]) * f64::from(x[r * k + i]);
                        }
                        let got =
                            f64::from(y[r * n + j]) - f64::from(bias[j]) - f64::from(residual[r * n + j]);
                        let tol = 2e-6 * mag + 1e-6;
                        assert!(
                            (got - exact).abs() <= tol,
                            "{} {isa:?} m {m} row {r} feature {j}: {got} vs {exact} (±{tol})",
                            format.name()
                        );
                        assert!(
                            (got - plain).abs() <= 0.02 * mag + 1e-4,
                            "{}: {got} vs {plain}",
                            format.name()
                        );
                        if (5..21).contains(&j) {
                            let p = f64::from(part[r * 16 + j - 5]) - f64::from(bias[j]);
                            assert!((p - exact).abs() <= tol, "{} {isa:?}: range", format.name());
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// A row's outputs are the same bits whatever rows share its call: alone
/// (a decode step's kernel), in groups of 8, 4, 2 and 1, or several to a
/// vector (a prefill's kernels with rows in lanes: 16 with AVX512-VNNI, 8
/// with AVX2), on every kernel the processor runs.
#[test]
fn rows_give_the_same_bits_alone_and_together() -> candle::Result<()> {
    let mut rng = Rng(13);
    for format in BlockFormat::ALL {
        let (n, k) = (24, 3 * 256);
        let data = random_blocks(format, n * k / format.block_elems(), &mut rng);
        let m = 37;
        let x: Vec<f32> = (0..m * k).map(|_| 2. * rng.unit() - 1.).collect();
        for isa in isa::supported() {
            let weight = BlockWeight::new(format, data.clone(), n, k, None, isa)?;
            let together = weight.forward(&x, m, (0, n), None);
            for r in 0..m {
                let alone = weight.forward(&x[r * k..(r + 1) * k], 1, (0, n), None);
                for (j, (a, t)) in alone.iter().zip(&together[r * n..(r + 1) * n]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        t.to_bits(),
                        "{} {isa:?} row {r} feature {j}: {a} alone, {t} with {m} rows",
                        format.name()
                    );
                }
            }
        }
    }
    Ok(())
}

/// Joined layers hold both weights' rows (the formats of 32 in panels
/// only from whole panels) in the parts' own buffers, repacked in the
/// buffers given where the features fill whole panels; shapes and sizes
/// that do not match are refused.
#[test]
fn rows_join_and_bad_shapes() -> candle::Result<()> {
    let mut rng = Rng(3);
    for format in [
        BlockFormat::Q4_K,
        BlockFormat::Q4_0,
        BlockFormat::Q5_1,
        BlockFormat::Q2_K,
        BlockFormat::Q3_K,
    ] {
        let nb = 512 / format.block_elems();
        let row = nb * format.block_bytes();
        let a = random_blocks(format, 8 * nb, &mut rng);
        let b = random_blocks(format, 2 * nb, &mut rng);
        let given_a = a.clone();
        let at_given = given_a.as_ptr();
        let wa = BlockWeight::new(format, given_a, 8, 512, None, Isa::Portable)?;
        let wb = BlockWeight::new(format, b.clone(), 2, 512, Some(vec![1.; 2]), Isa::Portable)?;
        let parts = |w: &BlockWeight| w.parts.iter().map(|(_, d)| d.as_ptr()).collect::<Vec<_>>();
        let (at_a, at_b) = (parts(&wa), parts(&wb));
        // 8 features fill a panel: repacked in the buffer given.
        assert_eq!(at_a, [at_given], "{}", format.name());
        assert!(wa.joins(&wb), "{}", format.name());
        let joined = wa.join(wb);
        // The parts' buffers kept, not copied.
        assert_eq!(parts(&joined), [at_a, at_b].concat(), "{}", format.name());
        assert_eq!(joined.dims(), (10, 512));
        let rows = joined.rows(&[9, 0]);
        let (mut want_b, mut want_a) = (vec![0f32; 512], vec![0f32; 512]);
        dequantize_row(format, &b[row..2 * row], &mut want_b);
        dequantize_row(format, &a[..row], &mut want_a);
        assert_eq!(&rows[..512], &want_b[..], "{}", format.name());
        assert_eq!(&rows[512..], &want_a[..], "{}", format.name());
        let mut bias = vec![0.; 8];
        bias.extend([1., 1.]);
        assert_eq!(joined.unpack().1, Some(bias));
        let other = if format == BlockFormat::Q6_K {
            BlockFormat::Q4_K
        } else {
            BlockFormat::Q6_K
        };
        let other = BlockWeight::new(
            other,
            random_blocks(other, 2, &mut rng),
            1,
            512,
            None,
            Isa::Portable,
        )?;
        assert!(!joined.joins(&other));
        assert!(BlockWeight::new(format, vec![0; 10], 1, 512, None, Isa::Portable).is_err());
        assert!(BlockWeight::new(format, vec![0; row], 1, 200, None, Isa::Portable).is_err());
    }
    // Four features of a format in panels fill no panel: not joined.
    let four = BlockWeight::new(BlockFormat::Q4_0, vec![0; 4 * 18], 4, 32, None, Isa::Portable)?;
    let more = BlockWeight::new(BlockFormat::Q4_0, vec![0; 18], 1, 32, None, Isa::Portable)?;
    assert!(!four.joins(&more));
    Ok(())
}

/// Not a test: `cargo test --release -p multihead-kernels quant::blocks::tests::speed
/// -- --ignored --nocapture` times per format (`QUANT_FORMATS=Q4_K,Q6_K`
/// for some) a decode-sized product (one row) and prefill-sized ones (64
/// and 128 rows) of a 16384 × 4096 weight, on the instruction set that
/// runs now, for working on the kernels. `QUANT_SHAPE=896x4864` takes a
/// model's layer instead, one row through as many copies as fill 256 MiB
/// in turn, so that every call reads its weights from memory as a decode
/// step does (the rows' products, of the first copy alone).
#[test]
#[ignore]
fn speed() -> candle::Result<()> {
    let mut rng = Rng(5);
    let (n, k) = match std::env::var("QUANT_SHAPE") {
        Ok(shape) => {
            let dims: Vec<usize> = shape.split('x').filter_map(|d| d.parse().ok()).collect();
            match dims[..] {
                [n, k] => (n, k),
                _ => panic!("QUANT_SHAPE={shape}: not NxK"),
            }
        }
        // Past the last-level cache, as a model's weights are.
        Err(_) => (16384, 4096),
    };
    let formats = std::env::var("QUANT_FORMATS").unwrap_or_default();
    for format in BlockFormat::ALL {
        if !formats.is_empty() && !formats.split(',').any(|f| f.eq_ignore_ascii_case(format.name())) {
            continue;
        }
        if !k.is_multiple_of(format.block_elems()) {
            continue;
        }
        let bytes = n * format.row_bytes(k);
        let copies = ((256 << 20) / bytes).max(1);
        let layers = (0..copies)
            .map(|_| {
                let data = random_blocks(format, n * k / format.block_elems(), &mut rng);
                BlockWeight::new(format, data, n, k, None, isa::current())
            })
            .collect::<candle::Result<Vec<_>>>()?;
        for m in [1, 64, 128] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit() - 0.5).collect();
            let layers = if m == 1 { &layers[..] } else { &layers[..1] };
            let _ = layers[0].forward(&x, m, (0, n), None);
            let reps = if m == 1 { 50usize.div_ceil(copies) } else { 4 };
            let t = std::time::Instant::now();
            for _ in 0..reps {
                for w in layers {
                    std::hint::black_box(w.forward(&x, m, (0, n), None));
                }
            }
            let s = t.elapsed().as_secs_f64() / (reps * layers.len()) as f64;
            eprintln!(
                "{} {n}x{k} m {m:3}: {:8.3} ms, {:6.1} GB/s of weights, {:6.1} GMAC/s",
                format.name(),
                s * 1e3,
                bytes as f64 / s / 1e9,
                (m * n * k) as f64 / s / 1e9
            );
        }
    }
    Ok(())
}

/// The Q4_0 quantizer (`--dtype q4_0`) gives gguf-py's `quantize` bit for
/// bit on the fixture's floats (magnitudes 1e-3 to 1e3, a zero block, a
/// tie of magnitudes, a value at the rounding's edge), from f32 and from
/// bf16 rounded alike; quantizing the dequantized blocks gives them back;
/// and a layer packed as Q4_0 holds those blocks.
#[test]
fn q4_0_quantizes_as_gguf_py() -> candle::Result<()> {
    use super::quantize::quantize_row_q4_0;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant/blocks.safetensors"
    );
    let tensors = candle::safetensors::load(path, &candle::Device::Cpu)?;
    let source: Vec<f32> = tensors["quantize.Q4_0.source"].flatten_all()?.to_vec1()?;
    let want: Vec<u8> = tensors["quantize.Q4_0.blocks"].flatten_all()?.to_vec1()?;
    let mut got = vec![0u8; want.len()];
    quantize_row_q4_0(&source, &mut got);
    let bad = got
        .chunks_exact(18)
        .zip(want.chunks_exact(18))
        .position(|(g, w)| g != w);
    assert_eq!(bad, None, "first block that differs from gguf-py's");
    // Dequantized and quantized again: the same blocks.
    let mut values = vec![0f32; source.len()];
    dequantize_row(BlockFormat::Q4_0, &want, &mut values);
    let mut again = vec![0u8; want.len()];
    quantize_row_q4_0(&values, &mut again);
    assert!(again == want, "requantizing changed blocks");
    // bf16 weights widen exactly: the same as their f32 values.
    let halves: Vec<half::bf16> = source.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let widened: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
    let (mut a, mut b) = (vec![0u8; want.len()], vec![0u8; want.len()]);
    quantize_row_q4_0(&halves, &mut a);
    quantize_row_q4_0(&widened, &mut b);
    assert!(a == b);
    let (n, k) = (4, source.len() / 4);
    let layer = crate::PackedLinear::with_options(
        candle::Tensor::from_vec(source.clone(), (n, k), &candle::Device::Cpu)?,
        None,
        &crate::PackOptions::new().with_format(crate::PackFormat::Q4_0),
    )?;
    assert_eq!(layer.block_format(), Some(BlockFormat::Q4_0));
    assert_eq!(layer.weight()?.flatten_all()?.to_vec1::<f32>()?, values);
    Ok(())
}

/// `--dtype q4_k`'s quantizers give their oracles' bits on the fixture's
/// floats: Q4_K ggml's own C `quantize_row_q4_K_ref` (a zero sub-block, an
/// all-positive one, a constant one, an outlier; magnitudes 1e-3 to 1e3),
/// Q5_0 (its fallback) gguf-py's `quantize`; from bf16 as from the f32
/// values it widens to; and a layer packed as Q4_K holds Q4_K blocks where
/// 256 divides its input size and Q5_0 blocks where only 32 does.
#[test]
fn q4_k_and_q5_0_quantize_as_ggml() -> candle::Result<()> {
    use super::quantize::{quantize_row_q4_k, quantize_row_q5_0};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant/blocks.safetensors"
    );
    let tensors = candle::safetensors::load(path, &candle::Device::Cpu)?;
    type Quantize = fn(&[f32], &mut [u8]);
    let rows: [(&str, usize, Quantize); 2] =
        [("Q4_K", 144, quantize_row_q4_k), ("Q5_0", 22, quantize_row_q5_0)];
    for (name, block_bytes, quantize) in rows {
        let source: Vec<f32> = tensors[&format!("quantize.{name}.source")]
            .flatten_all()?
            .to_vec1()?;
        let want: Vec<u8> = tensors[&format!("quantize.{name}.blocks")]
            .flatten_all()?
            .to_vec1()?;
        let mut got = vec![0u8; want.len()];
        quantize(&source, &mut got);
        let bad = got
            .chunks_exact(block_bytes)
            .zip(want.chunks_exact(block_bytes))
            .position(|(g, w)| g != w);
        assert_eq!(bad, None, "{name}: first block that differs from the oracle's");
    }
    let source: Vec<f32> = tensors["quantize.Q4_K.source"].flatten_all()?.to_vec1()?;
    let halves: Vec<half::bf16> = source.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let widened: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
    let (mut a, mut b) = (
        vec![0u8; source.len() / 256 * 144],
        vec![0u8; source.len() / 256 * 144],
    );
    quantize_row_q4_k(&halves, &mut a);
    quantize_row_q4_k(&widened, &mut b);
    assert!(a == b);
    let q4k = crate::PackOptions::new().with_format(crate::PackFormat::Q4_K);
    let dev = candle::Device::Cpu;
    for (k, format) in [(512, BlockFormat::Q4_K), (96, BlockFormat::Q5_0)] {
        let w = candle::Tensor::randn(0f32, 1., (16, k), &dev)?;
        let layer = crate::PackedLinear::with_options(w, None, &q4k)?;
        assert_eq!(layer.block_format(), Some(format), "input size {k}");
    }
    let odd =
        crate::PackedLinear::with_options(candle::Tensor::randn(0f32, 1., (16, 40), &dev)?, None, &q4k)?;
    assert_eq!(odd.block_format(), None);
    Ok(())
}
