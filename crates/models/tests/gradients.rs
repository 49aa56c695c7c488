//! Training through attention: every parameter of every public module of
//! both crates (the attention modules, the ViT with softmax and Hydra
//! blocks, `nn.Transformer`'s stacks and the `Seq2Seq` model around them)
//! gets a non-zero gradient, a short training run of the encoder–decoder
//! lowers its loss, a model built over a `VarMap` answers each training
//! step as one built anew from the trained weights (packed) does, every
//! model's gradients agree with finite differences of its loss, and
//! dropout acts only in training, generic callers included.

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    HydraAttention, HydraConfig, Mask, MhaConfig, MhaOptions, MultiheadAttention, SeparateNames, WeightLayout,
};
use multihead_models::transformer::{
    Activation, Seq2Seq, Seq2SeqConfig, Transformer, TransformerConfig, TransformerMasks,
};
use multihead_models::vit::{VisionTransformer, VitConfig};
use multihead_test_support::{
    compare::{assert_close, max_abs_diff},
    weights::plain_copy,
};

/// Backpropagates `loss` and checks that every variable of `varmap` has a
/// gradient with a non-zero entry, naming the first that has none.
fn assert_all_grads(what: &str, varmap: &VarMap, loss: &Tensor) -> Result<()> {
    let grads = loss.backward()?;
    let vars: Vec<(String, Var)> = {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned VarMap lock"))?;
        data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    if vars.is_empty() {
        bail!("{what}: no variables")
    }
    for (name, var) in vars {
        let g = grads
            .get(var.as_tensor())
            .with_context(|| format!("{what}: no gradient for '{name}'"))?;
        let max = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        if !(max > 0. && max.is_finite()) {
            bail!("{what}: gradient of '{name}' has max |g| = {max}")
        }
    }
    Ok(())
}

/// A loss that weighs every output element differently, so no symmetry
/// (such as a softmax's invariance to a shift) hides a gradient.
fn weighted_sum(out: &Tensor) -> Result<Tensor> {
    let w = Tensor::randn(0f32, 1., out.shape(), out.device())?;
    Ok((out * w)?.sum_all()?)
}

#[test]
fn every_attention_parameter_gets_a_gradient() -> Result<()> {
    let dev = Device::Cpu;
    let cases = [
        (
            "pytorch layout, bias_kv, zero_attn",
            MhaConfig::new(16, 4).with_bias_kv(true).with_zero_attn(true),
            WeightLayout::PyTorch,
        ),
        (
            "timm layout, qk_norm",
            MhaConfig::new(16, 4).with_qk_norm(true),
            WeightLayout::timm(),
        ),
        (
            "separate, kdim/vdim",
            MhaConfig::new(16, 2).with_kv_dims(6, 10),
            WeightLayout::Separate(SeparateNames::default()),
        ),
        (
            "pytorch layout, kdim/vdim",
            MhaConfig::new(16, 2).with_kv_dims(6, 10),
            WeightLayout::PyTorch,
        ),
    ];
    for (what, cfg, layout) in cases {
        let varmap = VarMap::new();
        let mha = MultiheadAttention::new_with_layout(
            &cfg,
            &layout,
            VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        )?;
        let q = Tensor::randn(0f32, 1., (2, 5, 16), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 7, cfg.kdim()), &dev)?;
        let v = Tensor::randn(0f32, 1., (2, 7, cfg.vdim()), &dev)?;
        let out = if cfg.qkv_same_embed_dim() {
            mha.forward_attn(&q, &q, &q, &MhaOptions::new().with_train(true))?
        } else {
            mha.forward_attn(&q, &k, &v, &MhaOptions::new().with_train(true))?
        };
        assert_all_grads(what, &varmap, &weighted_sum(&out.output)?)?;
    }

    let varmap = VarMap::new();
    let hydra = HydraAttention::new(
        &HydraConfig::new(16),
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 9, 16), &dev)?;
    let out = hydra.forward_masked(&x, &Mask::causal(multihead_attention::Causal::TopLeft))?;
    assert_all_grads("hydra", &varmap, &weighted_sum(&out)?)?;
    Ok(())
}

#[test]
fn gradient_reaches_the_input_through_the_fast_path_dispatcher() -> Result<()> {
    // Long enough for the tiled kernel; a Var input makes Auto pick the
    // differentiable path.
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(32, 4),
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev),
    )?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (1, 300, 32), &dev)?)?;
    let loss = weighted_sum(&mha.forward_t(x.as_tensor(), true)?)?;
    let grads = loss.backward()?;
    let g = grads.get(x.as_tensor()).context("no gradient for the input")?;
    assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.);
    Ok(())
}

