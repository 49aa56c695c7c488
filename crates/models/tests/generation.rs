//! `multihead_models::generation` on a toy model whose next-token
//! probabilities are written out below, so every expected output and score
//! is arithmetic: greedy, beam search, seeded sampling, each processor, the
//! token constraint, and the errors raised before any decoding step.

use std::cell::Cell;

use anyhow::Result;
use candle::{Device, Tensor};
use multihead_models::generation::{
    generate, Decoding, ForcedBos, ForcedEos, GenerateConfig, Generated, LogitsProcessor, MaxLength,
    MinLength, PrefixAllowedTokens, RepetitionPenalty, StepContext, StepModel, Temperature, TokenConstraint,
    TopK, TopP,
};

const PAD: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const A: u32 = 3;
const B: u32 = 4;

/// Token texts: `<pad> <bos> <eos> a b`.
fn tokens() -> Vec<Option<String>> {
    vec![None, None, None, Some("a".into()), Some("b".into())]
}

/// A model that returns `ln p(next | prefix)` for a probability table given
/// as a function of the generated prefix; it counts its steps.
struct Toy<F> {
    probs: F,
    device: Device,
    steps: Cell<usize>,
}

impl<F: Fn(&[u32]) -> [f32; 5]> Toy<F> {
    fn new(probs: F) -> Self {
        Self {
            probs,
            device: Device::Cpu,
            steps: Cell::new(0),
        }
    }

    fn run(
        &self,
        batch: usize,
        cfg: &GenerateConfig,
        p: &[&dyn LogitsProcessor],
    ) -> Result<Vec<Vec<Generated>>> {
        Ok(generate(self, vec![Vec::new(); batch], batch, cfg, p)?)
    }
}

impl<F: Fn(&[u32]) -> [f32; 5]> StepModel for Toy<F> {
    /// Per row: the tokens fed so far, the start token excluded.
    type Cache = Vec<Vec<u32>>;

    fn step(&self, tokens: &Tensor, cache: &mut Self::Cache) -> candle::Result<Tensor> {
        self.steps.set(self.steps.get() + 1);
        let fed = tokens.to_vec2::<u32>()?;
        let mut out = Vec::new();
        for (row, t) in cache.iter_mut().zip(&fed) {
            if t[0] != BOS {
                row.push(t[0]);
            }
            out.extend((self.probs)(row).map(f32::ln));
        }
        Tensor::from_vec(out, (cache.len(), 5), &self.device)
    }

    fn select_rows(&self, cache: &mut Self::Cache, rows: &Tensor) -> candle::Result<()> {
        *cache = rows
            .to_vec1::<u32>()?
            .iter()
            .map(|&r| cache[r as usize].clone())
            .collect();
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        5
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// `[pad, bos, eos, a, b]`:
/// - first token: a 0.5, b 0.4, end 0.1;
/// - after "a": end 0.4, a 0.3, b 0.3;
/// - after "b": end 0.9, a 0.05, b 0.05;
/// - after two tokens: end 0.98, a 0.01, b 0.01.
///
/// Greedy reads "a" (0.5 · 0.4 = 0.2); the best sequence is "b"
/// (0.4 · 0.9 = 0.36).
fn branching(prefix: &[u32]) -> [f32; 5] {
    match prefix {
        [] => [0., 0., 0.1, 0.5, 0.4],
        [A] => [0., 0., 0.4, 0.3, 0.3],
        [B] => [0., 0., 0.9, 0.05, 0.05],
        _ => [0., 0., 0.98, 0.01, 0.01],
    }
}

/// All but never ends: a 0.6, b 0.4, end 1e-6.
fn endless(_: &[u32]) -> [f32; 5] {
    [0., 0., 1e-6, 0.6, 0.4]
}

fn greedy(max_len: usize) -> GenerateConfig {
    GenerateConfig {
        max_len,
        start_id: BOS,
        eos_id: EOS,
        pad_id: PAD,
        ..GenerateConfig::default()
    }
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() < 1e-5
}

#[test]
fn greedy_takes_the_locally_best_token() -> Result<()> {
    let toy = Toy::new(branching);
    let out = toy.run(2, &greedy(5), &[])?;
    for o in &out {
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].tokens, [A]);
        assert!(o[0].finished);
        assert!(close(o[0].score, 0.2f32.ln()), "{}", o[0].score);
    }
    Ok(())
}

