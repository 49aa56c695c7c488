//! A HF decoder folder: one decode step's latency, a prompt's prefill,
//! and a step's read rate as a share of the memory bandwidth of the same
//! moment.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle::{Device, Tensor};
use multihead::models::checkpoint::{LoadOptions, ModelFiles, TensorInfo, WeightDtype};
use multihead::models::decoder::{CausalLm, DecoderModel};
use multihead::models::formats::gguf::{is_gguf, GgufFile};

use crate::machine::read_rate_every_core;
use crate::{median, median_ms, share_fields};

/// A HF decoder folder (GPT-2 or Llama) or a GGUF file (`dtype` ggml: its
/// matrices as stored) with a cache of `cache_len`
/// positions, for one greedy decode step of batch 1 over it, and a prompt
/// of `prompt_len` tokens to prefill.
pub struct DecoderBench {
    model: DecoderModel,
    cache: multihead::models::decoder::DecoderCache,
    cache_len: usize,
    token: Tensor,
    prompt: Tensor,
    prompt_len: usize,
}

impl DecoderBench {
    pub fn new(dir: &str, cache_len: usize, prompt_len: usize, dtype: WeightDtype) -> Result<Self> {
        let dev = Device::Cpu;
        let opts = LoadOptions {
            dtype,
            ..LoadOptions::default()
        };
        let model = match is_gguf(dir.as_ref()) {
            true => DecoderModel::from_gguf(dir.as_ref(), &dev, &opts)?,
            false => DecoderModel::from_folder_with(dir.as_ref(), &dev, &opts)?,
        };
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

    pub fn step_work(&self) -> String {
        format!("decode step, cache {}", self.cache_len)
    }

    pub fn prefill_work(&self) -> String {
        format!("prefill {} tokens", self.prompt_len)
    }

    /// One step over the cache, cut back after it so that every step sees
    /// the same length.
    pub fn step(&mut self) -> Result<()> {
        self.model.forward(&self.token, &mut self.cache)?;
        self.cache.truncate(self.cache_len);
        Ok(())
    }

    pub fn prefill(&self) -> Result<()> {
        Ok(self
            .model
            .forward(&self.prompt, &mut self.model.new_cache(vec![]))
            .map(drop)?)
    }
}

/// `decoder DIR [CACHE_LEN] [PROMPT_LEN] [DTYPE]`.
pub fn decoder(dir: &str, rest: &[&str]) -> Result<()> {
    let cache_len: usize = rest.first().map_or(Ok(2048), |s| s.parse())?;
    let prompt_len: usize = rest.get(1).map_or(Ok(512), |s| s.parse())?;
    let dtype: WeightDtype = rest.get(2).map_or(Ok(WeightDtype::F32), |s| s.parse())?;
    let mut dec = DecoderBench::new(dir, cache_len, prompt_len, dtype)?;
    let ms = median_ms(|| dec.step())?;
    println!(r#"{{"work": "{}", "median_ms": {ms:.3}}}"#, dec.step_work());
    let ms = median_ms(|| dec.prefill())?;
    let tok_s = prompt_len as f64 / (ms * 1e-3);
    println!(
        r#"{{"work": "{}", "median_ms": {ms:.2}, "tokens_per_s": {tok_s:.0}}}"#,
        dec.prefill_work()
    );
    Ok(())
}

/// `decode-share DIR [DTYPE] [CACHE_LEN]`: rounds of a bandwidth probe
/// (every core reading 256 MiB of its own, the better of two passes) and
/// ~0.1 s of decode steps (after one that wakes the threads), for ~8 s;
/// each round's share is the step's weight bytes over its mean time and
/// the higher of the probes before and after it. The host's bandwidth
/// moves by half within minutes, so only a probe of the same moment
/// tells how near its limit a step reads.
pub fn decode_share(dir: &str, rest: &[&str]) -> Result<()> {
    let dtype: WeightDtype = rest.first().map_or(Ok(WeightDtype::F32), |s| s.parse())?;
    let cache_len: usize = rest.get(1).map_or(Ok(144), |s| s.parse())?;
    let bytes = step_bytes(dir, dtype)?;
    let mut dec = DecoderBench::new(dir, cache_len, 1, dtype)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bufs = vec![vec![1f32; 256 << 18]; cores];
    let mut before = read_rate_every_core(&bufs);
    let (mut shares, mut steps, mut probes) = (Vec::new(), Vec::new(), vec![before]);
    let start = Instant::now();
    while shares.len() < 10 || start.elapsed() < Duration::from_secs(8) {
        dec.step()?;
        let (t, mut n) = (Instant::now(), 0);
        while n < 3 || t.elapsed() < Duration::from_millis(100) {
            dec.step()?;
            n += 1;
        }
        let secs = t.elapsed().as_secs_f64() / n as f64;
        let after = read_rate_every_core(&bufs);
        shares.push(bytes / secs / 1e9 / before.max(after));
        steps.push(secs * 1e3);
        probes.push(after);
        before = after;
    }
    shares.sort_by(f64::total_cmp);
    println!(
        r#"{{"work": "decode step, cache {cache_len}, {}: its share of the bandwidth", "weights_mb": {:.0}, "rounds": {}, "step_ms": {:.2}, "bandwidth_gb_s": {:.1}, {}}}"#,
        dtype.name(),
        bytes / 1e6,
        shares.len(),
        median(&steps),
        median(&probes),
        share_fields("share", &shares)
    );
    Ok(())
}

/// The bytes a decode step reads of the folder's weights in `dtype`: every
/// matrix once, the output head too (the token table where it is tied),
/// but no embedding table, of which a step reads one row; of a GGUF file,
/// its matrices as stored (`dtype` ggml) or in `dtype`.
fn step_bytes(dir: &str, dtype: WeightDtype) -> Result<f64> {
    if is_gguf(dir.as_ref()) {
        let file = GgufFile::read(dir.as_ref())?;
        let tied = file.info("output.weight").is_none();
        let read = file
            .tensors()
            .iter()
            .filter(|t| t.shape.len() == 2 && (t.name != "token_embd.weight" || tied));
        return read
            .map(|t| match dtype {
                WeightDtype::Ggml => Ok(t.range.len() as f64),
                _ => bytes_in(dtype, t.shape[0] * t.shape[1], t.shape[1]),
            })
            .sum();
    }
    let ckpt = ModelFiles::resolve(dir.as_ref())?.read()?;
    let lookup = |t: &&TensorInfo| ["embed_tokens", "wte", "wpe"].iter().any(|l| t.name.contains(l));
    let matrices = ckpt
        .tensors()
        .iter()
        .filter(|t| t.shape.len() == 2 && t.is_float());
    let tied = ckpt.info("lm_head.weight").is_none();
    let read = matrices.filter(|t| {
        !lookup(t) || (tied && (t.name.ends_with("embed_tokens.weight") || t.name.ends_with("wte.weight")))
    });
    read.map(|t| bytes_in(dtype, t.numel(), t.shape[1])).sum()
}

/// The bytes of `numel` weights of rows of `k` in `dtype`.
fn bytes_in(dtype: WeightDtype, numel: usize, k: usize) -> Result<f64> {
    Ok(numel as f64
        * match dtype {
            WeightDtype::F32 => 4.,
            WeightDtype::Bf16 | WeightDtype::F16 => 2.,
            WeightDtype::Q8_0 => 34. / 32.,
            WeightDtype::Q4_0 => 18. / 32.,
            // Q5_0 where 256 does not divide the input size.
            WeightDtype::Q4_K if k.is_multiple_of(256) => 144. / 256.,
            WeightDtype::Q4_K => 22. / 32.,
            WeightDtype::Ggml => bail!("a folder's weights are floats: ggml is for GGUF files"),
        })
}
