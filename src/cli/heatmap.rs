//! A labelled heat map of an attention matrix, written as PNG: rows are
//! output characters (down), columns input characters (across).
//!
//! Labels use the public-domain 8x8 bitmap font of the `font8x8` crate
//! (ASCII), plus three glyphs drawn here for the CJK date characters the
//! date model reads (年, 月, 日); any other character is drawn as a box.

use anyhow::{bail, Result};
use image::{Rgb, RgbImage};
use std::path::Path;

/// Pixels per glyph pixel: 8x8 glyphs drawn at 16x16.
const SCALE: u32 = 2;
/// Side of one heat-map cell, a little more than a glyph.
const CELL: u32 = 8 * SCALE + 4;
const MARGIN: u32 = 6;

/// 8x8 glyphs for 年, 月, 日, one byte per row, bit 0 = leftmost pixel
/// (the `font8x8` convention).
const CJK: [(char, [u8; 8]); 3] = [
    ('年', [0x04, 0x7E, 0x0A, 0x7E, 0x0A, 0xFF, 0x08, 0x08]),
    ('月', [0x7C, 0x44, 0x7C, 0x44, 0x7C, 0x44, 0x42, 0x61]),
    ('日', [0x7E, 0x42, 0x42, 0x7E, 0x42, 0x42, 0x7E, 0x00]),
];

/// An empty box for characters without a glyph.
const BOX: [u8; 8] = [0xFF, 0x81, 0x81, 0x81, 0x81, 0x81, 0x81, 0xFF];

fn glyph(c: char) -> [u8; 8] {
    if c.is_ascii() {
        return font8x8::legacy::BASIC_LEGACY[c as usize];
    }
    CJK.iter().find(|(k, _)| *k == c).map_or(BOX, |(_, g)| *g)
}

fn draw_char(img: &mut RgbImage, c: char, x0: u32, y0: u32, color: Rgb<u8>) {
    for (row, bits) in glyph(c).iter().enumerate() {
        for col in 0..8u32 {
            if bits >> col & 1 == 1 {
                for dy in 0..SCALE {
                    for dx in 0..SCALE {
                        let (x, y) = (x0 + col * SCALE + dx, y0 + row as u32 * SCALE + dy);
                        if x < img.width() && y < img.height() {
                            img.put_pixel(x, y, color);
                        }
                    }
                }
            }
        }
    }
}

/// White (0) to dark blue (1), interpolated in sRGB: enough to read an
/// alignment, and legible in grey-scale print.
fn color(v: f32) -> Rgb<u8> {
    let v = v.clamp(0., 1.);
    let lerp = |a: f32, b: f32| (a + (b - a) * v).round() as u8;
    Rgb([lerp(255., 8.), lerp(255., 48.), lerp(255., 107.)])
}

/// Writes `weights` (`rows.len()` rows of `cols.len()` values) as a PNG
/// heat map at `path`, scaled so that the largest weight is darkest.
pub fn write_png(path: &Path, weights: &[Vec<f32>], rows: &[char], cols: &[char]) -> Result<()> {
    if weights.len() != rows.len() || weights.iter().any(|r| r.len() != cols.len()) {
        bail!(
            "attention map: {} rows of weights for {} output and {} input characters",
            weights.len(),
            rows.len(),
            cols.len()
        )
    }
    let (n_rows, n_cols) = (rows.len() as u32, cols.len() as u32);
    let left = MARGIN + CELL;
    let top = MARGIN + CELL;
    let width = left + n_cols.max(1) * CELL + MARGIN;
    let height = top + n_rows.max(1) * CELL + MARGIN;
    let mut img = RgbImage::from_pixel(width, height, Rgb([255, 255, 255]));
    let max = weights
        .iter()
        .flatten()
        .fold(0f32, |m, &w| m.max(w))
        .max(f32::MIN_POSITIVE);
    let ink = Rgb([20, 20, 20]);
    let pad = (CELL - 8 * SCALE) / 2;
    for (j, &c) in cols.iter().enumerate() {
        draw_char(&mut img, c, left + j as u32 * CELL + pad, MARGIN + pad, ink);
    }
    for (i, (&c, row)) in rows.iter().zip(weights).enumerate() {
        let y0 = top + i as u32 * CELL;
        draw_char(&mut img, c, MARGIN + pad, y0 + pad, ink);
        for (j, &w) in row.iter().enumerate() {
            let x0 = left + j as u32 * CELL;
            let fill = color(w / max);
            // One pixel of white between cells keeps the grid readable.
            for y in y0..y0 + CELL - 1 {
                for x in x0..x0 + CELL - 1 {
                    img.put_pixel(x, y, fill);
                }
            }
        }
    }
    super::output::write_png(path, &img, "attention map")
}
