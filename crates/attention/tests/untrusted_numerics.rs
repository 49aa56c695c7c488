//! Extreme logits, fully masked rows and all-zero inputs: every attention
//! path returns finite outputs, in f32, f16 and bf16.

use anyhow::Result;
use candle::{DType, Device, Tensor};
use multihead_attention::{scaled_dot_product_attention_via, AttnMask, AttnPath, KeyPaddingMask, Mask};

const PATHS: [AttnPath; 2] = [AttnPath::Reference, AttnPath::CpuTiled];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn all_finite(t: &Tensor) -> Result<bool> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().all(|x| x.is_finite()))
}

/// Runs every path on every dtype; returns the f32 outputs per (path, dtype).
fn each_path(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: Option<f64>,
) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for dtype in DTYPES {
        let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
        for path in PATHS {
            let what = format!("{path:?} {dtype:?}");
            let y = scaled_dot_product_attention_via(&q, &k, &v, mask, scale, path)
                .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
            assert_eq!(y.dtype(), dtype, "{what}");
            assert!(all_finite(&y)?, "{what}: non-finite output {y}");
            out.push((what, y.to_dtype(DType::F32)?));
        }
    }
    Ok(out)
}

/// Scores of ±1e4: q = 50, keys alternating ±50 over head_dim 4.
#[test]
fn extreme_logits_stay_finite() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::full(50f32, (1, 2, 3, 4), &dev)?;
    let sign = Tensor::new(&[1f32, -1., 1., -1., 1.], &dev)?.reshape((1, 1, 5, 1))?;
    let k = sign.broadcast_mul(&Tensor::full(50f32, (1, 2, 5, 4), &dev)?)?;
    let v = Tensor::arange(0f32, 40., &dev)?.reshape((1, 2, 5, 4))?;
    for (what, y) in each_path(&q, &k, &v, &Mask::new(), Some(1.0))? {
        // softmax puts all weight on the three +1e4 keys equally: the
        // mean of v rows 0, 2, 4 (first head: 8, 9, 10, 11).
        let row: Vec<f32> = y.get(0)?.get(0)?.get(0)?.to_vec1()?;
        for (got, want) in row.iter().zip([8f32, 9., 10., 11.]) {
            assert!((got - want).abs() < 0.1, "{what}: {row:?}");
        }
    }
    // Negative extreme: every score -1e4.
    let k_neg = Tensor::full(-50f32, (1, 2, 5, 4), &dev)?;
    each_path(&q, &k_neg, &v, &Mask::new(), Some(1.0))?;
    Ok(())
}

#[test]
fn extreme_additive_mask_stays_finite() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (2, 2, 3, 4), &dev)?;
    let bias = Tensor::new(&[[1e4f32, -1e4, 0.], [-1e4, -1e4, -1e4], [6e4, -6e4, 0.]], &dev)?;
    let mask = Mask::new().with_attn(AttnMask::Additive(bias));
    each_path(&q, &q, &q, &mask, None)?;
    Ok(())
}

#[test]
fn fully_masked_rows_give_zeros() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (2, 2, 3, 4), &dev)?;
    // Batch 1 has no valid key at all; row 1 of the attn mask hides every key.
    let kp = KeyPaddingMask::from_lengths(&[3, 0], 3, &dev)?;
    let hide = Tensor::new(&[[0u8, 0, 0], [1, 1, 1], [0, 1, 0]], &dev)?;
    let mask = Mask::new()
        .with_key_padding(kp)
        .with_attn(AttnMask::IgnoreWhereTrue(hide));
    for (what, y) in each_path(&q, &q, &q, &mask, None)? {
        let masked_batch: Vec<f32> = y.get(1)?.flatten_all()?.to_vec1()?;
        assert!(masked_batch.iter().all(|&x| x == 0.), "{what}: {masked_batch:?}");
        let masked_row: Vec<f32> = y.get(0)?.get(0)?.get(1)?.to_vec1()?;
        assert!(masked_row.iter().all(|&x| x == 0.), "{what}: {masked_row:?}");
    }
    Ok(())
}

#[test]
fn all_zero_inputs_give_zeros() -> Result<()> {
    let dev = Device::Cpu;
    let z = Tensor::zeros((1, 2, 4, 8), DType::F32, &dev)?;
    for (what, y) in each_path(&z, &z, &z, &Mask::new(), None)? {
        let v: Vec<f32> = y.flatten_all()?.to_vec1()?;
        assert!(v.iter().all(|&x| x == 0.), "{what}");
    }
    Ok(())
}
