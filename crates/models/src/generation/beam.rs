//! Beam search over any [`StepModel`]: `beams` hypotheses per source,
//! the processors applied to each at every step.

use candle::{Result, Tensor};

use super::processors::{LogitsProcessor, StepContext};
use super::search::{apply, next_log_probs, GenerateConfig, Generated};
use super::step::StepModel;

#[derive(Debug, Clone)]
struct Beam {
    tokens: Vec<u32>,
    score: f32,
    done: bool,
}

/// Beam search: `beams` hypotheses per source, expanded by every token the
/// processors leave, the best `beams` kept at each step. A finished
/// hypothesis stays a candidate with its score; there is no length penalty.
pub(super) fn beam<M: StepModel>(
    model: &M,
    mut cache: M::Cache,
    first: &[u32],
    beams: usize,
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
) -> Result<Vec<Vec<Generated>>> {
    let dev = model.device().clone();
    let batch = first.len();
    // Every source repeated `beams` times: (B * K, ...).
    let rows: Vec<u32> = (0..batch as u32)
        .flat_map(|i| std::iter::repeat_n(i, beams))
        .collect();
    model.select_rows(&mut cache, &Tensor::new(rows.as_slice(), &dev)?)?;
    // Only the first beam of each source is live at the start, so the
    // first step's best tokens become distinct hypotheses.
    let mut state: Vec<Beam> = (0..batch * beams)
        .map(|i| Beam {
            tokens: Vec::new(),
            score: if i % beams == 0 { 0. } else { f32::NEG_INFINITY },
            done: false,
        })
        .collect();
    let mut fed: Vec<u32> = (0..batch * beams).map(|r| first[r / beams]).collect();
    for step in 0..cfg.max_len {
        // Beams rank log-probabilities, as HF's beam search does.
        let (mut logp, offsets, _) = next_log_probs(model, fed, &mut cache, step)?;
        let mut next = Vec::with_capacity(batch * beams);
        let mut parents = Vec::with_capacity(batch * beams);
        for g in 0..batch {
            let mut cands: Vec<(f32, usize, Option<u32>)> = Vec::new();
            for p in g * beams..(g + 1) * beams {
                let bm = &state[p];
                if bm.score == f32::NEG_INFINITY {
                    continue;
                }
                if bm.done {
                    cands.push((bm.score, p, None));
                    continue;
                }
                let ctx = StepContext {
                    source: g,
                    prefix: &bm.tokens,
                    max_len: cfg.max_len,
                    logit_offset: offsets[p],
                };
                apply(processors, &ctx, &mut logp[p])?;
                cands.extend(
                    logp[p]
                        .iter()
                        .enumerate()
                        .filter(|(_, &lp)| lp > f32::NEG_INFINITY)
                        .map(|(v, &lp)| (bm.score + lp, p, Some(v as u32))),
                );
            }
            // Stable: among equal scores the earlier beam and the lower id
            // win, as greedy's argmax does.
            cands.sort_by(|a, b| b.0.total_cmp(&a.0));
            cands.truncate(beams);
            for j in 0..beams {
                let Some(&(score, p, tok)) = cands.get(j) else {
                    // Fewer candidates than beams: a dead beam that never wins.
                    next.push(Beam {
                        tokens: Vec::new(),
                        score: f32::NEG_INFINITY,
                        done: true,
                    });
                    parents.push((g * beams) as u32);
                    continue;
                };
                let mut bm = Beam {
                    tokens: state[p].tokens.clone(),
                    score,
                    done: state[p].done,
                };
                match tok {
                    Some(t) if cfg.is_eos(t) => bm.done = true,
                    Some(t) => bm.tokens.push(t),
                    None => {}
                }
                next.push(bm);
                parents.push(p as u32);
            }
        }
        state = next;
        if state.iter().all(|bm| bm.done) {
            break;
        }
        model.select_rows(&mut cache, &Tensor::new(parents.as_slice(), &dev)?)?;
        fed = state
            .iter()
            .enumerate()
            .map(|(r, bm)| match (bm.done, bm.tokens.last()) {
                (true, _) => cfg.pad_id,
                (false, Some(&t)) => t,
                (false, None) => first[r / beams],
            })
            .collect();
    }
    let out = state
        .chunks(beams)
        .map(|group| {
            let mut alive: Vec<&Beam> = group.iter().filter(|bm| bm.score > f32::NEG_INFINITY).collect();
            // Finished hypotheses first, then the best score; stable.
            alive.sort_by(|x, y| y.done.cmp(&x.done).then(y.score.total_cmp(&x.score)));
            alive
                .into_iter()
                .take(cfg.num_return)
                .map(|bm| Generated {
                    tokens: bm.tokens.clone(),
                    score: bm.score,
                    finished: bm.done,
                })
                .collect()
        })
        .collect();
    Ok(out)
}
