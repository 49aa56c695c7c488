//! Times the models this workspace ships at the sizes people run, and
//! prints one JSON object per line (`scripts/bench_vs_pytorch.py --models`
//! runs it beside timm and PyTorch on the same weights):
//!
//! ```text
//! cargo run --release --example bench_models -- vit-b16 1 [WEIGHTS.safetensors]
//! cargo run --release --example bench_models -- sgemm 2048
//! cargo run --release --example bench_models -- peak
//! cargo run --release --example bench_models -- stream 4
//! cargo run --release --example bench_models -- linear 1576 768 2304 [LAYERS]
//! cargo run --release --example bench_models -- linear-bf16 1576 3072 768 [LAYERS]
//! RAYON_NUM_THREADS=1 cargo run --release --example bench_models -- share 512 512 2048 [LAYERS]
//! cargo run --release --example bench_models -- split 512 512 512 [LAYERS]
//! cargo run --release --example bench_models -- transformer [WEIGHTS.safetensors]
//! cargo run --release --example bench_models -- residual 1
//! cargo run --release --example bench_models -- vit-linears 1
//! cargo run --release --example bench_models -- decode-layers bf16
//! cargo run --release --example bench_models -- decoder MODEL_DIR [CACHE_LEN] [PROMPT_LEN] [DTYPE]
//! cargo run --release --example bench_models -- decode-share MODEL_DIR [DTYPE] [CACHE_LEN]
//! cargo run --release --example bench_models -- serve [--sgemm] [--vit WEIGHTS|random] \
//!     [--vit-bf16 WEIGHTS] [--transformer WEIGHTS|random] [--linear MxKxN]... [--decoder DIR] \
//!     [--train full|tiny]
//! ```
//!
//! `serve`: answers `N WORK` requests on stdin with the median of `N` runs
//! of the work (`support/serve.rs`), for the script to pair with
//! PyTorch's. The works are the flags': `--sgemm` candle's 2048² matmul
//! (`sgemm 2048`) and a `PackedLinear 2048`; `--vit` and `--transformer`
//! the two ViT-B/16 rows and the two transformer rows as the other modes
//! name them; `--vit-bf16` ViT-B/16 with its weight matrices in bf16
//! (`vit_base_patch16_224 bf16 B1`, `B8`); `--linear` a `PackedLinear` without bias (`linear MxKxN`);
//! `--decoder` the `decoder` mode's two works; `--train full` a training
//! step (forward, backward, SGD) of five models over `VarMap`s
//! (`bench_models/train.rs`), `--train tiny` the same models shrunk, to
//! check that they run.
//!
//! `decoder DIR`: a HF decoder folder (GPT-2 or Llama) or a GGUF file: the
//! latency of one greedy decode step of batch 1 over a cache of
//! `CACHE_LEN` (2048) positions, and prefill throughput of a `PROMPT_LEN`
//! (512) token prompt, its weight matrices in `DTYPE` (`f32`, `bf16`,
//! `f16`, `q8_0`, or `ggml` for a GGUF file's as stored, as
//! `multihead generate --dtype`). `decode-share DIR [DTYPE] [CACHE_LEN]`:
//! a decode step over a cache of `CACHE_LEN` (144) positions as a share
//! of the memory bandwidth probed just before and after it, round after
//! round (`bench_models/decoder.rs`); prints the median share and its
//! quartiles and range over the rounds.
//!
//! `vit-b16 B`: timm's `vit_base_patch16_224` forward at batch `B`, on the
//! given timm state_dict or on random weights, and the peak resident
//! memory of a forward (the model and its input built, the peak reset),
//! and the minor page faults a forward takes (fresh pages from the
//! allocator). `sgemm N`: candle's `N × N` f32 matmul, the machine's
//! measured rate that the other rows are judged against.
//!
//! `linear M K N [LAYERS]`: a `PackedLinear`, candle's `Linear` and
//! candle's matmul on the same `(M, K) x (K, N)` product, in turn; with
//! `LAYERS`, that many layers of their own weights one after another, so
//! that the weights come from memory as a model's do.
//!
//! `linear-bf16 M K N [LAYERS]`: the `linear` mode's packed layers and
//! the same weights rounded to bf16 and packed as such, in turn: each
//! one's GFLOP/s and the median of the rounds' speed-ups.
//!
//! `share M K N [LAYERS]`: the `linear` mode's packed layers and candle's
//! matmul on one core, each as a share of that core's FMA peak (`peak`'s
//! loop) measured just before and after it, round after round: the host's
//! speed moves both alike, so the share shows how near the peak a kernel
//! runs at that moment, where a rate alone shows mostly the host. Prints
//! the median share and its quartiles and range over the rounds. The peak
//! is that of the vector width the tiles run with (`peak`'s); candle's
//! matmul (the `gemm` crate) keeps its AVX-512 under `MULTIHEAD_CPU_ISA=avx2`,
//! so there its share can pass 1.
//!
//! `split M K N [LAYERS]`: the `linear` mode's packed layers as one call
//! over the kernels' threads, against a copy of them per thread, each
//! copy's calls on its own thread alone (`with_threads(1, ..)`), all running at once, and one copy alone,
//! round after round: what splitting one call over the threads loses,
//! next to what the cores lose when all are busy. Prints the medians'
//! rates and, over the rounds, the median and quartiles of a copy's rate
//! at once over alone and of the call's rate over the copies' sum.
//!
//! `peak`: the FMA peak of every core at once, at the width the kernels
//! run with (`multihead::attention::cpu_isa`: AVX-512F, or AVX2 where the
//! processor or `MULTIHEAD_CPU_ISA=avx2` stops there), and that name;
//! at `avx512bf16`, the `vdpbf16ps` peak too, the bf16 layers' limit.
//!
//! `residual B`: a ViT-B/16 block's attention and MLP halves (random
//! weights, norms left out) with their residual adds fused into the output
//! projections (`MhaOptions::with_residual`, `PackedLinear::forward_add`)
//! and as separate adds, in turn; the last field is the median of the
//! rounds' ratios (separate over fused).
//!
//! `vit-linears B`: a ViT-B/16 forward at batch `B` (random weights) and
//! its 48 linears alone (qkv, proj, fc1 with its GELU, fc2 of 12 blocks,
//! each with weights of its own, over fixed inputs of `B · 197` rows), in
//! turn; the last field is the linears' time over the forward's. (The
//! forward's last block runs only the class token's queries and MLP, so
//! the linears alone do slightly more work than the forward's.)
//!
//! `stream MIB`: the rate each core reads a buffer of `MIB` MiB of its
//! own, every core at once (4 MiB: out of L2, in L3 on the Xeon of the
//! README).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::attention::{Causal, Mask, PackedLinear};
use multihead::kernels::PackFormat;
use multihead::models::checkpoint::{Checkpoint, WeightDtype};
use multihead::models::transformer::{Transformer, TransformerConfig, TransformerMasks};
use multihead::models::vit::{VisionTransformer, VitConfig};

