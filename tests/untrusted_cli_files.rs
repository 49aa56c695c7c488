//! Files through the binary: weights and images `inspect`, `vit` and
//! `seq2seq` cannot use (truncated, pickled, missing, holding NaN, a
//! decompression bomb, empty), names and metadata holding terminal
//! escapes (printed escaped), devices and FIFOs where a file belongs,
//! writes that fail, and a standard output closed early. Each refusal is
//! one `error:` line, a non-zero exit, no panic and no backtrace even with
//! RUST_BACKTRACE=1; a closed standard output ends quietly with status 0.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result};
use candle::{Device, Tensor};
use multihead_test_support::{
    cli::{arg, assert_one_line_error, has_raw_controls, output, run_capped, text},
    multihead, scratch_dir, shipped,
    weights::many_tensors,
};

/// `multihead ARGS` run in the shipped digits model's folder, where
/// `model.safetensors` and `config.json` are the model's.
fn in_digits(args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multihead"));
    cmd.current_dir(shipped::folder("vit-digits")).args(args);
    output(cmd, b"")
}

#[test]
fn inspect_the_shipped_model() -> Result<()> {
    let out = in_digits(&["inspect", "model.safetensors"])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "blocks.0.attn.qkv.weight",
        "layout: timm VisionTransformer",
        "embed_dim 64, depth 4",
        "patch 4, image 16, in_chans 1, classes 10, mlp 128",
        "values: all finite",
        "every tensor matches",
    ] {
        assert!(stdout.contains(want), "no {want:?} in\n{stdout}");
    }
    let out = in_digits(&["inspect", "--json", "model.safetensors"])?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["layout"]["kind"], "timm_vit");
    assert_eq!(v["layout"]["embed_dim"], 64);
    assert_eq!(v["config"]["clean"], true);
    assert!(v["total_params"].as_u64().is_some_and(|n| n > 100_000));
    Ok(())
}

#[test]
fn inspect_lists_every_mismatch_against_a_config() -> Result<()> {
    let dir = scratch_dir!("config")?;
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        shipped::folder("vit-digits").join("config.json"),
    )?)?;
    cfg["depth"] = serde_json::json!(5);
    cfg["num_classes"] = serde_json::json!(0);
    cfg["labels"] = serde_json::Value::Null;
    let path = dir.join("deeper.json");
    std::fs::write(&path, cfg.to_string())?;
    let out = in_digits(&["inspect", "model.safetensors", "--config", arg(&path)?])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("missing     blocks.4.attn.qkv.weight [192, 64]"),
        "{stdout}"
    );
    assert!(stdout.contains("unexpected  head.weight"), "{stdout}");
    assert_one_line_error(&out, &["does not fit config", "12 missing", "2 unexpected"]);
    Ok(())
}

/// A safetensors file whose tensor names and metadata hold terminal
/// escapes: ESC sequences (clear the screen, set the title) and a C1 CSI
/// (U+009B). Its two tensors are an `nn.MultiheadAttention`'s, under a
/// prefix that is the escape.
fn hostile_safetensors(path: &Path) -> Result<()> {
    let tensors = [
        ("\u{1b}[2J.in_proj_weight", [12usize, 4]),
        ("\u{1b}[2J.out_proj.weight", [4, 4]),
    ];
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "\u{1b}]0;title\u{7}": "\u{1b}[2J\u{9b}31m" }),
    );
    let mut offset = 0;
    for (name, shape) in &tensors {
        let end = offset + 4 * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let header = serde_json::to_vec(&header)?;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.resize(bytes.len() + offset, 0);
    Ok(std::fs::write(path, bytes)?)
}

