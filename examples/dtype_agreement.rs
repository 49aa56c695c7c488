//! How far a decoder's logits move when its weight matrices are kept in
//! bf16, f16 or Q8_0 instead of f32: one teacher-forced prompt through the
//! same folder at each dtype, compared position by position with f32's.
//!
//! ```text
//! cargo run --release --example dtype_agreement -- MODEL_DIR [TOKENS] [DTYPES] [CHUNKS]
//! cargo run --release --example dtype_agreement -- --text
//! ```
//!
//! `TOKENS` (default 128) is the prompt's length: English text from the
//! folder's `tokenizer.json`, repeated as needed, every position compared.
//! With `CHUNKS`, the text is that many prompts of `TOKENS` tokens, one
//! after another in the repeated text, each from an empty cache, and only
//! the second half of each is compared: the positions `llama-perplexity
//! --kl-divergence -c TOKENS` scores over the same text. `DTYPES` (default
//! `bf16,f16,q8_0`) are compared with f32; an entry ending in `.gguf` is
//! that GGUF file of the same model, kept in the blocks it stores (`ggml`:
//! a `llama-quantize` file of the folder's f32 GGUF). For each it prints the share of
//! positions whose top-1 token is f32's, and the largest logit difference
//! relative to the largest f32 logit of its position. `--text` prints the
//! text the prompt repeats (`scripts/bench_llamacpp.py --agreement` gives
//! it to llama.cpp).

use anyhow::{ensure, Context, Result};
use candle::{Device, Tensor};
use multihead::models::checkpoint::{LoadOptions, WeightDtype};
use multihead::models::decoder::{CausalLm, DecoderModel, TextTokenizer};

const TEXT: &str = "The committee read every page of the long report on bandwidth, caches and the cost of \
                    moving weights from memory to the cores that multiply them. One token follows another \
                    until the summary is done, and the reviewers check each figure against the machine it \
                    came from before they sign. ";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args
        .first()
        .context("usage: dtype_agreement MODEL_DIR [TOKENS] [DTYPES] [CHUNKS], or --text")?;
    if dir == "--text" {
        print!("{TEXT}");
        return Ok(());
    }
    let tokens: usize = match args.get(1) {
        Some(n) => n
            .parse()
            .with_context(|| format!("TOKENS: '{n}' is not a count"))?,
        None => 128,
    };
    let dtypes: Vec<&str> = args
        .get(2)
        .map_or("bf16,f16,q8_0", String::as_str)
        .split(',')
        .collect();

    let chunks: Option<usize> = args
        .get(3)
        .map(|n| n.parse().with_context(|| format!("CHUNKS: '{n}' is not a count")))
        .transpose()?;
    ensure!(tokens > 0, "TOKENS must be at least 1");
    ensure!(chunks != Some(0), "CHUNKS must be at least 1");

    let tokenizer = TextTokenizer::from_folder(dir.as_ref())?;
    let mut ids = Vec::new();
    let total = tokens
        .checked_mul(chunks.unwrap_or(1))
        .context("TOKENS x CHUNKS overflows")?;
    while ids.len() < total {
        ids.extend(tokenizer.encode_plain(TEXT)?);
    }
    ids.truncate(total);
    // The prompts, and the first position of each that is compared.
    let (prompts, from): (Vec<&[u32]>, usize) = match chunks {
        Some(_) => (ids.chunks(tokens).collect(), tokens / 2),
        None => (vec![&ids[..]], 0),
    };
    let positions = prompts.len() * (tokens - from);

    let reference = load(dir, WeightDtype::F32)?;
    println!("{dir}: {positions} positions, each dtype against f32");
    for dtype in dtypes {
        let (other, name) = match dtype.strip_suffix(".gguf") {
            Some(stem) => {
                let name = stem.rsplit(['-', '/']).next().unwrap_or(stem).to_string();
                (load_gguf(dtype)?, name)
            }
            None => {
                let d: WeightDtype = dtype.parse()?;
                (load(dir, d)?, d.name().to_string())
            }
        };
        let (mut same, mut worst) = (0, 0f32);
        for prompt in &prompts {
            let (r, o) = (logits(&reference, prompt)?, logits(&other, prompt)?);
            for (r, o) in r.iter().zip(&o).skip(from) {
                same += usize::from(argmax(r) == argmax(o));
                let scale = r.iter().fold(0f32, |m, x| m.max(x.abs()));
                let diff = r.iter().zip(o).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(diff / scale);
            }
        }
        println!(
            "  {:>5}: top-1 equal at {same}/{positions} positions ({:.1} %), largest logit difference {:.2e} of the largest logit",
            name,
            100.0 * same as f64 / positions as f64,
            worst
        );
    }
    Ok(())
}

/// The folder's model, its weights kept in `dtype`.
fn load(dir: &str, dtype: WeightDtype) -> Result<DecoderModel> {
    let opts = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    DecoderModel::from_folder_with(dir.as_ref(), &Device::Cpu, &opts)
        .with_context(|| format!("loading {dir} in {}", dtype.name()))
}

/// A GGUF file's model, kept in its blocks.
fn load_gguf(path: &str) -> Result<DecoderModel> {
    let opts = LoadOptions {
        dtype: WeightDtype::Ggml,
        ..LoadOptions::default()
    };
    DecoderModel::from_gguf(path.as_ref(), &Device::Cpu, &opts).with_context(|| format!("loading {path}"))
}

/// Every position's logits of `ids` fed as one prompt to an empty cache.
fn logits(model: &DecoderModel, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
    let input = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    let mut cache = model.new_cache(vec![0]);
    Ok(model.forward(&input, &mut cache)?.squeeze(0)?.to_vec2()?)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |best, (i, &x)| if x > best.1 { (i, x) } else { best },
        )
        .0
}
