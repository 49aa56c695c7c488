//! Times attention paths on the shapes of docs/benchmarks.md's attention table and
//! prints one JSON object per line (`scripts/bench_vs_pytorch.py` runs this
//! beside PyTorch and prints the ratios).
//!
//! ```text
//! cargo run --release --example bench_attention            # the table's shapes
//! cargo run --release --example bench_attention -- --peak-rss 16384
//! cargo run --release --example bench_attention -- --mask-memory
//! cargo run --release --example bench_attention -- --backward-memory
//! cargo run --release --example bench_attention -- --softcap
//! cargo run --release --example bench_attention -- --serve
//! ```
//!
//! `--peak-rss N` runs one B1 H8 hd64 self-attention of N tokens through the
//! default path and reports the process's peak resident memory.
//! `--mask-memory` runs B4 H2 N4096 hd64 self-attention with each kind of
//! mask and reports the memory each call adds at its peak (the peak
//! resident set, reset before the call, less the resident set before it:
//! inputs and the mask tensor itself are not counted), beside the
//! unmasked call's.
//! `--backward-memory` runs a forward and `Tensor::backward` of B1 H8 N4096
//! hd64 causal self-attention with q, k and v as variables, on the fused
//! path and on the reference path, each in a process of its own, and
//! reports the memory each adds at its peak and its time.
//! `--softcap` times B1 N4096 H8 hd64 self-attention soft-capped at 50
//! (Gemma 2's `attn_logit_softcapping`) beside the same uncapped, without a
//! mask and causal, in alternating rounds, and prints the ratio.
//! `--serve` answers `N WORK` requests on stdin with our path's median over
//! `N` runs of the work (`support/serve.rs`), for the script to pair with
//! PyTorch's.
//! `--only TEXT` times only our path, on the works whose label contains
//! TEXT: what to run under a profiler, e.g.
//!
//! ```text
//! RAYON_NUM_THREADS=1 perf record -e cpu-clock \
//!     target/release/examples/bench_attention --only "B1 N1024 H8"
//! perf report --sort sym
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor, D};
use candle_nn::attention::{flash_attn, AttnMask as CandleMask};
use multihead::attention::{
    scaled_dot_product_attention_via, AttnPath, Causal, Mask, MhaConfig, MultiheadAttention,
};

#[path = "support/rss.rs"]
mod rss;
#[path = "support/serve.rs"]
mod serve;

/// Median wall time of `f` over at least 5 runs and ~2 s, after one
/// warm-up (3 runs when one takes over a second).
fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    let min_runs = if t.elapsed() > Duration::from_secs(1) {
        3
    } else {
        5
    };
    let mut times = vec![];
    let start = Instant::now();
    while times.len() < min_runs || (start.elapsed() < Duration::from_secs(2) && times.len() < 200) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn randn(shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1., shape, &Device::Cpu)?)
}

fn report(work: &str, path: &str, ms: f64) {
    println!(r#"{{"work": "{work}", "path": "{path}", "median_ms": {ms:.4}}}"#);
}

/// What a candle user writes by hand: matmul, softmax, matmul.
fn candle_matmul_softmax(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if causal {
        let (l, s) = (q.dim(2)?, k.dim(2)?);
        let mask: Vec<f32> = (0..l)
            .flat_map(|i| (0..s).map(move |j| if j + l > i + s { f32::NEG_INFINITY } else { 0. }))
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (l, s), q.device())?)?;
    }
    let w = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(w.matmul(v)?)
}

/// A case's `(q, k, v)` and mask.
fn sdpa_inputs(
    (b, h, l, s, d): (usize, usize, usize, usize, usize),
    causal: bool,
) -> Result<(Tensor, Tensor, Tensor, Mask)> {
    let mask = if causal {
        Mask::causal(Causal::BottomRight)
    } else {
        Mask::new()
    };
    Ok((
        randn(&[b, h, l, d])?,
        randn(&[b, h, s, d])?,
        randn(&[b, h, s, d])?,
        mask,
    ))
}

