//! `multihead seq2seq` end to end: translations, and the inputs it refuses
//! with one line and a non-zero exit, never a panic.

use std::process::Output;

use anyhow::{Context, Result};
use multihead_test_support::{cli::text, multihead};

/// `multihead seq2seq ARGS` with `stdin` on its standard input.
fn run(args: &[&str], stdin: impl AsRef<[u8]>) -> Result<Output> {
    multihead!(&[&["seq2seq"], args].concat(), stdin)
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
    let o = run(&["March 3, 2021"], "")?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(text(&o.stdout), "2021-03-03\n");
    Ok(())
}

#[test]
fn translates_stdin_lines_with_beam_search() -> Result<()> {
    let o = run(
        &["--beam", "3"],
        "2021年3月3日\n03/03/21\nWednesday, March 3, 2021\n",
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(text(&o.stdout), "2021-03-03\n2021-03-03\n2021-03-03\n");
    Ok(())
}

#[test]
fn writes_an_attention_map() -> Result<()> {
    let path = std::env::temp_dir().join(format!("multihead-attn-{}.png", std::process::id()));
    let o = run(
        &["3 Mar 2021", "--attention-map", path.to_str().context("path")?],
        "",
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&path)?;
    std::fs::remove_file(&path)?;
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    Ok(())
}

#[test]
fn refuses_out_of_vocabulary_characters() -> Result<()> {
    assert_refused(&run(&["March 3, 2021 ☃"], "")?, "not in the model's vocabulary");
    Ok(())
}

#[test]
fn refuses_empty_input() -> Result<()> {
    assert_refused(&run(&[""], "")?, "empty input");
    assert_refused(&run(&[], "\n  \n")?, "line 1 (\"\"): empty input");
    assert_refused(&run(&[], "")?, "no input");
    Ok(())
}

/// One blank line does not abort the batch: the good lines are translated,
/// each bad one gets an empty output line and a message naming its line,
/// and the exit status says something was wrong.
#[test]
fn a_bad_line_does_not_stop_the_batch() -> Result<()> {
    let o = run(&[], "March 3, 2021\n\n4 May 2020\nMarch ☃\n")?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(text(&o.stdout), "2021-03-03\n\n2020-05-04\n\n", "{err}");
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
    assert_refused(&run(&[&"1".repeat(500)], "")?, "at most");
    Ok(())
}

#[test]
fn refuses_bad_options() -> Result<()> {
    assert_refused(&run(&["x", "--beam", "0"], "")?, "--beam");
    assert_refused(&run(&["March 3, 2021", "--dtype", "f64"], "")?, "unknown dtype");
    assert_refused(&run(&["March 3, 2021", "--device", "tpu"], "")?, "unknown device");
    assert_refused(
        &run(&["March 3, 2021", "--weights", "/nonexistent"], "")?,
        "reading weights '/nonexistent'",
    );
    Ok(())
}

/// A year the input states is the year printed, or the input
/// is refused; an input with no year needs `--year`.
#[test]
fn stated_years_are_kept_or_refused() -> Result<()> {
    let out = run(
        &[
            "July 4th, 1776",
            "le 14 juillet 1789",
            "March 3",
            "March 3, 2021",
            "03/04/21",
        ],
        "",
    )?;
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

    let out = run(&["--year", "2024", "March 3", "le 14 juillet"], "")?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "2024-03-03\n2024-07-14\n");
    let out = run(&["--year", "1776", "March 3"], "")?;
    assert!(text(&out.stderr).contains("--year 1776 is outside the years the model reads"));
    Ok(())
}

/// An invalid UTF-8 line is reported with its number; the
/// other lines are translated.
#[test]
fn an_invalid_utf8_line_is_reported_alone() -> Result<()> {
    let out = run(&[], b"March 3, 2021\n\xff\xfe bad\nMay 5, 2020\n")?;
    let err = text(&out.stderr);
    assert_eq!(text(&out.stdout), "2021-03-03\n\n2020-05-05\n", "{err}");
    assert!(
        err.contains("line 2 (") && err.contains("not UTF-8 text (invalid byte at offset 0)"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    Ok(())
}