#[test]
fn dropout_only_in_training() -> Result<()> {
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(16, 4).with_dropout(0.5),
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 6, 16), &dev)?;
    let eval_a: Vec<f32> = mha.forward_t(&x, false)?.flatten_all()?.to_vec1()?;
    let eval_b: Vec<f32> = mha.forward_t(&x, false)?.flatten_all()?.to_vec1()?;
    assert_eq!(eval_a, eval_b, "eval must be deterministic");
    let train: Vec<f32> = mha.forward_t(&x, true)?.flatten_all()?.to_vec1()?;
    assert_ne!(eval_a, train, "dropout 0.5 must change the training output");
    Ok(())
}

/// A small one-channel ViT with LayerScale: `VitConfig::new`'s arguments
/// and the number of classes.
fn small_vit(img: usize, dim: usize, depth: usize, heads: usize, classes: usize) -> VitConfig {
    VitConfig {
        img_size: img,
        patch_size: 4,
        embed_dim: dim,
        depth,
        num_heads: heads,
        in_chans: 1,
        num_classes: classes,
        image_mean: vec![0.5],
        image_std: vec![0.5],
        init_values: Some(0.1),
        ..VitConfig::default()
    }
}

#[test]
fn every_vit_parameter_gets_a_gradient_with_softmax_and_hydra_blocks() -> Result<()> {
    let dev = Device::Cpu;
    let mut cfg = small_vit(8, 16, 3, 2, 3);
    cfg.hydra_layers = vec![1, 2];
    let varmap = VarMap::new();
    let vit = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let images = Tensor::randn(0f32, 1., (4, 1, 8, 8), &dev)?;
    let labels = Tensor::new(&[0u32, 1, 2, 1], &dev)?;
    let logits = candle::Module::forward(&vit, &images)?;
    let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
    assert_all_grads("vit", &varmap, &loss)?;
    Ok(())
}

/// Inference on a model whose weights are a `VarMap`'s variables, between
/// training steps: after each AdamW step its outputs on plain inputs move,
/// and equal those of the same model built anew from plain copies of the
/// trained weights, which packs them (and folds the LayerScale into
/// them): no packed copy of an earlier step is ever read. (Checked
/// against a build whose layers packed their variables for plain inputs
/// and trained them through the differentiable path: it fails here at
/// the first step, the patch embedding, whose input is plain, answering
/// from the stale copy.)
#[test]
fn a_model_over_a_varmap_answers_each_training_step_as_one_built_from_its_weights() -> Result<()> {
    use candle::Module;
    use candle_nn::Optimizer;
    let dev = Device::Cpu;
    let cfg = small_vit(16, 64, 2, 4, 5);
    let varmap = VarMap::new();
    let vit = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let images = Tensor::randn(0f32, 1., (24, 1, 16, 16), &dev)?;
    let labels = Tensor::from_vec((0..24u32).map(|i| i % 5).collect(), 24, &dev)?;
    let mut opt = adamw(&varmap)?;
    // Training reads the images through a variable, so that every layer,
    // the patch embedding (whose input is otherwise plain) included, takes
    // the differentiable path and trains; inference reads plain images.
    let tracked = Var::from_tensor(&images)?;
    let mut before = vit.forward(&images)?;
    for step in 0..3 {
        let logits = vit.forward(tracked.as_tensor())?;
        opt.backward_step(&candle_nn::loss::cross_entropy(&logits, &labels)?)?;
        let after = vit.forward(&images)?;
        let rebuilt = VisionTransformer::new(&cfg, plain_copy(&varmap)?)?.forward(&images)?;
        let moved = max_abs_diff(&after, &before)?;
        assert!(moved > 1e-3, "step {step}: the outputs moved by {moved} only");
        assert_close(
            &format!("step {step}, against the model built from the trained weights"),
            &after,
            &rebuilt,
            1e-5,
        )?;
        before = after;
    }
    Ok(())
}

/// AdamW over every variable of `varmap`, learning rate 1e-2.
fn adamw(varmap: &VarMap) -> Result<candle_nn::AdamW> {
    let params = candle_nn::ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    Ok(candle_nn::Optimizer::new(varmap.all_vars(), params)?)
}

/// A small `nn.Transformer` config, batch-first.
fn small_transformer(norm_first: bool, bias: bool) -> TransformerConfig {
    let mut cfg = TransformerConfig::new(16, 2)
        .with_layers(2, 2)
        .with_dim_feedforward(24)
        .with_batch_first(true)
        .with_norm_first(norm_first);
    cfg.bias = bias;
    if norm_first {
        cfg = cfg.with_activation(Activation::Gelu);
    }
    cfg
}

