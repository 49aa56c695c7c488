"""Model folders as HF transformers and timm write them, for tests/vit_folders.rs.

Random-init TINY models (width 32, 2 blocks, 2 heads, patch 8, image 32,
5 classes), each saved by its library's own writer:

- hf_vit/            ViTForImageClassification.save_pretrained + ViTImageProcessorPil
- hf_deit/           DeiTForImageClassification + DeiTImageProcessorPil (resize 35, crop 32)
- hf_deit_teacher/   DeiTForImageClassificationWithTeacher, sharded (max_shard_size 40KB)
- timm_vit/          timm vit_tiny_patch16_224 (overridden sizes) through save_for_hf
- timm_deit_distilled/  timm deit_tiny_distilled_patch16_224 through save_for_hf

timm_names.json (what timm builds for each of the 34 standard names the
Rust side maps to sizes), and photo.png (64x48 RGB: gradients, a disc, a bar, noise), and per folder
expected/<name>.safetensors with the library's own preprocessing of
photo.png (`input`, (1, 3, 32, 32)) and the model's logits for it
(`logits`, (1, 5)); for the HF folders also `input_torchvision`, what
transformers 5's default (torchvision) ViTImageProcessor gives.

Everything is written to a temporary folder first (scripts/staging.py);
tests/fixtures/folders is replaced only when all of it succeeded. No
network. The venv of scripts/requirements.txt:

    .venv-ref/bin/python scripts/make_folder_fixtures.py
    .venv-ref/bin/python scripts/make_folder_fixtures.py --full target/full-folders   # 700 MB, not committed
"""

import json
import os
import sys

import numpy as np
import timm
import timm.data
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.models import save_for_hf
from staging import staged
from transformers import (
    DeiTConfig,
    DeiTForImageClassification,
    DeiTForImageClassificationWithTeacher,
    DeiTImageProcessor,
    DeiTImageProcessorPil,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
    ViTImageProcessorPil,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "folders")
LABELS = ["cat", "dog", "fish", "bird", "frog"]
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=32, patch_size=8, num_labels=5,
            id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)})
TIMM_TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def photo():
    """64 wide, 48 high: colour gradients, a disc, a dark bar and some noise."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:64].astype(np.float64)
    r = 255 * x / 63
    g = 255 * y / 47
    b = 128 + 100 * np.sin(x / 5) * np.cos(y / 7)
    disc = (x - 40) ** 2 + (y - 20) ** 2 < 12 ** 2
    r[disc], g[disc], b[disc] = 250, 220, 30
    bar = (np.abs(x - y - 5) < 3)
    r[bar], g[bar], b[bar] = 20, 30, 60
    img = np.stack([r, g, b], -1) + rng.normal(0, 8, (48, 64, 3))
    return Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8), "RGB")


def perturb(model, scale=0.1):
    """The random inits leave tokens, biases and heads near zero and the
    logits near constant; noise on every weight makes each one count."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def save_expected(tmp, name, inputs, logits, extra=None):
    os.makedirs(os.path.join(tmp, "expected"), exist_ok=True)
    tensors = {"input": inputs.contiguous(), "logits": logits.detach().contiguous()}
    tensors.update(extra or {})
    save_file(tensors, os.path.join(tmp, "expected", f"{name}.safetensors"))
    print(f"{name}: logits {logits.detach().numpy().round(4).tolist()}")


