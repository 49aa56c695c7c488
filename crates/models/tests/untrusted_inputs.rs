//! Bad images, sequences and masks: each ends in an error that says what
//! is wrong, never a panic or an allocation the header asked for.

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    scaled_dot_product_attention, AttnMask, KeyPaddingMask, Mask, MhaConfig, MhaOptions, MultiheadAttention,
};
use multihead_models::image_input::{decode_image, MAX_IMAGE_SIDE};
use multihead_test_support::errors::assert_err;

/// CRC-32 (IEEE), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
}

/// A PNG whose header claims `width x height` 8-bit grayscale pixels,
/// followed by a tiny (wrong-sized) image data chunk.
fn png_claiming(width: u32, height: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 0, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    // zlib stream of two zero bytes: one 1-pixel row and its filter byte.
    chunk(
        &mut out,
        b"IDAT",
        &[0x78, 0x9c, 0x63, 0x60, 0x00, 0x00, 0x00, 0x02, 0x00, 0x01],
    );
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn a_small_valid_png_decodes() -> Result<()> {
    let img = decode_image(&png_claiming(1, 1), "one.png")?;
    assert_eq!((img.width(), img.height()), (1, 1));
    Ok(())
}

#[test]
fn not_an_image() {
    assert_err(
        decode_image(b"these are not pixels\n", "notes.png"),
        &["'notes.png' is not a PNG or JPEG"],
    );
    assert_err(
        decode_image(b"GIF89a\x01\x00\x01\x00", "a.gif"),
        &["not a PNG or JPEG"],
    );
}

#[test]
fn empty_file_is_not_an_image() {
    assert_err(decode_image(&[], "empty.png"), &["'empty.png' is an empty file"]);
}

#[test]
fn zero_sized_image() {
    assert_err(decode_image(&png_claiming(0, 5), "zero.png"), &["zero.png"]);
    assert_err(decode_image(&png_claiming(7, 0), "zero.png"), &["zero.png"]);
}

#[test]
fn decompression_bomb_is_refused_before_allocating() {
    // 100 bytes claiming 100000 x 100000 pixels: 10 GB decoded.
    let bomb = png_claiming(100_000, 100_000);
    assert!(bomb.len() < 100);
    assert_err(
        decode_image(&bomb, "bomb.png"),
        &["'bomb.png' is refused", "beyond the limit"],
    );
    // One side over the limit, small in area.
    assert_err(
        decode_image(&png_claiming(MAX_IMAGE_SIDE + 1, 1), "wide.png"),
        &["beyond the limit"],
    );
    // Within the sides, over the allocation limit: 16384 x 16384 x 1 byte
    // = 256 MiB fits; a JPEG header claiming 65500 x 65500 does not.
    let mut jpeg = vec![0xff, 0xd8, 0xff, 0xc0, 0x00, 0x0b, 0x08];
    jpeg.extend_from_slice(&65500u16.to_be_bytes());
    jpeg.extend_from_slice(&65500u16.to_be_bytes());
    jpeg.extend_from_slice(&[0x01, 0x01, 0x11, 0x00, 0xff, 0xd9]);
    assert_err(decode_image(&jpeg, "bomb.jpg"), &["bomb.jpg"]);
}

#[test]
fn truncated_png() {
    let png = png_claiming(4, 4);
    assert_err(decode_image(&png[..30], "cut.png"), &["decoding image 'cut.png'"]);
}

fn mha() -> Result<MultiheadAttention> {
    let vb = VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    Ok(MultiheadAttention::new(&MhaConfig::new(8, 2), vb)?)
}

#[test]
fn empty_sequences_are_refused_by_name() -> Result<()> {
    let m = mha()?;
    let empty = Tensor::zeros((2, 0, 8), DType::F32, &Device::Cpu)?;
    let x = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu)?;
    assert_err(m.forward(&empty), &["query is an empty sequence"]);
    let opts = multihead_attention::MhaOptions::new();
    assert_err(
        m.forward_attn(&x, &empty, &empty, &opts).map(|o| o.output),
        &["key and value are empty sequences"],
    );
    let q = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
    let kv = Tensor::zeros((1, 2, 0, 4), DType::F32, &Device::Cpu)?;
    let mask = multihead_attention::Mask::new();
    assert_err(
        multihead_attention::scaled_dot_product_attention(&q, &kv, &kv, &mask, None),
        &["empty sequence: q_len 3, kv_len 0"],
    );
    Ok(())
}

#[test]
fn vit_image_smaller_than_a_patch() -> Result<()> {
    let mut cfg = multihead_models::vit::VitConfig {
        img_size: 8,
        patch_size: 4,
        embed_dim: 8,
        depth: 1,
        num_heads: 2,
        ..multihead_models::vit::VitConfig::default()
    };
    cfg.num_classes = 2;
    let vb = VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    let vit = multihead_models::vit::VisionTransformer::new(&cfg, vb)?;
    let x = Tensor::zeros((1, 3, 0, 0), DType::F32, &Device::Cpu)?;
    assert_err(candle::Module::forward(&vit, &x), &["image size 0x0"]);
    let x = Tensor::zeros((1, 3, 3, 3), DType::F32, &Device::Cpu)?;
    assert_err(
        candle::Module::forward(&vit, &x),
        &["3x3 is not a non-zero multiple of the patch size 4"],
    );
    Ok(())
}

#[test]
fn key_padding_mask_of_the_wrong_shape() -> Result<()> {
    let m = mha()?;
    let x = Tensor::zeros((2, 5, 8), DType::F32, &Device::Cpu)?;
    let kp = KeyPaddingMask::PadWhereTrue(Tensor::zeros((2, 4), DType::U8, &Device::Cpu)?);
    let o = MhaOptions::new().with_mask(Mask::new().with_key_padding(kp));
    assert_err(
        m.forward_attn(&x, &x, &x, &o),
        &["key_padding_mask", "(2, 5)", "[2, 4]"],
    );
    Ok(())
}

#[test]
fn attn_mask_of_the_wrong_shape() -> Result<()> {
    let q = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
    let am = AttnMask::Additive(Tensor::zeros((3, 7), DType::F32, &Device::Cpu)?);
    assert_err(
        scaled_dot_product_attention(&q, &q, &q, &Mask::new().with_attn(am), None),
        &["attn_mask"],
    );
    Ok(())
}

#[test]
fn boolean_mask_of_a_float_dtype() -> Result<()> {
    let q = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
    let am = AttnMask::IgnoreWhereTrue(Tensor::zeros((3, 3), DType::F32, &Device::Cpu)?);
    assert_err(
        scaled_dot_product_attention(&q, &q, &q, &Mask::new().with_attn(am), None),
        &["must be an integer tensor", "F32"],
    );
    Ok(())
}

#[test]
fn additive_mask_of_an_integer_dtype() -> Result<()> {
    let q = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
    let am = AttnMask::Additive(Tensor::zeros((3, 3), DType::U8, &Device::Cpu)?);
    assert_err(
        scaled_dot_product_attention(&q, &q, &q, &Mask::new().with_attn(am), None),
        &["additive mask must be a float tensor", "U8"],
    );
    Ok(())
}