#[test]
fn beam_search_finds_the_better_sequence_and_returns_n_best() -> Result<()> {
    let toy = Toy::new(branching);
    let cfg = greedy(5)
        .with_decoding(Decoding::Beam { beams: 2 })
        .with_num_return(2);
    let out = toy.run(3, &cfg, &[])?;
    assert_eq!(out.len(), 3);
    for o in &out {
        // "b" (0.36) then "a" (0.2), both finished.
        assert_eq!(
            o.iter().map(|h| h.tokens.clone()).collect::<Vec<_>>(),
            [vec![B], vec![A]]
        );
        assert!(close(o[0].score, 0.36f32.ln()) && close(o[1].score, 0.2f32.ln()));
        assert!(o.iter().all(|h| h.finished));
    }
    // One beam is greedy.
    let one = toy.run(1, &greedy(5).with_decoding(Decoding::Beam { beams: 1 }), &[])?;
    assert_eq!(one, toy.run(1, &greedy(5), &[])?);
    Ok(())
}

#[test]
fn no_search_runs_past_max_len() -> Result<()> {
    let toy = Toy::new(endless);
    for decoding in [
        Decoding::Greedy,
        Decoding::Sample { seed: 1 },
        Decoding::Beam { beams: 3 },
    ] {
        for max_len in [1, 4, 9] {
            toy.steps.set(0);
            let out = toy.run(2, &greedy(max_len).with_decoding(decoding), &[])?;
            for h in out.iter().flatten() {
                assert!(h.tokens.len() <= max_len, "{decoding:?}");
                // Greedy and sampling keep going (the end token is all but
                // impossible) and are cut.
                if decoding != (Decoding::Beam { beams: 3 }) {
                    assert_eq!((h.tokens.len(), h.finished), (max_len, false), "{decoding:?}");
                }
            }
            assert!(toy.steps.get() <= max_len, "{decoding:?}");
        }
    }
    Ok(())
}

#[test]
fn sampling_is_reproducible_and_follows_the_distribution() -> Result<()> {
    let toy = Toy::new(branching);
    let n = 2000;
    let cfg = |seed| {
        greedy(5)
            .with_decoding(Decoding::Sample { seed })
            .with_num_return(n)
    };
    let first = |out: &[Vec<Generated>]| -> [usize; 3] {
        let mut c = [0; 3];
        for h in &out[0] {
            c[match h.tokens.first() {
                Some(&A) => 0,
                Some(&B) => 1,
                _ => 2,
            }] += 1;
        }
        c
    };
    let s1 = toy.run(1, &cfg(7), &[])?;
    assert_eq!(s1, toy.run(1, &cfg(7), &[])?, "same seed, same samples");
    assert_ne!(s1, toy.run(1, &cfg(8), &[])?, "another seed, other samples");
    // A row's draws do not depend on the rows batched with it: source 0 of
    // a batch of 3 equals the single source.
    assert_eq!(toy.run(3, &cfg(7), &[])?[0], s1[0]);
    // First token a 0.5, b 0.4, end 0.1; 2000 draws have a standard error
    // of at most 0.011 per frequency.
    let c = first(&s1);
    for (count, p) in c.iter().zip([0.5, 0.4, 0.1]) {
        assert!((*count as f64 / n as f64 - p).abs() < 0.04, "{c:?}");
    }
    // Temperature 2: p^(1/2) renormalised = (0.707, 0.632, 0.316) / 1.655
    // = (0.427, 0.382, 0.191).
    let t = Temperature::new(2.)?;
    let c = first(&toy.run(1, &cfg(7), &[&t])?);
    for (count, p) in c.iter().zip([0.427, 0.382, 0.191]) {
        assert!((*count as f64 / n as f64 - p).abs() < 0.04, "{c:?}");
    }
    // Top-p 0.85: a and b (0.5 + 0.4 >= 0.85) stay, the end token never
    // comes first; top-p 0.5 and top-k 1 leave only a.
    let c = first(&toy.run(1, &cfg(7), &[&TopP::new(0.85)?])?);
    assert_eq!(c[2], 0, "{c:?}");
    assert!(c[0] > 0 && c[1] > 0);
    assert_eq!(first(&toy.run(1, &cfg(7), &[&TopP::new(0.5)?])?), [n, 0, 0]);
    // Top-k 1 sampling is greedy decoding.
    let k1 = toy.run(1, &cfg(3), &[&TopK::new(1)?])?;
    assert!(k1[0].iter().all(|h| h.tokens == [A]));
    Ok(())
}

