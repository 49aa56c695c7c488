//! The fused attention backward (`AttnPath::CpuTiled` on tracked f32
//! tensors) equals the reference path's autograd: random shapes (query and
//! key lengths apart and across the backward's tiles, grouped-query heads,
//! odd head dims), every mask kind, every instruction set the processor
//! runs; and `MultiheadAttention`'s weights get the reference path's
//! gradients through it; and the gradients equal `torch.autograd`'s
//! (here, and soft-capped in `softcap.rs`).

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    scaled_dot_product_attention_dropout, scaled_dot_product_attention_tiled_on,
    scaled_dot_product_attention_via, set_dropout_seed, Alibi, AttnMask, AttnPath, Causal, KeyPaddingMask,
    Mask, MhaConfig, MhaOptions, MultiheadAttention,
};
use multihead_kernels::isa::{supported, Isa};
use multihead_test_support::compare::{assert_close, max_abs_diff};
use multihead_test_support::{
    errors::assert_err,
    fixtures::{fixture_dir, Fixture},
    random::randn,
};

/// Which way a test runs attention.
#[derive(Clone, Copy, Debug)]
enum Via {
    Path(AttnPath),
    Isa(Isa),
}

/// The output of attention over variables `q`, `k`, `v` via `via`, and
/// the gradients of `sum(out · g)` with respect to each.
fn grads(
    (q, k, v): (&Var, &Var, &Var),
    mask: &Mask,
    scale: Option<f64>,
    g: &Tensor,
    via: Via,
) -> Result<(Tensor, [Tensor; 3])> {
    let out = match via {
        Via::Path(path) => scaled_dot_product_attention_via(q, k, v, mask, scale, path)?,
        Via::Isa(isa) => scaled_dot_product_attention_tiled_on(q, k, v, mask, scale, isa)?,
    };
    let store = (&out * g)?.sum_all()?.backward()?;
    let get = |x: &Var, name: &str| {
        store
            .get(x)
            .cloned()
            .with_context(|| format!("no gradient for {name}"))
    };
    Ok((out, [get(q, "q")?, get(k, "k")?, get(v, "v")?]))
}

/// `got` within 1e-5 of `expected`'s largest magnitude, or within 1e-6
/// where that is 0: a query that sees one key has weight 1 whatever its
/// score, so its dq is 0 exactly on the reference path and the rounding of
/// `exp(s − lse)` (about 1e-7) on the fused one.
fn gradients_close(what: &str, got: &Tensor, expected: &Tensor) -> Result<()> {
    if expected.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? == 0. {
        let diff = max_abs_diff(got, expected)?;
        anyhow::ensure!(diff <= 1e-6, "{what}: {diff:e} from an all-zero gradient");
        return Ok(());
    }
    assert_close(what, got, expected, 1e-5)
}

/// Every mask kind the forward takes, alone and together, over `(b, h,
/// l, s)`; the last hides every key of batch 1's rows (zero output, zero
/// gradients).
fn masks(b: usize, h: usize, l: usize, s: usize) -> Result<Vec<(&'static str, Mask)>> {
    let dev = Device::Cpu;
    let lengths: Vec<usize> = (0..b).map(|i| s - i * s / 3).collect();
    let coin =
        |p: f32, shape: &[usize]| -> Result<Tensor> { Ok(Tensor::rand(0f32, 1., shape, &dev)?.lt(p)?) };
    let mut none_for_1 = vec![s; b];
    if b > 1 {
        none_for_1[1] = 0;
    }
    Ok(vec![
        ("none", Mask::new()),
        ("causal top-left", Mask::causal(Causal::TopLeft)),
        ("causal bottom-right", Mask::causal(Causal::BottomRight)),
        ("causal offset", Mask::causal(Causal::Offset(3))),
        (
            "key padding",
            Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &dev)?),
        ),
        (
            "additive key padding",
            Mask::new().with_key_padding(KeyPaddingMask::Additive(randn(&[b, s])?)),
        ),
        (
            "ignore where true",
            Mask::new().with_attn(AttnMask::IgnoreWhereTrue(coin(0.3, &[l, s])?)),
        ),
        (
            "attend where true, per head",
            Mask::new().with_attn(AttnMask::AttendWhereTrue(coin(0.7, &[b, h, l, s])?)),
        ),
        (
            "additive",
            Mask::causal(Causal::BottomRight).with_attn(AttnMask::Additive(randn(&[l, s])?)),
        ),
        ("window", Mask::causal(Causal::BottomRight).with_window(5)),
        ("alibi", Mask::new().with_alibi(Alibi::new(h))),
        (
            "window, alibi, softcap",
            Mask::causal(Causal::BottomRight)
                .with_window(70)
                .with_alibi(Alibi::new(h))
                .with_softcap(1.5),
        ),
        (
            "softcap, padding",
            Mask::causal(Causal::TopLeft)
                .with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &dev)?)
                .with_softcap(30.),
        ),
        (
            "fully masked rows",
            Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&none_for_1, s, &dev)?),
        ),
    ])
}

