//! `multihead seq2seq` end to end: translations, and the inputs it refuses
//! with one line and a non-zero exit, never a panic.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result};

fn run(args: &[&str], stdin: Option<&str>) -> Result<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .arg("seq2seq")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting multihead")?;
    let mut pipe = child.stdin.take().context("stdin")?;
    pipe.write_all(stdin.unwrap_or("").as_bytes())?;
    drop(pipe);
    Ok(child.wait_with_output()?)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A refusal: non-zero exit, nothing on stdout, one line on stderr that
/// contains `needle`, and no panic.
fn assert_refused(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected failure, got {err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(needle), "expected {needle:?} in {err}");
}

#[test]
fn translates_an_argument() -> Result<()> {
    let o = run(&["March 3, 2021"], None)?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(stdout(&o), "2021-03-03\n");
    Ok(())
}

#[test]
fn translates_stdin_lines_with_beam_search() -> Result<()> {
    let o = run(
        &["--beam", "3"],
        Some("2021年3月3日\n03/03/21\nWednesday, March 3, 2021\n"),
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(stdout(&o), "2021-03-03\n2021-03-03\n2021-03-03\n");
    Ok(())
}

#[test]
fn writes_an_attention_map() -> Result<()> {
    let path = std::env::temp_dir().join(format!("multihead-attn-{}.png", std::process::id()));
    let o = run(
        &["3 Mar 2021", "--attention-map", path.to_str().context("path")?],
        None,
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&path)?;
    std::fs::remove_file(&path)?;
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    Ok(())
}

#[test]
fn refuses_out_of_vocabulary_characters() -> Result<()> {
    assert_refused(&run(&["March 3, 2021 ☃"], None)?, "not in the model's vocabulary");
    Ok(())
}

#[test]
fn refuses_empty_input() -> Result<()> {
    assert_refused(&run(&[""], None)?, "empty input");
    assert_refused(&run(&[], Some("\n  \n"))?, "line 1 (\"\"): empty input");
    assert_refused(&run(&[], Some(""))?, "no input");
    Ok(())
}

/// One blank line does not abort the batch: the good lines are translated,
/// each bad one gets an empty output line and a message naming its line,
/// and the exit status says something was wrong.
#[test]
fn a_bad_line_does_not_stop_the_batch() -> Result<()> {
    let o = run(&[], Some("March 3, 2021\n\n4 May 2020\nMarch ☃\n"))?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(stdout(&o), "2021-03-03\n\n2020-05-04\n\n", "{err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[0].starts_with("line 2 (\"\"): empty input"), "{err}");
    assert!(
        lines[1].starts_with("line 4 (\"March ☃\"): character '☃'"),
        "{err}"
    );
    assert!(
        lines[2].starts_with("error: 2 of 4 inputs could not be translated (lines 2, 4;"),
        "{err}"
    );
    Ok(())
}

#[test]
fn refuses_too_long_input() -> Result<()> {
    assert_refused(&run(&[&"1".repeat(500)], None)?, "at most");
    Ok(())
}

#[test]
fn refuses_bad_options() -> Result<()> {
    assert_refused(&run(&["x", "--beam", "0"], None)?, "--beam");
    assert_refused(&run(&["March 3, 2021", "--dtype", "f64"], None)?, "unknown dtype");
    assert_refused(
        &run(&["March 3, 2021", "--device", "tpu"], None)?,
        "unknown device",
    );
    assert_refused(
        &run(&["March 3, 2021", "--weights", "/nonexistent"], None)?,
        "reading weights '/nonexistent'",
    );
    Ok(())
}
