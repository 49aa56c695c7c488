//! Logit soft-capping (`Mask::softcap`, `MhaConfig::softcap`): HF
//! transformers' Gemma 2 attention (fixture written by
//! `scripts/make_softcap_fixtures.py`: `eager_attention_forward` and its
//! gradients from `torch.autograd`), and the tiled CPU kernel equal to the
//! reference path on every instruction set the processor runs.

use anyhow::{Context, Result};
use candle::{Device, IndexOp, Tensor, Var};
use multihead_attention::{
    scaled_dot_product_attention_tiled_on, scaled_dot_product_attention_via, AttnMask, AttnPath, Causal,
    KeyPaddingMask, Mask, MhaConfig, MhaOptions, MultiheadAttention,
};
use multihead_kernels::isa::supported;
use multihead_test_support::{
    compare::assert_close,
    errors::assert_err,
    fixtures::{fixture_dir, Fixture},
    random::randn,
    weights::plain_copy,
};

/// A fixture case's mask in our terms (see the script's docstring).
fn case_mask(case: &serde_json::Value, batch: usize, kv_len: usize) -> Result<Mask> {
    let cap = case["softcap"].as_f64().context("softcap")? as f32;
    let mut mask = Mask::new().with_softcap(cap);
    if let Some(offset) = case["causal_offset"].as_u64() {
        mask = mask.with_causal(Causal::Offset(offset as usize));
    }
    if let Some(w) = case["window"].as_u64() {
        mask = mask.with_window(w as usize);
    }
    let left: Vec<usize> = case["left_padding"]
        .as_array()
        .context("left_padding")?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize).context("left_padding entry"))
        .collect::<Result<_>>()?;
    assert_eq!(left.len(), batch);
    let lengths: Vec<usize> = left.iter().map(|l| kv_len - l).collect();
    Ok(mask.with_key_padding(KeyPaddingMask::from_lengths_left(&lengths, kv_len, &Device::Cpu)?))
}

/// HF's Gemma 2 eager attention (soft-capped, `query_pre_attn_scalar`
/// scale, grouped-query, causal, sliding window, left-padded decode step),
/// with the mask as our rules and as the boolean mask HF was given, on
/// every path and instruction set.
#[test]
fn matches_hf_gemma2_eager_attention() -> Result<()> {
    let f = Fixture::load(&fixture_dir("softcap.safetensors"), &Device::Cpu)?;
    let cases = f.case["cases"].as_object().context("no cases")?;
    assert_eq!(cases.len(), 4);
    for (name, case) in cases {
        let get = |part: &str| f.get(&format!("{name}.{part}"));
        let (q, k, v, expected) = (get("q")?, get("k")?, get("v")?, get("out")?);
        let scale = case["scaling"].as_f64().context("scaling")?;
        let (batch, kv_len) = (k.dim(0)?, k.dim(2)?);
        let rules = case_mask(case, batch, kv_len)?;
        let boolean = Mask::new()
            .with_softcap(rules.softcap.context("softcap")?)
            .with_attn(AttnMask::AttendWhereTrue(get("allowed")?.clone()));
        for (m, mask) in [("rules", &rules), ("bool", &boolean)] {
            for path in [AttnPath::Auto, AttnPath::CpuTiled, AttnPath::Reference] {
                let out = scaled_dot_product_attention_via(q, k, v, mask, Some(scale), path)?;
                assert_close(&format!("{name} {m} {path:?}"), &out, expected, 1e-5)?;
            }
            for isa in supported() {
                let out = scaled_dot_product_attention_tiled_on(q, k, v, mask, Some(scale), isa)?;
                assert_close(&format!("{isa:?} {name} {m}"), &out, expected, 1e-5)?;
            }
        }
    }
    Ok(())
}

