//! Sizes through the binary: headers of 100,000 tensors, configs whose
//! sizes no file of theirs could hold, a 16384 x 16384 PNG, size flags out
//! of range, and a 100 MB line on standard input. Each ends in bounded
//! work and either a result or one `error:` line, never a panic.
//!
//! Every input is generated here (the largest, the 100,000-tensor header,
//! is 6 MB and written to the target directory).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle::Tensor;
use multihead_test_support::{
    cli::{arg, assert_one_line_error, run_capped, text},
    multihead, scratch_dir, shipped,
    weights::many_tensors,
};

/// `inspect` parses the header once, not once per tensor, and cuts its
/// listing to a screenful. Not timed: a quadratic version would take hours
/// here, which a test run notices.
#[test]
fn inspect_a_header_of_100000_tensors() -> Result<()> {
    let dir = scratch_dir!("many")?;
    let path = dir.join("many.safetensors");
    many_tensors(&path, 100_000)?;
    let out = multihead!(&["inspect", arg(&path)?])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.lines().count() < 300, "not truncated");
    for want in [
        "t.199 ",
        "… 99800 more tensors (--all lists them)",
        "total: 100000 tensors (100000 F32), 100000 parameters",
        "values: all finite",
    ] {
        assert!(stdout.contains(want), "no {want:?} in the output");
    }
    let out = multihead!(&["inspect", "--json", arg(&path)?])?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["tensors"].as_array().map(Vec::len), Some(100_000));
    Ok(())
}

/// The shipped ViT's directory with `depth` in its config changed.
fn deep_vit(dir: &Path, depth: u64) -> Result<PathBuf> {
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        shipped::folder("vit-digits").join("config.json"),
    )?)?;
    cfg["depth"] = serde_json::json!(depth);
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    let w = dir.join("model.safetensors");
    std::fs::copy(shipped::folder("vit-digits").join("model.safetensors"), &w)?;
    Ok(w)
}

/// `depth: 300000` beside the shipped weights is refused before anything
/// is built (built, it would record 3.6 million tensors: about a minute,
/// 2 GB and a 3.6-million-entry error line).
#[test]
fn a_config_deeper_than_its_file_is_refused_before_building() -> Result<()> {
    let dir = scratch_dir!("deep")?;
    let w = deep_vit(&dir, 300_000)?;
    let cfg = dir.join("config.json");
    let out = multihead!(&["vit", "--weights", arg(&w)?])?;
    assert_one_line_error(&out, &["depth 300000", "larger than this file can hold"]);
    assert!(out.stderr.len() < 1000, "a long error line");
    let out = multihead!(&["inspect", arg(&w)?, "--config", arg(&cfg)?])?;
    assert_one_line_error(&out, &["depth 300000", "larger than this file can hold"]);
    // Beside the file, the config is not used, and inspect says why.
    let out = multihead!(&["inspect", arg(&w)?])?;
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("(beside the file) not used: "));
    // A width past the file is refused at its first tensor, and sizes
    // whose products overflow are errors too, not wrapped values.
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg)?)?;
    v["depth"] = serde_json::json!(4);
    v["num_heads"] = serde_json::json!(1);
    for (embed_dim, why) in [
        (1u64 << 40, "larger than this file can hold"),
        (1 << 62, "overflows"),
    ] {
        v["embed_dim"] = serde_json::json!(embed_dim);
        std::fs::write(&cfg, v.to_string())?;
        assert_one_line_error(
            &multihead!(&["vit", "--weights", arg(&w)?])?,
            &[&format!("embed_dim {embed_dim}"), "patch_embed.proj.weight", why],
        );
    }
    Ok(())
}

/// An absurd `max_positions` overflowed and panicked (index out of
/// bounds), with the table stored or computed.
#[test]
fn seq2seq_refuses_absurd_max_positions() -> Result<()> {
    let dir = scratch_dir!("seq2seq_positions")?;
    let huge = |c: &mut serde_json::Value| c["max_positions"] = serde_json::json!(1u64 << 62);
    shipped::dates_with(&dir, huge, |_| Ok(()))?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(&out, &["max_positions (4611686018427387904)", "overflows"]);
    // No stored table: a billion rows would be computed.
    let billion = |c: &mut serde_json::Value| c["max_positions"] = serde_json::json!(1_000_000_000);
    let no_pe = |t: &mut std::collections::HashMap<String, Tensor>| {
        t.remove("pos_encoding.pe");
        Ok(())
    };
    shipped::dates_with(&dir, billion, no_pe)?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(&out, &["max_positions (1000000000)", "pos_encoding.pe"]);
    // Stored, but not that long: a table past what the file holds.
    shipped::dates_with(&dir, billion, |_| Ok(()))?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(
        &out,
        &[
            "max_positions 1000000000",
            "'pos_encoding.pe' [1000000000, 64]",
            "larger than this file can hold",
        ],
    );
    // Within it, but not the stored table's length: mis-shaped.
    let longer = |c: &mut serde_json::Value| c["max_positions"] = serde_json::json!(128);
    shipped::dates_with(&dir, longer, |_| Ok(()))?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(&out, &["pos_encoding.pe expected [128, 64] found [64, 64]"]);
    // And a config with layers the file does not have.
    let deep =
        |c: &mut serde_json::Value| c["transformer"]["num_encoder_layers"] = serde_json::json!(100_000);
    shipped::dates_with(&dir, deep, |_| Ok(()))?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(
        &out,
        &["num_encoder_layers 100000", "larger than this file can hold"],
    );
    Ok(())
}

