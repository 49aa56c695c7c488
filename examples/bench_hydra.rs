//! Hydra attention against softmax attention: time and peak memory of the
//! attention itself (projections excluded) for one image of N tokens,
//! D = 768 (ViT-B: 12 heads of 64 for softmax, 768 heads of 1 for Hydra).
//!
//! ```text
//! cargo run --release --example bench_hydra                # N = 197, 784, 3136, 12544
//! cargo run --release --example bench_hydra -- 197 784     # some N only
//! ```
//!
//! Peak memory is measured in a fresh process per case
//! (`--peak-rss hydra|softmax N`): the process's VmHWM after one call, and
//! the growth over its resident memory just before the call.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle::{Device, Tensor};
use multihead::attention::{hydra_attention, scaled_dot_product_attention_via, AttnPath, Mask};

const D: usize = 768;
const HEADS: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Hydra,
    Softmax,
}

impl Kind {
    fn parse(s: &str) -> Result<Self> {
        match s {
            "hydra" => Ok(Self::Hydra),
            "softmax" => Ok(Self::Softmax),
            _ => bail!("unknown attention '{s}', expected hydra or softmax"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Hydra => "hydra",
            Self::Softmax => "softmax",
        }
    }

    /// q, k, v: `(1, N, D)` for Hydra, `(1, H, N, D / H)` for softmax.
    fn inputs(self, n: usize) -> Result<[Tensor; 3]> {
        let shape: &[usize] = match self {
            Self::Hydra => &[1, n, D],
            Self::Softmax => &[1, HEADS, n, D / HEADS],
        };
        let r = || Tensor::randn(0f32, 1., shape, &Device::Cpu);
        Ok([r()?, r()?, r()?])
    }

    fn run(self, [q, k, v]: &[Tensor; 3]) -> Result<Tensor> {
        Ok(match self {
            Self::Hydra => hydra_attention(q, k, v, &Mask::new())?,
            Self::Softmax => scaled_dot_product_attention_via(q, k, v, &Mask::new(), None, AttnPath::Auto)?,
        })
    }
}

/// Median wall time after one warm-up: at least 3 runs and ~1.5 s, or a
/// single run when one takes over 2 s (softmax at N = 12544).
fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = vec![];
    let start = Instant::now();
    loop {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        let enough = times.len() >= 3 && start.elapsed() > Duration::from_millis(1500);
        if enough || times[0] > 2000. || times.len() >= 200 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn status_kb(field: &str) -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))
}

/// Child process: one call, then `peak_mib growth_mib` on stdout.
fn peak_rss(kind: Kind, n: usize) -> Result<()> {
    let inputs = kind.inputs(n)?;
    let before = status_kb("VmRSS:")?;
    let out = kind.run(&inputs)?;
    let peak = status_kb("VmHWM:")?;
    // Keeps the output alive until after the measurement.
    let _ = out.dims();
    println!("{:.1} {:.1}", peak / 1024., (peak - before) / 1024.);
    Ok(())
}

/// Runs `peak_rss` in a fresh process: `(peak MiB, growth MiB)`.
fn measure_peak(kind: Kind, n: usize) -> Result<(f64, f64)> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let out = Command::new(exe)
        .args(["--peak-rss", kind.name(), &n.to_string()])
        .output()
        .context("running the peak-memory child")?;
    if !out.status.success() {
        bail!(
            "peak-memory child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(str::parse::<f64>);
    match (it.next(), it.next()) {
        (Some(Ok(p)), Some(Ok(g))) => Ok((p, g)),
        _ => bail!("peak-memory child printed '{text}'"),
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, kind, n] = args.as_slice() {
        if flag == "--peak-rss" {
            return peak_rss(Kind::parse(kind)?, n.parse().context("N must be a number")?);
        }
    }
    let ns: Vec<usize> = if args.is_empty() {
        vec![197, 784, 3136, 12544]
    } else {
        args.iter()
            .map(|a| a.parse().with_context(|| format!("'{a}' is not a token count")))
            .collect::<Result<_>>()?
    };
    println!("D = {D}; softmax: {HEADS} heads (AttnPath::Auto); Hydra: {D} heads; batch 1, f32, CPU");
    println!(
        "| N | softmax ms | Hydra ms | speed-up | softmax peak MiB (+growth) | Hydra peak MiB (+growth) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for n in ns {
        let mut ms = [0.; 2];
        let mut mem = [(0., 0.); 2];
        for (i, kind) in [Kind::Softmax, Kind::Hydra].into_iter().enumerate() {
            let inputs = kind.inputs(n)?;
            ms[i] = median_ms(|| kind.run(&inputs).map(drop))?;
            mem[i] = measure_peak(kind, n)?;
        }
        println!(
            "| {n} | {:.3} | {:.3} | {:.1}x | {:.0} (+{:.0}) | {:.0} (+{:.0}) |",
            ms[0],
            ms[1],
            ms[0] / ms[1],
            mem[0].0,
            mem[0].1,
            mem[1].0,
            mem[1].1
        );
    }
    Ok(())
}
