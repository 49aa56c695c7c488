//! `multihead seq2seq`: translate text with the shipped encoder–decoder
//! (by default the date normaliser of `scripts/train_dates.py`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use multihead_models::dates::{self, DateOrder, StatedYear};
use multihead_models::generation::{Temperature, TopK, TopP};

use super::heatmap;
use super::input::{preview, read_lines};

mod translator;

use translator::Translator;

/// Largest `--beam` and `--num-return`: each source decodes that many rows
/// at once, and past a few dozen hypotheses a beam finds nothing
/// greedy-ish decoding misses.
const MAX_BEAM: usize = 64;

/// Arguments of `multihead seq2seq`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Texts to translate, one output line each; without any, one input
    /// per line is read from standard input.
    pub inputs: Vec<String>,
    /// Beam search with this many hypotheses (1: greedy decoding; at
    /// most 64).
    #[arg(long, default_value_t = 1)]
    pub beam: usize,
    /// Weights: a folder with model.safetensors, config.json and
    /// vocab.json, or a safetensors file with config.json and vocab.json
    /// beside it. Default: the date normaliser built into the binary
    /// (weights/dates).
    #[arg(long, value_name = "FILE|DIR")]
    pub weights: Option<PathBuf>,
    /// cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Writes the cross-attention of the (single) input as a PNG heat map:
    /// output characters down, input characters across.
    #[arg(long, value_name = "OUT.png")]
    pub attention_map: Option<PathBuf>,
    #[command(flatten)]
    pub generation: GenerationArgs,
}

/// How outputs are generated: sampling, several outputs, constraints.
#[derive(Debug, clap::Args)]
pub struct GenerationArgs {
    /// Sample each token from the model's distribution instead of taking
    /// the best (reproducible: see --seed).
    #[arg(long)]
    pub sample: bool,
    /// Sampling temperature (> 0; below 1 sharper, above 1 flatter).
    #[arg(long, requires = "sample")]
    pub temperature: Option<f32>,
    /// Sample only among the K most likely tokens.
    #[arg(long, value_name = "K", requires = "sample")]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to P.
    #[arg(long, value_name = "P", requires = "sample")]
    pub top_p: Option<f32>,
    /// Seed of the samples: the same seed gives the same outputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Outputs per input, each with its log-probability: the N best beams
    /// (beam search widens to N), or N samples with --sample; at most 64.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub num_return: usize,
    /// `date`: every output is a real calendar date (constrained decoding
    /// plus a final check), or the input is reported unreadable; `none`:
    /// the model's raw output.
    #[arg(long, value_enum, default_value_t = Constraint::Date)]
    pub constraint: Constraint,
    /// Read ambiguous numeric dates ("03/04/2021") day first (April 3rd);
    /// month first (March 4th) by default, as dateutil does.
    #[arg(long)]
    pub day_first: bool,
    /// With `--constraint date`: below this probability the best real date
    /// is not trusted and the input is reported unreadable.
    #[arg(long, value_name = "P", default_value_t = 0.5)]
    pub min_prob: f32,
    /// With `--constraint date`: the year of inputs that state none
    /// ("March 3"), which are otherwise refused (the model would invent
    /// one). 1950 to 2049, the years the model reads.
    #[arg(long, value_name = "YYYY")]
    pub year: Option<u32>,
}

/// What outputs must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Constraint {
    /// `YYYY-MM-DD`, a day that exists.
    Date,
    /// Anything the model says.
    None,
}

/// `cpu`, `cuda`, `cuda:N` or `metal` as a candle device.
pub fn parse_device(s: &str) -> Result<Device> {
    let dev = match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        "metal" => Device::new_metal(0)?,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::new_cuda(n)?,
            _ => bail!("unknown device {s:?}: expected cpu, cuda, cuda:N or metal"),
        },
    };
    Ok(dev)
}

/// `f32`, `f16` or `bf16`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        s => bail!("unknown dtype {s:?}: expected f32, f16 or bf16"),
    })
}

/// The first line of a message (candle appends a backtrace to some when
/// `RUST_BACKTRACE` is set).
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim().to_string()
}

/// Where an input came from, for messages: `input 2` (an argument) or
/// `line 2` (standard input).
fn input_label(from_stdin: bool, i: usize) -> String {
    if from_stdin {
        format!("line {}", i + 1)
    } else {
        format!("input {}", i + 1)
    }
}