/// The gradients through the soft-cap equal `torch.autograd`'s through
/// HF's eager attention (grouped-query, causal, sliding window, left
/// padding), on the reference path and through the fused backward (the
/// path `Auto` takes for tracked f32 inputs) under every instruction set.
#[test]
fn gradients_match_torch_autograd() -> Result<()> {
    let f = Fixture::load(&fixture_dir("softcap.safetensors"), &Device::Cpu)?;
    let case = &f.case["cases"]["grad"];
    let (q, k, v) = (
        Var::from_tensor(f.get("grad.q")?)?,
        Var::from_tensor(f.get("grad.k")?)?,
        Var::from_tensor(f.get("grad.v")?)?,
    );
    let mask = case_mask(case, q.dim(0)?, k.dim(2)?)?;
    let scale = case["scaling"].as_f64().context("scaling")?;
    let paths = [AttnPath::Auto, AttnPath::CpuTiled, AttnPath::Reference]
        .into_iter()
        .map(|path| {
            (
                format!("{path:?}"),
                scaled_dot_product_attention_via(&q, &k, &v, &mask, Some(scale), path),
            )
        });
    let isas = supported().into_iter().map(|isa| {
        (
            format!("{isa:?}"),
            scaled_dot_product_attention_tiled_on(&q, &k, &v, &mask, Some(scale), isa),
        )
    });
    for (via, out) in paths.chain(isas) {
        let out = out?;
        assert_close(&format!("{via} grad out"), &out, f.get("grad.out")?, 1e-5)?;
        let grads = (out * f.get("grad.g")?)?.sum_all()?.backward()?;
        for (name, var) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let g = grads
                .get(var)
                .with_context(|| format!("{via}: no gradient for {name}"))?;
            assert_close(&format!("{via} {name}"), g, f.get(&format!("grad.{name}"))?, 1e-5)?;
        }
    }
    Ok(())
}

/// The tiled kernel equals the reference path for soft-capped attention:
/// random shapes (prefill on the packed tiles, decode-sized on the direct
/// products, grouped-query), every mask kind, caps from tight to Gemma 2's,
/// under every instruction set.
#[test]
fn tiled_equals_reference_soft_capped_on_every_isa() -> Result<()> {
    let dev = Device::Cpu;
    // (batch, heads, kv_heads, q_len, kv_len, head_dim)
    let shapes = [
        (1, 2, 2, 1, 1, 8),
        (2, 4, 2, 1, 600, 64),
        (2, 8, 4, 3, 530, 40),
        (1, 4, 1, 40, 77, 64),
        (2, 4, 2, 100, 613, 32),
        (1, 2, 2, 129, 129, 256),
    ];
    let mut cases = Vec::new();
    for (b, h, kh, l, s, d) in shapes {
        let (q, k, v) = (
            (randn(&[b, h, l, d])? * 2.)?,
            (randn(&[b, kh, s, d])? * 2.)?,
            randn(&[b, kh, s, d])?,
        );
        let lengths: Vec<usize> = (0..b).map(|i| s - i * s / 3).collect();
        let padding = KeyPaddingMask::from_lengths(&lengths, s, &dev)?;
        let masks = [
            Mask::new(),
            Mask::causal(Causal::BottomRight),
            Mask::causal(Causal::TopLeft).with_key_padding(padding.clone()),
            Mask::causal(Causal::BottomRight).with_window(5),
            Mask::causal(Causal::BottomRight).with_window(300),
            Mask::new().with_attn(AttnMask::AttendWhereTrue(randn(&[b, 1, l, s])?.ge(-0.5)?)),
            Mask::new().with_attn(AttnMask::IgnoreWhereTrue(randn(&[b * h, l, s])?.ge(1.)?)),
            Mask::causal(Causal::BottomRight)
                .with_attn(AttnMask::Additive(randn(&[l, s])?))
                .with_key_padding(padding),
        ];
        for (m, mask) in masks.into_iter().enumerate() {
            for cap in [1., 5., 50.] {
                cases.push((
                    format!("{:?} mask {m} cap {cap}", (b, h, kh, l, s, d)),
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    mask.clone().with_softcap(cap),
                ));
            }
        }
    }
    for (what, q, k, v, mask) in &cases {
        let reference = scaled_dot_product_attention_via(q, k, v, mask, None, AttnPath::Reference)?;
        for isa in supported() {
            let tiled = scaled_dot_product_attention_tiled_on(q, k, v, mask, None, isa)?;
            assert_close(&format!("{isa:?} {what}"), &tiled, &reference, 1e-5)?;
        }
    }
    Ok(())
}

