//! Bad weight files and configs: each ends in an error that says what is
//! wrong, from the library, never a panic. Inputs are built in the test.

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_models::checkpoint::Checkpoint;
use multihead_models::vit::{VisionTransformer, VitConfig};
use multihead_test_support::errors::assert_err;

/// A ViT small enough to build in a test: 8x8 grayscale, 4x4 patches.
fn tiny_cfg() -> VitConfig {
    VitConfig {
        img_size: 8,
        patch_size: 4,
        embed_dim: 8,
        depth: 1,
        num_heads: 2,
        in_chans: 1,
        num_classes: 3,
        mlp_ratio: 2.,
        image_mean: vec![0.5],
        image_std: vec![0.5],
        ..VitConfig::default()
    }
}

/// The tiny ViT's randomly initialised tensors, by name.
fn tiny_tensors(dtype: DType) -> Result<Vec<(String, Tensor)>> {
    let varmap = VarMap::new();
    VisionTransformer::new(
        &tiny_cfg(),
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let data = varmap.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let mut v: Vec<(String, Tensor)> = data
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.as_tensor().to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// safetensors bytes of `tensors`.
fn serialize(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let dir = std::env::temp_dir().join(format!("untrusted_weights_{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}.safetensors", rand_name()));
    let map: std::collections::HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle::safetensors::save(&map, &path)?;
    let bytes = std::fs::read(&path)?;
    std::fs::remove_file(&path)?;
    Ok(bytes)
}

fn rand_name() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("f{}", N.fetch_add(1, Ordering::Relaxed))
}

fn tiny_bytes() -> Result<Vec<u8>> {
    serialize(&tiny_tensors(DType::F32)?)
}

/// A file of `header` (JSON text) and `data`.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Parses `bytes` and loads the tiny ViT from them.
fn load(bytes: Vec<u8>) -> candle::Result<VisionTransformer> {
    let ckpt = Checkpoint::from_bytes(bytes, "bad.safetensors")?;
    ckpt.load(DType::F32, &Device::Cpu, |vb| {
        VisionTransformer::new(&tiny_cfg(), vb)
    })
}

fn with(
    tensors: Vec<(String, Tensor)>,
    name: &str,
    f: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<(String, Tensor)>> {
    tensors
        .into_iter()
        .map(|(k, t)| Ok(if k == name { (k, f(&t)?) } else { (k, t) }))
        .collect()
}

#[test]
fn a_good_file_loads_in_every_float_dtype() -> Result<()> {
    let x = Tensor::zeros((1, 1, 8, 8), DType::F32, &Device::Cpu)?;
    for stored in [DType::F32, DType::F16, DType::BF16] {
        let bytes = serialize(&tiny_tensors(stored)?)?;
        for wanted in [DType::F32, DType::F16] {
            let ckpt = Checkpoint::from_bytes(bytes.clone(), "good.safetensors")?;
            let vit = ckpt.load(wanted, &Device::Cpu, |vb| VisionTransformer::new(&tiny_cfg(), vb))?;
            let y = candle::Module::forward(&vit, &x.to_dtype(wanted)?)?;
            assert_eq!((y.dims(), y.dtype()), (&[1, 3][..], wanted), "stored {stored:?}");
        }
    }
    Ok(())
}

#[test]
fn empty_file() {
    assert_err(load(vec![]), &["bad.safetensors", "truncated", "0 bytes"]);
}

#[test]
fn file_shorter_than_the_header_length() {
    assert_err(load(vec![1, 2, 3]), &["truncated", "3 bytes"]);
}

#[test]
fn truncated_in_the_data() -> Result<()> {
    let mut bytes = tiny_bytes()?;
    bytes.truncate(bytes.len() - 10);
    assert_err(
        load(bytes),
        &["bad.safetensors", "do not end where the file ends"],
    );
    Ok(())
}

#[test]
fn header_length_past_the_end() -> Result<()> {
    let mut bytes = tiny_bytes()?;
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_err(load(bytes), &["header length"]);
    let mut bytes = tiny_bytes()?;
    let n = bytes.len() as u64;
    bytes[..8].copy_from_slice(&n.to_le_bytes());
    assert_err(load(bytes), &["header length runs past the end"]);
    Ok(())
}

#[test]
fn header_not_json() {
    assert_err(
        load(raw("{this is not json}", &[])),
        &["not a valid safetensors JSON header"],
    );
    assert_err(
        load(raw("[1, 2, 3]", &[])),
        &["not a valid safetensors JSON header"],
    );
}

#[test]
fn header_not_utf8() {
    let mut bytes = raw("{\"a\": 1}", &[]);
    bytes[10] = 0xff;
    assert_err(load(bytes), &["not UTF-8"]);
}

#[test]
fn overlapping_offsets() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    assert_err(load(raw(h, &[0; 12])), &["data_offsets", "overlap"]);
}

#[test]
fn offsets_past_the_data() {
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    assert_err(load(raw(h, &[0; 8])), &["offsets past the data"]);
}

#[test]
fn shape_disagrees_with_byte_range() {
    let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    assert_err(load(raw(h, &[0; 8])), &["does not match its shape and dtype"]);
}

#[test]
fn shape_overflows() {
    let h = r#"{"a":{"dtype":"F32","shape":[18446744073709551615, 4],"data_offsets":[0,8]}}"#;
    assert_err(load(raw(h, &[0; 8])), &["overflow"]);
}

#[test]
fn unknown_dtype() {
    let h = r#"{"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}}"#;
    assert_err(load(raw(h, &[0; 8])), &["JSON header", "Q4_K"]);
}

#[test]
fn integer_where_a_float_belongs() -> Result<()> {
    let t = with(tiny_tensors(DType::F32)?, "head.weight", |t| {
        Ok(t.to_dtype(DType::I64)?)
    })?;
    assert_err(load(serialize(&t)?), &["not float", "head.weight is I64"]);
    let t = with(tiny_tensors(DType::F32)?, "cls_token", |t| {
        Ok(t.to_dtype(DType::U8)?)
    })?;
    assert_err(load(serialize(&t)?), &["cls_token is U8"]);
    Ok(())
}

#[test]
fn wrong_shapes_are_listed_together() -> Result<()> {
    let t = with(tiny_tensors(DType::F32)?, "head.weight", |_| {
        Ok(Tensor::zeros((4, 8), DType::F32, &Device::Cpu)?)
    })?;
    let t = with(t, "pos_embed", |_| {
        Ok(Tensor::zeros((1, 3, 8), DType::F32, &Device::Cpu)?)
    })?;
    assert_err(
        load(serialize(&t)?),
        &[
            "2 mis-shaped",
            "head.weight expected [3, 8] found [4, 8]",
            "pos_embed expected [1, 5, 8] found [1, 3, 8]",
        ],
    );
    Ok(())
}

#[test]
fn missing_tensors_are_listed_together() -> Result<()> {
    let t: Vec<_> = tiny_tensors(DType::F32)?
        .into_iter()
        .filter(|(k, _)| k != "head.bias" && k != "blocks.0.attn.qkv.weight")
        .collect();
    assert_err(
        load(serialize(&t)?),
        &["2 missing", "blocks.0.attn.qkv.weight [24, 8]", "head.bias [3]"],
    );
    Ok(())
}

#[test]
fn unexpected_tensors_are_refused() -> Result<()> {
    let mut t = tiny_tensors(DType::F32)?;
    t.push((
        "head_dist.weight".into(),
        Tensor::zeros((3, 8), DType::F32, &Device::Cpu)?,
    ));
    assert_err(load(serialize(&t)?), &["1 unexpected: head_dist.weight"]);
    Ok(())
}

#[test]
fn nan_and_inf_are_reported() -> Result<()> {
    let nan = Tensor::new(&[f32::NAN, 1., f32::NAN], &Device::Cpu)?;
    let t = with(tiny_tensors(DType::F32)?, "head.bias", |_| Ok(nan.clone()))?;
    assert_err(load(serialize(&t)?), &["NaN/Inf", "head.bias (2 NaN, 0 Inf)"]);
    let t = with(tiny_tensors(DType::F16)?, "norm.weight", |w| {
        Ok(w.ones_like()?.affine(0., f64::INFINITY)?)
    })?;
    assert_err(load(serialize(&t)?), &["norm.weight (0 NaN, 8 Inf)"]);
    Ok(())
}

#[test]
fn pickles_are_refused_with_the_export_command() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("untrusted_pickle_{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for name in ["model.bin", "model.pt", "model.pth"] {
        let path = dir.join(name);
        std::fs::write(&path, b"\x80\x02}q\x00.")?;
        assert_err(
            Checkpoint::read(&path),
            &[
                "PyTorch pickle",
                "arbitrary code",
                "from safetensors.torch import save_file",
                // Copied: `save_file` refuses tensors sharing memory, as a
                // tied embedding and head do in a `.bin`.
                "save_file({k: v.contiguous().clone() for k, v in sd.items()}",
                name,
            ],
        );
    }
    // torch.save's zip format, whatever the extension says.
    let zip = b"PK\x03\x04\x00\x00\x00\x00archive/data.pkl".to_vec();
    assert_err(
        Checkpoint::from_bytes(zip, "model.safetensors"),
        &["PyTorch pickle"],
    );
    Ok(())
}

