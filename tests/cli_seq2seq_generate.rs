//! `multihead seq2seq`'s generation options end to end: the date constraint
//! (on by default), N best with scores, seeded sampling, and the inputs
//! and options it refuses with one line and exit status 1.

use std::process::Output;

use anyhow::{Context, Result};
use multihead_test_support::{cli::text, multihead, shipped};

/// `multihead seq2seq ARGS`.
fn run(args: &[&str]) -> Result<Output> {
    multihead!(&[&["seq2seq"], args].concat())
}

fn is_date(s: &str) -> bool {
    multihead::models::dates::is_calendar_date(s)
}

#[test]
fn the_date_constraint_never_prints_an_impossible_date() -> Result<()> {
    // Unconstrained, the model writes February 29th of a common year.
    let free = run(&["--constraint", "none", "Feb 29 2021"])?;
    assert!(free.status.success(), "{}", text(&free.stderr));
    assert_eq!(text(&free.stdout), "2021-02-29\n");
    // Constrained, it finds no real date it believes in, and says so.
    let o = run(&["Feb 29 2021"])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("cannot read a date"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(
        text(&o.stderr).trim_end().lines().count(),
        1,
        "{}",
        text(&o.stderr)
    );
    // With the threshold off it prints the best real date (an input with
    // no year needs one given).
    let o = run(&[
        "--min-prob",
        "0",
        "--year",
        "2021",
        "Feb 29 2021",
        "hello there",
        "13/03/2021",
    ])?;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let lines: Vec<String> = text(&o.stdout).lines().map(String::from).collect();
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| is_date(l)), "{lines:?}");
    Ok(())
}

#[test]
fn unreadable_inputs_keep_the_output_aligned() -> Result<()> {
    // "hello there" states no year: `--year` lets it reach the model.
    let o = run(&["--year", "2021", "March 3, 2021", "hello there", "3 Mar 2021"])?;
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o.stdout), "2021-03-03\n\n2021-03-03\n");
    let err = text(&o.stderr);
    assert!(
        err.contains("input 2 (\"hello there\"): cannot read a date"),
        "{err}"
    );
    assert!(err.contains("1 of 3 inputs could not be read"), "{err}");
    Ok(())
}

#[test]
fn num_return_prints_the_best_beams_with_scores() -> Result<()> {
    let o = run(&["--num-return", "3", "March 3, 2021"])?;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let rows: Vec<(String, f32)> = text(&o.stdout)
        .lines()
        .map(|l| {
            let (t, s) = l.split_once('\t').context("no tab")?;
            Ok((t.to_string(), s.parse()?))
        })
        .collect::<Result<_>>()?;
    assert!(!rows.is_empty() && rows.len() <= 3, "{rows:?}");
    assert_eq!(rows[0].0, "2021-03-03");
    // Best first, log-probabilities, all real dates.
    assert!(rows.windows(2).all(|w| w[0].1 >= w[1].1), "{rows:?}");
    assert!(rows.iter().all(|(t, s)| is_date(t) && *s <= 0.), "{rows:?}");
    Ok(())
}

#[test]
fn sampling_is_reproducible_from_the_seed() -> Result<()> {
    let args = [
        "--sample",
        "--temperature",
        "2",
        "--seed",
        "5",
        "--num-return",
        "8",
        "Feb 29 2021",
    ];
    let a = run(&args)?;
    assert!(a.status.success(), "{}", text(&a.stderr));
    assert_eq!(text(&a.stdout), text(&run(&args)?.stdout));
    let sampled = text(&a.stdout);
    let lines: Vec<&str> = sampled.lines().collect();
    assert!(!lines.is_empty());
    assert!(
        lines.iter().all(|l| l.split('\t').next().is_some_and(is_date)),
        "{lines:?}"
    );
    let other = run(&[
        "--sample",
        "--temperature",
        "2",
        "--seed",
        "6",
        "--num-return",
        "8",
        "Feb 29 2021",
    ])?;
    assert_ne!(text(&a.stdout), text(&other.stdout));
    Ok(())
}

#[test]
fn refuses_bad_generation_options() -> Result<()> {
    for (args, needle) in [
        (vec!["--num-return", "0", "3 Mar 2021"], "--num-return"),
        (vec!["--min-prob", "2", "x"], "--min-prob"),
        (vec!["--sample", "--temperature", "0", "x"], "temperature"),
        (vec!["--sample", "--top-p", "1.5", "x"], "top-p"),
        (vec!["--sample", "--top-k", "0", "x"], "top-k"),
        (vec!["--constraint", "regex", "x"], "invalid value"),
    ] {
        let o = run(&args)?;
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{args:?}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(needle), "{args:?}: expected {needle:?} in {err}");
    }
    // Warpers only mean something when sampling.
    let o = run(&["--top-k", "3", "x"])?;
    assert!(
        !o.status.success() && text(&o.stderr).contains("--sample"),
        "{}",
        text(&o.stderr)
    );
    Ok(())
}

#[test]
fn day_first_reads_ambiguous_numeric_dates_or_says_the_model_cannot() -> Result<()> {
    let vocab = std::fs::read_to_string(shipped::folder("dates").join("vocab.json"))?;
    let day_first = run(&["--day-first", "03/04/2021"])?;
    if vocab.contains("\"<dmy>\"") {
        // A model trained with the reading prefix: April 3rd day first,
        // March 4th month first (the default, as dateutil).
        assert_eq!(
            text(&day_first.stdout),
            "2021-04-03\n",
            "{}",
            text(&day_first.stderr)
        );
        assert_eq!(text(&run(&["03/04/2021"])?.stdout), "2021-03-04\n");
    } else {
        // A model with one fixed reading cannot honour the flag.
        assert_eq!(day_first.status.code(), Some(1));
        assert!(
            text(&day_first.stderr).contains("day-first"),
            "{}",
            text(&day_first.stderr)
        );
    }
    Ok(())
}

/// A temperature whose division overflows is an error.
#[test]
fn an_overflowing_temperature_is_an_error() -> Result<()> {
    let out = run(&["--sample", "--temperature", "1e-45", "March 3, 2021"])?;
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("overflows f32"), "{err}");
    Ok(())
}