#[test]
fn every_transformer_parameter_gets_a_gradient() -> Result<()> {
    // The layers used candle-nn's fused LayerNorm, which has no backward:
    // no variable got a gradient, without an error.
    let dev = Device::Cpu;
    for (norm_first, bias) in [(false, true), (true, false)] {
        let what = format!("transformer norm_first={norm_first} bias={bias}");
        let varmap = VarMap::new();
        let cfg = small_transformer(norm_first, bias);
        let model = Transformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
        let src = Tensor::randn(0f32, 1., (2, 7, 16), &dev)?;
        let tgt = Tensor::randn(0f32, 1., (2, 5, 16), &dev)?;
        let padding = multihead_attention::KeyPaddingMask::from_lengths(&[7, 4], 7, &dev)?;
        let masks = TransformerMasks {
            src: Mask::new().with_key_padding(padding.clone()),
            tgt: Mask::causal(multihead_attention::Causal::TopLeft),
            memory: Mask::new().with_key_padding(padding),
        };
        let out = model.forward(&src, &tgt, &masks)?;
        assert_all_grads(&what, &varmap, &weighted_sum(&out)?)?;
    }
    Ok(())
}

/// A small `Seq2Seq`: vocabularies of 12 (0 pad, 1 bos, 2 eos).
fn small_seq2seq(varmap: &VarMap) -> Result<Seq2Seq> {
    let cfg = Seq2SeqConfig {
        transformer: small_transformer(false, true).with_layers(1, 1),
        src_vocab_size: 12,
        tgt_vocab_size: 12,
        max_positions: 16,
        max_src_len: 8,
        max_tgt_len: 9,
        pad_id: 0,
        bos_id: 1,
        eos_id: 2,
        scale_embeddings: true,
    };
    Ok(Seq2Seq::new(
        &cfg,
        VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu),
    )?)
}

/// Reversal of random sequences of tokens 3..12: sources `(n, 6)`,
/// decoder inputs (bos + reversed) and targets (reversed + eos), `(n, 7)`.
fn reversal_batch(n: usize, seed: u64) -> Result<(Tensor, Tensor, Tensor)> {
    let mut state = seed;
    let mut next = || {
        // xorshift64: a fixed, dependency-free stream of tokens.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        3 + (state % 9) as u32
    };
    let (mut src, mut dec_in, mut dec_out) = (Vec::<u32>::new(), Vec::<u32>::new(), Vec::<u32>::new());
    for _ in 0..n {
        let seq: Vec<u32> = (0..6).map(|_| next()).collect();
        let rev: Vec<u32> = seq.iter().rev().copied().collect();
        src.extend(&seq);
        dec_in.push(1);
        dec_in.extend(&rev);
        dec_out.extend(&rev);
        dec_out.push(2);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(src, (n, 6), &dev)?,
        Tensor::from_vec(dec_in, (n, 7), &dev)?,
        Tensor::from_vec(dec_out, (n, 7), &dev)?,
    ))
}

#[test]
fn every_seq2seq_parameter_gets_a_gradient_and_training_lowers_the_loss() -> Result<()> {
    use candle_nn::Optimizer;
    let varmap = VarMap::new();
    let model = small_seq2seq(&varmap)?;
    let loss_of = |batch: &(Tensor, Tensor, Tensor)| -> Result<Tensor> {
        let (src, dec_in, dec_out) = batch;
        let logits = model.decode_full(dec_in, &model.encode(src)?)?;
        Ok(candle_nn::loss::cross_entropy(
            &logits.flatten_to(1)?,
            &dec_out.flatten_all()?,
        )?)
    };
    let held_out = reversal_batch(64, 7)?;
    assert_all_grads("seq2seq", &varmap, &loss_of(&held_out)?)?;
    let before = loss_of(&held_out)?.to_scalar::<f32>()?;
    let mut opt = adamw(&varmap)?;
    for step in 0..120 {
        opt.backward_step(&loss_of(&reversal_batch(32, 100 + step)?)?)?;
    }
    let after = loss_of(&held_out)?.to_scalar::<f32>()?;
    // The untrained model starts near 3.1-3.3 and 120 steps bring it to
    // 1.3-1.6 (three runs); with the fused LayerNorm (no backward) nothing
    // trained and the loss stayed where it was.
    assert!(
        after < 0.75 * before,
        "held-out loss {before} -> {after} after 120 AdamW steps"
    );
    Ok(())
}