/// Runs the command.
///
/// A batch goes on past a bad input: each one is reported on standard
/// error (`line N: why`), gets an empty output line so outputs stay one per
/// input, and the command exits 1 at the end. When no input can be
/// translated, one error line says why and nothing is printed.
pub fn run(args: Args) -> Result<()> {
    if args.beam == 0 || args.beam > MAX_BEAM {
        bail!("--beam must be in 1..={MAX_BEAM}, found {}", args.beam)
    }
    let from_stdin = args.inputs.is_empty();
    // Each input's text (a preview for a line that cannot be read) and,
    // for such a line, why.
    let (inputs, unreadable_lines): (Vec<String>, Vec<Option<String>>) = if from_stdin {
        read_lines(std::io::stdin().lock())
            .context("reading standard input")?
            .into_iter()
            .unzip()
    } else {
        args.inputs.iter().map(|t| (t.clone(), None)).unzip()
    };
    if inputs.is_empty() {
        bail!("no input: pass texts as arguments or one per line on standard input")
    }
    if args.attention_map.is_some() && inputs.len() != 1 {
        bail!(
            "--attention-map draws one input's attention, but {} inputs were given",
            inputs.len()
        )
    }
    let g = &args.generation;
    if g.num_return == 0 || g.num_return > MAX_BEAM {
        bail!("--num-return must be in 1..={MAX_BEAM}, found {}", g.num_return)
    }
    if let Some(y) = g.year {
        if !dates::YEARS.contains(&y) {
            bail!(
                "--year {y} is outside the years the model reads ({}-{})",
                dates::YEARS.start(),
                dates::YEARS.end()
            )
        }
    }
    if !(g.min_prob.is_finite() && (0.0..=1.0).contains(&g.min_prob)) {
        bail!("--min-prob must be in [0, 1], found {}", g.min_prob)
    }
    // Refuse bad sampling settings before loading anything.
    g.temperature.map(Temperature::new).transpose()?;
    g.top_k.map(TopK::new).transpose()?;
    g.top_p.map(TopP::new).transpose()?;
    let order = if g.day_first {
        DateOrder::DayFirst
    } else {
        DateOrder::MonthFirst
    };
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let tr = Translator::load(args.weights.as_deref(), device, dtype)?;
    // Line endings and surrounding blanks are not part of a date. With the
    // date constraint, a year the input states must be one the model reads,
    // and an input with none gets `--year` or is refused.
    let texts: Vec<Result<(String, StatedYear)>> = inputs
        .iter()
        .zip(&unreadable_lines)
        .map(|(text, why)| {
            if let Some(why) = why {
                bail!("{why}")
            }
            // The model's own checks (length, vocabulary) come first.
            tr.encode(text.trim(), order)?;
            match g.constraint {
                Constraint::Date => dated(text.trim(), g.year),
                Constraint::None => Ok((text.trim().to_string(), StatedYear::None)),
            }
        })
        .collect();
    let encoded: Vec<Result<Vec<u32>>> = texts
        .iter()
        .map(|t| match t {
            Ok((text, _)) => tr.encode(text, order),
            Err(e) => bail!("{e:#}"),
        })
        .collect();
    let good: Vec<Vec<u32>> = encoded.iter().filter_map(|e| e.as_ref().ok()).cloned().collect();
    let years: Vec<StatedYear> = texts
        .iter()
        .zip(&encoded)
        .filter(|(_, e)| e.is_ok())
        .filter_map(|(t, _)| t.as_ref().ok().map(|(_, y)| *y))
        .collect();
    let bad: Vec<(usize, String)> = encoded
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.as_ref().err().map(|e| (i, first_line(&format!("{e:#}")))))
        .collect();
    if good.is_empty() {
        let (i, why) = &bad[0];
        let more = if bad.len() > 1 {
            format!(" (and {} more inputs, none translatable)", bad.len() - 1)
        } else {
            String::new()
        };
        bail!(
            "{} ({:?}): {why}{more}",
            input_label(from_stdin, *i),
            preview(&inputs[*i])
        )
    }
    for (i, why) in &bad {
        eprintln!(
            "{} ({:?}): {why}",
            input_label(from_stdin, *i),
            preview(&inputs[*i])
        );
    }
    // One entry per good input: its output lines, or why it is unreadable.
    let outputs: Vec<std::result::Result<Vec<String>, String>> =
        if g.constraint == Constraint::None && !g.sample && g.num_return == 1 {
            // The plain model output, as before the constraints existed.
            tr.translate(&good, args.beam)?
                .into_iter()
                .map(|line| Ok(vec![line]))
                .collect()
        } else {
            tr.generate(&good, &years, args.beam, g)?
        };
    let mut outputs = outputs.into_iter();
    let mut unreadable = Vec::new();
    let mut out = std::io::stdout().lock();
    for (i, e) in encoded.iter().enumerate() {
        // A bad or unreadable input gets an empty line: output lines stay
        // aligned with the inputs.
        match (e, e.is_ok().then(|| outputs.next()).flatten()) {
            (Ok(_), Some(Ok(lines))) => {
                for line in lines {
                    writeln!(out, "{line}")?;
                }
            }
            (Ok(_), Some(Err(why))) => {
                writeln!(out)?;
                unreadable.push((i, why));
            }
            _ => writeln!(out)?,
        }
    }
    out.flush()?;
    match unreadable.as_slice() {
        [] => {}
        [(i, msg)] if inputs.len() == 1 => {
            bail!(
                "{} ({:?}): {msg}",
                input_label(from_stdin, *i),
                preview(&inputs[*i])
            )
        }
        all => {
            for (i, msg) in all {
                eprintln!(
                    "{} ({:?}): {msg}",
                    input_label(from_stdin, *i),
                    preview(&inputs[*i])
                );
            }
        }
    }
    if let (Some(path), Some(Ok(src)), Some(Ok((text, _)))) =
        (&args.attention_map, encoded.first(), texts.first())
    {
        write_attention_map(&tr, text, src, path)?;
    }
    if !bad.is_empty() || !unreadable.is_empty() {
        let mut failed: Vec<usize> = bad.iter().chain(&unreadable).map(|(i, _)| *i).collect();
        failed.sort_unstable();
        let which: Vec<String> = failed.iter().take(10).map(|i| (i + 1).to_string()).collect();
        // Inputs the model could not take, and outputs that are no date.
        let what = if bad.is_empty() {
            "read as a date"
        } else {
            "translated"
        };
        bail!(
            "{} of {} inputs could not be {what} ({} {}{}; empty output lines in their place)",
            failed.len(),
            inputs.len(),
            match (from_stdin, failed.len()) {
                (true, 1) => "line",
                (true, _) => "lines",
                (false, 1) => "input",
                (false, _) => "inputs",
            },
            which.join(", "),
            if failed.len() > 10 { ", …" } else { "" }
        )
    }
    Ok(())
}