fn ours(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> Result<()> {
    Ok(scaled_dot_product_attention_via(q, k, v, mask, None, AttnPath::Auto).map(drop)?)
}

fn bench_sdpa(
    work: &str,
    dims @ (_, _, l, s, d): (usize, usize, usize, usize, usize),
    causal: bool,
    ours_only: bool,
) -> Result<()> {
    let (q, k, v, mask) = sdpa_inputs(dims, causal)?;
    let scale = 1. / (d as f64).sqrt();
    report(work, "ours", median_ms(|| ours(&q, &k, &v, &mask))?);
    if ours_only {
        return Ok(());
    }
    report(
        work,
        "candle_matmul_softmax",
        median_ms(|| candle_matmul_softmax(&q, &k, &v, scale, causal).map(drop))?,
    );
    if l * s > 2048 * 2048 {
        // candle's CPU flash attention takes tens of seconds a call here.
        return Ok(());
    }
    // candle's CPU flash attention takes (B, S, H, D).
    let t = |x: &Tensor| -> Result<Tensor> { Ok(x.transpose(1, 2)?.contiguous()?) };
    let (qt, kt, vt) = (t(&q)?, t(&k)?, t(&v)?);
    let cmask = || {
        if causal {
            CandleMask::causal_with_offset(s - l)
        } else {
            CandleMask::None
        }
    };
    report(
        work,
        "candle_flash_attn",
        median_ms(|| Ok(flash_attn::<f32>(&qt, &kt, &vt, scale as f32, cmask(), None, None).map(drop)?))?,
    );
    Ok(())
}

/// `nn.MultiheadAttention(e, h)` on random weights, and its input.
fn mha_inputs((b, n, e, h): (usize, usize, usize, usize)) -> Result<(MultiheadAttention, Tensor)> {
    // Plain tensors (as loaded from a checkpoint), not variables.
    let weights = [
        ("in_proj_weight", randn(&[3 * e, e])?),
        ("in_proj_bias", randn(&[3 * e])?),
        ("out_proj.weight", randn(&[e, e])?),
        ("out_proj.bias", randn(&[e])?),
    ];
    let weights = weights
        .into_iter()
        .map(|(name, t)| Ok((name.to_string(), (t * 0.02)?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(e, h),
        candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu),
    )?;
    Ok((mha, randn(&[b, n, e])?))
}

fn peak_rss(n: usize) -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 8, n, 64])?,
        randn(&[1, 8, n, 64])?,
        randn(&[1, 8, n, 64])?,
    );
    let t = Instant::now();
    let out = scaled_dot_product_attention_via(&q, &k, &v, &Mask::new(), None, AttnPath::Auto)?;
    let secs = t.elapsed().as_secs_f64();
    let checksum = out.sum_keepdim(D::Minus1)?.sum_all()?.to_scalar::<f32>()?;
    println!(
        r#"{{"work": "B1 N{n} H8 hd64 peak RSS", "peak_rss_mib": {:.1}, "seconds": {secs:.2}, "checksum": {checksum}}}"#,
        rss::peak_rss_mib()?
    );
    Ok(())
}

/// A line of `/proc/self/status`, in MiB.
fn status_mib(key: &str) -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {key} in /proc/self/status"))?;
    Ok(kb as f64 / 1024.)
}

/// The masks `--mask-memory` compares, over `(b, n)`.
fn memory_masks(b: usize, n: usize) -> Result<Vec<(&'static str, Mask)>> {
    use multihead::attention::{AttnMask, KeyPaddingMask};
    let dev = Device::Cpu;
    let lengths: Vec<usize> = (0..b).map(|i| n - i * n / 8).collect();
    let pairs = randn(&[n, n])?;
    let padding = || KeyPaddingMask::from_lengths(&lengths, n, &dev);
    Ok(vec![
        ("none", Mask::new()),
        ("causal", Mask::causal(Causal::TopLeft)),
        ("key padding (B, S) u8", Mask::new().with_key_padding(padding()?)),
        (
            "attn (L, S) u8",
            Mask::new().with_attn(AttnMask::IgnoreWhereTrue(pairs.ge(1.)?)),
        ),
        (
            "attn (L, S) f32",
            Mask::new().with_attn(AttnMask::Additive((pairs.ge(1.)?.to_dtype(DType::F32)? * -1e9)?)),
        ),
        (
            "causal + key padding + attn (L, S) u8",
            Mask::causal(Causal::TopLeft)
                .with_key_padding(padding()?)
                .with_attn(AttnMask::AttendWhereTrue(pairs.ge(-1.)?)),
        ),
    ])
}

