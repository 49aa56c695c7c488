//! The process's peak resident memory, for the examples that report it.

use anyhow::{Context, Result};

/// The peak resident set of this process in MiB (`VmHWM` in
/// `/proc/self/status`).
pub fn peak_rss_mib() -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb as f64 / 1024.)
}