#[test]
fn fused_gradients_equal_reference_over_shapes_and_masks() -> Result<()> {
    // (batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim): the
    // lengths apart and past the backward's 128-row and 128-key tiles.
    let shapes = [
        (2, 2, 2, 9, 13, 8, 8),
        (2, 4, 2, 130, 70, 64, 64),
        (1, 3, 1, 40, 260, 37, 21),
        (2, 2, 1, 1, 30, 16, 16),
        (1, 8, 4, 140, 300, 16, 16),
    ];
    for (b, h, kh, l, s, d, dv) in shapes {
        let (q, k, v) = (
            Var::from_tensor(&randn(&[b, h, l, d])?)?,
            Var::from_tensor(&randn(&[b, kh, s, d])?)?,
            Var::from_tensor(&randn(&[b, kh, s, dv])?)?,
        );
        let g = randn(&[b, h, l, dv])?;
        for (name, mask) in masks(b, h, l, s)? {
            let scale = Some(0.8 / (d as f64).sqrt());
            let (out, expected) = grads((&q, &k, &v), &mask, scale, &g, Via::Path(AttnPath::Reference))?;
            let vias = [Via::Path(AttnPath::Auto), Via::Path(AttnPath::CpuTiled)]
                .into_iter()
                .chain(supported().into_iter().map(Via::Isa));
            // One thread: a pass over (batch, kv-head) units where there
            // are at least 4 of them; 64: the two passes over tiles.
            for (via, threads) in vias.flat_map(|via| [(via, 1), (via, 64)]) {
                let what = format!(
                    "{via:?} {threads} threads {:?} mask {name}",
                    (b, h, kh, l, s, d, dv)
                );
                let (ours, got) =
                    multihead_kernels::with_threads(threads, || grads((&q, &k, &v), &mask, scale, &g, via))?;
                assert_close(&format!("{what}: out"), &ours, &out, 1e-5)?;
                for ((x, got), expected) in ["dq", "dk", "dv"].iter().zip(&got).zip(&expected) {
                    gradients_close(&format!("{what}: {x}"), got, expected)?;
                }
            }
        }
    }
    Ok(())
}

/// The output and gradients equal `torch.autograd`'s through
/// `F.scaled_dot_product_attention` (fixture written by
/// `scripts/make_attention_grad_fixtures.py`): grouped-query heads with
/// PyTorch's causal rule, an additive mask, a boolean mask over keys past
/// the backward's tiles, key padding; on every path and instruction set.
#[test]
fn gradients_match_torch_autograd() -> Result<()> {
    let f = Fixture::load(&fixture_dir("attention_grads.safetensors"), &Device::Cpu)?;
    let cases = f.case["cases"].as_object().context("no cases")?;
    assert_eq!(cases.len(), 4);
    for (name, case) in cases {
        let get = |part: &str| f.get(&format!("{name}.{part}"));
        let var = |part: &str| -> Result<Var> { Ok(Var::from_tensor(get(part)?)?) };
        let (q, k, v) = (var("q")?, var("k")?, var("v")?);
        let mask = match case["mask"].as_str().context("mask")? {
            "causal_top_left" => Mask::causal(Causal::TopLeft),
            "additive" => Mask::new().with_attn(AttnMask::Additive(get("mask")?.clone())),
            "attend_where_true" => Mask::new().with_attn(AttnMask::AttendWhereTrue(get("mask")?.clone())),
            "key_padding" => {
                let lengths: Vec<usize> = case["lengths"]
                    .as_array()
                    .context("lengths")?
                    .iter()
                    .map(|x| x.as_u64().map(|x| x as usize).context("length"))
                    .collect::<Result<_>>()?;
                Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&lengths, k.dim(2)?, &Device::Cpu)?)
            }
            other => anyhow::bail!("{name}: unknown mask {other}"),
        };
        let scale = case["scale"].as_f64();
        let vias = [AttnPath::Auto, AttnPath::CpuTiled, AttnPath::Reference]
            .map(Via::Path)
            .into_iter()
            .chain(supported().into_iter().map(Via::Isa));
        for via in vias {
            let (out, got) = grads((&q, &k, &v), &mask, scale, get("g")?, via)?;
            assert_close(&format!("{name} {via:?} out"), &out, get("out")?, 1e-5)?;
            for (x, got) in ["dq", "dk", "dv"].iter().zip(&got) {
                assert_close(&format!("{name} {via:?} {x}"), got, get(x)?, 1e-5)?;
            }
        }
    }
    Ok(())
}