/// One `--mask-memory` case, in a process of its own: the memory the call
/// adds at its peak (the peak resident set, reset before the call, less
/// the resident set before it) and the process's whole peak.
fn mask_memory_case(case: usize) -> Result<()> {
    let (b, h, n, d) = (4, 2, 4096, 64);
    let (q, k, v) = (
        randn(&[b, h, n, d])?,
        randn(&[b, h, n, d])?,
        randn(&[b, h, n, d])?,
    );
    let masks = memory_masks(b, n)?;
    let (what, mask) = masks.get(case).context("no such mask case")?;
    // Linux resets the peak resident set (VmHWM) to the current one when 5
    // is written to clear_refs.
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
    let before = status_mib("VmRSS:")?;
    let out = scaled_dot_product_attention_via(&q, &k, &v, mask, None, AttnPath::Auto)?;
    let peak = status_mib("VmHWM:")?;
    drop(out);
    println!(
        r#"{{"work": "B{b} H{h} N{n} hd{d} mask: {what}", "call_peak_mib": {:.1}, "process_peak_mib": {peak:.1}}}"#,
        peak - before
    );
    Ok(())
}

/// Each mask case in a fresh process (a process reuses freed pages, which
/// would hide a later call's allocations).
fn mask_memory() -> Result<()> {
    let exe = std::env::current_exe().context("finding this executable")?;
    for case in 0..memory_masks(1, 8)?.len() {
        let status = std::process::Command::new(&exe)
            .args(["--mask-memory-case", &case.to_string()])
            .status()
            .context("running a mask case")?;
        if !status.success() {
            bail!("mask case {case} failed: {status}")
        }
    }
    Ok(())
}

/// One `--backward-memory` case, in a process of its own: a forward and
/// backward of causal self-attention with q, k and v as variables on
/// `path`, the memory it adds at its peak (as `mask_memory_case` counts it:
/// the gradients are kept until the peak is read) and its wall time.
fn backward_memory_case(path: AttnPath) -> Result<()> {
    let (b, h, n, d) = (1, 8, 4096, 64);
    let var = || Ok::<_, anyhow::Error>(candle::Var::from_tensor(&randn(&[b, h, n, d])?)?);
    let (q, k, v) = (var()?, var()?, var()?);
    let weights = randn(&[b, h, n, d])?;
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
    let before = status_mib("VmRSS:")?;
    let start = Instant::now();
    let out = scaled_dot_product_attention_via(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        &Mask::causal(Causal::TopLeft),
        None,
        path,
    )?;
    let grads = (out * &weights)?.sum_all()?.backward()?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let peak = status_mib("VmHWM:")?;
    for var in [&q, &k, &v] {
        grads.get(var).context("a variable without a gradient")?;
    }
    println!(
        r#"{{"work": "forward + backward B{b} H{h} N{n} hd{d} causal", "path": "{path:?}", "call_peak_mib": {:.1}, "ms": {ms:.0}}}"#,
        peak - before
    );
    Ok(())
}

/// The fused and the reference backward, each in a fresh process.
fn backward_memory() -> Result<()> {
    let exe = std::env::current_exe().context("finding this executable")?;
    for path in ["tiled", "reference"] {
        let status = std::process::Command::new(&exe)
            .args(["--backward-memory-case", path])
            .status()
            .context("running a backward case")?;
        if !status.success() {
            bail!("backward case {path} failed: {status}")
        }
    }
    Ok(())
}