/// A grayscale PNG of `side` x `side` pixels, a horizontal ramp, written
/// row by row (a 16384-pixel side compresses to about 270 KB).
fn big_png(path: &Path, side: u32) -> Result<()> {
    use flate2::{write::ZlibEncoder, Compression};
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let mut crc = flate2::Crc::new();
        crc.update(&out[start..]);
        out.extend_from_slice(&crc.sum().to_be_bytes());
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = side.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&side.to_be_bytes());
    ihdr.extend_from_slice(&[8, 0, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    // Filter byte 0 and the ramp, then rows filtered "Up" (type 2): equal
    // to the row above, so all zeros, which deflate shrinks ~1000 times.
    let first: Vec<u8> = std::iter::once(0)
        .chain((0..side).map(|x| (x * 256 / side) as u8))
        .collect();
    let mut same = vec![0u8; first.len()];
    same[0] = 2;
    let mut z = ZlibEncoder::new(Vec::new(), Compression::best());
    z.write_all(&first)?;
    for _ in 1..side {
        z.write_all(&same)?;
    }
    chunk(&mut png, b"IDAT", &z.finish()?);
    chunk(&mut png, b"IEND", &[]);
    std::fs::write(path, png)?;
    Ok(())
}

/// A 16384 x 16384 grayscale PNG is averaged down in 8 bits first (f32
/// copies and a dense resize of the full image would peak at 2.6 GB), so
/// what reaches the float resize is a few times the model input. Peak
/// memory is measured in docs/untrusted.md (`/usr/bin/time -v`), not here.
#[test]
fn a_16384_pixel_png_is_reduced_in_8_bits() -> Result<()> {
    use multihead::models::image_input::{decode_image, pixels_u8, MAX_IMAGE_SIDE};
    let dir = scratch_dir!("big_png")?;
    let path = dir.join("big.png");
    big_png(&path, MAX_IMAGE_SIDE)?;
    let bytes = std::fs::read(&path)?;
    assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
    let img = decode_image(&bytes, "big.png")?;
    let px = pixels_u8(&img, 1, (16, 16))?;
    // 16384 / (2 x 16) = 512 per block: a 32 x 32 image.
    assert_eq!((px.height, px.width), (32, 32));
    // The ramp survives the averaging: left dark, right bright.
    assert!(px.data[0] < 10 && px.data[31] > 245, "{:?}", &px.data[..32]);
    drop(img);
    let out = multihead!(&["vit", arg(&path)?])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("big.png"));
    Ok(())
}

/// `--image-size 16384` on a small sample grew to ~24 GB; `--image-size 0`
/// said "not a multiple of the patch size"; `--beam` had no bound.
#[test]
fn size_flags_have_bounds() -> Result<()> {
    let sample = shipped::folder("vit-digits").join("samples/digit4_1221.png");
    let out = multihead!(&["vit", arg(&sample)?, "--image-size", "16384"])?;
    assert_one_line_error(
        &out,
        &["--image-size 16384", "at most 4096 patches", "--image-size 256"],
    );
    let out = multihead!(&["vit", arg(&sample)?, "--image-size", "0"])?;
    assert_one_line_error(&out, &["--image-size must be at least the patch size 4, found 0"]);
    let out = multihead!(&["vit", arg(&sample)?, "--image-size", "256"])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = multihead!(&["seq2seq", "--beam", "1000000000", "March 3, 2021"])?;
    assert_one_line_error(&out, &["--beam must be in 1..=64"]);
    Ok(())
}

/// `--num-return` has the bound `--beam` has, and a 100 MB
/// stdin line is measured, not held: the other lines are translated
/// within a 768 MiB address space.
#[test]
fn num_return_and_stdin_lines_are_bounded() -> Result<()> {
    let out = multihead!(&["seq2seq", "--num-return", "20000", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(
        err.contains("--num-return must be in 1..=64, found 20000"),
        "{err}"
    );

    let mut input = vec![b'a'; 100 << 20];
    input.extend_from_slice(b"\nMay 5, 2020\n");
    let out = run_capped(env!("CARGO_BIN_EXE_multihead"), &["seq2seq"], &input, 768)?;
    let err = text(&out.stderr);
    assert_eq!(text(&out.stdout), "\n2020-05-05\n", "{err}");
    assert!(
        err.contains("line 1 (") && err.contains("the line is 104857600 bytes long, over the limit of 4096"),
        "{err}"
    );
    Ok(())
}