#[test]
fn processors_edit_scores_as_written() -> Result<()> {
    let ctx = |prefix: &'static [u32]| StepContext {
        source: 0,
        prefix,
        max_len: 4,
        logit_offset: 0.,
    };
    let run = |p: &dyn LogitsProcessor, prefix: &'static [u32]| -> Result<Vec<f32>> {
        let mut s = vec![-1.0, -2.0, 0.5, -0.25, -3.0];
        p.process(&ctx(prefix), &mut s)?;
        Ok(s)
    };
    let inf = f32::NEG_INFINITY;
    // Tokens 0 and 2 seen: -1 * 2 = -2, 0.5 / 2 = 0.25.
    assert_eq!(
        run(&RepetitionPenalty::new(2.)?, &[0, 2, 2])?,
        [-2.0, -2.0, 0.25, -0.25, -3.0]
    );
    assert_eq!(run(&Temperature::new(0.5)?, &[])?, [-2.0, -4.0, 1.0, -0.5, -6.0]);
    assert_eq!(run(&TopK::new(2)?, &[])?, [inf, inf, 0.5, -0.25, inf]);
    assert_eq!(run(&ForcedBos(4), &[])?, [inf, inf, inf, inf, 0.]);
    assert_eq!(run(&ForcedBos(4), &[3])?, [-1.0, -2.0, 0.5, -0.25, -3.0]);
    // Four tokens allowed, three generated: the last step is the end token's.
    assert_eq!(run(&ForcedEos(2), &[3, 3, 3])?, [inf, inf, 0., inf, inf]);
    assert_eq!(run(&ForcedEos(2), &[3, 3])?, [-1.0, -2.0, 0.5, -0.25, -3.0]);
    assert_eq!(
        run(
            &MinLength {
                min_len: 2,
                eos_id: 2
            },
            &[3]
        )?,
        [-1.0, -2.0, inf, -0.25, -3.0]
    );
    assert_eq!(
        run(
            &MaxLength {
                max_len: 1,
                eos_id: 2
            },
            &[3]
        )?,
        [inf, inf, 0., inf, inf]
    );
    let allow = PrefixAllowedTokens(|_: usize, p: &[u32]| if p.is_empty() { vec![1, 3] } else { vec![2] });
    assert_eq!(run(&allow, &[])?, [inf, -2.0, inf, -0.25, inf]);
    assert_eq!(run(&allow, &[1])?, [inf, inf, 0.5, inf, inf]);
    Ok(())
}