/// The text to translate for `text` under the date constraint, and the
/// year it states: refused when that year is outside the model's years;
/// with no year, `year` is appended ("March 3" → "March 3 2024") or the
/// input is refused, since the model would invent one.
fn dated(text: &str, year: Option<u32>) -> Result<(String, StatedYear)> {
    let (first, last) = (dates::YEARS.start(), dates::YEARS.end());
    match (StatedYear::of(text), year) {
        (StatedYear::Full(y), _) if !dates::YEARS.contains(&y) => {
            bail!("the year {y} is outside the years the model reads ({first}-{last})")
        }
        (StatedYear::None, Some(y)) => Ok((format!("{text} {y}"), StatedYear::Full(y))),
        (StatedYear::None, None) => bail!(
            "no year in the input, and the model would invent one: add it, or pass --year YYYY \
             (or --constraint none for the raw output)"
        ),
        (stated, _) => Ok((text.to_string(), stated)),
    }
}

fn write_attention_map(tr: &Translator, text: &str, src: &[u32], path: &Path) -> Result<()> {
    let src = Tensor::new(src, &tr.device)?.unsqueeze(0)?;
    let att = tr.model.greedy_with_attention(&src)?;
    let weights: Vec<Vec<f32>> = att.attention.to_dtype(DType::F32)?.to_vec2()?;
    // One label per step, '?' for a special token the model emitted.
    let rows: Vec<char> = att
        .tokens
        .iter()
        .map(|&t| tr.vocab.decode(&[t]).chars().next().unwrap_or('?'))
        .collect();
    // A reading prefix token (`<mdy>`/`<dmy>`) the model was given first
    // is labelled '*'.
    let prefixed = src.dim(1)?.saturating_sub(text.chars().count());
    let cols: Vec<char> = std::iter::repeat_n('*', prefixed).chain(text.chars()).collect();
    heatmap::write_png(path, &weights, &rows, &cols)?;
    eprintln!("attention map: {}", path.display());
    Ok(())
}
