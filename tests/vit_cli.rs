//! `multihead vit` as a user runs it: the default run, `--eval`,
//! `--attention-map`, and one-line errors on bad input.

use std::process::{Command, Output};

use anyhow::{Context, Result};
use multihead_test_support::{
    cli::{assert_one_line_error, output},
    scratch_dir, shipped,
};

/// `multihead vit ARGS` run in the shipped digits model's folder.
fn vit(args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multihead"));
    cmd.current_dir(shipped::folder("vit-digits"))
        .arg("vit")
        .args(args);
    output(cmd, b"")
}

#[test]
fn default_run_classifies_the_samples() -> Result<()> {
    let out = vit(&[])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout)?;
    let samples = std::fs::read_dir(shipped::folder("vit-digits").join("samples"))?.count();
    assert!(samples >= 10);
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with(".png")).count(),
        samples,
        "{stdout}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with('%')).count(),
        3 * samples,
        "{stdout}"
    );
    Ok(())
}

#[test]
fn eval_prints_accuracy_and_confusion() -> Result<()> {
    let out = vit(&["--eval", "heldout"])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout)?;
    assert!(stdout.starts_with("accuracy: "), "{stdout}");
    assert!(stdout.contains("confusion matrix"), "{stdout}");
    // Header and one row per class.
    assert_eq!(stdout.lines().count(), 2 + 1 + 10, "{stdout}");
    Ok(())
}

#[test]
fn attention_map_is_written() -> Result<()> {
    let dir = scratch_dir!("attention_map")?;
    let out_png = dir.join("map.png");
    let sample = std::fs::read_dir(shipped::folder("vit-digits").join("samples"))?
        .next()
        .context("no sample")??
        .path();
    let out = vit(&[
        sample.to_str().context("path")?,
        "--attention-map",
        out_png.to_str().context("path")?,
    ])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let img = image::open(&out_png)?;
    assert_eq!((img.width(), img.height()), (2 * 256 + 8, 256));
    Ok(())
}

#[test]
fn other_dtypes_and_sizes_run() -> Result<()> {
    for args in [&["--dtype", "f16"][..], &["--image-size", "24"]] {
        let out = vit(args)?;
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[test]
fn missing_file() -> Result<()> {
    assert_one_line_error(&vit(&["no-such-image.png"])?, &["no-such-image.png"]);
    Ok(())
}

#[test]
fn not_an_image() -> Result<()> {
    let dir = scratch_dir!("not_an_image")?;
    let path = dir.join("notes.png");
    std::fs::write(&path, "these are not pixels\n")?;
    assert_one_line_error(&vit(&[path.to_str().context("path")?])?, &["not a PNG or JPEG"]);
    Ok(())
}

#[test]
fn corrupt_image() -> Result<()> {
    let dir = scratch_dir!("corrupt_image")?;
    let good = std::fs::read_dir(shipped::folder("vit-digits").join("samples"))?
        .next()
        .context("no sample")??
        .path();
    let mut bytes = std::fs::read(good)?;
    bytes.truncate(bytes.len() / 2);
    let path = dir.join("truncated.png");
    std::fs::write(&path, bytes)?;
    assert_one_line_error(&vit(&[path.to_str().context("path")?])?, &["decoding image"]);
    Ok(())
}

#[test]
fn weights_that_do_not_match_the_config() -> Result<()> {
    let dir = scratch_dir!("mismatch")?;
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        shipped::folder("vit-digits").join("config.json"),
    )?)?;
    cfg["embed_dim"] = serde_json::json!(32);
    let path = dir.join("config.json");
    std::fs::write(&path, cfg.to_string())?;
    let out = vit(&["--config", path.to_str().context("path")?])?;
    assert_one_line_error(&out, &["do not match the model"]);
    Ok(())
}

#[test]
fn size_the_patch_does_not_divide() -> Result<()> {
    assert_one_line_error(
        &vit(&["--image-size", "15"])?,
        &["not a multiple of the patch size"],
    );
    let dir = scratch_dir!("bad_config")?;
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        shipped::folder("vit-digits").join("config.json"),
    )?)?;
    cfg["patch_size"] = serde_json::json!(3);
    let path = dir.join("config.json");
    std::fs::write(&path, cfg.to_string())?;
    assert_one_line_error(
        &vit(&["--config", path.to_str().context("path")?])?,
        &["patch_size (3)"],
    );
    Ok(())
}

/// Top-10 `(class, prob)` of each image, from `--format json`.
fn readings(args: &[&str]) -> Result<Vec<Vec<(u64, f64)>>> {
    let out = vit(&[args, &["--format", "json", "--top-k", "10"]].concat())?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut all = Vec::new();
    for image in json.as_array().context("array")? {
        let mut top = Vec::new();
        for e in image["top_k"].as_array().context("top_k")? {
            top.push((
                e["class"].as_u64().context("class")?,
                e["prob"].as_f64().context("prob")?,
            ));
        }
        all.push(top);
    }
    Ok(all)
}

/// A digit drawn dark on light (as people draw) reads as the same digit
/// light on dark (as scikit-learn's digits are): the border says which
/// is the background. Both are a shipped sample enlarged to 64 x 64, one
/// of them inverted.
#[test]
fn either_polarity_reads_the_same() -> Result<()> {
    let dir = scratch_dir!("polarity")?;
    let sample = image::open(shipped::folder("vit-digits").join("samples/digit3_0705.png"))?.to_luma8();
    let big = image::imageops::resize(&sample, 64, 64, image::imageops::FilterType::Nearest);
    let mut ink_on_paper = big.clone();
    image::imageops::invert(&mut ink_on_paper);
    let (dark, light) = (dir.join("light-on-dark.png"), dir.join("dark-on-light.png"));
    big.save(&dark)?;
    ink_on_paper.save(&light)?;
    let (dark, light) = (dark.to_str().context("path")?, light.to_str().context("path")?);

    let auto = readings(&[dark, light])?;
    assert_eq!(auto[0][0].0, 3, "{auto:?}");
    // The inverted image reaches the model as the original, pixel for pixel.
    assert_eq!(auto[0], auto[1]);
    // Taken as it is, dark on light is misread (as a 0 at 81 %): the
    // detection is what reads it.
    let never = readings(&["--invert", "never", light])?;
    assert_ne!(never[0][0].0, 3, "as-is: {never:?}");
    // Forcing it inverts the light-on-dark one the wrong way round.
    let always = readings(&["--invert", "always", light, dark])?;
    assert_eq!(always[0], auto[1]);
    assert_ne!(always[1][0].0, 3, "{always:?}");
    Ok(())
}
