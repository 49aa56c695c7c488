//! Training steps (`serve --train`, `scripts/bench_vs_pytorch.py
//! --train`): each model's parameters are a `VarMap`'s variables, and a
//! step is a forward, the backward of `Σ y ∘ g` (a fixed random `g` of the
//! output's shape) and an SGD step (`multihead::kernels::optim::Sgd`,
//! candle-nn's `SGD` updating each variable in place, as `torch.optim.SGD`
//! does), which writes new weights, so that each step's linears pack their
//! weights again as in training.

use anyhow::Result;
use candle::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use multihead::attention::{
    Causal, Mask, MhaConfig, MhaOptions, MultiheadAttention, PackedLinear, PositionEncoding, RotaryConfig,
    WeightLayout,
};
use multihead::kernels::optim::Sgd;
use multihead::kernels::{silu_mul, RmsNorm};
use multihead::models::transformer::{Transformer, TransformerConfig, TransformerMasks};
use multihead::models::vit::{VisionTransformer, VitConfig};

use crate::serve::Work;

/// The SGD step's learning rate: small, but it changes every weight.
const LR: f64 = 1e-4;

/// A model's forward over its inputs, as a closure over the variables of
/// `varmap`, and the work that steps it.
fn step_work(
    name: String,
    varmap: VarMap,
    forward: impl Fn() -> candle::Result<Tensor> + 'static,
) -> Result<Work<'static>> {
    let probe = forward()?;
    let g = Tensor::randn(0f32, 1., probe.shape(), probe.device())?;
    let mut sgd = Sgd::new(varmap.all_vars(), LR)?;
    Ok((
        name,
        Box::new(move || {
            let grads = (forward()? * &g)?.sum_all()?.backward()?;
            sgd.step(&grads)?;
            Ok(())
        }),
    ))
}

/// A `VarMap` and a builder over it, f32 on the CPU.
fn vars() -> (VarMap, VarBuilder<'static>) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    (varmap, vb)
}

fn randn(shape: &[usize]) -> candle::Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)
}

/// `nn.MultiheadAttention(E, H, dropout)` self-attention over `(B, N, E)`,
/// causal or not.
fn mha(b: usize, n: usize, e: usize, h: usize, causal: bool, dropout: f32) -> Result<Work<'static>> {
    let (varmap, vb) = vars();
    let mha = MultiheadAttention::new(&MhaConfig::new(e, h).with_dropout(dropout), vb)?;
    // Data: no gradient of its own, as PyTorch's input has none.
    let x = randn(&[b, n, e])?;
    let mut opts = MhaOptions::new().with_train(true);
    let name = match causal {
        true => {
            opts = opts.with_mask(Mask::causal(Causal::TopLeft));
            format!("train MHA causal B{b} N{n} D{e} H{h}")
        }
        false => format!("train MHA B{b} N{n} D{e} H{h}"),
    };
    let name = match dropout {
        0. => name,
        p => format!("{name} dropout {p}"),
    };
    step_work(name, varmap, move || {
        Ok(mha.forward_attn(&x, &x, &x, &opts)?.output)
    })
}

/// `nn.Transformer(E, H, 6, 6, 4E)` (`dim_feedforward` 2048 at 512), B8
/// S`t` T`t`, a causal target mask.
fn transformer(e: usize, h: usize, t: usize) -> Result<Work<'static>> {
    let (varmap, vb) = vars();
    let mut cfg = TransformerConfig::new(e, h).with_batch_first(true);
    cfg.dropout = 0.;
    cfg.dim_feedforward = 4 * e;
    let model = Transformer::new(&cfg, vb)?;
    let (src, tgt) = (randn(&[8, t, e])?, randn(&[8, t, e])?);
    let masks = TransformerMasks {
        tgt: Mask::causal(Causal::TopLeft),
        ..Default::default()
    };
    let name = match e {
        512 => format!("train nn.Transformer B8 S{t} T{t}"),
        _ => format!("train nn.Transformer D{e} B8 S{t} T{t}"),
    };
    step_work(name, varmap, move || model.forward(&src, &tgt, &masks))
}

