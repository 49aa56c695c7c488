//! Steering the shipped date normaliser: the date constraint turns its
//! impossible outputs into real dates, a constraint that never binds
//! changes nothing, the generic search equals `Seq2Seq::greedy`, and the
//! ISO-date automaton accepts exactly the days of the calendar.

use anyhow::{Context, Result};
use candle::{DType, Device};
use multihead_models::dates::{self, DateReading, ISO_DATE_PATTERN};
use multihead_models::generation::{Decoding, LogitsProcessor, TokenConstraint};
use multihead_models::transformer::{CacheMode, CharVocab, Seq2Seq};
use multihead_test_support::{shipped, tokens::padded};
use serde_json::Value;

fn date_constraint(vocab: &CharVocab, model: &Seq2Seq) -> Result<TokenConstraint> {
    Ok(TokenConstraint::from_pattern(
        ISO_DATE_PATTERN,
        &vocab.tgt_tokens(),
        model.config().eos_id,
    )?)
}

fn sources(vocab: &CharVocab, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
    texts
        .iter()
        .map(|t| Ok(dates::encode_source(vocab, t, dates::DateOrder::default())?))
        .collect()
}

#[test]
fn the_date_constraint_turns_impossible_outputs_into_real_dates() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    let c = date_constraint(&vocab, &model)?;
    // Inputs that name no real date: February 29th of a common year, April
    // 31st, month 13. Unconstrained, the model copies them into impossible
    // ISO strings.
    let texts = ["Feb 29 2021", "31/04/2021", "2021-13-45"];
    let src = padded(&sources(&vocab, &texts)?, &dev)?;
    let free = model.greedy(&src, CacheMode::Use)?;
    for (t, ids) in texts.iter().zip(&free) {
        let out = vocab.decode(ids);
        assert!(
            !dates::is_calendar_date(&out) && !c.matches(ids),
            "{t:?} -> {out:?} is a real date"
        );
    }
    for decoding in [Decoding::Greedy, Decoding::Beam { beams: 4 }] {
        let cfg = model.generation_config().with_decoding(decoding);
        let out = model.generate(&src, &cfg, &[&c])?;
        for (t, hyps) in texts.iter().zip(&out) {
            let h = hyps.first().context("no hypothesis")?;
            let text = vocab.decode(&h.tokens);
            assert!(h.finished && c.matches(&h.tokens), "{t:?} -> {text:?}");
            assert!(dates::is_calendar_date(&text), "{t:?} -> {text:?}");
        }
    }
    // The year the caller asks for: "19xx" although the input says 2021.
    let c19 = TokenConstraint::from_pattern(r"19\d\d-\d\d-\d\d", &vocab.tgt_tokens(), model.config().eos_id)?;
    let src = padded(&sources(&vocab, &["March 3, 2021"])?, &dev)?;
    let out = model.generate(&src, &model.generation_config(), &[&c19])?;
    let text = vocab.decode(&out[0][0].tokens);
    assert!(text.starts_with("19") && text.len() == 10, "{text}");
    Ok(())
}

fn heldout_sources(vocab: &CharVocab, n: usize) -> Result<Vec<Vec<u32>>> {
    let heldout: Value = serde_json::from_str(&std::fs::read_to_string(
        shipped::folder("dates").join("heldout.json"),
    )?)?;
    let examples = heldout["examples"].as_array().context("examples")?;
    examples
        .iter()
        .take(n)
        .map(|e| {
            let input = e["input"].as_str().context("input")?;
            let order = match e["prefix"].as_str() {
                Some("<dmy>") => dates::DateOrder::DayFirst,
                _ => dates::DateOrder::MonthFirst,
            };
            Ok(dates::encode_source(vocab, input, order)?)
        })
        .collect()
}

#[test]
fn a_constraint_that_never_binds_changes_nothing_and_generate_is_greedy() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    // Any digits and dashes: every held-out output already is one.
    let any = TokenConstraint::from_pattern(r"[0-9\-]*", &vocab.tgt_tokens(), model.config().eos_id)?;
    let date = date_constraint(&vocab, &model)?;
    let src = heldout_sources(&vocab, 200)?;
    for chunk in src.chunks(100) {
        let src = padded(chunk, &dev)?;
        let reference = model.greedy(&src, CacheMode::Use)?;
        for decoding in [Decoding::Greedy, Decoding::Beam { beams: 3 }] {
            let cfg = model.generation_config().with_decoding(decoding);
            let free = model.generate(&src, &cfg, &[])?;
            // Identical outputs and scores.
            assert_eq!(model.generate(&src, &cfg, &[&any])?, free, "{decoding:?}");
            if decoding == Decoding::Greedy {
                // Greedy's held-out outputs are real dates, so every step's
                // best token is one the date constraint allows: it does not
                // bind either. (Beam search's other beams it does change.)
                let date: &dyn LogitsProcessor = &date;
                assert_eq!(model.generate(&src, &cfg, &[date])?, free);
                let ids: Vec<Vec<u32>> = free.iter().map(|h| h[0].tokens.clone()).collect();
                assert_eq!(ids, reference);
            }
        }
    }
    Ok(())
}