#[test]
fn a_generic_modulet_caller_gets_attention_dropout() -> Result<()> {
    use candle_nn::ModuleT;
    /// What a generic candle trainer does.
    fn run<M: ModuleT>(m: &M, x: &Tensor, train: bool) -> candle::Result<Tensor> {
        m.forward_t(x, train)
    }
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(16, 4).with_dropout(0.5),
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 6, 16), &dev)?;
    let eval: Vec<f32> = run(&mha, &x, false)?.flatten_all()?.to_vec1()?;
    assert_eq!(eval, mha.forward(&x)?.flatten_all()?.to_vec1::<f32>()?);
    let train: Vec<f32> = run(&mha, &x, true)?.flatten_all()?.to_vec1()?;
    assert_ne!(eval, train, "ModuleT::forward_t(x, true) must apply dropout");
    Ok(())
}

/// Each decoder family over a `VarMap` trains in f32 through the CPU's
/// fused ops — the attention's fused backward (into its packed projection
/// where it can), the trained rotation, the norms, the gated and plain
/// activations, the packed linears, soft-capping — and every parameter's
/// gradient agrees with central finite differences of its loss (two
/// coordinates each), an oracle that shares no code with any backward:
/// a Llama (grouped-query heads, rotary, the gated MLP kept apart as
/// variables are, RMSNorm), Qwen3 (per-head qk-norms, tied embeddings),
/// Phi-3 (one `gate_up_proj`, partial rotary), GPT-2 (LayerNorm, biases, learned positions,
/// tanh GELU), Gemma 2 (GeGLU, sandwich norms, soft-capped attention
/// and logits, alternating sliding windows) and Gemma 3 (qk-norms, two
/// rotary bases).
#[test]
fn decoders_train_through_the_fused_ops_as_their_loss_moves() -> Result<()> {
    use multihead_models::decoder::{CausalLm, Gemma, Gpt2, HfDecoderConfig, Llama};

    let configs = [
        r#"{"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
        r#"{"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": true}"#,
        r#"{"model_type": "phi3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}"#,
        r#"{"model_type": "gpt2", "vocab_size": 50, "n_embd": 32, "n_layer": 2, "n_head": 4,
            "n_positions": 32}"#,
        r#"{"model_type": "gemma2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4}"#,
        r#"{"model_type": "gemma3_text", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": 8, "sliding_window": 4, "sliding_window_pattern": 2}"#,
    ];
    for text in configs {
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let (model, layers): (Box<dyn CausalLm>, usize) =
            match HfDecoderConfig::from_json(text, "test config")? {
                HfDecoderConfig::Llama(cfg) => (Box::new(Llama::new(&cfg, vb)?), cfg.num_hidden_layers),
                HfDecoderConfig::Gpt2(cfg) => (Box::new(Gpt2::new(&cfg, vb, None)?), cfg.n_layer),
                HfDecoderConfig::Gemma(cfg) => (Box::new(Gemma::new(&cfg, vb)?), cfg.num_hidden_layers),
            };
        decoder_agrees(model.as_ref(), layers, &varmap).with_context(|| format!("config {text}"))?;
    }
    Ok(())
}

/// `Σ logits ∘ g` (a fixed `g`) of `model` over two sequences of 11
/// tokens, with `varmap` given the values [`set_test_values`] gives, its
/// gradients against finite differences ([`finite_differences_agree`]).
fn decoder_agrees(
    model: &dyn multihead_models::decoder::CausalLm,
    layers: usize,
    varmap: &VarMap,
) -> Result<()> {
    use multihead_models::decoder::DecoderCache;

    let dev = Device::Cpu;
    set_test_values(varmap, 2 * layers + 2)?;
    let ids = Tensor::from_vec((0..2 * 11u32).map(|i| (i * 7 + 3) % 50).collect(), (2, 11), &dev)?;
    let g = Tensor::from_vec(pattern(2 * 11 * 50, 999), (2, 11, 50), &dev)?;
    finite_differences_agree(varmap, || {
        let logits = model.forward(&ids, &mut DecoderCache::new(layers, vec![0, 0]))?;
        Ok((logits * &g)?.sum_all()?)
    })
}

/// A smooth pseudo-random pattern of `n` values in [-1, 1], one per `seed`:
/// deterministic, so that a test passes or fails every time.
fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) as f32 * 0.618_034).sin())
        .collect()
}

/// Every variable of `varmap` (at least `least` of them) set from
/// [`pattern`] (the builders' zeros and ones would leave most gradients
/// 0): norms near 1, the rest large enough that attention is far from
/// uniform, small enough that a loss stays smooth over the differences'
/// steps.
fn set_test_values(varmap: &VarMap, least: usize) -> Result<()> {
    let vars = sorted_vars(varmap)?;
    assert!(vars.len() >= least, "{} variables", vars.len());
    for (j, (name, var)) in vars.iter().enumerate() {
        let t = var.as_tensor();
        let noise = Tensor::from_vec(pattern(t.elem_count(), j), t.shape(), t.device())?;
        let value = match name.contains("norm") {
            true => (noise * 0.1)? + 1.,
            false => noise * 0.2,
        }?;
        var.set(&value)?;
    }
    Ok(())
}

