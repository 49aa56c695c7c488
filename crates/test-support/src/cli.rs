//! The `multihead` binary run as a user runs it, and what it answered.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};

/// `multihead ARGS` (with `STDIN` on its standard input, else none): the
/// binary cargo built for the calling integration test of the root
/// package, run by [`run`]. A macro because cargo sets
/// `CARGO_BIN_EXE_multihead` only while it compiles those tests.
#[macro_export]
macro_rules! multihead {
    ($args:expr) => {
        $crate::cli::run(env!("CARGO_BIN_EXE_multihead"), $args, b"")
    };
    ($args:expr, $stdin:expr) => {
        $crate::cli::run(env!("CARGO_BIN_EXE_multihead"), $args, $stdin)
    };
}

/// `exe ARGS` with `RUST_BACKTRACE=1` (so that an error line is checked
/// to carry no backtrace), `stdin` on its standard input.
pub fn run(exe: &str, args: &[&str], stdin: impl AsRef<[u8]>) -> Result<Output> {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    output(cmd, stdin.as_ref())
}

/// [`run`] in an address space of `limit_mib` MiB (`ulimit -v`, through
/// `sh`): work a bound should keep small fails instead of swapping.
pub fn run_capped(exe: &str, args: &[&str], stdin: impl AsRef<[u8]>, limit_mib: u64) -> Result<Output> {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", limit_mib * 1024))
        .arg(exe)
        .args(args);
    output(cmd, stdin.as_ref())
}

/// `cmd`'s output, run with `RUST_BACKTRACE=1`, with `stdin` written from
/// a thread of its own (so that a large input does not block on a full
/// pipe; the program may stop reading early, and a broken pipe is its
/// answer).
pub fn output(mut cmd: Command, stdin: &[u8]) -> Result<Output> {
    let mut child = cmd
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let mut pipe = child.stdin.take().context("stdin")?;
    let input = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = pipe.write_all(&input);
    });
    let out = child.wait_with_output()?;
    writer.join().ok().context("stdin writer")?;
    Ok(out)
}

/// Bytes a program wrote, as text (invalid UTF-8 replaced).
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether output holds a control character other than a newline: what
/// printing a file's names raw would let through to the terminal.
pub fn has_raw_controls(bytes: &[u8]) -> bool {
    String::from_utf8_lossy(bytes)
        .chars()
        .any(|c| c.is_control() && c != '\n')
}

/// What a run that must succeed printed: its standard output, or an error
/// carrying its standard error.
pub fn success(out: &Output) -> Result<String> {
    if !out.status.success() {
        bail!("failed: {}", text(&out.stderr))
    }
    Ok(String::from_utf8(out.stdout.clone())?)
}

/// A path as a command-line argument.
pub fn arg(p: &Path) -> Result<&str> {
    p.to_str().context("path is not UTF-8")
}

/// Asserts a command failed with exactly one `error: ...` line on stderr
/// (no panic, no backtrace) that mentions every one of `what`.
#[track_caller]
pub fn assert_one_line_error(out: &Output, what: &[&str]) {
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "succeeded: {}", text(&out.stdout));
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for w in what {
        assert!(lines[0].contains(w), "{stderr} does not mention {w:?}");
    }
}
