//! Which way round a grayscale image is: the digits model was trained on
//! scikit-learn's digits, light ink on a dark background, while people
//! draw dark ink on white paper. A person reads both; so does `vit`, by
//! looking at the image's border, which is background in a picture of one
//! digit.

use anyhow::Result;
use candle::Tensor;

/// `--invert`: whether a grayscale image is turned into its negative
/// before the model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Invert {
    /// For a one-channel model, invert an image whose border is mostly
    /// light (dark ink on a light background), so that it reaches the
    /// model light on dark as the digits model was trained; colour models
    /// get their images as they are.
    Auto,
    /// Never invert.
    Never,
    /// Always invert (one-channel models only).
    Always,
}

/// Mean of the border at or above which the background counts as light:
/// half of the 0–255 range.
const LIGHT_BORDER: f64 = 127.5;

/// Whether the image's outermost ring of pixels is light on average.
///
/// `px`: `(H, W)` values in `0..=255`, row-major.
pub fn light_border(px: &[u8], (h, w): (usize, usize)) -> bool {
    if h == 0 || w == 0 || px.len() != h * w {
        return false;
    }
    let (mut sum, mut n) = (0u64, 0u64);
    for y in 0..h {
        for x in 0..w {
            if y == 0 || y + 1 == h || x == 0 || x + 1 == w {
                sum += u64::from(px[y * w + x]);
                n += 1;
            }
        }
    }
    sum as f64 / n as f64 >= LIGHT_BORDER
}

/// `pixels` as the model should see them: inverted (`255 - v`) when `mode`
/// says so for this image.
///
/// # Shapes
/// - `pixels`: `(channels, H, W)` u8; only one-channel images are ever
///   inverted
pub fn apply(pixels: Tensor, mode: Invert) -> Result<Tensor> {
    let (c, h, w) = pixels.dims3()?;
    if c != 1 || mode == Invert::Never {
        return Ok(pixels);
    }
    let px: Vec<u8> = pixels.flatten_all()?.to_vec1()?;
    if mode == Invert::Auto && !light_border(&px, (h, w)) {
        return Ok(pixels);
    }
    let negative: Vec<u8> = px.into_iter().map(|v| 255 - v).collect();
    Ok(Tensor::from_vec(negative, (c, h, w), pixels.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_border_decides() {
        // A dark 4x4 with a light centre, and its negative.
        let dark: Vec<u8> = (0..16)
            .map(|i| if [5, 6, 9, 10].contains(&i) { 255 } else { 0 })
            .collect();
        let light: Vec<u8> = dark.iter().map(|v| 255 - v).collect();
        assert!(!light_border(&dark, (4, 4)));
        assert!(light_border(&light, (4, 4)));
        // Half the border at 255, half at 0: 127.5 counts as light.
        let half: Vec<u8> = (0..4).map(|i| if i < 2 { 255 } else { 0 }).collect();
        assert!(light_border(&half, (2, 2)));
        assert!(!light_border(&[], (0, 0)));
    }

    #[test]
    fn auto_turns_dark_on_light_into_light_on_dark() -> Result<()> {
        let dev = candle::Device::Cpu;
        let light = Tensor::from_vec(
            vec![250u8, 250, 250, 250, 10, 250, 250, 250, 250],
            (1, 3, 3),
            &dev,
        )?;
        let seen: Vec<u8> = apply(light.clone(), Invert::Auto)?.flatten_all()?.to_vec1()?;
        assert_eq!(seen, [5, 5, 5, 5, 245, 5, 5, 5, 5]);
        let kept: Vec<u8> = apply(light.clone(), Invert::Never)?.flatten_all()?.to_vec1()?;
        assert_eq!(kept, light.flatten_all()?.to_vec1::<u8>()?);
        // Colour images are left alone even when asked.
        let rgb = Tensor::zeros((3, 2, 2), candle::DType::U8, &dev)?;
        let out: Vec<u8> = apply(rgb, Invert::Always)?.flatten_all()?.to_vec1()?;
        assert!(out.iter().all(|&v| v == 0));
        Ok(())
    }
}