def hf_folder(tmp, img, name, model, pil_proc, tv_proc, shard=None):
    d = os.path.join(tmp, name)
    model.eval()
    perturb(model)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, **kwargs)
    pil_proc.save_pretrained(d)
    x = pil_proc(images=img, return_tensors="pt")["pixel_values"]
    x_tv = tv_proc(images=img, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    print(f"{name}: |PIL - torchvision processor| max {float((x - x_tv).abs().max()):.4f}")
    save_expected(tmp, name, x, logits, {"input_torchvision": x_tv.contiguous()})


def timm_folder(tmp, img, name, arch):
    d = os.path.join(tmp, name)
    model = timm.create_model(arch, pretrained=False, **TIMM_TINY).eval()
    perturb(model)
    save_for_hf(model, d, safe_serialization=True, model_config={"label_names": LABELS})
    # The eval transform from the config.json just written, as a user of the folder gets it.
    with open(os.path.join(d, "config.json")) as f:
        saved = json.load(f)
    data_cfg = timm.data.resolve_data_config({}, pretrained_cfg=saved["pretrained_cfg"])
    transform = timm.data.create_transform(**data_cfg, is_training=False)
    x = transform(img).unsqueeze(0)
    with torch.no_grad():
        logits = model(x)
    print(f"{name}: {data_cfg} {transform}")
    save_expected(tmp, name, x, logits)


def timm_names(tmp):
    """What timm builds for every standard ViT/DeiT name multihead maps to
    sizes (on the meta device: no memory), for the Rust name parser."""
    import re
    pat = re.compile(r"^(vit|deit|deit3)_(tiny|small|medium|base|large|huge)(_distilled)?_patch(8|14|16|32)_(\d+)$")
    out = {}
    for name in sorted(n for n in timm.list_models() if pat.match(n)):
        with torch.device("meta"):
            m = timm.create_model(name, pretrained=False)
        blk = m.blocks[0]
        out[name] = dict(
            embed_dim=m.embed_dim, depth=len(m.blocks), num_heads=blk.attn.num_heads,
            patch_size=m.patch_embed.patch_size[0], img_size=m.patch_embed.img_size[0],
            mlp_hidden=blk.mlp.fc1.out_features, qkv_bias=blk.attn.qkv.bias is not None,
            qk_norm=not isinstance(blk.attn.q_norm, torch.nn.Identity),
            layer_scale=not isinstance(blk.ls1, torch.nn.Identity),
            no_embed_class=m.no_embed_class, num_prefix_tokens=m.num_prefix_tokens,
            dist_token=getattr(m, "dist_token", None) is not None, global_pool=m.global_pool,
            fc_norm=not isinstance(m.fc_norm, torch.nn.Identity), eps=blk.norm1.eps,
            num_classes=m.num_classes)
    assert len(out) >= 30, sorted(out)
    with open(os.path.join(tmp, "timm_names.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"timm_names.json: {len(out)} names")


def full(out_dir):
    """Full-size random-init models (not committed, 350 MB each) and a
    640x480 photo: timm vit_base_patch16_224 (crop_pct 0.9: resize 248,
    crop 224) and HF DeiT-base with teacher sharded in four, with PyTorch's
    probabilities in probs.json, for `cargo test --release --test
    vit_folders -- --ignored`."""
    torch.manual_seed(0)
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:480, 0:640].astype(np.float64)
    img = np.stack([255 * x / 639, 255 * y / 479, 128 + 100 * np.sin(x / 25) * np.cos(y / 37)], -1)
    img = Image.fromarray(np.clip(np.round(img + rng.normal(0, 10, img.shape)), 0, 255).astype(np.uint8))
    img.save(os.path.join(out_dir, "photo.png"))
    probs = {}
    m = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10).eval()
    perturb(m, 0.02)
    d = os.path.join(out_dir, "timm_vit_base")
    save_for_hf(m, d, safe_serialization=True)
    with open(os.path.join(d, "config.json")) as f:
        saved = json.load(f)
    t = timm.data.create_transform(**timm.data.resolve_data_config({}, pretrained_cfg=saved["pretrained_cfg"]),
                                   is_training=False)
    with torch.no_grad():
        probs["timm_vit_base"] = torch.softmax(m(t(img)[None]), -1)[0].tolist()
    deit = DeiTForImageClassificationWithTeacher(DeiTConfig(num_labels=10)).eval()
    perturb(deit, 0.02)
    d = os.path.join(out_dir, "hf_deit_base_teacher")
    deit.save_pretrained(d, max_shard_size="100MB")
    proc = DeiTImageProcessorPil()
    proc.save_pretrained(d)
    with torch.no_grad():
        x = proc(images=img, return_tensors="pt")["pixel_values"]
        probs["hf_deit_base_teacher"] = torch.softmax(deit(pixel_values=x).logits, -1)[0].tolist()
    with open(os.path.join(out_dir, "probs.json"), "w") as f:
        json.dump(probs, f)
    print(f"wrote {out_dir}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--full":
        return full(sys.argv[2])
    torch.manual_seed(0)
    with staged(OUT) as tmp:
        img = photo()
        img.save(os.path.join(tmp, "photo.png"))
        size = {"height": 32, "width": 32}
        hf_folder(tmp, img, "hf_vit", ViTForImageClassification(ViTConfig(**TINY)),
                  ViTImageProcessorPil(size=size), ViTImageProcessor(size=size))
        # 35: an odd margin, where transformers' crop (rounds down) and torchvision's (rounds half to even) differ.
        deit_proc = dict(size={"height": 35, "width": 35}, crop_size=size)
        hf_folder(tmp, img, "hf_deit", DeiTForImageClassification(DeiTConfig(**TINY)),
                  DeiTImageProcessorPil(**deit_proc), DeiTImageProcessor(**deit_proc))
        hf_folder(tmp, img, "hf_deit_teacher",
                  DeiTForImageClassificationWithTeacher(DeiTConfig(**TINY)),
                  DeiTImageProcessorPil(**deit_proc), DeiTImageProcessor(**deit_proc), shard="40KB")
        timm_folder(tmp, img, "timm_vit", "vit_tiny_patch16_224")
        timm_folder(tmp, img, "timm_deit_distilled", "deit_tiny_distilled_patch16_224")
        timm_names(tmp)
        shards = [f for f in os.listdir(os.path.join(tmp, "hf_deit_teacher")) if f.endswith(".safetensors")]
        assert len(shards) > 1, f"not sharded: {shards}"
        # Only the safetensors are kept (save_pretrained writes no pickles).
        for root, _, files in os.walk(tmp):
            for f in files:
                assert not f.endswith((".bin", ".pth")), f
        total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp) for f in fs)
        print(f"total {total / 1024:.0f} KB")
        assert total < 1_500_000, "fixtures too large"
    # staged() has moved every folder and file over OUT (a folder replaces a folder whole).

if __name__ == "__main__":
    sys.exit(main())
