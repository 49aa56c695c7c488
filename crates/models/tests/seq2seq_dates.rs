//! The shipped date normaliser: our greedy output equals PyTorch's on every
//! held-out example (`weights/dates/heldout.json`, written by
//! `scripts/train_dates.py`), with and without the KV cache.

use anyhow::{Context, Result};
use candle::Device;
use multihead_models::dates::{encode_source, DateOrder};
use multihead_models::transformer::CacheMode;
use multihead_test_support::{shipped, tokens::padded};
use serde_json::Value;

#[test]
fn greedy_equals_pytorch_on_every_heldout_example() -> Result<()> {
    let dev = Device::Cpu;
    let dir = shipped::folder("dates");
    let (model, vocab) = shipped::dates(&dev)?;
    let heldout: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("heldout.json"))?)?;
    let examples = heldout["examples"].as_array().context("examples")?;
    assert!(examples.len() >= 500, "only {} held-out examples", examples.len());
    let field = |e: &Value, k: &str| -> Result<String> {
        Ok(e[k]
            .as_str()
            .with_context(|| format!("example without {k}"))?
            .to_string())
    };
    let (mut ours_correct, mut torch_correct) = (0, 0);
    for (i, chunk) in examples.chunks(100).enumerate() {
        let src: Vec<Vec<u32>> = chunk
            .iter()
            .map(|e| {
                // A model trained with reading tokens has each example's
                // token in `prefix` (`<mdy>`/`<dmy>`); older ones have none.
                let order = match e["prefix"].as_str() {
                    Some("<dmy>") => DateOrder::DayFirst,
                    _ => DateOrder::MonthFirst,
                };
                Ok(encode_source(&vocab, &field(e, "input")?, order)?)
            })
            .collect::<Result<_>>()?;
        let src = padded(&src, &dev)?;
        let cached = model.greedy(&src, CacheMode::Use)?;
        // The uncached reference on the first chunk only: it is slower.
        if i == 0 {
            assert_eq!(model.greedy(&src, CacheMode::Recompute)?, cached);
        }
        for (e, ids) in chunk.iter().zip(&cached) {
            let ours = vocab.decode(ids);
            let (torch, target) = (field(e, "pytorch")?, field(e, "target")?);
            assert_eq!(ours, torch, "input {:?}", field(e, "input")?);
            ours_correct += usize::from(ours == target);
            torch_correct += usize::from(torch == target);
        }
    }
    let acc = ours_correct as f64 / examples.len() as f64;
    println!(
        "held-out exact match: ours {ours_correct}/{n}, PyTorch {torch_correct}/{n}",
        n = examples.len()
    );
    assert!(acc >= 0.98, "exact match {acc} < 0.98");
    Ok(())
}

#[test]
fn beam_search_normalises_a_date() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    let src = padded(
        &[
            encode_source(&vocab, "March 3, 2021", DateOrder::MonthFirst)?,
            encode_source(&vocab, "3rd of March 2021", DateOrder::MonthFirst)?,
        ],
        &dev,
    )?;
    for h in model.beam_search(&src, 4)? {
        assert_eq!(vocab.decode(&h.tokens), "2021-03-03");
        assert!(h.score <= 0. && h.score.is_finite());
    }
    Ok(())
}
