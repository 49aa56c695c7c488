//! Embedding `MultiheadAttention` in a small candle model built from a
//! `VarMap`, and training it with AdamW.
//!
//! The task needs attention: a sequence of 8 tokens from a vocabulary of 6
//! is labelled 1 when its first token appears again later in the sequence.
//! Position 0 has to look at every other position and compare tokens, which
//! an MLP over position 0 alone cannot do.
//!
//! ```text
//! cargo run --release --example embed_in_a_model
//! ```

use anyhow::{Context, Result};
use candle::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{embedding, linear, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use multihead::attention::{MhaConfig, MultiheadAttention};
use multihead::kernels::optim::AdamW;

const VOCAB: usize = 6;
const SEQ: usize = 8;
const DIM: usize = 32;

/// Token and position embeddings, one self-attention layer, a classifier
/// on position 0.
struct RepeatDetector {
    tokens: Embedding,
    positions: Tensor,
    attn: MultiheadAttention,
    head: Linear,
}

impl RepeatDetector {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            tokens: embedding(VOCAB, DIM, vb.pp("tokens"))?,
            positions: vb.get_with_hints((SEQ, DIM), "positions", candle_nn::init::DEFAULT_KAIMING_NORMAL)?,
            attn: MultiheadAttention::new(&MhaConfig::new(DIM, 4), vb.pp("attn"))?,
            head: linear(DIM, 2, vb.pp("head"))?,
        })
    }

    /// `(batch, SEQ)` token ids → `(batch, 2)` logits.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        // (B, SEQ, DIM)
        let x = self.tokens.forward(ids)?.broadcast_add(&self.positions)?;
        let x = (&x + self.attn.forward(&x)?)?;
        // (B, DIM) -> (B, 2)
        Ok(self.head.forward(&x.i((.., 0))?)?)
    }
}

/// A batch of sequences and labels; half the labels are 1.
fn batch(n: usize, rng: &mut u64, dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut next = |m: usize| {
        // xorshift64: the example needs no rand dependency.
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        (*rng % m as u64) as u32
    };
    let (mut ids, mut labels) = (Vec::with_capacity(n * SEQ), Vec::with_capacity(n));
    for i in 0..n {
        let first = next(VOCAB);
        let want_repeat = i % 2 == 0;
        let mut seq = vec![first];
        while seq.len() < SEQ {
            let t = next(VOCAB);
            if want_repeat || t != first {
                seq.push(t);
            }
        }
        if want_repeat && !seq[1..].contains(&first) {
            let pos = 1 + next(SEQ - 1) as usize;
            seq[pos] = first;
        }
        labels.push(u32::from(seq[1..].contains(&first)));
        ids.extend(seq);
    }
    Ok((
        Tensor::from_vec(ids, (n, SEQ), dev)?,
        Tensor::from_vec(labels, n, dev)?,
    ))
}

fn accuracy(logits: &Tensor, labels: &Tensor) -> Result<f32> {
    let hits = logits.argmax(D::Minus1)?.eq(labels)?.to_dtype(DType::F32)?;
    Ok(hits.mean_all()?.to_scalar::<f32>()?)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = RepeatDetector::new(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let params = ParamsAdamW {
        lr: 3e-3,
        ..Default::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let mut rng = 0x9E37_79B9_7F4A_7C15;
    let (test_ids, test_labels) = batch(1000, &mut rng, &dev)?;
    let before = accuracy(&model.forward(&test_ids)?, &test_labels)?;
    for step in 1..=400 {
        let (ids, labels) = batch(64, &mut rng, &dev)?;
        let loss = candle_nn::loss::cross_entropy(&model.forward(&ids)?, &labels)?;
        opt.backward_step(&loss)?;
        if step % 100 == 0 {
            let acc = accuracy(&model.forward(&test_ids)?, &test_labels)?;
            println!(
                "step {step:3}  loss {:.4}  held-out accuracy {:.1} %",
                loss.to_scalar::<f32>()?,
                100. * acc
            );
        }
    }
    let after = accuracy(&model.forward(&test_ids)?, &test_labels).context("evaluating")?;
    println!(
        "held-out accuracy: {:.1} % before training, {:.1} % after",
        100. * before,
        100. * after
    );
    Ok(())
}
