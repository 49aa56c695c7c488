//! Greedy decoding speed with and without the KV cache.
//!
//! - `dates/*`: the shipped date normaliser on real inputs (11 tokens per
//!   output, the end token included), batch 1 and batch 32.
//! - `long/*`: a random model of the same size decoding 128 positions
//!   (teacher-forced, so that every run does the same number of steps),
//!   where the uncached decoder's quadratic re-computation shows.
//!
//! `cargo bench --bench seq2seq_decode`; throughput is in tokens/s
//! ("elem/s").

use std::path::Path;

use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use multihead::models::transformer::{CacheMode, CharVocab, Seq2Seq, Seq2SeqConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn load_dates(dev: &Device) -> Res<(Seq2Seq, CharVocab)> {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/weights/dates"));
    let cfg = Seq2SeqConfig::from_json(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let vocab = CharVocab::from_json(&std::fs::read_to_string(dir.join("vocab.json"))?)?;
    let vb = VarBuilder::from_buffered_safetensors(
        std::fs::read(dir.join("model.safetensors"))?,
        DType::F32,
        dev,
    )?;
    Ok((Seq2Seq::new(&cfg, vb)?, vocab))
}

fn batch(vocab: &CharVocab, texts: &[&str], dev: &Device) -> Res<Tensor> {
    let rows: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| vocab.encode(t))
        .collect::<candle::Result<_>>()?;
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let data: Vec<u32> = rows
        .iter()
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, n - r.len())))
        .collect();
    Ok(Tensor::from_vec(data, (rows.len(), n), dev)?)
}

fn dates(c: &mut Criterion) -> Res<()> {
    let dev = Device::Cpu;
    let (model, vocab) = load_dates(&dev)?;
    let texts = [
        "Wednesday, March 3, 2021",
        "3rd of March 2021",
        "03/03/21",
        "2021年3月3日",
    ];
    let mut group = c.benchmark_group("dates");
    for n in [1usize, 32] {
        let inputs: Vec<&str> = texts.iter().cycle().take(n).copied().collect();
        let src = batch(&vocab, &inputs, &dev)?;
        // Tokens generated, end tokens included.
        let tokens: usize = model
            .greedy(&src, CacheMode::Use)?
            .iter()
            .map(|t| t.len() + 1)
            .sum();
        group.throughput(Throughput::Elements(tokens as u64));
        for (name, cache) in [("cached", CacheMode::Use), ("uncached", CacheMode::Recompute)] {
            group.bench_with_input(BenchmarkId::new(name, format!("batch{n}")), &src, |b, src| {
                b.iter(|| model.greedy(src, cache).map(|o| o.len()).unwrap_or(0))
            });
        }
    }
    group.finish();
    Ok(())
}

fn long(c: &mut Criterion) -> Res<()> {
    let dev = Device::Cpu;
    let (dates_model, _) = load_dates(&dev)?;
    let mut cfg = dates_model.config().clone();
    cfg.max_positions = 160;
    cfg.max_tgt_len = 128;
    let varmap = VarMap::new();
    let model = Seq2Seq::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let src = Tensor::ones((1, 24), DType::U32, &dev)?;
    let tgt = Tensor::ones((1, 128), DType::U32, &dev)?;
    let enc = model.encode(&src)?;
    let mut group = c.benchmark_group("long");
    group.throughput(Throughput::Elements(128));
    group.sample_size(10);
    group.bench_function("cached/128", |b| {
        b.iter(|| -> candle::Result<()> {
            let mut cache = model.start(&enc)?;
            for t in 0..128 {
                model.step(&tgt.narrow(1, t, 1)?, &mut cache)?;
            }
            Ok(())
        })
    });
    group.bench_function("uncached/128", |b| {
        b.iter(|| -> candle::Result<()> {
            for t in 1..=128 {
                model.decode_full(&tgt.narrow(1, 0, t)?, &enc)?;
            }
            Ok(())
        })
    });
    group.finish();
    Ok(())
}

fn benches(c: &mut Criterion) {
    // A bench without its model reports why instead of panicking.
    if let Err(e) = dates(c) {
        eprintln!("dates bench skipped: {e}");
    }
    if let Err(e) = long(c) {
        eprintln!("long bench skipped: {e}");
    }
}

criterion_group! {
    name = decode;
    config = Criterion::default().measurement_time(std::time::Duration::from_secs(3)).warm_up_time(std::time::Duration::from_secs(1));
    targets = benches
}
criterion_main!(decode);
