//! Building [`MultiheadAttention`] from weights stored in a
//! [`WeightLayout`], or initialised as PyTorch initialises them.

use candle::{bail, Result};
use candle_nn::{Init, VarBuilder};

use multihead_kernels::{LayerNorm, PackOptions, PackedLinear};

use super::{HeadNorm, MultiheadAttention};
use crate::config::{MhaConfig, NormKind, PositionEncoding};
use crate::layout::WeightLayout;
use crate::projection::{linear, xavier_uniform, InKind, InProjection, Stored};
use crate::rotary::Rotary;

impl MultiheadAttention {
    /// Loads PyTorch `nn.MultiheadAttention` weights ([`WeightLayout::PyTorch`]),
    /// or initialises them as PyTorch does when `vb` is backed by a `VarMap`.
    pub fn new(cfg: &MhaConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with_layout(cfg, &WeightLayout::PyTorch, vb)
    }

    /// Loads the weights stored in `layout`, or initialises them as PyTorch
    /// does (xavier-uniform input projection, zero biases) when `vb` is
    /// backed by a `VarMap`.
    pub fn new_with_layout(cfg: &MhaConfig, layout: &WeightLayout, vb: VarBuilder) -> Result<Self> {
        Self::new_with_pack(cfg, layout, &PackOptions::default(), vb)
    }