#[test]
fn processors_steer_the_search() -> Result<()> {
    let toy = Toy::new(branching);
    // Forced "b" scores 0 (HF's convention), then the end token 0.9.
    let out = toy.run(1, &greedy(5), &[&ForcedBos(B)])?;
    assert_eq!(out[0][0].tokens, [B]);
    assert!(close(out[0][0].score, 0.9f32.ln()));
    // No end before two tokens: a (0.5), then a/b tie at 0.3 -> a (lower
    // id), then the end (0.98).
    let out = toy.run(
        1,
        &greedy(5),
        &[&MinLength {
            min_len: 2,
            eos_id: EOS,
        }],
    )?;
    assert_eq!(out[0][0].tokens, [A, A]);
    assert!(close(out[0][0].score, (0.5f32 * 0.3 * 0.98).ln()));
    let endless = Toy::new(endless);
    let out = endless.run(1, &greedy(4), &[&ForcedEos(EOS)])?;
    assert_eq!(
        (out[0][0].tokens.as_slice(), out[0][0].finished),
        ([A, A, A].as_slice(), true)
    );
    let out = endless.run(
        1,
        &greedy(9),
        &[&MaxLength {
            max_len: 2,
            eos_id: EOS,
        }],
    )?;
    assert_eq!(
        (out[0][0].tokens.as_slice(), out[0][0].finished),
        ([A, A].as_slice(), true)
    );
    Ok(())
}

#[test]
fn a_constraint_turns_a_violating_output_into_a_matching_one() -> Result<()> {
    let toy = Toy::new(branching);
    let only_b = TokenConstraint::from_pattern("b+", &tokens(), EOS)?;
    // Unconstrained greedy says "a", which "b+" refuses.
    let free = toy.run(1, &greedy(5), &[])?;
    assert!(!only_b.matches(&free[0][0].tokens));
    // Constrained: "b" (0.4, a masked), then the end (0.9). The score is
    // the model's probability, not renormalised over allowed tokens.
    for cfg in [greedy(5), greedy(5).with_decoding(Decoding::Beam { beams: 2 })] {
        let out = toy.run(2, &cfg, &[&only_b])?;
        for o in &out {
            assert_eq!(o[0].tokens, [B]);
            assert!(close(o[0].score, 0.36f32.ln()));
            assert!(o.iter().all(|h| only_b.matches(&h.tokens)));
        }
    }
    // With the endless model, "ab?" must end after at most two tokens even
    // though the model all but never wants to, and "a{3}" gets exactly
    // three. Both hypotheses end with the unlikely end token (1e-6): "a"
    // (0.6e-6) beats "ab" (0.24e-6).
    let endless = Toy::new(endless);
    let c = TokenConstraint::from_pattern("ab?", &tokens(), EOS)?;
    let out = endless.run(
        1,
        &greedy(9)
            .with_decoding(Decoding::Beam { beams: 3 })
            .with_num_return(2),
        &[&c],
    )?;
    let got: Vec<_> = out[0].iter().map(|h| h.tokens.clone()).collect();
    assert_eq!(got, [vec![A], vec![A, B]]);
    let c = TokenConstraint::from_pattern("a{3}", &tokens(), EOS)?;
    assert_eq!(endless.run(1, &greedy(4), &[&c])?[0][0].tokens, [A, A, A]);
    Ok(())
}

#[test]
fn a_constraint_that_never_binds_changes_nothing() -> Result<()> {
    let toy = Toy::new(branching);
    let any = TokenConstraint::from_pattern("[ab]*", &tokens(), EOS)?;
    for cfg in [
        greedy(5),
        greedy(5)
            .with_decoding(Decoding::Beam { beams: 2 })
            .with_num_return(2),
        greedy(5)
            .with_decoding(Decoding::Sample { seed: 4 })
            .with_num_return(50),
    ] {
        assert_eq!(toy.run(2, &cfg, &[&any])?, toy.run(2, &cfg, &[])?, "{cfg:?}");
    }
    Ok(())
}

#[test]
fn the_constraint_keeps_the_output_in_the_length_budget() -> Result<()> {
    // "a|b{4}": taking b needs four tokens and the end; with max_len 3 only
    // "a" is possible.
    let c = TokenConstraint::from_pattern("a|bbbb", &tokens(), EOS)?;
    assert_eq!(c.allowed(&[], 3), [A]);
    assert_eq!(c.allowed(&[], 5), [A, B]);
    assert_eq!(c.allowed(&[A], 2), [EOS]);
    let toy = Toy::new(|_: &[u32]| [0., 0., 0.1, 0.1, 0.8]);
    assert_eq!(toy.run(1, &greedy(3), &[&c])?[0][0].tokens, [A]);
    assert_eq!(toy.run(1, &greedy(5), &[&c])?[0][0].tokens, [B, B, B, B]);
    Ok(())
}

