#!/usr/bin/env python3
"""Write the timm fixtures for the ViT's tests (crates/models/tests/vit_timm.rs).

Each case is one safetensors file in tests/fixtures/vit/: a randomly
initialised timm `VisionTransformer`'s state_dict under `model.` (timm's own
names, or HF `ViTForImageClassification` names for `naming: hf` cases), the
input images `input`, timm's `logits`, and every block's attention weights
`attn.N` (timm's `attn.softmax(dim=-1)` output, captured with a hook on
`attn_drop`). The case's description, whose "config" is the `VitConfig` JSON,
is in the file's metadata under "case".

HF names: `transformers` is not needed. The HF cases are timm models whose
state_dict is renamed to HF's keys here (`to_hf_names`), following HF's own
timm-to-HF conversion script (`convert_vit_timm_to_pytorch.py`): the fused
`qkv` is split into `query`/`key`/`value`.

Regenerate (the venv of scripts/requirements.txt; no download; seconds;
the committed files are replaced only once every case is written):

    .venv-ref/bin/python scripts/make_vit_fixtures.py

Check the full architectures locally (random init, too large to commit):

    .venv-ref/bin/python scripts/make_vit_fixtures.py --full
    cargo test --release --test vit_timm -- --ignored

`--full` writes vit_tiny_patch16_224, vit_small_patch16_224 and
vit_base_patch16_224 cases (224x224, and vit_tiny at 320x256 too) to
target/vit-full-fixtures/, which the ignored test reads.
"""

import argparse
import json
import os
from functools import partial

import torch
import torch.nn as nn
import timm
from timm.models.vision_transformer import VisionTransformer
from safetensors.torch import save_file

from staging import staged

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "vit")
FULL_OUT = os.path.join(ROOT, "target", "vit-full-fixtures")
# Where `make_case` writes: a temporary folder while the script runs, moved
# over OUT or FULL_OUT once every case is written (see staging.py).
DEST = OUT


