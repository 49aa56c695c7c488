//! `scaled_dot_product_attention` with masks as PyTorch users hold them,
//! against `F.scaled_dot_product_attention` (fixture written by
//! `scripts/make_sdpa_mask_fixtures.py`): boolean masks saved as
//! safetensors `BOOL` (read as u8) and PyTorch's broadcasting of `(L, 1)`,
//! `(1, S)`, `(H, L, S)` over a batch of 2, and `(B, 1, L, S)`.

use anyhow::Result;
use candle::{DType, Device, Tensor};
use multihead_attention::{scaled_dot_product_attention_via, AttnMask, AttnPath, Mask};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, Fixture},
};

#[test]
fn masks_read_and_broadcast_as_pytorch_does() -> Result<()> {
    let dev = Device::Cpu;
    let f = Fixture::load(&fixture_dir("sdpa_masks.safetensors"), &dev)?;
    let (q, k, v) = (f.get("q")?, f.get("k")?, f.get("v")?);
    let cases = f.case["cases"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("no cases"))?;
    assert_eq!(cases.len(), 8);
    for name in cases.keys() {
        let m = f.get(&format!("{name}.mask"))?;
        let mask = if name.starts_with("bool") {
            // safetensors BOOL arrives as u8.
            assert_eq!(m.dtype(), DType::U8, "{name}");
            Mask::new().with_attn(AttnMask::AttendWhereTrue(m.clone()))
        } else {
            Mask::new().with_attn(AttnMask::Additive(m.clone()))
        };
        // PyTorch gives NaN where every key of a query is masked; we give
        // zeros there (documented).
        let expected = f.get(&format!("{name}.out"))?;
        let expected = expected
            .ne(expected)?
            .where_cond(&expected.zeros_like()?, expected)?;
        for path in [AttnPath::CpuTiled, AttnPath::Reference] {
            let out = scaled_dot_product_attention_via(q, k, v, &mask, None, path)?;
            assert_close(&format!("{name} {path:?}"), &out, &expected, 1e-5)?;
        }
    }
    // A bool mask the wrong size is refused with its shape.
    let bad = Tensor::ones((3, 5), DType::U8, &dev)?;
    let err = scaled_dot_product_attention_via(
        q,
        k,
        v,
        &Mask::new().with_attn(AttnMask::AttendWhereTrue(bad)),
        None,
        AttnPath::Auto,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("[3, 5]"), "{err}");
    Ok(())
}