/// `varmap`'s variables by name.
fn sorted_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let mut vars: Vec<_> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone()
        .into_iter()
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(vars)
}

/// The gradient of the scalar `loss()` with respect to each variable of
/// `varmap` against central finite differences of it, at two coordinates
/// of each (the largest gradient's and one in the middle).
fn finite_differences_agree(varmap: &VarMap, loss: impl Fn() -> Result<Tensor>) -> Result<()> {
    let dev = Device::Cpu;
    let vars = sorted_vars(varmap)?;
    let grads = loss()?.backward()?;
    let eps = 4e-3f32;
    for (name, var) in vars {
        let grad = grads
            .get(var.as_tensor())
            .with_context(|| format!("no gradient for {name}"))?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let values = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        // The coordinate of the largest gradient and one in the middle.
        let top = (0..grad.len())
            .max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs()))
            .unwrap_or(0);
        for at in [top, grad.len() / 2] {
            let moved = |delta: f32| -> Result<f32> {
                let mut v = values.clone();
                v[at] += delta;
                var.set(&Tensor::from_vec(v, var.as_tensor().shape(), &dev)?)?;
                Ok(loss()?.to_scalar::<f32>()?)
            };
            // Central differences at h and h/2, extrapolated (Richardson):
            // the error falls from O(h²) to O(h⁴).
            let central = |h: f32| -> Result<f32> { Ok((moved(h)? - moved(-h)?) / (2. * h)) };
            let (wide, narrow) = (central(eps)?, central(eps / 2.)?);
            let numeric = (4. * narrow - wide) / 3.;
            var.set(&Tensor::from_vec(values.clone(), var.as_tensor().shape(), &dev)?)?;
            let err = (numeric - grad[at]).abs();
            assert!(
                err <= 5e-3 * grad[at].abs().max(numeric.abs()) + 2e-2,
                "d{name}[{at}]: autograd {} vs finite differences {numeric}",
                grad[at]
            );
        }
    }
    Ok(())
}

/// The ViT (LayerScale, class token, learned positions, exact GELU; with
/// a Hydra block and without) and
/// `nn.Transformer` (post-norm with ReLU and pre-norm with GELU, causal
/// target mask, cross-attention) over a `VarMap` train through the CPU's
/// fused ops with gradients that agree with finite differences of their
/// loss, as the decoders' do.
#[test]
fn vit_and_transformer_train_through_the_fused_ops_as_their_loss_moves() -> Result<()> {
    use candle::Module;

    let dev = Device::Cpu;
    // Softmax blocks alone, and a Hydra block between two.
    for hydra_layers in [vec![], vec![1]] {
        let varmap = VarMap::new();
        let mut cfg = small_vit(8, 16, 3, 2, 3);
        cfg.hydra_layers = hydra_layers.clone();
        let vit = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
        set_test_values(&varmap, 2 * 8)?;
        let images = Tensor::from_vec(pattern(2 * 64, 7), (2, 1, 8, 8), &dev)?;
        let g = Tensor::from_vec(pattern(2 * 3, 8), (2, 3), &dev)?;
        finite_differences_agree(&varmap, || Ok((vit.forward(&images)? * &g)?.sum_all()?))
            .with_context(|| format!("ViT, Hydra blocks {hydra_layers:?}"))?;
    }

    for norm_first in [false, true] {
        let varmap = VarMap::new();
        let cfg = small_transformer(norm_first, true);
        let model = Transformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
        set_test_values(&varmap, 2 * 8)?;
        let src = Tensor::from_vec(pattern(2 * 5 * 16, 11), (2, 5, 16), &dev)?;
        let tgt = Tensor::from_vec(pattern(2 * 4 * 16, 12), (2, 4, 16), &dev)?;
        let g = Tensor::from_vec(pattern(2 * 4 * 16, 13), (2, 4, 16), &dev)?;
        let masks = TransformerMasks {
            tgt: Mask::causal(multihead_attention::Causal::TopLeft),
            ..Default::default()
        };
        finite_differences_agree(&varmap, || {
            Ok((model.forward(&src, &tgt, &masks)? * &g)?.sum_all()?)
        })
        .with_context(|| format!("nn.Transformer, norm_first {norm_first}"))?;
    }
    Ok(())
}