/// Infinite scores are capped, as HF's `tanh` caps them: `±inf` becomes
/// `±cap`, so the row stays finite (uncapped, a `+inf` score makes it
/// NaN), on every path.
#[test]
fn infinite_scores_are_capped() -> Result<()> {
    let (l, s, d) = (20, 40, 16);
    // The first query's first dim is infinite: its scores are `±inf`.
    let q = randn(&[1, 1, l, d])?;
    let q = q.slice_assign(
        &[0..1, 0..1, 0..1, 0..1],
        &Tensor::full(f32::INFINITY, (1, 1, 1, 1), &Device::Cpu)?,
    )?;
    let (k, v) = (randn(&[1, 1, s, d])?, randn(&[1, 1, s, d])?);
    let mask = Mask::causal(Causal::BottomRight).with_softcap(10.);
    let reference = scaled_dot_product_attention_via(&q, &k, &v, &mask, None, AttnPath::Reference)?;
    for isa in supported() {
        let tiled = scaled_dot_product_attention_tiled_on(&q, &k, &v, &mask, None, isa)?;
        let first: Vec<f32> = reference.i((0, 0, 0))?.to_vec1()?;
        assert!(first.iter().all(|x| x.is_finite()), "{first:?}");
        assert_close(&format!("{isa:?}"), &tiled, &reference, 1e-5)?;
    }
    Ok(())
}

/// `MhaConfig::softcap` reaches every path of a module (appended
/// `add_bias_kv` keys capped too); the call's mask may not set it; a cap
/// that is not finite and > 0 is refused in either place.
#[test]
fn multihead_attention_takes_the_cap_from_its_config() -> Result<()> {
    let cfg = MhaConfig::new(64, 8).with_softcap(2.).with_bias_kv(true);
    let varmap = candle_nn::VarMap::new();
    MultiheadAttention::new(
        &cfg,
        candle_nn::VarBuilder::from_varmap(&varmap, candle::DType::F32, &Device::Cpu),
    )?;
    // Plain copies: the kernel's forward alone, without the op that ties
    // it to its backward.
    let mha = MultiheadAttention::new(&cfg, plain_copy(&varmap)?)?;
    let uncapped = MultiheadAttention::new(
        &MhaConfig {
            softcap: None,
            ..cfg.clone()
        },
        plain_copy(&varmap)?,
    )?;
    let x = (randn(&[2, 33, 64])? * 4.)?;
    let run = |mha: &MultiheadAttention, path| {
        mha.forward_attn(
            &x,
            &x,
            &x,
            &MhaOptions::new()
                .with_mask(Mask::causal(Causal::TopLeft))
                .with_path(path),
        )
    };
    let (fast, reference) = (run(&mha, AttnPath::CpuTiled)?, run(&mha, AttnPath::Reference)?);
    assert_close("mha softcap", &fast.output, &reference.output, 1e-5)?;
    // The cap changes the output: it was applied, not dropped.
    let plain = run(&uncapped, AttnPath::CpuTiled)?;
    assert!(assert_close("uncapped", &plain.output, &fast.output, 1e-3).is_err());
    assert_err(
        mha.forward_attn(
            &x,
            &x,
            &x,
            &MhaOptions::new().with_mask(Mask::new().with_softcap(2.)),
        ),
        &["MhaConfig::softcap"],
    );
    for cap in [0., -1., f32::NAN, f32::INFINITY] {
        assert_err(MhaConfig::new(64, 8).with_softcap(cap).validate(), &["softcap"]);
        let q = randn(&[1, 1, 2, 8])?;
        assert_err(
            scaled_dot_product_attention_via(
                &q,
                &q,
                &q,
                &Mask::new().with_softcap(cap),
                None,
                AttnPath::Auto,
            ),
            &["soft-capping"],
        );
    }
    Ok(())
}