#[path = "bench_models/decoder.rs"]
mod decoder;
#[path = "bench_models/linear.rs"]
mod linear;
#[path = "bench_models/machine.rs"]
mod machine;
#[path = "support/rss.rs"]
mod rss;
#[path = "support/serve.rs"]
mod serve;
#[path = "bench_models/train.rs"]
mod train;
#[path = "bench_models/vit.rs"]
mod vit;

/// Median wall time of `f` in ms over at least 5 runs (3 past a second)
/// and ~2 s, after one warm-up run.
fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let min_runs = if timed(&mut f)? > 1. { 3 } else { 5 };
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < min_runs || (start.elapsed().as_secs_f64() < 2. && times.len() < 200) {
        times.push(timed(&mut f)? * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Wall times in ms of each of `fs`, taken in turn (one run of each per
/// round, after one warm-up round) for at least 5 rounds and ~3 s, so that
/// the host's drift falls on all of them alike.
fn alternating_ms(fs: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<Vec<Vec<f64>>> {
    for f in fs.iter_mut() {
        f()?;
    }
    let mut times = vec![Vec::new(); fs.len()];
    let start = Instant::now();
    while times[0].len() < 5 || (start.elapsed().as_secs_f64() < 3. && times[0].len() < 300) {
        for (f, times) in fs.iter_mut().zip(&mut times) {
            times.push(timed(&mut *f)? * 1e3);
        }
    }
    Ok(times)
}

fn dtype_name(format: PackFormat, dtype: DType) -> &'static str {
    match (format, dtype) {
        (PackFormat::Q8_0, _) => "q8_0",
        (PackFormat::Q4_0, _) => "q4_0",
        (PackFormat::Q4_K, _) => "q4_k",
        (_, DType::BF16) => "bf16",
        (_, DType::F16) => "f16",
        _ => "f32",
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut xs = xs.to_vec();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The `f` quantile (0 to 1, the nearest rank) of `sorted`, which is not
/// empty.
fn quantile(sorted: &[f64], f: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * f).round() as usize]
}

/// The JSON fields of the shares in `sorted` (not empty), measured round
/// after round: the median under `name`, then `share_quartiles` and
/// `share_range`.
fn share_fields(name: &str, sorted: &[f64]) -> String {
    let q = |f: f64| quantile(sorted, f);
    format!(
        r#""{name}": {:.3}, "share_quartiles": [{:.3}, {:.3}], "share_range": [{:.3}, {:.3}]"#,
        q(0.5),
        q(0.25),
        q(0.75),
        q(0.),
        q(1.)
    )
}

/// Seconds one run of `f` takes.
fn timed(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// A VarBuilder over `path`, or over random weights initialised as the
/// modules initialise them, as plain tensors (a `VarMap`'s variables track
/// gradients, which sends every op down the differentiable paths).
fn weights(
    path: Option<&str>,
    build: impl Fn(VarBuilder) -> candle::Result<()>,
) -> Result<VarBuilder<'static>> {
    let dev = Device::Cpu;
    if let Some(path) = path {
        // SAFETY: the file is not modified while mapped (a benchmark's input).
        return Ok(unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &dev)? });
    }
    let varmap = VarMap::new();
    build(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let plain = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned VarMap lock"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    Ok(VarBuilder::from_tensors(plain, DType::F32, &dev))
}

/// timm's `vit_base_patch16_224` on the timm state_dict at `path`, or on
/// random weights.
fn vit_b16(path: Option<&str>) -> Result<VisionTransformer> {
    let cfg = VitConfig::base_patch16_224();
    let vb = weights(path, |vb| VisionTransformer::new(&cfg, vb).map(drop))?;
    Ok(VisionTransformer::new(&cfg, vb)?)
}

const TRANSFORMER_FORWARD: &str = "nn.Transformer B8 S64 T64 forward";
const TRANSFORMER_GREEDY: &str = "nn.Transformer B8 S64 encode + 32 greedy steps";

/// `nn.Transformer(d_model=512, nhead=8, 6 + 6 layers, batch_first=True)`
/// and its inputs: a B8 S64 T64 forward with a causal target mask, and 32
/// greedy steps with the cache (each step's output fed back as the next
/// input).
struct TransformerBench {
    model: Transformer,
    src: Tensor,
    tgt: Tensor,
    masks: TransformerMasks,
}

impl TransformerBench {
    /// On the `nn.Transformer` state_dict at `path`, or on random weights.
    fn new(path: Option<&str>) -> Result<Self> {
        let mut cfg = TransformerConfig::new(512, 8).with_batch_first(true);
        cfg.dropout = 0.;
        let vb = weights(path, |vb| Transformer::new(&cfg, vb).map(drop))?;
        let dev = Device::Cpu;
        Ok(TransformerBench {
            model: Transformer::new(&cfg, vb)?,
            src: Tensor::randn(0f32, 1., (8, 64, 512), &dev)?,
            tgt: Tensor::randn(0f32, 1., (8, 64, 512), &dev)?,
            masks: TransformerMasks {
                tgt: Mask::causal(Causal::TopLeft),
                ..Default::default()
            },
        })
    }

    fn forward(&self) -> Result<()> {
        Ok(self.model.forward(&self.src, &self.tgt, &self.masks).map(drop)?)
    }

    fn greedy(&self) -> Result<()> {
        let memory = self.model.encoder().forward(&self.src, &Mask::new())?;
        let mut cache = self.model.decoder().start(&memory, None)?;
        let mut x = Tensor::zeros((8, 1, 512), DType::F32, self.src.device())?;
        for _ in 0..32 {
            x = self.model.decoder().step(&x, &mut cache)?;
        }
        Ok(())
    }
}
/// `serve`: the works its flags name, on request (`support/serve.rs`).
fn serve_works(args: &[&str]) -> Result<()> {
    use std::rc::Rc;
    let dev = Device::Cpu;
    let mut works: Vec<serve::Work> = Vec::new();
    let mut args = args.iter();
    while let Some(&flag) = args.next() {
        let mut value = || {
            args.next()
                .copied()
                .with_context(|| format!("serve: {flag} takes a value"))
        };
        let random_or = |v: &str| (v != "random").then(|| v.to_string());
        match flag {
            "--sgemm" => {
                let (a, b) = (
                    Tensor::randn(0f32, 1., (2048, 2048), &dev)?,
                    Tensor::randn(0f32, 1., (2048, 2048), &dev)?,
                );
                let packed = PackedLinear::new(Tensor::randn(0f32, 1., (2048, 2048), &dev)?, None)?;
                let a2 = a.clone();
                works.push(("sgemm 2048".into(), Box::new(move || Ok(a.matmul(&b).map(drop)?))));
                works.push((
                    "PackedLinear 2048".into(),
                    Box::new(move || Ok(packed.forward(&a2).map(drop)?)),
                ));
            }
            "--vit" => {
                let vit = Rc::new(vit_b16(random_or(value()?).as_deref())?);
                for batch in [1, 8] {
                    let (vit, x) = (vit.clone(), Tensor::randn(0f32, 1., (batch, 3, 224, 224), &dev)?);
                    let work = format!("vit_base_patch16_224 B{batch}");
                    works.push((work, Box::new(move || Ok(vit.forward(&x).map(drop)?))));
                }
            }
            "--vit-bf16" => {
                // The weight matrices kept in bf16 (`multihead vit --dtype
                // bf16` on the CPU), activations in f32.
                let path = value()?;
                let cfg = VitConfig::base_patch16_224();
                let vit = Rc::new(
                    Checkpoint::read(path.as_ref())?
                        .with_weight_dtype(Some(WeightDtype::Bf16))
                        .load(DType::F32, &dev, |vb| VisionTransformer::new(&cfg, vb))?,
                );
                for batch in [1, 8] {
                    let (vit, x) = (vit.clone(), Tensor::randn(0f32, 1., (batch, 3, 224, 224), &dev)?);
                    let work = format!("vit_base_patch16_224 bf16 B{batch}");
                    works.push((work, Box::new(move || Ok(vit.forward(&x).map(drop)?))));
                }
            }
            "--transformer" => {
                let tr = Rc::new(TransformerBench::new(random_or(value()?).as_deref())?);
                let tr2 = tr.clone();
                works.push((TRANSFORMER_FORWARD.into(), Box::new(move || tr.forward())));
                works.push((TRANSFORMER_GREEDY.into(), Box::new(move || tr2.greedy())));
            }
            "--linear" => {
                // MxKxN: a PackedLinear without bias and its input.
                let shape = value()?;
                let dims: Vec<usize> = shape
                    .split('x')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .ok()
                    .filter(|d: &Vec<usize>| d.len() == 3)
                    .with_context(|| format!("serve: --linear takes MxKxN, not {shape}"))?;
                let x = Tensor::randn(0f32, 1., (dims[0], dims[1]), &dev)?;
                let lin = PackedLinear::new(Tensor::randn(0f32, 1., (dims[2], dims[1]), &dev)?, None)?;
                works.push((
                    format!("linear {shape}"),
                    Box::new(move || Ok(lin.forward(&x).map(drop)?)),
                ));
            }
            "--train" => {
                let tiny = match value()? {
                    "full" => false,
                    "tiny" => true,
                    other => bail!("serve: --train takes full or tiny, not {other}"),
                };
                works.extend(train::works(tiny)?);
            }
            "--decoder" => {
                let dec = Rc::new(std::cell::RefCell::new(decoder::DecoderBench::new(
                    value()?,
                    2048,
                    512,
                    WeightDtype::F32,
                )?));
                let (step, prefill) = (dec.borrow().step_work(), dec.borrow().prefill_work());
                let dec2 = dec.clone();
                works.push((step, Box::new(move || dec.borrow_mut().step())));
                works.push((prefill, Box::new(move || dec2.borrow().prefill())));
            }
            _ => bail!(
                "serve takes --sgemm, --vit WEIGHTS|random, --vit-bf16 WEIGHTS, --transformer \
                 WEIGHTS|random, --linear MxKxN, --train full|tiny and --decoder DIR, not {flag}"
            ),
        }
    }
    serve::serve(&mut works)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["peak"] => machine::peak()?,
        ["stream", mib] => machine::stream(mib)?,
        ["sgemm", n] => {
            let n: usize = n.parse().context("sgemm takes a size")?;
            let a = Tensor::randn(0f32, 1., (n, n), &Device::Cpu)?;
            let b = Tensor::randn(0f32, 1., (n, n), &Device::Cpu)?;
            let ms = median_ms(|| Ok(a.matmul(&b).map(drop)?))?;
            let gflops = 2. * (n as f64).powi(3) / (ms * 1e-3) / 1e9;
            println!(r#"{{"work": "sgemm {n}", "median_ms": {ms:.3}, "gflops": {gflops:.1}}}"#);
        }
        ["linear", m, k, n, rest @ ..] => linear::linear(m, k, n, rest)?,
        ["linear-bf16", m, k, n, rest @ ..] => linear::linear_bf16(m, k, n, rest)?,
        ["share", m, k, n, rest @ ..] => linear::share(m, k, n, rest)?,
        ["split", m, k, n, rest @ ..] => linear::split(m, k, n, rest)?,
        ["residual", batch] => vit::residual(batch)?,
        ["transformer", rest @ ..] => {
            let tr = TransformerBench::new(rest.first().copied())?;
            let ms = median_ms(|| tr.forward())?;
            println!(r#"{{"work": "{TRANSFORMER_FORWARD}", "median_ms": {ms:.2}}}"#);
            let ms = median_ms(|| tr.greedy())?;
            println!(r#"{{"work": "{TRANSFORMER_GREEDY}", "median_ms": {ms:.2}}}"#);
        }
        ["serve", rest @ ..] => serve_works(rest)?,
        ["decoder", dir, rest @ ..] => decoder::decoder(dir, rest)?,
        ["decode-share", dir, rest @ ..] => decoder::decode_share(dir, rest)?,
        ["vit-b16", batch, rest @ ..] => {
            let batch: usize = batch.parse().context("vit-b16 takes a batch size")?;
            let vit = vit_b16(rest.first().copied())?;
            let x = Tensor::randn(0f32, 1., (batch, 3, 224, 224), &Device::Cpu)?;
            // The forward's own peak: Linux resets the peak resident set
            // (VmHWM) to the current one when 5 is written to clear_refs.
            std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
            vit.forward(&x)?;
            let rss = rss::peak_rss_mib()?;
            let ms = median_ms(|| Ok(vit.forward(&x).map(drop)?))?;
            // Fresh pages the allocator hands out a forward (its heap
            // given back and taken again), over three more.
            let before = machine::minor_faults()?;
            for _ in 0..3 {
                vit.forward(&x)?;
            }
            let faults = (machine::minor_faults()? - before) / 3;
            println!(
                r#"{{"work": "vit_base_patch16_224 B{batch}", "median_ms": {ms:.2}, "peak_rss_mib": {rss:.1}, "page_faults_per_forward": {faults}}}"#
            );
        }
        ["decode-layers", dtype] => linear::decode_layers(dtype)?,
        ["vit-linears", batch] => vit::vit_linears(batch)?,
        _ => bail!(
            "usage: bench_models (peak | stream MIB | sgemm N | linear M K N [LAYERS] \
             | linear-bf16 M K N [LAYERS] | share M K N [LAYERS] \
             | split M K N [LAYERS] | vit-b16 BATCH [WEIGHTS] | transformer [WEIGHTS] \
             | vit-linears BATCH | residual BATCH | decode-layers f32|bf16|f16|q8_0 \
             | decoder MODEL_DIR [CACHE_LEN] [PROMPT_LEN] [DTYPE] \
             | decode-share MODEL_DIR [DTYPE] [CACHE_LEN])"
        ),
    }
    Ok(())
}
