#!/usr/bin/env python3
"""Write tests/fixtures/attention_grads.safetensors: the gradients of
F.scaled_dot_product_attention from torch.autograd, for the fused backward.

Each case `NAME` holds `NAME.q` `(B, H, L, D)`, `NAME.k`, `NAME.v`
`(B, Hkv, S, D)` (grouped-query where Hkv < H: each kv head serves H / Hkv
consecutive query heads, `repeat_interleave`, so that autograd sums dK and
dV over them), `NAME.g` (the upstream gradient of the output), `NAME.out`
and `NAME.dq`, `NAME.dk`, `NAME.dv`, computed in float64 from the float32
inputs and stored as float32. A case's mask, where it has one, is
`NAME.mask` as PyTorch is given it. The metadata "case" (JSON) gives each
case's `mask` in our terms (`causal_top_left`, `additive`,
`attend_where_true`, `key_padding` with its `lengths`) and its `scale`
(null: 1/sqrt(D)). Every query row sees at least one key (PyTorch's
wholly masked row is NaN, ours zeros).

Writes a temporary file and renames it over the committed one only when every
case ran. Regenerate (the venv of scripts/requirements.txt):

    .venv-ref/bin/python scripts/make_attention_grad_fixtures.py
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from staging import staged_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "attention_grads.safetensors")

# name: (batch, heads, kv_heads, q_len, kv_len, head_dim, mask, scale)
CASES = {
    # Grouped-query, PyTorch's is_causal (top-left: key j for query i <= j).
    "gqa_causal": (2, 4, 2, 7, 11, 8, "causal_top_left", None),
    # A float mask per batch row, added to the scores; a given scale.
    "additive": (2, 3, 3, 5, 9, 16, "additive", 0.3),
    # A boolean mask, True = may attend, over keys past the backward's
    # 128-key tiles; an odd head dim; multi-query.
    "attend_where_true": (1, 2, 1, 6, 140, 5, "attend_where_true", None),
    # Key padding: batch row 1 has 3 real keys of 6.
    "key_padding": (2, 2, 2, 4, 6, 8, "key_padding", None),
}
LENGTHS = [6, 3]


def main():
    torch.manual_seed(0)
    tensors, cases = {}, {}
    for name, (b, h, kh, l, s, d, kind, scale) in CASES.items():
        q, k, v = torch.randn(b, h, l, d), torch.randn(b, kh, s, d), torch.randn(b, kh, s, d)
        g = torch.randn(b, h, l, d)
        kwargs, meta = {}, {"mask": kind, "scale": scale}
        if kind == "causal_top_left":
            kwargs["is_causal"] = True
        elif kind == "additive":
            mask = torch.randn(b, 1, l, s)
            tensors[f"{name}.mask"] = mask
            kwargs["attn_mask"] = mask.double()
        elif kind == "attend_where_true":
            mask = torch.rand(l, s) > 0.3
            mask[:, 0] = True
            tensors[f"{name}.mask"] = mask
            kwargs["attn_mask"] = mask
        elif kind == "key_padding":
            meta["lengths"] = LENGTHS
            kwargs["attn_mask"] = (torch.arange(s)[None, :] < torch.tensor(LENGTHS)[:, None])[:, None, None, :]
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        rep = h // kh
        out = F.scaled_dot_product_attention(
            q64, k64.repeat_interleave(rep, dim=1), v64.repeat_interleave(rep, dim=1), scale=scale, **kwargs
        )
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), g.double())
        for part, t in [("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("dq", dq), ("dk", dk), ("dv", dv)]:
            tensors[f"{name}.{part}"] = t.detach().float()
        cases[name] = meta
    meta = {"case": json.dumps({"torch": torch.__version__, "cases": cases})}
    with staged_file(OUT) as tmp:
        save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=meta)
    print(f"wrote {os.path.abspath(OUT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