/// Names and metadata from a safetensors file cannot drive the terminal:
/// every control character prints escaped (`\u{1b}`) in the listing, the
/// metadata, the layout, the config check and the one-line error, as a
/// GGUF file's do; the JSON writes them as `\u` escapes and parses back
/// to the file's own names.
#[test]
fn inspect_escapes_control_characters_from_a_safetensors_file() -> Result<()> {
    let dir = scratch_dir!("hostile_names")?;
    let path = dir.join("hostile.safetensors");
    hostile_safetensors(&path)?;
    let config = dir.join("mha.json");
    std::fs::write(&config, r#"{"embed_dim": 4, "num_heads": 1}"#)?;

    let out = in_digits(&["inspect", arg(&path)?])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        !has_raw_controls(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in [
        r"\u{1b}[2J.out_proj.weight  F32    [4, 4]",
        r"metadata: \u{1b}]0;title\u{7} = \u{1b}[2J\u{9b}31m",
        r"  at '\u{1b}[2J.': embed_dim 4,",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }

    // Against a config: the missing biases under the file's prefix, named.
    let out = in_digits(&["inspect", arg(&path)?, "--config", arg(&config)?])?;
    assert!(
        !has_raw_controls(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        !has_raw_controls(&out.stderr),
        "{:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains(r"  missing     \u{1b}[2J.in_proj_bias [12]"),
        "{text}"
    );
    assert_one_line_error(&out, &[r"2 missing: \u{1b}[2J.in_proj_bias [12]"]);

    let out = in_digits(&["inspect", "--json", arg(&path)?])?;
    assert!(
        !has_raw_controls(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let json = String::from_utf8(out.stdout)?;
    assert!(json.contains(r"\u001b[2J") && json.contains(r"\u009b"), "{json}");
    let v: serde_json::Value = serde_json::from_str(&json)?;
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .context("tensors")?
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["\u{1b}[2J.in_proj_weight", "\u{1b}[2J.out_proj.weight"]);
    assert_eq!(v["metadata"]["\u{1b}]0;title\u{7}"], "\u{1b}[2J\u{9b}31m");
    Ok(())
}

#[test]
fn inspect_a_truncated_file() -> Result<()> {
    let dir = scratch_dir!("truncated")?;
    let bytes = std::fs::read(shipped::folder("vit-digits").join("model.safetensors"))?;
    let path = dir.join("cut.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() / 2])?;
    assert_one_line_error(
        &in_digits(&["inspect", arg(&path)?])?,
        &["cut.safetensors", "do not end where the file ends"],
    );
    std::fs::write(&path, &bytes[..5])?;
    assert_one_line_error(&in_digits(&["inspect", arg(&path)?])?, &["truncated"]);
    Ok(())
}

#[test]
fn inspect_refuses_a_pickle() -> Result<()> {
    let dir = scratch_dir!("pickle")?;
    let path = dir.join("pytorch_model.bin");
    std::fs::write(&path, b"\x80\x02}q\x00.")?;
    assert_one_line_error(
        &in_digits(&["inspect", arg(&path)?])?,
        &["PyTorch pickle", "save_file"],
    );
    Ok(())
}

#[test]
fn inspect_a_missing_file() -> Result<()> {
    assert_one_line_error(
        &in_digits(&["inspect", "nope.safetensors"])?,
        &["reading weights 'nope.safetensors'"],
    );
    Ok(())
}

/// The shipped weights with one tensor's first value replaced.
fn poisoned_weights(dir: &Path, value: f32) -> Result<PathBuf> {
    let mut tensors = candle::safetensors::load(
        shipped::folder("vit-digits").join("model.safetensors"),
        &candle::Device::Cpu,
    )?;
    let bias = tensors.get("head.bias").context("head.bias")?;
    let mut v: Vec<f32> = bias.to_vec1()?;
    v[0] = value;
    tensors.insert("head.bias".into(), candle::Tensor::new(v, &candle::Device::Cpu)?);
    let path = dir.join("model.safetensors");
    candle::safetensors::save(&tensors, &path)?;
    std::fs::copy(
        shipped::folder("vit-digits").join("config.json"),
        dir.join("config.json"),
    )?;
    Ok(path)
}

#[test]
fn vit_refuses_nan_weights() -> Result<()> {
    let dir = scratch_dir!("nan")?;
    let w = poisoned_weights(&dir, f32::NAN)?;
    assert_one_line_error(
        &in_digits(&["vit", "--weights", arg(&w)?])?,
        &["do not match the model", "head.bias (1 NaN, 0 Inf)"],
    );
    let out = in_digits(&["inspect", arg(&w)?])?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("head.bias has 1 NaN and 0 Inf"));
    Ok(())
}

#[test]
fn vit_refuses_a_decompression_bomb() -> Result<()> {
    let dir = scratch_dir!("bomb")?;
    // An 8-bit grayscale PNG header claiming 100000 x 100000 pixels.
    let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
    png.extend_from_slice(&100_000u32.to_be_bytes());
    png.extend_from_slice(&100_000u32.to_be_bytes());
    png.extend_from_slice(&[8, 0, 0, 0, 0]);
    png.extend_from_slice(&0u32.to_be_bytes()); // CRC (checked after the limits or not at all)
    let path = dir.join("bomb.png");
    std::fs::write(&path, &png)?;
    assert_one_line_error(&in_digits(&["vit", arg(&path)?])?, &["bomb.png"]);
    Ok(())
}

#[test]
fn vit_refuses_an_empty_image_file() -> Result<()> {
    let dir = scratch_dir!("empty")?;
    let path = dir.join("empty.png");
    std::fs::write(&path, b"")?;
    assert_one_line_error(&in_digits(&["vit", arg(&path)?])?, &["empty.png", "empty file"]);
    Ok(())
}

/// `seq2seq` built its model straight from a VarBuilder: a NaN weight
/// printed an empty line and exited 0.
#[test]
fn seq2seq_refuses_nan_weights() -> Result<()> {
    let dir = scratch_dir!("seq2seq_nan")?;
    shipped::dates_with(
        &dir,
        |_| {},
        |t| {
            let b = t.get("generator.bias").context("generator.bias")?;
            let mut v: Vec<f32> = b.to_vec1()?;
            v[3] = f32::NAN;
            t.insert("generator.bias".into(), Tensor::new(v, &Device::Cpu)?);
            Ok(())
        },
    )?;
    let out = multihead!(&["seq2seq", "--weights", arg(&dir)?, "March 3, 2021"])?;
    assert_one_line_error(&out, &["do not match the model", "generator.bias (1 NaN, 0 Inf)"]);
    assert!(out.stdout.is_empty());
    Ok(())
}

/// `/dev/zero` or a FIFO as weights, config or image is refused
/// by name at once, never read or waited on.
#[test]
fn devices_and_fifos_are_not_read() -> Result<()> {
    let dir = scratch_dir!("devices")?;
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status()?.success());
    let fifo = fifo.to_str().context("path")?;
    for args in [
        vec!["inspect", "/dev/zero"],
        vec!["inspect", fifo],
        vec!["vit", "/dev/zero"],
        vec!["vit", fifo],
        vec!["seq2seq", "--weights", "/dev/zero", "March 3, 2021"],
    ] {
        let out = run_capped(env!("CARGO_BIN_EXE_multihead"), &args, b"", 1024)?;
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains("not a regular file"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A config beside the weights that is a device.
    let weights = dir.join("model");
    std::fs::create_dir_all(&weights)?;
    let dates = shipped::folder("dates");
    std::fs::copy(dates.join("model.safetensors"), weights.join("model.safetensors"))?;
    std::fs::copy(dates.join("vocab.json"), weights.join("vocab.json"))?;
    std::os::unix::fs::symlink("/dev/zero", weights.join("config.json"))?;
    let out = run_capped(
        env!("CARGO_BIN_EXE_multihead"),
        &[
            "seq2seq",
            "--weights",
            weights.to_str().context("path")?,
            "March 3, 2021",
        ],
        b"",
        1024,
    )?;
    let err = text(&out.stderr);
    assert!(
        err.contains("config") && err.contains("not a regular file"),
        "{err}"
    );
    Ok(())
}

/// A write that fails is an error, and a failed write leaves no
/// partial file where the map should be.
#[test]
fn failed_writes_are_errors_and_leave_no_partial_file() -> Result<()> {
    let out = multihead!(&["seq2seq", "--attention-map", "/dev/full", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("writing attention map '/dev/full'") && err.contains("No space left"),
        "{err}"
    );
    let digit = shipped::folder("vit-digits").join("samples/digit0_0386.png");
    let out = multihead!(&[
        "vit",
        digit.to_str().context("path")?,
        "--attention-map",
        "/dev/full",
    ])?;
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("No space left"), "{err}");

    // A folder that does not exist: no map, no temporary file, an error.
    let dir = scratch_dir!("writes")?;
    let map = dir.join("missing/map.png");
    let out = multihead!(&[
        "seq2seq",
        "--attention-map",
        map.to_str().context("path")?,
        "March 3, 2021",
    ])?;
    assert!(!out.status.success() && !map.exists());
    assert_eq!(std::fs::read_dir(&dir)?.count(), 0);
    // A good write leaves exactly the file.
    let map = dir.join("map.png");
    let out = multihead!(&[
        "seq2seq",
        "--attention-map",
        map.to_str().context("path")?,
        "March 3, 2021",
    ])?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(&std::fs::read(&map)?[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(std::fs::read_dir(&dir)?.count(), 1);
    Ok(())
}

/// Runs `multihead args` with its standard output closed at once, as
/// `| head -0` does: the first write finds no reader.
fn with_stdout_closed(args: &[&str]) -> Result<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .env("RUST_BACKTRACE", "1")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    Ok(child.wait_with_output()?)
}

/// `multihead inspect FILE | head -3`: a standard output closed early
/// ends every subcommand quietly with status 0, not with Rust's "failed
/// printing to stdout: Broken pipe" panic.
#[test]
fn a_closed_pipe_ends_quietly() -> Result<()> {
    let dir = scratch_dir!("pipe")?;
    let many = dir.join("many.safetensors");
    many_tensors(&many, 5000)?;
    for args in [
        &["inspect", arg(&many)?, "--all"][..],
        &["inspect", "--json", arg(&many)?],
        &["vit"],
        &["vit", "--format", "json"],
        &["seq2seq", "March 3, 2021", "4 May 2020"],
    ] {
        let out = with_stdout_closed(args)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "{args:?}");
    }
    // And `| head -3` itself: read three lines, then close.
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(["inspect", arg(&many)?, "--all"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut first = [0u8; 64];
    stdout.read_exact(&mut first)?;
    drop(stdout);
    let out = child.wait_with_output()?;
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
    Ok(())
}