/// timm's `vit_base_patch16_224` (or `cfg`, named `name`), B8.
fn vit(name: &str, cfg: VitConfig) -> Result<Work<'static>> {
    let (varmap, vb) = vars();
    let x = randn(&[8, cfg.in_chans, cfg.img_size, cfg.img_size])?;
    let model = VisionTransformer::new(&cfg, vb)?;
    step_work(format!("train {name} B8"), varmap, move || model.forward(&x))
}

/// HF's `LlamaDecoderLayer` (hidden `e`, 8 heads over 2 key/value heads,
/// rotary, SwiGLU `inter`, RMSNorm before each half), causal, B4 T`t`.
fn llama_layer(e: usize, inter: usize, t: usize) -> Result<Work<'static>> {
    let eps = 1e-6;
    let (varmap, vb) = vars();
    let cfg = MhaConfig::new(e, 8)
        .with_bias(false)
        .with_kv_heads(2)
        .with_position(PositionEncoding::Rotary(RotaryConfig::new(10000.)));
    let attn = MultiheadAttention::new_with_layout(&cfg, &WeightLayout::llama(), vb.pp("self_attn"))?;
    let linear = |i: usize, o: usize, name: &str| -> candle::Result<PackedLinear> {
        PackedLinear::new(vb.pp("mlp").get((o, i), &format!("{name}.weight"))?, None)
    };
    let (gate, up, down) = (
        linear(e, inter, "gate_proj")?,
        linear(e, inter, "up_proj")?,
        linear(inter, e, "down_proj")?,
    );
    let norm = |name: &str| RmsNorm::new(e, eps, vb.pp(name));
    let (norm1, norm2) = (norm("input_layernorm")?, norm("post_attention_layernorm")?);
    let x = randn(&[4, t, e])?;
    let opts = MhaOptions::new()
        .with_mask(Mask::causal(Causal::TopLeft))
        .with_train(true);
    let name = format!("train Llama decoder layer B4 T{t} D{e} H8/2 SwiGLU {inter}");
    step_work(name, varmap, move || {
        // The decoders' RMSNorm, which trains as one op.
        let h = norm1.forward(&x)?;
        let x = (&x + attn.forward_attn(&h, &h, &h, &opts)?.output)?;
        let h = norm2.forward(&x)?;
        let mlp = down.forward(&silu_mul(&gate.forward(&h)?, &up.forward(&h)?)?)?;
        &x + mlp
    })
}

/// The training works, by the names the script pairs them under; `tiny`,
/// the same models at a few features and positions (their sizes in their
/// names), to check that they run.
pub fn works(tiny: bool) -> Result<Vec<Work<'static>>> {
    if tiny {
        let mut cfg = VitConfig::tiny_patch16_224();
        (
            cfg.img_size,
            cfg.embed_dim,
            cfg.depth,
            cfg.num_heads,
            cfg.num_classes,
        ) = (32, 32, 2, 2, 10);
        return Ok(vec![
            mha(8, 9, 32, 4, false, 0.)?,
            mha(8, 9, 32, 4, false, 0.1)?,
            mha(4, 16, 32, 4, true, 0.)?,
            transformer(32, 4, 8)?,
            vit("vit tiny", cfg)?,
            llama_layer(64, 96, 16)?,
        ]);
    }
    Ok(vec![
        mha(8, 197, 768, 12, false, 0.)?,
        mha(8, 197, 768, 12, false, 0.1)?,
        mha(4, 512, 512, 8, true, 0.)?,
        transformer(512, 8, 64)?,
        vit("vit_base_patch16_224", VitConfig::base_patch16_224())?,
        llama_layer(512, 1408, 512)?,
    ])
}
