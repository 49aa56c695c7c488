//! Properties of decoder self-attention through a [`KvCache`]: prefill,
//! chunked prefill and token-by-token decoding all equal the full causal
//! pass, for every modern option (grouped-query heads, rotary embeddings in
//! both pairings, ALiBi, sliding windows, qk-norm); left padding, beam
//! reordering and truncation keep each row's result; the tiled kernel's
//! window and ALiBi equal the reference path.

use std::collections::HashMap;

use anyhow::Result;
use candle::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    scaled_dot_product_attention_via, Alibi, AttnMask, AttnPath, Causal, KvCache, Mask, MhaConfig,
    MhaOptions, MultiheadAttention, NormKind, PositionEncoding, RotaryConfig, RotaryStyle, WeightLayout,
};
use multihead_test_support::{
    compare::{assert_close, max_abs_diff},
    random::randn,
};

const E: usize = 32;
const H: usize = 4;

/// A module with random weights (biases too), built from plain tensors so
/// that the packed linears serve it as they serve a loaded checkpoint.
fn random_mha(cfg: &MhaConfig, layout: &WeightLayout) -> Result<MultiheadAttention> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    MultiheadAttention::new_with_layout(cfg, layout, vb)?;
    let mut tensors = HashMap::new();
    for (name, var) in varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
    {
        let t = var.as_tensor();
        let noise = Tensor::randn(0f32, 0.3, t.shape(), &Device::Cpu)?;
        tensors.insert(name.clone(), (t + noise)?.detach());
    }
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    Ok(MultiheadAttention::new_with_layout(cfg, layout, vb)?)
}

/// The configurations a decoder-only model uses, each with its layout.
fn decoder_configs() -> Vec<(&'static str, MhaConfig, WeightLayout)> {
    let base = MhaConfig::new(E, H);
    let rope = RotaryConfig::new(10_000.);
    vec![
        ("plain", base.clone(), WeightLayout::PyTorch),
        ("gpt2 conv1d", base.clone(), WeightLayout::gpt2()),
        (
            "llama gqa rope",
            base.clone()
                .with_bias(false)
                .with_kv_heads(2)
                .with_position(PositionEncoding::Rotary(RotaryConfig::new(500_000.))),
            WeightLayout::llama(),
        ),
        ("mqa fused", base.clone().with_kv_heads(1), WeightLayout::timm()),
        (
            "gpt-j interleaved partial rope",
            base.clone().with_position(PositionEncoding::Rotary(
                rope.clone().with_dims(4).with_style(RotaryStyle::Interleaved),
            )),
            WeightLayout::PyTorch,
        ),
        (
            "neox half-split partial rope",
            base.clone()
                .with_position(PositionEncoding::Rotary(rope.with_dims(6))),
            WeightLayout::PyTorch,
        ),
        (
            "alibi",
            base.clone().with_position(PositionEncoding::Alibi),
            WeightLayout::PyTorch,
        ),
        (
            "sliding window gqa",
            base.clone().with_kv_heads(2).with_sliding_window(3),
            WeightLayout::llama(),
        ),
        ("qk-norm", base.clone().with_qk_norm(true), WeightLayout::timm()),
        (
            "qwen3: wide heads, rms qk-norm, gqa, rope",
            qwen3_like(),
            WeightLayout::llama(),
        ),
        (
            "gemma2: soft-capped, query_pre_attn_scalar scale, gqa, rope, window",
            MhaConfig::new(E, H)
                .with_bias(false)
                .with_head_dim(16)
                .with_kv_heads(2)
                .with_position(PositionEncoding::Rotary(RotaryConfig::new(10_000.)))
                .with_sliding_window(4)
                .with_softcap(2.)
                .with_scale(1. / 24f64.sqrt()),
            WeightLayout::llama(),
        ),
    ]
}

/// Heads wider than `E / H` (q is 4 × 16 = 64 wide for E = 32) with an
/// RMSNorm on each head of q and k, as Qwen3 has.
fn qwen3_like() -> MhaConfig {
    let mut cfg = MhaConfig::new(E, H)
        .with_bias(false)
        .with_head_dim(16)
        .with_kv_heads(2)
        .with_qk_norm(true)
        .with_position(PositionEncoding::Rotary(RotaryConfig::new(1e6)));
    cfg.qk_norm_kind = NormKind::RmsNorm;
    cfg
}

