//! Times the text side of generation a token at a time: a folder's
//! tokenizer turning generated ids into streamed text
//! ([`TextTokenizer::stream`]) and what a stop string adds (the text not
//! final yet, [`TextStream::pending`]), at 100, 2,000 and 8,000 generated
//! tokens. The work a token should not grow with the tokens before it.
//!
//! ```text
//! cargo run --release --example bench_text -- tests/fixtures/text/llama2-sp
//! ```
//!
//! Prints one JSON object per line: tokens, whether stop strings were
//! checked, and the median and range over 7 runs of microseconds a token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use multihead::models::decoder::TextTokenizer;

fn main() -> Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "tests/fixtures/text/llama2-sp".into()),
    );
    let tok = TextTokenizer::from_folder(&dir).with_context(|| dir.display().to_string())?;
    // Ids of real text, repeated: what a model writes, not noise.
    let text = "The quick brown fox jumps over the lazy dog, and the cat sat on the mat. ";
    let cycle = tok.encode_plain(text)?;
    for n in [100usize, 2_000, 8_000] {
        let ids: Vec<u32> = cycle.iter().copied().cycle().take(n).collect();
        for stops in [false, true] {
            let mut times = Vec::new();
            for _ in 0..7 {
                let start = Instant::now();
                let mut stream = tok.stream();
                let mut length = 0;
                for &id in &ids {
                    length += stream.push(id)?.map_or(0, |p| p.len());
                    if stops {
                        std::hint::black_box(stream.pending()?);
                    }
                }
                length += stream.finish()?.len();
                std::hint::black_box(length);
                times.push(start.elapsed().as_secs_f64() * 1e6 / n as f64);
            }
            times.sort_by(f64::total_cmp);
            println!(
                "{{\"tokens\": {n}, \"stop_strings\": {stops}, \"us_per_token\": {:.2}, \"min\": {:.2}, \"max\": {:.2}}}",
                times[3], times[0], times[6]
            );
        }
    }
    Ok(())
}
