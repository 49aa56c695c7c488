//! Continuous batching ([`Batcher`]): sequences decoded together, joining
//! and leaving between steps, each give what they give alone
//! ([`TextGenerator::generate`], itself HF's: `text_generation.rs`), their
//! streamed text equal to their final text; a listener that leaves frees
//! its row without touching the others.

use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use candle::Device;
use multihead::models::decoder::{
    BatchEvent, BatchRequest, Batcher, Finish, GenerationSettings, Sampling, TextGenerator, TextOutput,
};
use multihead_test_support::text::fixtures;

const PROMPTS: [&str; 5] = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog, and then",
    "héllo, 日本語?",
    "a",
    "Once upon a time there was a small model that wanted to batch its decoding steps",
];

/// A sequence's events, as they came.
type Events = Arc<Mutex<Vec<BatchEvent>>>;

fn request(g: &TextGenerator, prompt: &str, settings: &GenerationSettings) -> Result<BatchRequest> {
    Ok(BatchRequest {
        prompt_ids: g.tokenizer().encode(prompt)?,
        settings: settings.clone(),
        ignore_eos: false,
    })
}

fn submit(b: &mut Batcher<'_>, req: BatchRequest) -> Result<Events> {
    let events: Events = Arc::default();
    let sink = Arc::clone(&events);
    b.submit(
        req,
        Box::new(move |e| {
            sink.lock().unwrap().push(e);
            true
        }),
    )?;
    Ok(events)
}

/// The output and the streamed text of a sequence that ended.
fn output(events: &Events) -> Result<(TextOutput, String)> {
    let events = events.lock().unwrap();
    let mut streamed = String::new();
    for e in events.iter() {
        match e {
            BatchEvent::Text(t) => streamed.push_str(t),
            BatchEvent::Done(out) => return Ok((out.clone(), streamed)),
            BatchEvent::Failed(why) => bail!("failed: {why}"),
        }
    }
    bail!("not ended: {} events", events.len())
}

fn run_to_idle(b: &mut Batcher<'_>) -> Result<()> {
    for _ in 0..10_000 {
        if b.is_idle() {
            return Ok(());
        }
        b.step()?;
    }
    bail!("the batcher never went idle")
}

/// Every sequence, joining at a different step, prefilled in small chunks,
/// queued behind a full batch, gives its alone output.
fn batched_equals_alone(
    name: &str,
    settings: &GenerationSettings,
    parallel: usize,
    chunk: usize,
) -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
    let alone: Vec<TextOutput> = PROMPTS
        .iter()
        .map(|p| Ok(g.generate(p, settings, &mut |_| Ok(()))?))
        .collect::<Result<_>>()?;
    let mut b = Batcher::new(&g, parallel).with_prefill_chunk(chunk);
    let mut events = Vec::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        events.push(submit(&mut b, request(&g, p, settings)?)?);
        // Later prompts arrive while the earlier ones decode.
        for _ in 0..i {
            b.step()?;
        }
    }
    run_to_idle(&mut b)?;
    assert!(b.steps() > 0);
    for ((p, want), events) in PROMPTS.iter().zip(&alone).zip(&events) {
        let (got, streamed) = output(events)?;
        assert_eq!(
            got.ids, want.ids,
            "{name} {p:?} (parallel {parallel}, chunk {chunk})"
        );
        assert_eq!(got.text, want.text, "{name} {p:?}");
        assert_eq!(got.finish, want.finish, "{name} {p:?}");
        assert_eq!(streamed, got.text, "{name} {p:?}: streamed");
        assert_eq!(got.prompt_ids, want.prompt_ids);
    }
    Ok(())
}

fn greedy(g_settings: GenerationSettings, max_new_tokens: usize) -> GenerationSettings {
    GenerationSettings {
        max_new_tokens,
        sampling: None,
        ..g_settings
    }
}

#[test]
fn greedy_batched_equals_alone_on_every_fixture() -> Result<()> {
    for name in ["llama3", "llama2-sp", "gpt2-bpe"] {
        let g = TextGenerator::from_folder(&fixtures().join(name), &Device::Cpu)?;
        let settings = greedy(g.settings(), 24);
        batched_equals_alone(name, &settings, 8, 256)?;
        batched_equals_alone(name, &settings, 2, 5)?;
    }
    Ok(())
}

#[test]
fn seeded_sampling_and_penalty_batched_equal_alone() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let settings = GenerationSettings {
        max_new_tokens: 16,
        sampling: Some(Sampling {
            seed: 7,
            temperature: 0.8,
            top_k: Some(40),
            top_p: 0.9,
        }),
        repetition_penalty: Some(1.3),
        stop_strings: vec!["the".into()],
        ..g.settings()
    };
    batched_equals_alone("llama3", &settings, 3, 7)
}

#[test]
fn ignore_eos_runs_to_max_new_tokens() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let settings = greedy(g.settings(), 40);
    let mut b = Batcher::new(&g, 4);
    let mut all = Vec::new();
    for p in PROMPTS {
        let mut req = request(&g, p, &settings)?;
        req.ignore_eos = true;
        all.push(submit(&mut b, req)?);
    }
    run_to_idle(&mut b)?;
    for events in &all {
        let (out, _) = output(events)?;
        assert_eq!(out.ids.len(), 40);
        assert_eq!(out.finish, Finish::Length);
    }
    Ok(())
}

#[test]
fn a_listener_that_leaves_frees_its_row_and_the_others_go_on() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let settings = greedy(g.settings(), 30);
    let mut b = Batcher::new(&g, 2);
    let kept = submit(&mut b, request(&g, PROMPTS[1], &settings)?)?;
    // This listener hangs up after three pieces of text.
    let heard = Arc::new(Mutex::new(0usize));
    let counter = Arc::clone(&heard);
    let mut req = request(&g, PROMPTS[4], &settings)?;
    req.ignore_eos = true;
    b.submit(
        req,
        Box::new(move |_| {
            let mut n = counter.lock().unwrap();
            *n += 1;
            *n < 3
        }),
    )?;
    // A third waits for a free place, which the one that left gives it.
    let third = submit(&mut b, request(&g, PROMPTS[0], &settings)?)?;
    run_to_idle(&mut b)?;
    assert_eq!(*heard.lock().unwrap(), 3);
    for (events, p) in [(&kept, PROMPTS[1]), (&third, PROMPTS[0])] {
        let (got, _) = output(events)?;
        let want = g.generate(p, &settings, &mut |_| Ok(()))?;
        assert_eq!(got.ids, want.ids, "{p:?}");
    }
    Ok(())
}

#[test]
fn requests_that_cannot_run_are_refused_at_submit() -> Result<()> {
    let g = TextGenerator::from_folder(&fixtures().join("llama3"), &Device::Cpu)?;
    let mut b = Batcher::new(&g, 2);
    let settings = greedy(g.settings(), 4);
    let empty = BatchRequest {
        prompt_ids: Vec::new(),
        settings: settings.clone(),
        ignore_eos: false,
    };
    let err = b.submit(empty, Box::new(|_| true)).unwrap_err().to_string();
    assert!(err.contains("no tokens"), "{err}");
    let outside = BatchRequest {
        prompt_ids: vec![1, u32::MAX],
        settings: settings.clone(),
        ignore_eos: false,
    };
    let err = b.submit(outside, Box::new(|_| true)).unwrap_err().to_string();
    assert!(err.contains("vocabulary"), "{err}");
    let mut none = request(&g, "hi", &settings)?;
    none.settings.max_new_tokens = 0;
    assert!(b.submit(none, Box::new(|_| true)).is_err());
    assert!(b.is_idle());
    Ok(())
}
