#!/usr/bin/env python3
"""Write tests/fixtures/sdpa_masks.safetensors: F.scaled_dot_product_attention
with masks as PyTorch users hold them.

* Boolean masks stored as safetensors BOOL (what `save_file` writes for a
  `torch.bool` tensor), which our loader must read as u8 masks.
* PyTorch's mask broadcasting: `(L, 1)`, `(1, S)`, `(H, L, S)` with
  batch > 1, `(B, 1, L, S)`, both boolean (True = may attend) and float.

Each case `NAME` holds `NAME.mask` and `NAME.out`; `q`, `k`, `v` are shared
(batch 2, heads 3, L 4, S 5, head_dim 8). Where a boolean mask hides every
key of a query, PyTorch's row is NaN (ours: zeros). The metadata "case" (JSON) lists
the cases with their mask shapes and dtypes.

Writes a temporary file and renames it over the committed one only when every
case ran. Regenerate (the venv of scripts/requirements.txt):

    .venv-ref/bin/python scripts/make_sdpa_mask_fixtures.py
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from staging import staged_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "sdpa_masks.safetensors")


def main():
    torch.manual_seed(0)
    b, h, l, s, d = 2, 3, 4, 5, 8
    q, k, v = torch.randn(b, h, l, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    tensors = {"q": q, "k": k, "v": v}
    cases = {}
    shapes = {"l1": (l, 1), "one_s": (1, s), "hls": (h, l, s), "b1ls": (b, 1, l, s)}
    for name, shape in shapes.items():
        # A query row whose keys are all masked is NaN in PyTorch and zeros
        # in ours (documented); the test reads NaN rows as zeros.
        allowed = torch.rand(shape) > 0.4
        tensors[f"bool_{name}.mask"] = allowed.contiguous()
        tensors[f"bool_{name}.out"] = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        additive = torch.randn(shape)
        tensors[f"float_{name}.mask"] = additive
        tensors[f"float_{name}.out"] = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        cases[f"bool_{name}"] = {"shape": list(allowed.shape), "dtype": "bool", "convention": "True = may attend"}
        cases[f"float_{name}"] = {"shape": list(shape), "dtype": "float32"}
    meta = {"case": json.dumps({"torch": torch.__version__, "q": [b, h, l, d], "kv_len": s, "cases": cases})}
    with staged_file(OUT) as tmp:
        save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata=meta)
    print(f"wrote {os.path.abspath(OUT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