fn causal() -> MhaOptions {
    MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft))
}

/// Runs `x` through a fresh cache in chunks of the given sizes.
fn cached(mha: &MultiheadAttention, x: &Tensor, chunks: &[usize]) -> Result<Tensor> {
    let mut cache = KvCache::new(4);
    let mut outs = Vec::new();
    let mut t0 = 0;
    for &n in chunks {
        outs.push(
            mha.forward_cached(&x.i((.., t0..t0 + n))?, &mut cache, &MhaOptions::new())?
                .output,
        );
        t0 += n;
    }
    assert_eq!(cache.len(), t0);
    Ok(Tensor::cat(&outs, 1)?)
}

#[test]
fn prefill_chunks_and_steps_equal_the_full_causal_pass() -> Result<()> {
    let x = randn(&[2, 9, E])?;
    for (name, cfg, layout) in decoder_configs() {
        let mha = random_mha(&cfg, &layout)?;
        let full = mha.forward_attn(&x, &x, &x, &causal())?.output;
        for chunks in [&[9][..], &[4, 3, 2], &[1; 9], &[2, 1, 6]] {
            let out = cached(&mha, &x, chunks)?;
            assert_close(&format!("{name}, chunks {chunks:?}"), &out, &full, 1e-5)?;
        }
    }
    Ok(())
}

#[test]
fn the_full_pass_is_causal_for_every_option() -> Result<()> {
    // Changing a later token changes no earlier output.
    let x = randn(&[1, 8, E])?;
    let later = Tensor::cat(&[x.i((.., ..5))?, randn(&[1, 3, E])?], 1)?;
    for (name, cfg, layout) in decoder_configs() {
        let mha = random_mha(&cfg, &layout)?;
        let a = mha.forward_attn(&x, &x, &x, &causal())?.output.i((.., ..5))?;
        let b = mha
            .forward_attn(&later, &later, &later, &causal())?
            .output
            .i((.., ..5))?;
        assert_eq!(max_abs_diff(&a, &b)?, 0., "{name}");
    }
    Ok(())
}

#[test]
fn the_sliding_window_hides_exactly_the_keys_outside_it() -> Result<()> {
    // Window 3: the output at position 6 depends on tokens 4, 5, 6 only.
    let cfg = MhaConfig::new(E, H).with_sliding_window(3);
    let mha = random_mha(&cfg, &WeightLayout::PyTorch)?;
    let x = randn(&[1, 7, E])?;
    let early = Tensor::cat(&[randn(&[1, 4, E])?, x.i((.., 4..))?], 1)?;
    let a = mha.forward_attn(&x, &x, &x, &causal())?.output.i((.., 6))?;
    let b = mha
        .forward_attn(&early, &early, &early, &causal())?
        .output
        .i((.., 6))?;
    assert_eq!(max_abs_diff(&a, &b)?, 0.);
    let c = mha.forward_attn(&x, &x, &x, &causal())?.output.i((.., 3))?;
    let d = mha
        .forward_attn(&early, &early, &early, &causal())?
        .output
        .i((.., 3))?;
    assert!(max_abs_diff(&c, &d)? > 1e-3, "position 3 sees the changed tokens");
    Ok(())
}

#[test]
fn left_padded_rows_equal_the_unpadded_row_alone() -> Result<()> {
    let x = randn(&[2, 8, E])?;
    for (name, cfg, layout) in decoder_configs() {
        let mha = random_mha(&cfg, &layout)?;
        // Row 1: 3 pad positions (garbage), then 5 real tokens.
        let mut cache = KvCache::with_left_padding(4, vec![0, 3]);
        let prefill = mha
            .forward_cached(&x.i((.., ..6))?, &mut cache, &MhaOptions::new())?
            .output;
        let step1 = mha
            .forward_cached(&x.i((.., 6..7))?, &mut cache, &MhaOptions::new())?
            .output;
        let step2 = mha
            .forward_cached(&x.i((.., 7..8))?, &mut cache, &MhaOptions::new())?
            .output;
        let padded = Tensor::cat(&[prefill, step1, step2], 1)?;
        let row1 = x.i((1..2, 3..))?;
        let alone = mha.forward_attn(&row1, &row1, &row1, &causal())?.output;
        assert_close(
            &format!("{name}: padded row"),
            &padded.i((1..2, 3..))?,
            &alone,
            1e-5,
        )?;
        let row0 = x.i(0..1)?;
        let full0 = mha.forward_attn(&row0, &row0, &row0, &causal())?.output;
        assert_close(&format!("{name}: unpadded row"), &padded.i(0..1)?, &full0, 1e-5)?;
    }
    Ok(())
}