/// The table's SDPA cases: label, `(b, h, l, s, d)`, causal.
type SdpaCase = (&'static str, (usize, usize, usize, usize, usize), bool);
const SDPA_CASES: [SdpaCase; 5] = [
    ("sdpa B8 N197 H12 hd64", (8, 12, 197, 197, 64), false),
    ("sdpa B1 N1024 H8 hd64", (1, 8, 1024, 1024, 64), false),
    ("sdpa B1 N4096 H8 hd64", (1, 8, 4096, 4096, 64), false),
    ("sdpa causal B1 N1024 H8 hd64", (1, 8, 1024, 1024, 64), true),
    (
        "decode B1 H8 hd64 1 query x 2048 keys",
        (1, 8, 1, 2048, 64),
        false,
    ),
];
const MHA_CASE: (&str, (usize, usize, usize, usize)) = ("MHA B8 N197 D768 H12", (8, 197, 768, 12));

/// `--softcap`: soft-capped against uncapped self-attention, unmasked and
/// causal. Five alternating rounds of each, so that load from elsewhere
/// falls on both; the median of each's round medians.
fn softcap_ratio() -> Result<()> {
    let dims = (1, 8, 4096, 4096, 64);
    for causal in [false, true] {
        let (q, k, v, mask) = sdpa_inputs(dims, causal)?;
        let capped = mask.clone().with_softcap(50.);
        let (mut plain, mut cap) = (vec![], vec![]);
        for _ in 0..5 {
            plain.push(median_ms(|| ours(&q, &k, &v, &mask))?);
            cap.push(median_ms(|| ours(&q, &k, &v, &capped))?);
        }
        plain.sort_by(f64::total_cmp);
        cap.sort_by(f64::total_cmp);
        let (plain, cap) = (plain[2], cap[2]);
        let work = format!("B1 N4096 H8 hd64{}", if causal { " causal" } else { "" });
        println!(
            r#"{{"work": "{work}", "uncapped_ms": {plain:.2}, "softcap50_ms": {cap:.2}, "ratio": {:.3}, "isa": "{}"}}"#,
            cap / plain,
            multihead::attention::cpu_isa()
        );
    }
    Ok(())
}

/// `--serve`: our path on each of the table's works, on request.
fn serve_works() -> Result<()> {
    let mut works: Vec<serve::Work> = Vec::new();
    for (work, dims, causal) in SDPA_CASES {
        let (q, k, v, mask) = sdpa_inputs(dims, causal)?;
        works.push((work.into(), Box::new(move || ours(&q, &k, &v, &mask))));
    }
    let (mha, x) = mha_inputs(MHA_CASE.1)?;
    works.push((
        MHA_CASE.0.into(),
        Box::new(move || Ok(mha.forward(&x).map(drop)?)),
    ));
    serve::serve(&mut works)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let only = match args.as_slice() {
        [] => None,
        [flag, n] if flag == "--peak-rss" => {
            return peak_rss(n.parse().context("--peak-rss takes a length")?)
        }
        [flag] if flag == "--mask-memory" => return mask_memory(),
        [flag, case] if flag == "--mask-memory-case" => {
            return mask_memory_case(case.parse().context("--mask-memory-case takes an index")?)
        }
        [flag] if flag == "--backward-memory" => return backward_memory(),
        [flag, path] if flag == "--backward-memory-case" => {
            return backward_memory_case(match path.as_str() {
                "tiled" => AttnPath::CpuTiled,
                "reference" => AttnPath::Reference,
                _ => bail!("--backward-memory-case takes tiled or reference"),
            })
        }
        [flag] if flag == "--serve" => return serve_works(),
        [flag] if flag == "--softcap" => return softcap_ratio(),
        [flag, text] if flag == "--only" => Some(text.as_str()),
        _ => {
            bail!("usage: bench_attention [--peak-rss N | --mask-memory | --backward-memory | --softcap | --only TEXT | --serve]")
        }
    };
    let run = |work: &str| only.is_none_or(|text| work.contains(text));
    for (work, dims, causal) in SDPA_CASES {
        if run(work) {
            bench_sdpa(work, dims, causal, only.is_some())?;
        }
    }
    let (work, dims) = MHA_CASE;
    if run(work) {
        let (mha, x) = mha_inputs(dims)?;
        report(work, "ours", median_ms(|| Ok(mha.forward(&x).map(drop)?))?);
    }
    Ok(())
}
