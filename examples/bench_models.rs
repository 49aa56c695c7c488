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
//! cargo run --release --example bench_models -- decoder MODEL_DIR [CACHE_LEN] [PROMPT_LEN]
//! cargo run --release --example bench_models -- serve [--sgemm] [--vit WEIGHTS|random] \
//!     [--vit-bf16 WEIGHTS] [--transformer WEIGHTS|random] [--linear MxKxN]... [--decoder DIR]
//! ```
//!
//! `serve`: answers `N WORK` requests on stdin with the median of `N` runs
//! of the work (`support/serve.rs`), for the script to pair with
//! PyTorch's. The works are the flags': `--sgemm` candle's 2048² matmul
//! (`sgemm 2048`) and a `PackedLinear 2048`; `--vit` and `--transformer`
//! the two ViT-B/16 rows and the two transformer rows as the other modes
//! name them; `--vit-bf16` ViT-B/16 with its weight matrices in bf16
//! (`vit_base_patch16_224 bf16 B1`, `B8`); `--linear` a `PackedLinear` without bias (`linear MxKxN`);
//! `--decoder` the `decoder` mode's two works.
//!
//! `decoder DIR`: a HF decoder folder (GPT-2 or Llama): the latency of one
//! greedy decode step of batch 1 over a cache of `CACHE_LEN` (2048)
//! positions, and prefill throughput of a `PROMPT_LEN` (512) token prompt.
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
//! over rayon's pool, against a copy of them per thread, each on a
//! one-thread pool of its own, all running at once, and one copy alone,
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
use multihead::attention::{Causal, Mask, MhaConfig, MhaOptions, MultiheadAttention, PackedLinear};
use multihead::kernels::{packing_as, PackFormat};
use multihead::models::checkpoint::{Checkpoint, WeightDtype};
use multihead::models::decoder::{CausalLm, DecoderModel};
use multihead::models::transformer::{Transformer, TransformerConfig, TransformerMasks};
use multihead::models::vit::{VisionTransformer, VitConfig};

#[path = "support/serve.rs"]
mod serve;

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

/// GFLOP/s of independent FMA chains on `x86_64`, of the width the
/// kernels run with (`cpu_isa`: AVX-512F, or AVX2+FMA where the processor
/// or `MULTIHEAD_CPU_ISA` stops there), run for `iters` rounds; 0 on the
/// portable kernels.
fn fma_peak(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        macro_rules! chains {
            ($feature:literal, $ty:ty, $lanes:expr, $chains:expr, $set1:ident, $fma:ident) => {{
                #[target_feature(enable = $feature)]
                unsafe fn run(iters: usize) -> f64 {
                    let (b, c) = std::hint::black_box(($set1(1.000_000_1), $set1(0.999_999)));
                    let mut acc: [$ty; $chains] = std::array::from_fn(|i| $set1(i as f32));
                    let t = Instant::now();
                    for _ in 0..iters {
                        for a in acc.iter_mut() {
                            *a = $fma(*a, b, c);
                        }
                    }
                    let secs = t.elapsed().as_secs_f64();
                    std::hint::black_box(acc);
                    (iters * $chains * $lanes * 2) as f64 / secs / 1e9
                }
                // SAFETY: the caller checked the features.
                unsafe { run(iters) }
            }};
        }
        // `cpu_isa` names only what the processor has. As many chains as
        // the registers hold with room to spare: AVX2's 16 `ymm` take 12
        // (24 spill and read low), enough to cover the FMA's latency on two
        // ports either way.
        match multihead::attention::cpu_isa() {
            "avx512" | "avx512bf16" => {
                return chains!("avx512f", __m512, 16, 24, _mm512_set1_ps, _mm512_fmadd_ps)
            }
            "avx2" => return chains!("avx2,fma", __m256, 8, 12, _mm256_set1_ps, _mm256_fmadd_ps),
            _ => {}
        }
    }
    let _ = iters;
    0.
}