#[test]
fn selecting_rows_and_truncating_keep_each_row() -> Result<()> {
    let cfg = MhaConfig::new(E, H)
        .with_kv_heads(2)
        .with_position(PositionEncoding::Rotary(RotaryConfig::new(10_000.)));
    let mha = random_mha(&cfg, &WeightLayout::llama())?;
    let x = randn(&[2, 6, E])?;
    let full = |row: usize| -> Result<Tensor> {
        let r = x.i(row..row + 1)?;
        Ok(mha.forward_attn(&r, &r, &r, &causal())?.output)
    };
    let mut cache = KvCache::new(2);
    mha.forward_cached(&x.i((.., ..5))?, &mut cache, &MhaOptions::new())?;
    // Beams: rows 1, 1, 0.
    cache.select_rows(&Tensor::new(&[1u32, 1, 0], &Device::Cpu)?)?;
    let next = Tensor::cat(&[x.i((1..2, 5..6))?, x.i((1..2, 5..6))?, x.i((0..1, 5..6))?], 0)?;
    let out = mha.forward_cached(&next, &mut cache, &MhaOptions::new())?.output;
    assert_close("beam 0", &out.i(0..1)?, &full(1)?.i((.., 5..6))?, 1e-5)?;
    assert_close("beam 1", &out.i(1..2)?, &full(1)?.i((.., 5..6))?, 1e-5)?;
    assert_close("beam 2", &out.i(2..3)?, &full(0)?.i((.., 5..6))?, 1e-5)?;
    // Rewind the last position and feed it again: the same outputs.
    cache.truncate(5);
    let again = mha.forward_cached(&next, &mut cache, &MhaOptions::new())?.output;
    assert_eq!(cache.len(), 6);
    assert_close("after truncate", &again, &out, 1e-6)?;
    assert!(cache.select_rows(&Tensor::new(&[3u32], &Device::Cpu)?).is_err());
    Ok(())
}

#[test]
fn the_cache_grows_in_chunks_without_losing_positions() -> Result<()> {
    let mha = random_mha(&MhaConfig::new(E, H), &WeightLayout::PyTorch)?;
    let x = randn(&[1, 40, E])?;
    let mut cache = KvCache::new(16);
    mha.forward_cached(&x.i((.., ..3))?, &mut cache, &MhaOptions::new())?;
    assert_eq!(cache.capacity(), 16);
    mha.forward_cached(&x.i((.., 3..20))?, &mut cache, &MhaOptions::new())?;
    assert_eq!(cache.capacity(), 32);
    let keys = cache.keys()?.ok_or_else(|| anyhow::anyhow!("empty"))?;
    let (k, _) = mha.project_kv(&x.i((.., ..20))?, &x.i((.., ..20))?)?;
    assert_close("held keys", &keys, &k, 1e-6)?;
    cache.reset();
    assert!(cache.is_empty());
    Ok(())
}

/// A cache told the most positions it will hold grows to them, not to
/// whole chunks, and past them grows as before, keeping what it holds.
#[test]
fn a_bounded_cache_grows_to_its_bound() -> Result<()> {
    let mha = random_mha(&MhaConfig::new(E, H), &WeightLayout::PyTorch)?;
    let x = randn(&[1, 40, E])?;
    let mut cache = KvCache::new(16);
    cache.expect_at_most(21);
    mha.forward_cached(&x.i((.., ..3))?, &mut cache, &MhaOptions::new())?;
    assert_eq!(cache.capacity(), 16);
    mha.forward_cached(&x.i((.., 3..21))?, &mut cache, &MhaOptions::new())?;
    assert_eq!(cache.capacity(), 21);
    mha.forward_cached(&x.i((.., 21..23))?, &mut cache, &MhaOptions::new())?;
    assert_eq!(cache.capacity(), 42);
    let keys = cache.keys()?.ok_or_else(|| anyhow::anyhow!("empty"))?;
    let (k, _) = mha.project_kv(&x.i((.., ..23))?, &x.i((.., ..23))?)?;
    assert_close("held keys", &keys, &k, 1e-6)?;
    Ok(())
}