    /// [`MultiheadAttention::new_with_layout`], its projections packed as
    /// `pack` asks (a format, an instruction set, a GGUF file's lent
    /// blocks): what a model loader passes down to every layer it builds.
    pub fn new_with_pack(
        cfg: &MhaConfig,
        layout: &WeightLayout,
        pack: &PackOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        let (e, kdim, vdim, kvd) = (cfg.embed_dim, cfg.kdim(), cfg.vdim(), cfg.kv_dim());
        // Query width: `e` unless `head_dim` sets another.
        let qd = cfg.q_dim();
        let qkv_bias = cfg.has_qkv_bias();
        let out_init = Init::Uniform {
            lo: -1. / (e as f64).sqrt(),
            up: 1. / (e as f64).sqrt(),
        };
        let fused_qkv_only = |what: &str| -> Result<()> {
            if !cfg.qkv_same_embed_dim() {
                bail!(
                    "MhaConfig: the {what} layout needs kdim == vdim == embed_dim ({e}), found kdim {kdim}, vdim {vdim}"
                )
            }
            Ok(())
        };
        let (kind, out_proj) = match layout {
            WeightLayout::PyTorch => {
                let bias = qkv_bias
                    .then(|| vb.get_with_hints(qd + 2 * kvd, "in_proj_bias", Init::Const(0.)))
                    .transpose()?;
                let kind = if cfg.qkv_same_embed_dim() {
                    let weight = vb.get_with_hints(
                        (qd + 2 * kvd, e),
                        "in_proj_weight",
                        xavier_uniform(qd + 2 * kvd, e),
                    )?;
                    InKind::Fused(PackedLinear::with_options(weight, bias, pack)?)
                } else {
                    let part = |from: usize, out: usize, name: &str, in_dim: usize| -> Result<PackedLinear> {
                        let w = vb.get_with_hints((out, in_dim), name, xavier_uniform(out, in_dim))?;
                        let b = bias.as_ref().map(|b| b.narrow(0, from, out)).transpose()?;
                        PackedLinear::with_options(w, b, pack)
                    };
                    InKind::Separate {
                        q: part(0, qd, "q_proj_weight", e)?,
                        k: part(qd, kvd, "k_proj_weight", kdim)?,
                        v: part(qd + kvd, kvd, "v_proj_weight", vdim)?,
                    }
                };
                (
                    kind,
                    linear(
                        (qd, e),
                        cfg.bias,
                        out_init,
                        Stored::OutIn,
                        pack,
                        vb.pp("out_proj"),
                    )?,
                )
            }
            WeightLayout::Separate(names) => {
                let (q, k, v) = (
                    linear(
                        (e, qd),
                        qkv_bias,
                        xavier_uniform(qd, e),
                        Stored::OutIn,
                        pack,
                        vb.pp(&names.q),
                    )?,
                    linear(
                        (kdim, kvd),
                        qkv_bias,
                        xavier_uniform(kvd, kdim),
                        Stored::OutIn,
                        pack,
                        vb.pp(&names.k),
                    )?,
                    linear(
                        (vdim, kvd),
                        qkv_bias,
                        xavier_uniform(kvd, vdim),
                        Stored::OutIn,
                        pack,
                        vb.pp(&names.v),
                    )?,
                );
                // Packed (plain weights, on the CPU) and all of one input
                // width, the three are joined into one weight, as PyTorch's
                // in_proj_weight holds them: self-attention then projects
                // with one call (a decoder step: one pass over the three,
                // not three, each with its own hand-over to the threads).
                // Variables stay apart, so that they train as they are.
                // Weights in a ggml block format join only their own
                // format (a Q4_K_M file keeps some v in Q6_K).
                let kind = if cfg.qkv_same_embed_dim()
                    && [&q, &k, &v].iter().all(|l| l.is_packed())
                    && q.joins_with(&k)
                    && k.joins_with(&v)
                {
                    InKind::Fused(PackedLinear::cat_with(vec![q, k, v], pack)?)
                } else {
                    InKind::Separate { q, k, v }
                };
                (
                    kind,
                    linear(
                        (qd, e),
                        cfg.bias,
                        out_init,
                        Stored::OutIn,
                        pack,
                        vb.pp(&names.out),
                    )?,
                )
            }
            WeightLayout::FusedQkv {
                qkv: fused,
                proj: out,
            }
            | WeightLayout::Conv1D {
                c_attn: fused,
                c_proj: out,
            } => {
                let (what, stored) = match layout {
                    WeightLayout::Conv1D { .. } => ("GPT-2 Conv1D", Stored::InOut),
                    _ => ("fused qkv", Stored::OutIn),
                };
                fused_qkv_only(what)?;
                let n = qd + 2 * kvd;
                let kind = InKind::Fused(linear(
                    (e, n),
                    qkv_bias,
                    xavier_uniform(n, e),
                    stored,
                    pack,
                    vb.pp(fused),
                )?);
                (
                    kind,
                    linear((qd, e), cfg.bias, out_init, stored, pack, vb.pp(out))?,
                )
            }
        };
        let in_proj = InProjection {
            kind,
            q_dim: qd,
            kv_dim: kvd,
        };
        let bias_kv = if cfg.add_bias_kv {
            // PyTorch: xavier_normal_ on (1, 1, E): fan_in = fan_out = E.
            let init = Init::Randn {
                mean: 0.,
                stdev: (1. / e as f64).sqrt(),
            };
            Some((
                vb.get_with_hints((1, 1, e), "bias_k", init)?,
                vb.get_with_hints((1, 1, e), "bias_v", init)?,
            ))
        } else {
            None
        };
        let qk_norm = if cfg.qk_norm {
            let norm = |name: &str, heads: usize| -> Result<HeadNorm> {
                let (hd, eps, vb) = (cfg.head_dim(), cfg.qk_norm_eps, vb.pp(name));
                let rms = |dim: usize, vb| {
                    multihead_kernels::RmsNorm::new_with_offset(dim, eps, cfg.qk_norm_offset, vb)
                };
                Ok(match cfg.qk_norm_kind {
                    NormKind::LayerNorm => HeadNorm::Layer(LayerNorm::new(hd, eps, vb)?),
                    NormKind::RmsNorm => HeadNorm::Rms(rms(hd, vb)?),
                    NormKind::RmsNormAllHeads => HeadNorm::RmsAllHeads(rms(heads * hd, vb)?),
                })
            };
            Some((norm("q_norm", cfg.num_heads)?, norm("k_norm", cfg.kv_heads())?))
        } else {
            None
        };
        let rotary = match &cfg.position {
            PositionEncoding::Rotary(r) => Some(Rotary::new(r, cfg.head_dim())?),
            _ => None,
        };
        Ok(Self {
            cfg: cfg.clone(),
            in_proj,
            out_proj,
            bias_kv,
            qk_norm,
            rotary,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle::{DType, Device, Result, Tensor};
    use candle_nn::{VarBuilder, VarMap};

    use multihead_test_support::compare::rel_err as diff;

    use crate::projection::InKind;
    use crate::{MhaConfig, MhaOptions, MultiheadAttention, WeightLayout};

    #[test]
    fn separate_plain_weights_are_joined_and_variables_stay_apart_and_live() -> Result<()> {
        let dev = Device::Cpu;
        for bias in [false, true] {
            let cfg = MhaConfig::new(64, 4).with_kv_heads(2).with_bias(bias);
            let build =
                |vb: VarBuilder| MultiheadAttention::new_with_layout(&cfg, &WeightLayout::llama(), vb);
            let varmap = VarMap::new();
            let live = build(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
            assert!(matches!(live.in_proj.kind, InKind::Separate { .. }));
            let plain = || -> Result<MultiheadAttention> {
                let tensors: HashMap<String, Tensor> = varmap
                    .data()
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
                    .collect();
                build(VarBuilder::from_tensors(tensors, DType::F32, &dev))
            };
            let joined = plain()?;
            assert!(matches!(joined.in_proj.kind, InKind::Fused(_)), "bias {bias}");
            let (x, y) = (
                Tensor::randn(0f32, 1., (2, 5, 64), &dev)?,
                Tensor::randn(0f32, 1., (2, 7, 64), &dev)?,
            );
            // Self-attention (one projection) and cross-attention (each
            // input its own features of the joined weight).
            let both = |m: &MultiheadAttention| -> Result<[Tensor; 2]> {
                let opts = MhaOptions::new();
                Ok([m.forward(&x)?, m.forward_attn(&x, &y, &y, &opts)?.output])
            };
            for (a, b) in both(&live)?.iter().zip(&both(&joined)?) {
                assert!(diff(a, b)? < 1e-5, "bias {bias}");
            }
            for var in varmap.all_vars() {
                var.set(&(var.as_tensor() * 2.)?)?;
            }
            let moved = both(&plain()?)?;
            for ((live, moved), joined) in both(&live)?.iter().zip(&moved).zip(&both(&joined)?) {
                assert!(diff(moved, joined)? > 0.1);
                assert!(diff(live, moved)? < 1e-5, "bias {bias}");
            }
        }
        Ok(())
    }
}