/// A row the mask hides whole gets a zero output and zero gradients, and
/// a key hidden from every query gets zero dK and dV, NaN or not in its
/// value (the backward reads no hidden value).
#[test]
fn hidden_rows_and_keys_get_zero_gradients() -> Result<()> {
    let (l, s, d) = (6, 10, 8);
    let mut v = randn(&[1, 1, s, d])?.flatten_all()?.to_vec1::<f32>()?;
    v[9 * d + 2] = f32::NAN;
    let v = Var::from_tensor(&Tensor::from_vec(v, (1, 1, s, d), &Device::Cpu)?)?;
    let (q, k) = (
        Var::from_tensor(&randn(&[1, 1, l, d])?)?,
        Var::from_tensor(&randn(&[1, 1, s, d])?)?,
    );
    // Row 0 sees no key; key 9 (NaN value) is padding.
    let mut allowed = vec![1u8; l * s];
    allowed[..s].fill(0);
    let mask = Mask::new()
        .with_attn(AttnMask::AttendWhereTrue(Tensor::from_vec(
            allowed,
            (l, s),
            &Device::Cpu,
        )?))
        .with_key_padding(KeyPaddingMask::from_lengths(&[9], s, &Device::Cpu)?);
    let g = randn(&[1, 1, l, d])?;
    let (out, [dq, dk, dv]) = grads((&q, &k, &v), &mask, None, &g, Via::Path(AttnPath::CpuTiled))?;
    let abs_max = |t: &Tensor| -> Result<f32> { Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
    let row = |t: &Tensor, dim: usize, i: usize| t.narrow(dim, i, 1);
    assert_eq!(abs_max(&row(&out, 2, 0)?)?, 0.);
    assert_eq!(abs_max(&row(&dq, 2, 0)?)?, 0.);
    assert_eq!(abs_max(&row(&dk, 2, 9)?)?, 0.);
    assert_eq!(abs_max(&row(&dv, 2, 9)?)?, 0.);
    for t in [&out, &dq, &dk, &dv] {
        assert!(abs_max(t)?.is_finite(), "a hidden NaN leaked");
    }
    Ok(())
}

/// What the fused backward does not serve goes to the reference path
/// under `Auto` and is refused, with the reason, when forced: half
/// precision, and a mask that itself needs gradients.
#[test]
fn what_the_fused_backward_refuses() -> Result<()> {
    let q = Var::from_tensor(&randn(&[1, 2, 5, 8])?)?;
    let kv = randn(&[1, 2, 6, 8])?.to_dtype(DType::BF16)?;
    let out = scaled_dot_product_attention_via(&q, &kv, &kv, &Mask::new(), None, AttnPath::Auto)?;
    let grads = out.sum_all()?.backward()?;
    assert!(grads.get(&q).is_some(), "no gradient reached q");
    assert_err(
        scaled_dot_product_attention_via(&q, &kv, &kv, &Mask::new(), None, AttnPath::CpuTiled),
        &["CpuTiled", "f32"],
    );
    let kv = randn(&[1, 2, 6, 8])?;
    let bias = Var::from_tensor(&randn(&[5, 6])?)?;
    let mask = Mask::new().with_attn(AttnMask::Additive(bias.as_tensor().clone()));
    let out = scaled_dot_product_attention_via(&q, &kv, &kv, &mask, None, AttnPath::Auto)?;
    let grads = out.sum_all()?.backward()?;
    assert!(grads.get(&bias).is_some(), "no gradient reached the mask");
    assert_err(
        scaled_dot_product_attention_via(&q, &kv, &kv, &mask, None, AttnPath::CpuTiled),
        &["CpuTiled", "mask needs gradients"],
    );
    Ok(())
}

/// `MultiheadAttention` built on a `VarMap` and run in training mode
/// (dropout 0), through the fused backward, gives its projections' weights
/// the reference path's gradients: self-attention with a causal mask and
/// grouped-query heads, cross-attention with key padding and PyTorch's
/// `add_bias_kv` (keys outside the mask).
#[test]
fn multihead_attention_weights_get_the_reference_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let x = randn(&[2, 37, 64])?;
    let mem = randn(&[2, 23, 64])?;
    let padding = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[23, 11], 23, &dev)?);
    let cases = [
        (
            MhaConfig::new(64, 8).with_kv_heads(2),
            &x,
            Mask::causal(Causal::TopLeft),
        ),
        (MhaConfig::new(64, 4).with_bias_kv(true), &mem, padding),
    ];
    for (cfg, kv, mask) in cases {
        let varmap = VarMap::new();
        let mha = MultiheadAttention::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
        let g = randn(&[2, 37, 64])?;
        let run = |path| -> Result<Vec<(String, Tensor)>> {
            let opts = MhaOptions::new()
                .with_mask(mask.clone())
                .with_train(true)
                .with_path(path);
            let out = mha.forward_attn(&x, kv, kv, &opts)?.output;
            let store = (out * &g)?.sum_all()?.backward()?;
            let mut vars: Vec<(String, Var)> = varmap.data().lock().unwrap().clone().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            vars.into_iter()
                .map(|(name, var)| {
                    let grad = store
                        .get(&var)
                        .with_context(|| format!("no gradient for {name}"))?;
                    Ok((name, grad.clone()))
                })
                .collect()
        };
        let reference = run(AttnPath::Reference)?;
        assert!(reference.len() >= 4, "{reference:?}");
        // Self-attention backpropagates into its fused projection in one
        // piece; one thread and 64 as in the shapes test.
        for path in [AttnPath::Auto, AttnPath::CpuTiled] {
            for threads in [1, 64] {
                for ((name, ours), (_, expected)) in multihead_kernels::with_threads(threads, || run(path))?
                    .iter()
                    .zip(&reference)
                {
                    assert_close(
                        &format!("{path:?} {threads} threads {name}"),
                        ours,
                        expected,
                        1e-5,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// `scaled_dot_product_attention_dropout`: probability 0 is the call
/// without dropout; otherwise the CPU path drops (the output moves, each
/// weight's expectation kept: the mean over many masks comes back to the
/// plain output), the seed stream restarted gives the same output and
/// gradients, and the fused backward serves it.
#[test]
fn dropout_through_the_public_call() -> Result<()> {
    let q = Var::from_tensor(&randn(&[1, 2, 20, 8])?)?;
    let (k, v) = (randn(&[1, 2, 24, 8])?, randn(&[1, 2, 24, 8])?);
    let mask = Mask::causal(Causal::BottomRight);
    let call = |p: f32| scaled_dot_product_attention_dropout(&q, &k, &v, &mask, None, p, AttnPath::Auto);
    let plain = scaled_dot_product_attention_via(&q, &k, &v, &mask, None, AttnPath::Auto)?;
    assert_eq!(max_abs_diff(&call(0.)?, &plain)?, 0.);
    set_dropout_seed(3);
    let first = call(0.25)?;
    let grad = first
        .sum_all()?
        .backward()?
        .get(&q)
        .cloned()
        .context("no gradient for q")?;
    assert!(max_abs_diff(&first, &plain)? > 0.1);
    set_dropout_seed(3);
    let again = call(0.25)?;
    assert_eq!(max_abs_diff(&first, &again)?, 0.);
    let grad_again = again
        .sum_all()?
        .backward()?
        .get(&q)
        .cloned()
        .context("no gradient for q")?;
    assert_eq!(max_abs_diff(&grad, &grad_again)?, 0.);
    let n = 400;
    let mut mean = plain.zeros_like()?;
    for _ in 0..n {
        mean = (mean + call(0.25)?.detach())?;
    }
    let mean = (mean / n as f64)?;
    let err = max_abs_diff(&mean, &plain)?;
    anyhow::ensure!(
        err < 0.15,
        "the mean of {n} dropped outputs is {err} from the plain one"
    );
    assert_err(call(1.), &["dropout", "[0, 1)"]);
    Ok(())
}