#[test]
fn bad_requests_fail_before_any_decoding_step() -> Result<()> {
    let toy = Toy::new(branching);
    let long = TokenConstraint::from_pattern("a{6}", &tokens(), EOS)?;
    let cases: Vec<(GenerateConfig, Vec<&dyn LogitsProcessor>, &str)> = vec![
        (greedy(5).with_num_return(2), vec![], "num_return"),
        (
            greedy(5)
                .with_decoding(Decoding::Beam { beams: 2 })
                .with_num_return(3),
            vec![],
            "cannot exceed",
        ),
        (
            greedy(5).with_decoding(Decoding::Beam { beams: 0 }),
            vec![],
            "beams",
        ),
        (greedy(0), vec![], "max_len"),
        (
            GenerateConfig {
                max_len: 5,
                start_id: 9,
                eos_id: EOS,
                pad_id: PAD,
                ..GenerateConfig::default()
            },
            vec![],
            "start_id",
        ),
        (greedy(5), vec![&ForcedBos(9)], "outside the vocabulary"),
        (greedy(6), vec![&long], "needs at least 6 tokens"),
    ];
    for (cfg, procs, needle) in cases {
        let err = toy
            .run(1, &cfg, &procs)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(needle), "{cfg:?}: expected {needle:?} in {err:?}");
        assert_eq!(toy.steps.get(), 0, "{cfg:?} decoded before refusing");
    }
    // Six tokens and the end fit in seven.
    assert_eq!(toy.run(1, &greedy(7), &[&long])?[0][0].tokens, [A; 6]);
    for bad in [Temperature::new(0.).err(), Temperature::new(f32::NAN).err()] {
        assert!(bad.is_some_and(|e| e.to_string().contains("temperature")));
    }
    assert!(TopK::new(0).is_err() && TopP::new(0.).is_err() && TopP::new(1.5).is_err());
    assert!(RepetitionPenalty::new(-1.).is_err());
    Ok(())
}

/// The same logits at every step, whatever was fed.
struct Fixed {
    logits: [f32; 5],
    device: Device,
}

impl StepModel for Fixed {
    type Cache = ();

    fn step(&self, tokens: &Tensor, _: &mut ()) -> candle::Result<Tensor> {
        let rows = tokens.dim(0)?;
        Tensor::from_vec(self.logits.repeat(rows), (rows, 5), &self.device)
    }

    fn select_rows(&self, _: &mut (), _: &Tensor) -> candle::Result<()> {
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        5
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// Greedy takes the largest logit, as HF's argmax of the logits does, also
/// where two logits one ulp apart round to one log-probability (small
/// logits beside their log-sum-exp, ln 5 here): "b", whose logit is the
/// larger, not "a", the first of the tied log-probabilities.
#[test]
fn greedy_takes_the_largest_logit_where_log_probabilities_tie() -> Result<()> {
    let a = 1e-3f32;
    let b = f32::from_bits(a.to_bits() + 1);
    let logits = [0.9e-3, 0.9e-3, 0.9e-3, a, b];
    let model = Fixed {
        logits,
        device: Device::Cpu,
    };
    // The premise: a's and b's log-probabilities are one number.
    let lp = candle_nn::ops::log_softmax(&Tensor::new(&logits, &Device::Cpu)?, 0)?.to_vec1::<f32>()?;
    assert_eq!(lp[3].to_bits(), lp[4].to_bits(), "{lp:?}");
    let out = generate(&model, (), 2, &greedy(1), &[])?;
    for o in &out {
        assert_eq!(o[0].tokens, [B]);
    }
    Ok(())
}
