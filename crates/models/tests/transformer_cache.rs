//! Properties of incremental decoding: the cached decoder equals the full
//! causal pass at every step (batch > 1, padded sources), and the searches
//! built on it agree with each other.

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{Causal, KeyPaddingMask, Mask};
use multihead_models::transformer::{
    Activation, CacheMode, Seq2Seq, Seq2SeqConfig, Transformer, TransformerConfig,
};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, Fixture},
    tokens::padded,
};

/// Cached and full passes do the same arithmetic in a different grouping
/// (separate k/v projections instead of one fused matmul).
const RTOL: f64 = 1e-5;

/// Decoder output of every target position, from the full causal pass and
/// from the cache fed `chunks` positions at a time.
fn check_decoder_cache(fixture: &str, chunks: &[usize]) -> Result<()> {
    let dev = Device::Cpu;
    let fx = Fixture::load(
        &fixture_dir("transformer").join(format!("{fixture}.safetensors")),
        &dev,
    )?;
    let cfg: TransformerConfig = serde_json::from_value(fx.case["config"].clone())?;
    let vb = VarBuilder::from_tensors(fx.tensors.clone(), DType::F32, &dev);
    let model = Transformer::new(&cfg, vb.pp("model"))?;
    let kp = KeyPaddingMask::PadWhereTrue(fx.get("memory_key_padding_mask")?.clone());
    let memory_mask = Mask::new().with_key_padding(kp.clone());
    let src_mask = Mask::new().with_key_padding(kp.clone());
    let (src, tgt) = (fx.get("src")?, fx.get("tgt")?);
    let seq_dim = if cfg.batch_first { 1 } else { 0 };
    let memory = model.encoder().forward(src, &src_mask)?;
    let full = model
        .decoder()
        .forward(tgt, &memory, &Mask::causal(Causal::TopLeft), &memory_mask)?;
    let mut cache = model.decoder().start(&memory, Some(kp))?;
    let mut pos = 0;
    for &n in chunks {
        let out = model.decoder().step(&tgt.narrow(seq_dim, pos, n)?, &mut cache)?;
        let what = format!("{fixture}: positions {pos}..{}", pos + n);
        assert_close(&what, &out, &full.narrow(seq_dim, pos, n)?, RTOL)?;
        pos += n;
        assert_eq!(cache.len(), pos);
    }
    assert_eq!(pos, tgt.dim(seq_dim)?, "chunks must cover the target");
    Ok(())
}

#[test]
fn cached_decoder_equals_full_pass_post_norm() -> Result<()> {
    check_decoder_cache("post_norm_padded", &[1, 1, 1, 1, 1])
}

#[test]
fn cached_decoder_equals_full_pass_pre_norm() -> Result<()> {
    check_decoder_cache("pre_norm_padded", &[1, 1, 1, 1, 1])
}

#[test]
fn cached_decoder_equals_full_pass_seq_first_with_prefill() -> Result<()> {
    check_decoder_cache("post_norm_seq_first", &[2, 1, 2])?;
    check_decoder_cache("pre_norm_seq_first", &[3, 1, 1])
}

/// A tiny random model and a batch of right-padded sources.
fn tiny_model(norm_first: bool, dev: &Device) -> Result<(Seq2Seq, Tensor, Vec<Vec<u32>>)> {
    let transformer = TransformerConfig::new(16, 4)
        .with_layers(2, 2)
        .with_dim_feedforward(32)
        .with_activation(Activation::Gelu)
        .with_batch_first(true)
        .with_norm_first(norm_first);
    let cfg = Seq2SeqConfig {
        transformer,
        src_vocab_size: 11,
        tgt_vocab_size: 9,
        max_positions: 32,
        max_src_len: 8,
        max_tgt_len: 7,
        pad_id: 0,
        bos_id: 1,
        eos_id: 2,
        scale_embeddings: true,
    };
    let varmap = VarMap::new();
    let model = Seq2Seq::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    let rows: Vec<Vec<u32>> = vec![vec![3, 4, 5, 6, 7, 8, 9, 10], vec![5, 3, 3], vec![10, 9, 8, 7, 6]];
    Ok((model, padded(&rows, dev)?, rows))
}

#[test]
fn cached_logits_equal_full_pass_at_every_step() -> Result<()> {
    let dev = Device::Cpu;
    for norm_first in [false, true] {
        let (model, src, _) = tiny_model(norm_first, &dev)?;
        let enc = model.encode(&src)?;
        // Any target works: teacher forcing with a fixed prefix.
        let tgt = Tensor::new(
            &[[1u32, 3, 4, 5, 6, 7], [1, 8, 8, 2, 0, 0], [1, 5, 4, 3, 6, 8]],
            &dev,
        )?;
        let full = model.decode_full(&tgt, &enc)?;
        let mut cache = model.start(&enc)?;
        for t in 0..tgt.dim(1)? {
            let step = model.step(&tgt.narrow(1, t, 1)?, &mut cache)?;
            assert_close(
                &format!("norm_first={norm_first}, step {t}"),
                &step,
                &full.narrow(1, t, 1)?,
                RTOL,
            )?;
        }
    }
    Ok(())
}

#[test]
fn greedy_with_and_without_cache_agree_and_ignore_padding() -> Result<()> {
    let dev = Device::Cpu;
    for norm_first in [false, true] {
        let (model, src, rows) = tiny_model(norm_first, &dev)?;
        let cached = model.greedy(&src, CacheMode::Use)?;
        let recomputed = model.greedy(&src, CacheMode::Recompute)?;
        assert_eq!(cached, recomputed);
        // Padding changes nothing: each source alone, unpadded.
        for (row, expected) in rows.iter().zip(&cached) {
            let one = Tensor::new(row.as_slice(), &dev)?.unsqueeze(0)?;
            assert_eq!(&model.greedy(&one, CacheMode::Use)?[0], expected);
        }
        // Beam search with one beam is greedy search.
        let beam1: Vec<Vec<u32>> = model
            .beam_search(&src, 1)?
            .into_iter()
            .map(|h| h.tokens)
            .collect();
        assert_eq!(beam1, cached);
        // A wider beam returns one hypothesis per source.
        let beam3 = model.beam_search(&src, 3)?;
        assert_eq!(beam3.len(), rows.len());
        // The attention map has one row per token and sums to one per row.
        let one = Tensor::new(rows[1].as_slice(), &dev)?.unsqueeze(0)?;
        let att = model.greedy_with_attention(&one)?;
        assert_eq!(att.tokens, cached[1]);
        assert_eq!(att.attention.dims(), &[att.tokens.len(), rows[1].len()]);
        for s in att.attention.sum(1)?.to_vec1::<f32>()? {
            assert!((s - 1.).abs() < 1e-5, "attention row sums to {s}");
        }
    }
    Ok(())
}
