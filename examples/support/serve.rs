//! The timing server `scripts/bench_vs_pytorch.py` drives (`bench_attention
//! --serve`, `bench_models serve`): it alternates single samples of ours
//! with PyTorch's a fraction of a second apart, so that the host's drift
//! falls on both sides of a pair alike.

use std::io::{BufRead, Write};
use std::time::Instant;

use anyhow::{Context, Result};

/// A work the server runs: its name and one run of it.
pub type Work<'a> = (String, Box<dyn FnMut() -> Result<()> + 'a>);

/// Answers requests from stdin until it closes, one a line: `N WORK` runs
/// the work named `WORK` `N` times in a row and prints `{"work": "WORK",
/// "median_ms": M}`, the median of the runs' wall times.
pub fn serve(works: &mut [Work]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading a request")?;
        let (n, name) = line
            .split_once(' ')
            .with_context(|| format!("a request is `N WORK`, not {line:?}"))?;
        let n: usize = n.parse().with_context(|| format!("N in {line:?}"))?;
        let (name, run) = works
            .iter_mut()
            .find(|(w, _)| *w == name)
            .with_context(|| format!("no work named {name:?}"))?;
        let mut times = Vec::with_capacity(n.max(1));
        for _ in 0..n.max(1) {
            let t = Instant::now();
            run()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        writeln!(
            out,
            r#"{{"work": "{name}", "median_ms": {:.4}}}"#,
            times[times.len() / 2]
        )?;
        out.flush()?;
    }
    Ok(())
}
