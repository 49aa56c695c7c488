//! `multihead seq2seq`'s generation options end to end: the date constraint
//! (on by default), N best with scores, seeded sampling, and the inputs
//! and options it refuses with one line and exit status 1.

use std::process::{Command, Output};

use anyhow::{Context, Result};

fn run(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_multihead"))
        .arg("seq2seq")
        .args(args)
        .output()
        .context("running multihead")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn is_date(s: &str) -> bool {
    multihead::models::dates::is_calendar_date(s)
}

#[test]
fn the_date_constraint_never_prints_an_impossible_date() -> Result<()> {
    // Unconstrained, the model writes February 29th of a common year.
    let free = run(&["--constraint", "none", "Feb 29 2021"])?;
    assert!(free.status.success(), "{}", stderr(&free));
    assert_eq!(stdout(&free), "2021-02-29\n");
    // Constrained, it finds no real date it believes in, and says so.
    let o = run(&["Feb 29 2021"])?;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot read a date"), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", stderr(&o));
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
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<String> = stdout(&o).lines().map(String::from).collect();
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| is_date(l)), "{lines:?}");
    Ok(())
}

#[test]
fn unreadable_inputs_keep_the_output_aligned() -> Result<()> {
    // "hello there" states no year: `--year` lets it reach the model.
    let o = run(&["--year", "2021", "March 3, 2021", "hello there", "3 Mar 2021"])?;
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "2021-03-03\n\n2021-03-03\n");
    let err = stderr(&o);
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
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<(String, f32)> = stdout(&o)
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
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(stdout(&a), stdout(&run(&args)?));
    let text = stdout(&a);
    let lines: Vec<&str> = text.lines().collect();
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
    assert_ne!(stdout(&a), stdout(&other));
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
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(needle), "{args:?}: expected {needle:?} in {err}");
    }
    // Warpers only mean something when sampling.
    let o = run(&["--top-k", "3", "x"])?;
    assert!(
        !o.status.success() && stderr(&o).contains("--sample"),
        "{}",
        stderr(&o)
    );
    Ok(())
}

#[test]
fn day_first_reads_ambiguous_numeric_dates_or_says_the_model_cannot() -> Result<()> {
    let vocab = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/weights/dates/vocab.json"))?;
    let day_first = run(&["--day-first", "03/04/2021"])?;
    if vocab.contains("\"<dmy>\"") {
        // A model trained with the reading prefix: April 3rd day first,
        // March 4th month first (the default, as dateutil).
        assert_eq!(stdout(&day_first), "2021-04-03\n", "{}", stderr(&day_first));
        assert_eq!(stdout(&run(&["03/04/2021"])?), "2021-03-04\n");
    } else {
        // A model with one fixed reading cannot honour the flag.
        assert_eq!(day_first.status.code(), Some(1));
        assert!(stderr(&day_first).contains("day-first"), "{}", stderr(&day_first));
    }
    Ok(())
}