#[test]
fn sampling_the_date_model_is_reproducible_and_always_a_date() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    let c = date_constraint(&vocab, &model)?;
    let src = padded(&sources(&vocab, &["March 3, 2021", "hello there"])?, &dev)?;
    let cfg = model
        .generation_config()
        .with_decoding(Decoding::Sample { seed: 11 })
        .with_num_return(20);
    let t = multihead_models::generation::Temperature::new(3.)?;
    let a = model.generate(&src, &cfg, &[&c, &t])?;
    assert_eq!(a, model.generate(&src, &cfg, &[&c, &t])?);
    for h in a.iter().flatten() {
        assert!(
            dates::is_calendar_date(&vocab.decode(&h.tokens)),
            "{:?}",
            vocab.decode(&h.tokens)
        );
    }
    // At temperature 3 the samples of a nonsense input spread out.
    let distinct: std::collections::BTreeSet<_> = a[1].iter().map(|h| h.tokens.clone()).collect();
    assert!(distinct.len() > 1);
    Ok(())
}

#[test]
fn read_date_trusts_a_likely_date_and_refuses_nonsense() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    let c = date_constraint(&vocab, &model)?;
    let src = padded(&sources(&vocab, &["March 3, 2021", "hello there"])?, &dev)?;
    let cfg = model
        .generation_config()
        .with_decoding(Decoding::Beam { beams: 4 })
        .with_num_return(4);
    let out = model.generate(&src, &cfg, &[&c])?;
    match dates::read_date(&out[0], &vocab, 0.5) {
        DateReading::Date { text, probability } => {
            assert_eq!(text, "2021-03-03");
            assert!(probability > 0.9, "{probability}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        dates::read_date(&out[1], &vocab, 0.5),
        DateReading::Unreadable { .. }
    ));
    Ok(())
}

#[test]
fn the_iso_date_automaton_accepts_exactly_the_calendar() -> Result<()> {
    let dev = Device::Cpu;
    let (model, vocab) = shipped::dates(&dev)?;
    let c = date_constraint(&vocab, &model)?;
    let tgt = vocab.tgt_tokens();
    let id = |ch: char| {
        tgt.iter()
            .position(|t| t.as_deref() == Some(&ch.to_string()[..]))
            .map(|i| i as u32)
    };
    // 1900 and 2100: not leap (centuries); 2000: leap (divisible by 400);
    // 1996, 2024: leap; 2021, 1950: common. Days accepted per year must be
    // 365 or 366.
    for (year, days) in [
        (1900, 365),
        (1950, 365),
        (1996, 366),
        (2000, 366),
        (2021, 365),
        (2024, 366),
        (2100, 365),
        (0, 366),
        (9999, 365),
    ] {
        let mut accepted = 0;
        for m in 0..=13 {
            for d in 0..=32 {
                let text = format!("{year:04}-{m:02}-{d:02}");
                let ids: Vec<u32> = text.chars().map(id).collect::<Option<_>>().context("id")?;
                let ok = c.matches(&ids);
                assert_eq!(ok, dates::is_calendar_date(&text), "{text}");
                accepted += usize::from(ok);
            }
        }
        assert_eq!(accepted, days, "{year}");
    }
    Ok(())
}

/// An empty batch gives empty outputs on every decoding path.
#[test]
fn an_empty_batch_decodes_to_nothing() -> Result<()> {
    let dev = Device::Cpu;
    let (model, _) = shipped::dates(&dev)?;
    let src = candle::Tensor::zeros((0, 7), DType::U32, &dev)?;
    assert!(model.greedy(&src, CacheMode::Use)?.is_empty());
    assert!(model.greedy(&src, CacheMode::Recompute)?.is_empty());
    assert!(model.beam_search(&src, 3)?.is_empty());
    for decoding in [
        Decoding::Greedy,
        Decoding::Sample { seed: 1 },
        Decoding::Beam { beams: 2 },
    ] {
        let cfg = model.generation_config().with_decoding(decoding);
        assert!(model.generate(&src, &cfg, &[])?.is_empty(), "{decoding:?}");
    }
    Ok(())
}
