#!/usr/bin/env python3
"""Fixtures for crates/attention/tests/hydra.rs: Hydra attention as the paper writes
it (Bolya et al., 2022, Algorithm 1), inside timm-style `qkv`/`proj`
projections, computed in float64 from float32 inputs.

    .venv-ref/bin/python scripts/make_hydra_fixtures.py

Writes tests/fixtures/hydra/<case>.safetensors: `x`, `attn.qkv.*`,
`attn.proj.*`, optionally `key_padding` (uint8, 1 = padding key), and `out`;
the case's options as JSON in the metadata under "case".
"""

import json
import os

import torch
from safetensors.torch import save_file

from staging import staged

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hydra")
# Where `case` writes: a temporary folder while `main` runs (see staging.py).
DEST = OUT


def hydra(q, k, v, causal=False, pad=None):
    """The paper's Algorithm 1, with a running sum for the causal variant."""
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    kv = k * v
    if pad is not None:
        kv = kv.masked_fill(pad[..., None].bool(), 0.0)
    kv = kv.cumsum(dim=-2) if causal else kv.sum(dim=-2, keepdim=True)
    return q * kv


def case(name, b, n, e, causal=False, lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, e, generator=g)
    qkv = torch.nn.Linear(e, 3 * e)
    proj = torch.nn.Linear(e, e)
    with torch.no_grad():
        for p in (*qkv.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * e**-0.5)
    pad = None
    tensors = {}
    if lengths is not None:
        pad = (torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]).to(torch.uint8)
        tensors["key_padding"] = pad
    with torch.no_grad():
        q, k, v = qkv.double()(x.double()).chunk(3, dim=-1)
        out = proj.double()(hydra(q, k, v, causal, pad))
    tensors.update({
        "x": x,
        "attn.qkv.weight": qkv.weight.float(),
        "attn.qkv.bias": qkv.bias.float(),
        "attn.proj.weight": proj.weight.float(),
        "attn.proj.bias": proj.bias.float(),
        "out": out.float(),
    })
    meta = {"causal": causal, "embed_dim": e}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(DEST, f"{name}.safetensors"), metadata={"case": json.dumps(meta)})


def main():
    global DEST
    # The committed fixtures are replaced only once every case is written.
    with staged(OUT, replace_all=True) as DEST:
        write_cases()
    print("wrote", OUT)


def write_cases():
    case("plain", 2, 17, 32, seed=1)
    # 150 positions: the running sum spans three blocks of 64.
    case("causal", 2, 150, 16, causal=True, seed=2)
    case("key_padding", 3, 11, 24, lengths=[11, 7, 1], seed=3)
    case("causal_key_padding", 2, 70, 16, causal=True, lengths=[70, 40], seed=4)


if __name__ == "__main__":
    main()