def randomize(model, scale):
    """timm zero-initialises biases and sets norms to 1: perturb every parameter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def to_hf_names(sd, depth, dim):
    """A timm ViT state_dict under HF ViTForImageClassification's names."""
    out = {
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.layernorm.weight": sd["norm.weight"],
        "vit.layernorm.bias": sd["norm.bias"],
        "classifier.weight": sd["head.weight"],
        "classifier.bias": sd["head.bias"],
    }
    for i in range(depth):
        t, h = f"blocks.{i}.", f"vit.encoder.layer.{i}."
        for a, b in [("norm1", "layernorm_before"), ("norm2", "layernorm_after"),
                     ("attn.proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                     ("mlp.fc2", "output.dense")]:
            for p in ("weight", "bias"):
                out[f"{h}{b}.{p}"] = sd[f"{t}{a}.{p}"]
        for j, name in enumerate(["query", "key", "value"]):
            out[f"{h}attention.attention.{name}.weight"] = sd[f"{t}attn.qkv.weight"][j * dim:(j + 1) * dim]
            out[f"{h}attention.attention.{name}.bias"] = sd[f"{t}attn.qkv.bias"][j * dim:(j + 1) * dim]
    return out


def run_with_attention(model, x):
    """timm's logits and each block's softmaxed attention weights."""
    attns = []
    for blk in model.blocks:
        blk.attn.fused_attn = False  # the explicit path materialises attn.softmax
        blk.attn.attn_drop.register_forward_hook(lambda m, inp, out: attns.append(inp[0].detach()))
    with torch.no_grad():
        logits = model(x)
    return logits, attns


def make_case(name, cfg, input_hw, *, batch=2, scale=0.1, seed=0, attn_layers="all"):
    """cfg: the VitConfig JSON; it also builds the timm model."""
    torch.manual_seed(seed)
    eps = cfg.get("layer_norm_eps", 1e-6)
    pool = cfg.get("global_pool", "token")
    model = VisionTransformer(
        img_size=cfg["img_size"],
        patch_size=cfg["patch_size"],
        in_chans=cfg.get("in_chans", 3),
        num_classes=cfg.get("num_classes", 1000),
        embed_dim=cfg["embed_dim"],
        depth=cfg["depth"],
        num_heads=cfg["num_heads"],
        mlp_ratio=cfg.get("mlp_ratio", 4.0),
        qkv_bias=cfg.get("qkv_bias", True),
        qk_norm=cfg.get("qk_norm", False),
        init_values=cfg.get("init_values"),
        class_token=cfg.get("class_token", True),
        reg_tokens=cfg.get("reg_tokens", 0),
        no_embed_class=cfg.get("no_embed_class", False),
        global_pool=pool,
        fc_norm=cfg.get("fc_norm"),
        norm_layer=partial(nn.LayerNorm, eps=eps),
        dynamic_img_size=True,
    ).eval()
    randomize(model, scale)
    x = torch.randn(batch, cfg.get("in_chans", 3), *input_hw)
    logits, attns = run_with_attention(model, x)
    sd = model.state_dict()
    if cfg.get("naming") == "hf":
        sd = to_hf_names(sd, cfg["depth"], cfg["embed_dim"])
    tensors = {f"model.{k}": v for k, v in sd.items()}
    tensors["input"] = x
    tensors["logits"] = logits
    layers = range(len(attns)) if attn_layers == "all" else attn_layers
    for i in layers:
        tensors[f"attn.{i}"] = attns[i]
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    case = {"config": cfg, "input_hw": list(input_hw), "attn_layers": list(layers)}
    save_file(tensors, os.path.join(DEST, f"{name}.safetensors"), metadata={"case": json.dumps(case)})
    n = sum(v.numel() for v in tensors.values())
    print(f"{name}: {n} values, logits {tuple(logits.shape)}")


def tiny(**kw):
    cfg = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=24, depth=2,
               num_heads=3, mlp_ratio=2.0)
    cfg.update(kw)
    return cfg


def small_cases():
    make_case("timm_token", tiny(), (16, 16))
    make_case("timm_layerscale_avg", tiny(init_values=0.1, global_pool="avg", qkv_bias=False), (16, 16))
    make_case("timm_qk_norm", tiny(qk_norm=True, in_chans=1, image_mean=[0.5], image_std=[0.5]), (16, 16))
    make_case("timm_reg_tokens_no_embed_class",
              tiny(reg_tokens=2, no_embed_class=True, global_pool="avg", fc_norm=False), (16, 16))
    make_case("timm_reg_tokens_embed_class", tiny(reg_tokens=1, init_values=0.5), (12, 20))
    # Another size than the training one: the position embedding is resampled
    # (timm dynamic_img_size=True): up, non-square, and down.
    make_case("timm_resized_up", tiny(), (24, 20))
    make_case("timm_resized_down", tiny(init_values=0.1, global_pool="avg"), (8, 12))
    make_case("hf_token", tiny(naming="hf", layer_norm_eps=1e-12), (16, 16))
    make_case("hf_resized", tiny(naming="hf", layer_norm_eps=1e-12, num_classes=3), (20, 28))


def full_cases():
    presets = {
        "vit_tiny_patch16_224": dict(embed_dim=192, num_heads=3),
        "vit_small_patch16_224": dict(embed_dim=384, num_heads=6),
        "vit_base_patch16_224": dict(embed_dim=768, num_heads=12),
    }
    for name, kw in presets.items():
        cfg = dict(img_size=224, patch_size=16, num_classes=1000, depth=12, **kw)
        # The registered architecture, to be sure these sizes are timm's.
        ref = timm.create_model(name, pretrained=False)
        assert (ref.embed_dim, len(ref.blocks), ref.blocks[0].attn.num_heads) == (kw["embed_dim"], 12, kw["num_heads"])
        make_case(name, cfg, (224, 224), batch=1, scale=0.02, attn_layers=[11])
    make_case("vit_tiny_patch16_224_320x256", dict(img_size=224, patch_size=16, num_classes=1000, depth=12,
              embed_dim=192, num_heads=3), (320, 256), batch=1, scale=0.02, attn_layers=[0])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="write the full-size architectures to target/vit-full-fixtures")
    args = ap.parse_args()
    # Files of this folder that this script does not write (other fixture
    # scripts') are left alone.
    with staged(FULL_OUT if args.full else OUT) as DEST:
        full_cases() if args.full else small_cases()