#[test]
fn config_with_missing_unknown_or_contradictory_fields() {
    let base = r#""img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2"#;
    assert_err(
        VitConfig::from_json(&format!("{{{base}}}")),
        &["missing field `num_heads`"],
    );
    assert_err(
        VitConfig::from_json(&format!(r#"{{{base}, "num_heads": 4, "heads": 4}}"#)),
        &["unknown field `heads`"],
    );
    assert_err(
        VitConfig::from_json(&format!(r#"{{{base}, "num_heads": "four"}}"#)),
        &["invalid type"],
    );
    assert_err(
        VitConfig::from_json(
            r#"{"img_size": 32, "patch_size": 4, "embed_dim": 10, "depth": 2, "num_heads": 3}"#,
        ),
        &["embed_dim (10) must be divisible by num_heads (3)"],
    );
    assert_err(
        VitConfig::from_json(
            r#"{"img_size": 30, "patch_size": 16, "embed_dim": 64, "depth": 2, "num_heads": 4}"#,
        ),
        &["img_size (30) must be divisible by patch_size (16)"],
    );
    assert_err(
        VitConfig::from_json(
            r#"{"img_size": 32, "patch_size": 0, "embed_dim": 64, "depth": 2, "num_heads": 4}"#,
        ),
        &["patch_size must be > 0"],
    );
    assert_err(VitConfig::from_json("not json"), &["VitConfig"]);
}

#[test]
fn position_table_shorter_than_the_sequence() -> Result<()> {
    // A table for a 2x2 grid cannot serve a 4x4 grid's 16 patches as is.
    let table = Tensor::zeros((1, 1 + 4, 8), DType::F32, &Device::Cpu)?;
    let res = multihead_models::vit::resample_abs_pos_embed(&table, (4, 4), (4, 4), 1);
    assert_err(res, &["5 positions do not match 1 prefix tokens and a 4x4 grid"]);
    Ok(())
}

#[test]
fn inspect_recognises_the_tiny_vit() -> Result<()> {
    let ckpt = Checkpoint::from_bytes(tiny_bytes()?, "tiny.safetensors")?;
    let layout = multihead_models::inspect::recognise(ckpt.tensors());
    let multihead_models::inspect::Layout::TimmVit(f) = layout else {
        anyhow::bail!("not recognised as timm: {layout:?}")
    };
    assert_eq!(
        (
            f.embed_dim,
            f.depth,
            f.patch_size,
            f.img_size,
            f.num_classes,
            f.in_chans
        ),
        (8, 1, 4, Some(8), 3, 1)
    );
    ckpt.info("pos_embed").context("pos_embed")?;
    Ok(())
}