/// The `vdpbf16ps` peak of this core in GFLOP/s (each instruction two
/// bf16 products and their sums into each of 16 f32 lanes: 64 FLOPs), 24
/// independent chains as in [`fma_peak`]; 0 where `cpu_isa` is not
/// `avx512bf16`.
fn dpbf16_peak(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if multihead::attention::cpu_isa() == "avx512bf16" {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn run(iters: usize) -> f64 {
            let (a, b) = std::hint::black_box((
                _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5), _mm512_set1_ps(0.25)),
                _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(-1e-3)),
            ));
            let mut acc: [__m512; 24] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
            let t = Instant::now();
            for _ in 0..iters {
                for c in acc.iter_mut() {
                    *c = _mm512_dpbf16_ps(*c, a, b);
                }
            }
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(acc);
            (iters * 24 * 64) as f64 / secs / 1e9
        }
        // SAFETY: `cpu_isa` names only what the processor has.
        return unsafe { run(iters) };
    }
    let _ = iters;
    0.
}

/// GB/s of summing `buf` `rounds` times (16 partial sums, so that it
/// vectorises).
fn read_rate(buf: &[f32], rounds: usize) -> f64 {
    let t = Instant::now();
    let mut lanes = [0f32; 16];
    for _ in 0..rounds {
        for chunk in buf.chunks_exact(16) {
            for (l, &x) in lanes.iter_mut().zip(chunk) {
                *l += x;
            }
        }
    }
    std::hint::black_box(lanes);
    (rounds * buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// `f` on every core at once, one thread each; its results in order.
fn on_every_core<R: Send>(f: impl Fn() -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores).map(|_| s.spawn(&f)).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a probe thread panicked"))
            .collect()
    })
}

fn peak_rss_mib() -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb as f64 / 1024.)
}

/// Minor page faults of this process so far (all its threads), from
/// `/proc/self/stat`'s tenth field.
fn minor_faults() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The fields after the command name, which may hold spaces, from the
    // third (the state) on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, r)| r.split_whitespace().collect());
    fields
        .get(7)
        .and_then(|f| f.parse().ok())
        .context("no minflt in /proc/self/stat")
}

/// The `f` quantile (0 to 1, the nearest rank) of `sorted`, which is not
/// empty.
fn quantile(sorted: &[f64], f: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * f).round() as usize]
}

