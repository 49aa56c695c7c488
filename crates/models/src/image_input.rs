//! Decoding images from strangers: PNG or JPEG recognised by their bytes,
//! with limits on the size a header may claim, so a small file that
//! declares enormous dimensions (a decompression bomb) is refused before
//! any pixel buffer is allocated.

use candle::Result;
use image::{DynamicImage, ImageFormat, ImageReader, Limits};

/// Largest width or height accepted, in pixels.
pub const MAX_IMAGE_SIDE: u32 = 16_384;

/// Most bytes the decoder may allocate for one image (512 MiB: a
/// 16384 x 8192 RGBA image).
pub const MAX_IMAGE_ALLOC: u64 = 512 * 1024 * 1024;

/// The limits [`decode_image`] decodes under.
pub fn image_limits() -> Limits {
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_ALLOC);
    limits
}

/// Decodes a PNG or JPEG from `bytes`; `label` names it in errors.
///
/// Refuses other formats, images wider or taller than
/// [`MAX_IMAGE_SIDE`], decodes that would allocate more than
/// [`MAX_IMAGE_ALLOC`], and images with no pixels.
pub fn decode_image(bytes: &[u8], label: &str) -> Result<DynamicImage> {
    let err = |msg: String| candle::Error::Msg(msg);
    if bytes.is_empty() {
        return Err(err(format!("image '{label}' is an empty file")));
    }
    let format = match image::guess_format(bytes) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg)) => f,
        _ => return Err(err(format!("'{label}' is not a PNG or JPEG image"))),
    };
    let mut reader = ImageReader::with_format(std::io::Cursor::new(bytes), format);
    reader.limits(image_limits());
    let img = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(l) => err(format!(
            "image '{label}' is refused: its header claims a size beyond the limit of \
             {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels / {} MiB ({l})",
            MAX_IMAGE_ALLOC >> 20
        )),
        e => err(format!("decoding image '{label}': {e}")),
    })?;
    if img.width() == 0 || img.height() == 0 {
        return Err(err(format!(
            "image '{label}' is empty ({}x{} pixels)",
            img.width(),
            img.height()
        )));
    }
    Ok(img)
}