#[test]
fn misuse_gets_a_clear_error() -> Result<()> {
    let mha = random_mha(&MhaConfig::new(E, H), &WeightLayout::PyTorch)?;
    let mut cache = KvCache::default();
    let x = randn(&[1, 3, E])?;
    // A causal rule in the options would fight the cache's offset.
    let err = mha
        .forward_cached(&x, &mut cache, &causal())
        .unwrap_err()
        .to_string();
    assert!(err.contains("causal rule comes from the cache"), "{err}");
    let err = mha
        .forward_cached(&randn(&[1, 3, E + 1])?, &mut cache, &MhaOptions::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected embed_dim"), "{err}");
    mha.forward_cached(&x, &mut cache, &MhaOptions::new())?;
    let err = mha
        .forward_cached(&randn(&[2, 1, E])?, &mut cache, &MhaOptions::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("KvCache::append"), "{err}");
    let bad = MhaConfig::new(E, H).with_kv_heads(3);
    let err = MultiheadAttention::new(&bad, VarBuilder::zeros(DType::F32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_kv_heads"), "{err}");
    // forward_projected names a wrong v instead of failing deep inside.
    let (k, _) = mha.project_kv(&x, &x)?;
    let v = randn(&[1, H, 3, E / H + 1])?;
    let err = mha
        .forward_projected(&x, &k, &v, &MhaOptions::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("v is [1, 4, 3, 9]"), "{err}");
    Ok(())
}

#[test]
fn kernel_window_and_alibi_equal_the_reference_path() -> Result<()> {
    // Long enough for several key tiles, so whole tiles are skipped.
    let (b, h, l, d) = (2, 4, 300, 16);
    let q = randn(&[b, h, l, d])?;
    let k = randn(&[b, 2, l, d])?;
    let v = randn(&[b, 2, l, d])?;
    let masks = [
        Mask::causal(Causal::TopLeft).with_window(37),
        Mask::causal(Causal::Offset(5)).with_window(1),
        Mask::causal(Causal::TopLeft).with_alibi(Alibi::new(h)),
        Mask::new().with_alibi(Alibi::new(h)),
        Mask::causal(Causal::BottomRight)
            .with_window(100)
            .with_alibi(Alibi::new(h))
            .with_attn(AttnMask::Additive(randn(&[l, l])?)),
    ];
    for (n, mask) in masks.iter().enumerate() {
        for (lq, offset) in [(l, 0), (1, l - 1), (7, l - 7)] {
            let qq = q.i((.., .., offset..offset + lq))?;
            let mask = match &mask.attn {
                Some(AttnMask::Additive(t)) => mask
                    .clone()
                    .with_attn(AttnMask::Additive(t.i(offset..offset + lq)?)),
                _ => mask.clone(),
            };
            let fast = scaled_dot_product_attention_via(&qq, &k, &v, &mask, None, AttnPath::CpuTiled)?;
            let reference = scaled_dot_product_attention_via(&qq, &k, &v, &mask, None, AttnPath::Reference)?;
            assert_close(&format!("mask {n}, q_len {lq}"), &fast, &reference, 1e-5)?;
        }
    }
    Ok(())
}

#[test]
fn alibi_slopes_follow_the_paper() {
    // 8 heads: 2^-1 .. 2^-8; 12 heads: the 8 of 8, then every other of 16.
    let s8 = Alibi::new(8);
    let expected: Vec<f32> = (1..=8).map(|k| 2f32.powi(-k)).collect();
    assert_eq!(s8.slopes(), expected.as_slice());
    let s12 = Alibi::new(12);
    let mut expected12 = expected.clone();
    expected12.extend([1, 3, 5, 7].map(|k| 2f32.powf(-0.5 * k as f32)));
    assert_eq!(s12.slopes().len(), 12);
    for (a, b) in s12.slopes().iter().zip(&expected12) {
        assert!((a - b).abs() < 1e-7, "{a} vs {b}");
    }
}

#[test]
fn sdpa_masks_broadcast_as_in_pytorch() -> Result<()> {
    let (b, h, l, s, d) = (2, 3, 4, 5, 8);
    let (q, k, v) = (
        randn(&[b, h, l, d])?,
        randn(&[b, h, s, d])?,
        randn(&[b, h, s, d])?,
    );
    let sdpa = |m: &Tensor| -> Result<Tensor> {
        let mask = Mask::new().with_attn(AttnMask::Additive(m.clone()));
        Ok(scaled_dot_product_attention_via(
            &q,
            &k,
            &v,
            &mask,
            None,
            AttnPath::Auto,
        )?)
    };
    // Each short shape against the same mask expanded by hand.
    for shape in [
        vec![l, 1],
        vec![1, s],
        vec![h, l, s],
        vec![1, l, s],
        vec![h, 1, s],
        vec![b, 1, l, 1],
    ] {
        let m = randn(&shape)?;
        let mut full_shape = vec![1; 4 - shape.len()];
        full_shape.extend(&shape);
        let full = m.reshape(full_shape)?.broadcast_as((b, h, l, s))?.contiguous()?;
        assert_close(&format!("mask {shape:?}"), &sdpa(&m)?, &sdpa(&full)?, 1e-6)?;
    }
    Ok(())
}

#[test]
fn projected_keys_go_into_candle_nn_kv_cache() -> Result<()> {
    // candle-nn's own cache copies in place and needs contiguous chunks.
    let mha = random_mha(&MhaConfig::new(E, H), &WeightLayout::PyTorch)?;
    let x = randn(&[1, 5, E])?;
    let mut cache = candle_nn::kv_cache::KvCache::new(2, 16);
    let (k, v) = mha.project_kv(&x.i((.., ..3))?, &x.i((.., ..3))?)?;
    cache.append(&k, &v)?;
    let (k, v) = mha.project_kv(&x.i((.., 3..))?, &x.i((.., 3..))?)?;
    let (k, v) = cache.append(&k, &v)?;
    let opts = MhaOptions::new().with_mask(Mask::causal(Causal::BottomRight));
    let out = mha.forward_projected(&x.i((.., 3..))?, &k, &v, &opts)?.output;
    let full = mha.forward_attn(&x, &x, &x, &causal())?.output;
    assert_close("candle-nn cache", &out, &full.i((.., 3..))?, 1e-5)?;
    Ok(())
}

/// A cache stored in bf16 or f16 beside the f32 module holds its keys and
/// values in that dtype; a prefill then steps through it (the steps read
/// it in place) give what the reference path gives over the same stored
/// keys and values, and stay within the rounding's reach of an f32 cache.
#[test]
fn a_half_precision_cache_equals_the_reference_path_over_it() -> Result<()> {
    let x = randn(&[2, 9, E])?;
    for (name, cfg, layout) in decoder_configs() {
        let mha = random_mha(&cfg, &layout)?;
        let f32_cache = cached(&mha, &x, &[4, 1, 1, 1, 1, 1])?;
        for dtype in [DType::BF16, DType::F16] {
            let run = |path: AttnPath| -> Result<(Tensor, KvCache)> {
                let mut cache = KvCache::new(4).with_dtype(dtype);
                let mut outs = Vec::new();
                for (t0, n) in [(0, 4), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1)] {
                    let opts = MhaOptions::new().with_path(path);
                    outs.push(
                        mha.forward_cached(&x.i((.., t0..t0 + n))?, &mut cache, &opts)?
                            .output,
                    );
                }
                Ok((Tensor::cat(&outs, 1)?, cache))
            };
            let (kernel, cache) = run(AttnPath::Auto)?;
            let (reference, _) = run(AttnPath::Reference)?;
            let what = format!("{name}, {dtype:?} cache");
            assert_eq!(cache.keys()?.map(|k| k.dtype()), Some(dtype), "{what}");
            assert_eq!(kernel.dtype(), DType::F32, "{what}");
            assert_close(
                &format!("{what}: kernel against reference"),
                &kernel,
                &reference,
                1e-5,
            )?;
            let rounding = if dtype == DType::BF16 { 3e-2 } else { 5e-3 };
            assert_close(
                &format!("{what}: against an f32 cache"),
                &kernel,
                &f32_cache,
                rounding,
            )?;
        }
    }
    Ok(())
}