/// Seconds one run of `f` takes.
fn timed(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// `LAYERS` (default 1) linear layers of `(M, K) x (K, N)`, each with
/// random weights of its own, three ways: packed, candle's `Linear` and
/// candle's matmul with the weight stored `(k, n)`; and the input.
struct LinearLayers {
    x: Tensor,
    packed: Vec<PackedLinear>,
    linear: Vec<candle_nn::Linear>,
    wt: Vec<Tensor>,
    /// Of one pass over the layers.
    gflop: f64,
    /// The work's name in the output.
    work: String,
}

impl LinearLayers {
    /// The three ways' names, in order.
    const PATHS: [&str; 3] = [
        "PackedLinear",
        "candle_nn::Linear",
        "candle matmul, (k, n) weight",
    ];

    fn new(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<Self> {
        let (m, k, n): (usize, usize, usize) = (m.parse()?, k.parse()?, n.parse()?);
        let layers: usize = rest.first().map_or(Ok(1), |l| l.parse()).context("LAYERS")?;
        let mut layer_set = LinearLayers {
            x: Tensor::randn(0f32, 1., (m, k), &Device::Cpu)?,
            packed: Vec::new(),
            linear: Vec::new(),
            wt: Vec::new(),
            gflop: 2. * (m * k * n * layers) as f64 / 1e9,
            work: match layers {
                1 => format!("linear {m}x{k} -> {n}"),
                _ => format!("linear {m}x{k} -> {n}, {layers} layers"),
            },
        };
        for _ in 0..layers {
            let w = Tensor::randn(0f32, 1., (n, k), &Device::Cpu)?;
            layer_set.packed.push(PackedLinear::new(w.clone(), None)?);
            layer_set.linear.push(candle_nn::Linear::new(w.clone(), None));
            layer_set.wt.push(w.t()?.contiguous()?);
        }
        Ok(layer_set)
    }
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

/// A HF decoder folder (GPT-2 or Llama) with a cache of `cache_len`
/// positions, for one greedy decode step of batch 1 over it, and a prompt
/// of `prompt_len` tokens to prefill.
struct DecoderBench {
    model: DecoderModel,
    cache: multihead::models::decoder::DecoderCache,
    cache_len: usize,
    token: Tensor,
    prompt: Tensor,
    prompt_len: usize,
}

impl DecoderBench {
    fn new(dir: &str, cache_len: usize, prompt_len: usize) -> Result<Self> {
        let dev = Device::Cpu;
        let model = DecoderModel::from_folder(dir.as_ref(), &dev)?;
        let vocab = model.vocab_size() as u32;
        let ids = |n: usize| -> candle::Result<Tensor> {
            let data: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
            Tensor::from_vec(data, (1, n), &dev)
        };
        let mut cache = model.new_cache(vec![]);
        model.forward(&ids(cache_len)?, &mut cache)?;
        Ok(DecoderBench {
            token: ids(1)?,
            prompt: ids(prompt_len)?,
            prompt_len,
            model,
            cache,
            cache_len,
        })
    }

    fn step_work(&self) -> String {
        format!("decode step, cache {}", self.cache_len)
    }

    fn prefill_work(&self) -> String {
        format!("prefill {} tokens", self.prompt_len)
    }

    /// One step over the cache, cut back after it so that every step sees
    /// the same length.
    fn step(&mut self) -> Result<()> {
        self.model.forward(&self.token, &mut self.cache)?;
        self.cache.truncate(self.cache_len);
        Ok(())
    }

    fn prefill(&self) -> Result<()> {
        Ok(self
            .model
            .forward(&self.prompt, &mut self.model.new_cache(vec![]))
            .map(drop)?)
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
            "--decoder" => {
                let dec = Rc::new(std::cell::RefCell::new(DecoderBench::new(value()?, 2048, 512)?));
                let (step, prefill) = (dec.borrow().step_work(), dec.borrow().prefill_work());
                let dec2 = dec.clone();
                works.push((step, Box::new(move || dec.borrow_mut().step())));
                works.push((prefill, Box::new(move || dec2.borrow().prefill())));
            }
            _ => bail!(
                "serve takes --sgemm, --vit WEIGHTS|random, --vit-bf16 WEIGHTS, --transformer \
                 WEIGHTS|random, --linear MxKxN and --decoder DIR, not {flag}"
            ),
        }
    }
    serve::serve(&mut works)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["peak"] => {
            let rates = on_every_core(|| fma_peak(100_000_000));
            let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
            println!(
                r#"{{"work": "FMA peak, every core at once", "isa": "{}", "gflops_per_core": [{}], "gflops": {:.1}}}"#,
                multihead::attention::cpu_isa(),
                per_core.join(", "),
                rates.iter().sum::<f64>()
            );
            if multihead::attention::cpu_isa() == "avx512bf16" {
                let rates = on_every_core(|| dpbf16_peak(100_000_000));
                let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
                println!(
                    r#"{{"work": "vdpbf16ps peak, every core at once", "gflops_per_core": [{}], "gflops": {:.1}}}"#,
                    per_core.join(", "),
                    rates.iter().sum::<f64>()
                );
            }
        }
        ["stream", mib] => {
            let len = mib.parse::<usize>().context("stream takes a size in MiB")? << 18;
            let rates = on_every_core(|| {
                let buf = vec![1f32; len];
                read_rate(&buf, 2);
                read_rate(&buf, (1 << 30) / (len * 4).max(1))
            });
            let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
            println!(
                r#"{{"work": "read {mib} MiB per core, every core at once", "gb_per_s_per_core": [{}]}}"#,
                per_core.join(", ")
            );
        }
        ["sgemm", n] => {
            let n: usize = n.parse().context("sgemm takes a size")?;
            let a = Tensor::randn(0f32, 1., (n, n), &Device::Cpu)?;
            let b = Tensor::randn(0f32, 1., (n, n), &Device::Cpu)?;
            let ms = median_ms(|| Ok(a.matmul(&b).map(drop)?))?;
            let gflops = 2. * (n as f64).powi(3) / (ms * 1e-3) / 1e9;
            println!(r#"{{"work": "sgemm {n}", "median_ms": {ms:.3}, "gflops": {gflops:.1}}}"#);
        }
        ["linear", m, k, n, rest @ ..] => {
            // One packed linear against candle's matmul on the same shapes;
            // with LAYERS, that many of them, each with its own weights,
            // run one after another, as a model's are, so that the
            // weights come from memory rather than cache.
            let LinearLayers {
                x,
                packed,
                linear,
                wt,
                gflop,
                work,
            } = LinearLayers::new(m, k, n, rest)?;
            // The three paths in turn, each round; the ratio is the median
            // of the rounds' ratios to the (k, n) matmul.
            let times = alternating_ms(&mut [
                &mut || packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
                &mut || linear.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
                &mut || wt.iter().try_for_each(|wt| Ok(x.matmul(wt).map(drop)?)),
            ])?;
            for (path, path_times) in LinearLayers::PATHS.iter().zip(&times) {
                let ms = median(path_times);
                let ratios: Vec<f64> = path_times.iter().zip(&times[2]).map(|(t, m)| m / t).collect();
                println!(
                    r#"{{"work": "{work}", "path": "{path}", "median_ms": {ms:.3}, "gflops": {:.1}, "speed_vs_matmul": {:.3}}}"#,
                    gflop / (ms * 1e-3),
                    median(&ratios)
                );
            }
        }
        ["linear-bf16", m, k, n, rest @ ..] => {
            // The `linear` mode's packed layers with their weights in f32
            // and in bf16, in turn: what the bf16 panels (on AVX512-BF16,
            // `vdpbf16ps` over inputs rounded to bf16) gain over f32.
            let LinearLayers {
                x,
                packed,
                gflop,
                work,
                ..
            } = LinearLayers::new(m, k, n, rest)?;
            let bf16 = packed
                .iter()
                .map(|l| Ok(PackedLinear::new(l.weight()?.to_dtype(DType::BF16)?, None)?))
                .collect::<Result<Vec<_>>>()?;
            let times = alternating_ms(&mut [
                &mut || packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
                &mut || bf16.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
            ])?;
            let ratios: Vec<f64> = times[0].iter().zip(&times[1]).map(|(f, b)| f / b).collect();
            let (f32_ms, bf16_ms) = (median(&times[0]), median(&times[1]));
            println!(
                r#"{{"work": "{work}", "isa": "{}", "f32_gflops": {:.1}, "bf16_gflops": {:.1}, "bf16_speedup": {:.3}}}"#,
                multihead::attention::cpu_isa(),
                gflop / (f32_ms * 1e-3),
                gflop / (bf16_ms * 1e-3),
                median(&ratios)
            );
        }
        ["share", m, k, n, rest @ ..] => {
            // One core's share of its FMA peak: rounds of the peak, the
            // packed layers, candle's matmul and the peak again, so that
            // each rate is divided by the peak of the same moment.
            if candle::utils::get_num_threads() != 1 {
                bail!("share measures one core: run it with RAYON_NUM_THREADS=1");
            }
            if fma_peak(1) == 0. {
                bail!(
                    "share needs the AVX-512F or AVX2 kernels for its peak loop, not {}",
                    multihead::attention::cpu_isa()
                );
            }
            let LinearLayers {
                x,
                packed,
                wt,
                gflop,
                work,
                ..
            } = LinearLayers::new(m, k, n, rest)?;
            let mut shares = [Vec::new(), Vec::new()];
            let mut peaks = Vec::new();
            let start = Instant::now();
            while peaks.len() < 10 || (start.elapsed().as_secs_f64() < 6. && peaks.len() < 200) {
                let peak = fma_peak(1_000_000);
                let times = [
                    timed(|| packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)))?,
                    timed(|| wt.iter().try_for_each(|wt| Ok(x.matmul(wt).map(drop)?)))?,
                ];
                let peak = (peak + fma_peak(1_000_000)) / 2.;
                for (shares, secs) in shares.iter_mut().zip(times) {
                    shares.push(gflop / secs / peak);
                }
                peaks.push(peak);
            }
            for (path, shares) in [LinearLayers::PATHS[0], LinearLayers::PATHS[2]]
                .iter()
                .zip(&mut shares)
            {
                shares.sort_by(f64::total_cmp);
                let q = |f: f64| quantile(shares, f);
                println!(
                    r#"{{"work": "{work}, one core", "path": "{path}", "rounds": {}, "peak_gflops": {:.1}, "share_of_peak": {:.3}, "share_quartiles": [{:.3}, {:.3}], "share_range": [{:.3}, {:.3}]}}"#,
                    shares.len(),
                    median(&peaks),
                    q(0.5),
                    q(0.25),
                    q(0.75),
                    q(0.),
                    q(1.)
                );
            }
        }
        ["split", m, k, n, rest @ ..] => {
            // One call on every core against a copy of the layers per core,
            // each copy on a one-thread pool of its own, all at once, and
            // one copy alone, round after round.
            let cores = rayon::current_num_threads();
            if cores < 2 {
                bail!("split compares one call over the pool's threads with a copy per thread: it needs two or more");
            }
            let copies = (0..cores)
                .map(|_| LinearLayers::new(m, k, n, rest))
                .collect::<Result<Vec<_>>>()?;
            let pools = (0..cores)
                .map(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
                .collect::<Result<Vec<_>, _>>()?;
            // GFLOP/s of one pass over a copy's packed layers.
            let rate = |c: &LinearLayers| -> Result<f64> {
                Ok(c.gflop / timed(|| c.packed.iter().try_for_each(|l| Ok(l.forward(&c.x).map(drop)?)))?)
            };
            let (mut alone, mut at_once, mut call) = (vec![], vec![], vec![]);
            let (mut at_once_over_alone, mut call_over_sum) = (vec![], vec![]);
            let start = Instant::now();
            while alone.len() < 10 || (start.elapsed().as_secs_f64() < 6. && alone.len() < 200) {
                let one = pools[0].install(|| rate(&copies[0]))?;
                let each = std::thread::scope(|s| {
                    let runs: Vec<_> = copies
                        .iter()
                        .zip(&pools)
                        .map(|(c, pool)| s.spawn(move || pool.install(|| rate(c))))
                        .collect();
                    runs.into_iter()
                        .map(|r| r.join().expect("a copy's thread panicked"))
                        .collect::<Result<Vec<f64>>>()
                })?;
                let split = rate(&copies[0])?;
                let sum: f64 = each.iter().sum();
                at_once_over_alone.push(sum / cores as f64 / one);
                call_over_sum.push(split / sum);
                alone.push(one);
                at_once.push(sum);
                call.push(split);
            }
            // "median, [lower quartile, upper quartile]".
            let q = |xs: &mut Vec<f64>| {
                xs.sort_by(f64::total_cmp);
                format!(
                    "{:.3}, [{:.3}, {:.3}]",
                    quantile(xs, 0.5),
                    quantile(xs, 0.25),
                    quantile(xs, 0.75)
                )
            };
            println!(
                r#"{{"work": "{}, {cores} threads", "rounds": {}, "one_copy_alone_gflops": {:.1}, "copies_at_once_gflops": {:.1}, "one_call_gflops": {:.1}, "copy_at_once_over_alone": [{}], "call_over_copies": [{}]}}"#,
                copies[0].work,
                alone.len(),
                median(&alone),
                median(&at_once),
                median(&call),
                q(&mut at_once_over_alone),
                q(&mut call_over_sum)
            );
        }
        ["residual", batch] => {
            // A ViT-B/16 block's two residual halves (norms left out), the
            // adds fused into the output projections and as candle adds,
            // in turn.
            let batch: usize = batch.parse().context("residual takes a batch size")?;
            let (dev, e) = (Device::Cpu, 768);
            let r = |s: &[usize]| -> Result<Tensor> { Ok((Tensor::randn(0f32, 1., s, &dev)? * 0.02)?) };
            let mha_weights = [
                ("in_proj_weight", r(&[3 * e, e])?),
                ("in_proj_bias", r(&[3 * e])?),
                ("out_proj.weight", r(&[e, e])?),
                ("out_proj.bias", r(&[e])?),
            ]
            .into_iter()
            .map(|(name, t)| (name.to_string(), t))
            .collect();
            let mha = MultiheadAttention::new(
                &MhaConfig::new(e, 12),
                VarBuilder::from_tensors(mha_weights, DType::F32, &dev),
            )?;
            let fc1 = PackedLinear::new(r(&[4 * e, e])?, Some(r(&[4 * e])?))?;
            let fc2 = PackedLinear::new(r(&[e, 4 * e])?, Some(r(&[e])?))?;
            let x = Tensor::randn(0f32, 1., (batch, 197, e), &dev)?;
            let times = alternating_ms(&mut [
                &mut || {
                    let opts = MhaOptions::new().with_residual(x.clone());
                    let x = mha.forward_attn(&x, &x, &x, &opts)?.output;
                    Ok(fc2.forward_add(&fc1.forward_gelu(&x)?, &x).map(drop)?)
                },
                &mut || {
                    let x = (&x + mha.forward(&x)?)?;
                    Ok((&x + fc2.forward(&fc1.forward_gelu(&x)?)?).map(drop)?)
                },
            ])?;
            let ratios: Vec<f64> = times[1]
                .iter()
                .zip(&times[0])
                .map(|(sep, fused)| sep / fused)
                .collect();
            println!(
                r#"{{"work": "ViT-B/16 block halves B{batch}", "fused_ms": {:.2}, "separate_adds_ms": {:.2}, "rounds": {}, "speed_fused": {:.3}}}"#,
                median(&times[0]),
                median(&times[1]),
                ratios.len(),
                median(&ratios)
            );
        }
        ["transformer", rest @ ..] => {
            let tr = TransformerBench::new(rest.first().copied())?;
            let ms = median_ms(|| tr.forward())?;
            println!(r#"{{"work": "{TRANSFORMER_FORWARD}", "median_ms": {ms:.2}}}"#);
            let ms = median_ms(|| tr.greedy())?;
            println!(r#"{{"work": "{TRANSFORMER_GREEDY}", "median_ms": {ms:.2}}}"#);
        }
        ["serve", rest @ ..] => serve_works(rest)?,
        ["decoder", dir, rest @ ..] => {
            let cache_len: usize = rest.first().map_or(Ok(2048), |s| s.parse())?;
            let prompt_len: usize = rest.get(1).map_or(Ok(512), |s| s.parse())?;
            let mut dec = DecoderBench::new(dir, cache_len, prompt_len)?;
            let ms = median_ms(|| dec.step())?;
            println!(r#"{{"work": "{}", "median_ms": {ms:.3}}}"#, dec.step_work());
            let ms = median_ms(|| dec.prefill())?;
            let tok_s = prompt_len as f64 / (ms * 1e-3);
            println!(
                r#"{{"work": "{}", "median_ms": {ms:.2}, "tokens_per_s": {tok_s:.0}}}"#,
                dec.prefill_work()
            );
        }
        ["vit-b16", batch, rest @ ..] => {
            let batch: usize = batch.parse().context("vit-b16 takes a batch size")?;
            let vit = vit_b16(rest.first().copied())?;
            let x = Tensor::randn(0f32, 1., (batch, 3, 224, 224), &Device::Cpu)?;
            // The forward's own peak: Linux resets the peak resident set
            // (VmHWM) to the current one when 5 is written to clear_refs.
            std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
            vit.forward(&x)?;
            let rss = peak_rss_mib()?;
            let ms = median_ms(|| Ok(vit.forward(&x).map(drop)?))?;
            // Fresh pages the allocator hands out a forward (its heap
            // given back and taken again), over three more.
            let before = minor_faults()?;
            for _ in 0..3 {
                vit.forward(&x)?;
            }
            let faults = (minor_faults()? - before) / 3;
            println!(
                r#"{{"work": "vit_base_patch16_224 B{batch}", "median_ms": {ms:.2}, "peak_rss_mib": {rss:.1}, "page_faults_per_forward": {faults}}}"#
            );
        }
        ["decode-layers", dtype] => {
            // A decode step's linears alone: the 0.39 B Llama-shaped
            // decoder's (24 layers of 896 wide, GQA 14/2, 4864
            // intermediate, a 32000-token head), one row through each in
            // turn, weights in `dtype`, each from memory: the rate the
            // weights stream at, to set beside the whole step's.
            let (dtype, format) = match *dtype {
                "f32" => (DType::F32, PackFormat::AsStored),
                "bf16" => (DType::BF16, PackFormat::AsStored),
                "f16" => (DType::F16, PackFormat::AsStored),
                "q8_0" => (DType::F32, PackFormat::Q8_0),
                other => bail!("decode-layers takes f32, bf16, f16 or q8_0, not {other}"),
            };
            let dev = Device::Cpu;
            let mut shapes = Vec::new();
            for _ in 0..24 {
                shapes.extend([(896 + 2 * 128, 896), (896, 896), (2 * 4864, 896), (896, 4864)]);
            }
            shapes.push((32000, 896));
            let layers = shapes
                .iter()
                .map(|&(n, k)| {
                    let w = (Tensor::randn(0f32, 1., (n, k), &dev)? * 0.02)?.to_dtype(dtype)?;
                    Ok(packing_as(format, || PackedLinear::new(w, None))?)
                })
                .collect::<Result<Vec<_>>>()?;
            let inputs = [896, 4864]
                .map(|k| Tensor::randn(0f32, 1., (1, k), &dev))
                .into_iter()
                .collect::<candle::Result<Vec<_>>>()?;
            let ms = median_ms(|| {
                for (layer, &(_, k)) in layers.iter().zip(&shapes) {
                    layer.forward(&inputs[usize::from(k != 896)])?;
                }
                Ok(())
            })?;
            let weights: usize = shapes.iter().map(|(n, k)| n * k).sum();
            let bytes = match format {
                PackFormat::Q8_0 => weights as f64 * 34. / 32.,
                PackFormat::AsStored => (weights * dtype.size_in_bytes()) as f64,
            };
            println!(
                r#"{{"work": "decode-layers {}", "median_ms": {ms:.2}, "gb_per_s": {:.1}, "tokens_per_s": {:.1}}}"#,
                dtype_name(format, dtype),
                bytes / (ms * 1e-3) / 1e9,
                1e3 / ms
            );
        }
        ["vit-linears", batch] => {
            // The share of a ViT-B/16 forward that its 48 linears take on
            // their own: the forward (random weights) and the same linears
            // (qkv, proj, fc1 with its GELU, fc2 of 12 blocks, each with
            // weights of its own, so that they come from memory as the
            // forward's do) over fixed inputs of its rows, in turn.
            let batch: usize = batch.parse().context("vit-linears takes a batch size")?;
            let vit = vit_b16(None)?;
            let dev = Device::Cpu;
            let (e, rows) = (768, batch * 197);
            let linear = |n: usize, k: usize| -> Result<PackedLinear> {
                let w = (Tensor::randn(0f32, 1., (n, k), &dev)? * 0.02)?;
                Ok(PackedLinear::new(w, Some(Tensor::zeros(n, DType::F32, &dev)?))?)
            };
            let blocks = (0..12)
                .map(|_| {
                    Ok([
                        linear(3 * e, e)?,
                        linear(e, e)?,
                        linear(4 * e, e)?,
                        linear(e, 4 * e)?,
                    ])
                })
                .collect::<Result<Vec<_>>>()?;
            let (x, hidden) = (
                Tensor::randn(0f32, 1., (rows, e), &dev)?,
                Tensor::randn(0f32, 1., (rows, 4 * e), &dev)?,
            );
            let img = Tensor::randn(0f32, 1., (batch, 3, 224, 224), &dev)?;
            let times = alternating_ms(&mut [&mut || Ok(vit.forward(&img).map(drop)?), &mut || {
                for [qkv, proj, fc1, fc2] in &blocks {
                    qkv.forward(&x)?;
                    proj.forward(&x)?;
                    fc1.forward_gelu(&x)?;
                    fc2.forward(&hidden)?;
                }
                Ok(())
            }])?;
            let gflop = 12. * 2. * (rows * e * (3 * e + e + 4 * e + 4 * e)) as f64 / 1e9;
            let (forward, linears) = (median(&times[0]), median(&times[1]));
            println!(
                r#"{{"work": "ViT-B/16 B{batch}: forward and its linears alone", "forward_ms": {forward:.2}, "linears_ms": {linears:.2}, "linears_gflops": {:.1}, "linears_share": {:.3}}}"#,
                gflop / (linears * 1e-3),
                linears / forward
            );
        }
        _ => bail!(
            "usage: bench_models (peak | stream MIB | sgemm N | linear M K N [LAYERS] \
             | linear-bf16 M K N [LAYERS] | share M K N [LAYERS] \
             | split M K N [LAYERS] | vit-b16 BATCH [WEIGHTS] | transformer [WEIGHTS] \
             | vit-linears BATCH | residual BATCH | decode-layers f32|bf16|f16|q8_0 \
             | decoder MODEL_DIR [CACHE_LEN] [PROMPT_LEN])"
        ),
    }
    Ok(())
}
