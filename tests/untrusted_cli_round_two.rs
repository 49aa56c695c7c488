//! Hostile inputs through the binary: files that are not regular, large
//! flags and lines, writes that fail, years the date model cannot read,
//! invalid UTF-8. Each ends in bounded work, the
//! good inputs translated, and an error naming the problem.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result};

fn scratch(name: &str) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("untrusted_cli_round_two")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs the binary with `stdin` fed from a thread (so a large input does
/// not block on a full pipe); `limit_mib` caps its address space.
fn multihead(args: &[&str], stdin: &[u8], limit_mib: Option<u64>) -> Result<Output> {
    let exe = env!("CARGO_BIN_EXE_multihead");
    let mut cmd = match limit_mib {
        Some(mib) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", mib * 1024))
                .arg(exe)
                .args(args);
            c
        }
        None => {
            let mut c = Command::new(exe);
            c.args(args);
            c
        }
    };
    let mut child = cmd
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut pipe = child.stdin.take().context("stdin")?;
    let input = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        // The binary may stop reading early; a broken pipe is its answer.
        let _ = pipe.write_all(&input);
    });
    let out = child.wait_with_output()?;
    writer.join().ok().context("stdin writer")?;
    Ok(out)
}

/// The binary on `args`, no input, no cap.
fn run(args: &[&str]) -> Result<Output> {
    multihead(args, b"", None)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `/dev/zero` or a FIFO as weights, config or image is refused
/// by name at once, never read or waited on.
#[test]
fn devices_and_fifos_are_not_read() -> Result<()> {
    let dir = scratch("devices")?;
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
        let out = multihead(&args, b"", Some(1024))?;
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
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/dates");
    std::fs::copy(
        shipped.join("model.safetensors"),
        weights.join("model.safetensors"),
    )?;
    std::fs::copy(shipped.join("vocab.json"), weights.join("vocab.json"))?;
    std::os::unix::fs::symlink("/dev/zero", weights.join("config.json"))?;
    let out = multihead(
        &[
            "seq2seq",
            "--weights",
            weights.to_str().context("path")?,
            "March 3, 2021",
        ],
        b"",
        Some(1024),
    )?;
    let err = text(&out.stderr);
    assert!(
        err.contains("config") && err.contains("not a regular file"),
        "{err}"
    );
    Ok(())
}

/// `--num-return` has the bound `--beam` has, and a 100 MB
/// stdin line is measured, not held: the other lines are translated
/// within a 768 MiB address space.
#[test]
fn num_return_and_stdin_lines_are_bounded() -> Result<()> {
    let out = run(&["seq2seq", "--num-return", "20000", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(
        err.contains("--num-return must be in 1..=64, found 20000"),
        "{err}"
    );

    let mut input = vec![b'a'; 100 << 20];
    input.extend_from_slice(b"\nMay 5, 2020\n");
    let out = multihead(&["seq2seq"], &input, Some(768))?;
    let err = text(&out.stderr);
    assert_eq!(text(&out.stdout), "\n2020-05-05\n", "{err}");
    assert!(
        err.contains("line 1 (") && err.contains("the line is 104857600 bytes long, over the limit of 4096"),
        "{err}"
    );
    Ok(())
}

/// A temperature whose division overflows is an error.
#[test]
fn an_overflowing_temperature_is_an_error() -> Result<()> {
    let out = run(&["seq2seq", "--sample", "--temperature", "1e-45", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("overflows f32"), "{err}");
    Ok(())
}

/// A write that fails is an error, and a failed write leaves no
/// partial file where the map should be.
#[test]
fn failed_writes_are_errors_and_leave_no_partial_file() -> Result<()> {
    let out = run(&["seq2seq", "--attention-map", "/dev/full", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("writing attention map '/dev/full'") && err.contains("No space left"),
        "{err}"
    );
    let digit = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/vit-digits/samples/digit0_0386.png");
    let out = run(&[
        "vit",
        digit.to_str().context("path")?,
        "--attention-map",
        "/dev/full",
    ])?;
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("No space left"), "{err}");

    // A folder that does not exist: no map, no temporary file, an error.
    let dir = scratch("writes")?;
    let map = dir.join("missing/map.png");
    let out = run(&[
        "seq2seq",
        "--attention-map",
        map.to_str().context("path")?,
        "March 3, 2021",
    ])?;
    assert!(!out.status.success() && !map.exists());
    assert_eq!(std::fs::read_dir(&dir)?.count(), 0);
    // A good write leaves exactly the file.
    let map = dir.join("map.png");
    let out = run(&[
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

/// A year the input states is the year printed, or the input
/// is refused; an input with no year needs `--year`.
#[test]
fn stated_years_are_kept_or_refused() -> Result<()> {
    let out = run(&[
        "seq2seq",
        "July 4th, 1776",
        "le 14 juillet 1789",
        "March 3",
        "March 3, 2021",
        "03/04/21",
    ])?;
    let err = text(&out.stderr);
    assert_eq!(text(&out.stdout), "\n\n\n2021-03-03\n2021-03-04\n", "{err}");
    assert!(
        err.contains(
            "input 1 (\"July 4th, 1776\"): the year 1776 is outside the years the model reads (1950-2049)"
        ),
        "{err}"
    );
    assert!(
        err.contains("input 2 (\"le 14 juillet 1789\"): the year 1789"),
        "{err}"
    );
    assert!(
        err.contains("input 3 (\"March 3\"): no year in the input"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");

    let out = run(&["seq2seq", "--year", "2024", "March 3", "le 14 juillet"])?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "2024-03-03\n2024-07-14\n");
    let out = run(&["seq2seq", "--year", "1776", "March 3"])?;
    assert!(text(&out.stderr).contains("--year 1776 is outside the years the model reads"));
    Ok(())
}

/// An invalid UTF-8 line is reported with its number; the
/// other lines are translated.
#[test]
fn an_invalid_utf8_line_is_reported_alone() -> Result<()> {
    let out = multihead(&["seq2seq"], b"March 3, 2021\n\xff\xfe bad\nMay 5, 2020\n", None)?;
    let err = text(&out.stderr);
    assert_eq!(text(&out.stdout), "2021-03-03\n\n2020-05-05\n", "{err}");
    assert!(
        err.contains("line 2 (") && err.contains("not UTF-8 text (invalid byte at offset 0)"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    Ok(())
}
