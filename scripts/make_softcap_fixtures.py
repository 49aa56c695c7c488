#!/usr/bin/env python3
"""Write tests/fixtures/softcap.safetensors: logit soft-capped attention as HF
transformers' Gemma 2 computes it (`eager_attention_forward` in
`transformers/models/gemma2/modeling_gemma2.py`: scores `q kᵀ · scaling`,
then `softcap · tanh(scores / softcap)`, then the additive mask, softmax in
f32, times the values), on small random inputs, with its gradients.

Each case `NAME` holds `NAME.q` `(B, H, L, D)`, `NAME.k`, `NAME.v`
`(B, Hkv, S, D)` (grouped-query: H = 2·Hkv), `NAME.allowed` (bool
`(B, 1, L, S)`, True = may attend: the mask HF is given, as
`torch.finfo.min` where False) and `NAME.out` `(B, H, L, D)`. The metadata
"case" (JSON) gives each case's `softcap`, `scaling`
(`query_pre_attn_scalar ** -0.5`, as Gemma 2's attention sets it) and the
mask in our terms: `causal_offset` (key j visible to query i iff j <= i +
offset), `window` (and j > i + offset - window, HF's sliding window) and
`left_padding` (per batch row, keys before it are padding). No query row is
wholly masked (HF's `finfo.min` mask would average such a row; ours gives
zeros). The case `grad` also holds `grad.g` (the upstream gradient of the
output) and `grad.dq`, `grad.dk`, `grad.dv` from `torch.autograd`.

Writes a temporary file and renames it over the committed one only when every
case ran. Regenerate (the venv of scripts/requirements.txt):

    .venv-ref/bin/python scripts/make_softcap_fixtures.py
"""

import json
import os
import types

import torch
import transformers
from safetensors.torch import save_file
from staging import staged_file
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "softcap.safetensors")

# name: (batch, heads, kv_heads, q_len, kv_len, head_dim, input std, softcap,
#        query_pre_attn_scalar, causal, window, left padding per batch row)
CASES = {
    # Gemma 2's cap and a prefill; inputs large enough that some scores
    # reach the tanh's bend.
    "causal_cap50": (2, 4, 2, 7, 7, 16, 5.0, 50.0, 256, True, None, [0, 0]),
    # A tight cap (most scores bent) with a sliding window.
    "window_cap5": (1, 4, 2, 9, 9, 16, 3.0, 5.0, 16, True, 3, [0]),
    # A decode step over a left-padded cache.
    "decode_cap20": (2, 4, 2, 1, 40, 32, 4.0, 20.0, 24, True, None, [0, 13]),
    # No causal rule, key padding only; the gradients come from this one.
    "grad": (2, 2, 1, 5, 6, 8, 3.0, 4.0, 8, False, None, [1, 0]),
}


def allowed_mask(b, l, s, causal, window, left):
    """(B, 1, L, S) bool: our Mask's rules written out."""
    offset = s - l  # bottom-right: the last query sees every key
    i = torch.arange(l)[:, None]
    j = torch.arange(s)[None, :]
    rule = torch.ones(l, s, dtype=torch.bool)
    if causal:
        rule &= j <= i + offset
        if window is not None:
            rule &= j > i + offset - window
    pad = torch.arange(s)[None, :] >= torch.tensor(left)[:, None]  # (B, S)
    return rule[None, None] & pad[:, None, None, :]


def main():
    torch.manual_seed(0)
    tensors, cases = {}, {}
    for name, (b, h, kh, l, s, d, std, cap, qpas, causal, window, left) in CASES.items():
        q = (torch.randn(b, h, l, d) * std).requires_grad_(name == "grad")
        k = (torch.randn(b, kh, s, d) * std).requires_grad_(name == "grad")
        v = torch.randn(b, kh, s, d).requires_grad_(name == "grad")
        allowed = allowed_mask(b, l, s, causal, window, left)
        assert allowed.any(-1).all(), f"{name}: a query row is wholly masked"
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        module = types.SimpleNamespace(head_dim=d, num_key_value_groups=h // kh, training=False)
        scaling = qpas**-0.5
        out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scaling, softcap=cap)
        # eager_attention_forward returns (B, L, H, D); ours is (B, H, L, D).
        out = out.transpose(1, 2)
        for part, t in [("q", q), ("k", k), ("v", v), ("allowed", allowed), ("out", out)]:
            tensors[f"{name}.{part}"] = t.detach().contiguous()
        if name == "grad":
            g = torch.randn(out.shape)
            (out * g).sum().backward()
            tensors["grad.g"] = g
            for part, t in [("dq", q), ("dk", k), ("dv", v)]:
                tensors[f"grad.{part}"] = t.grad.contiguous()
        cases[name] = {
            "softcap": cap,
            "scaling": scaling,
            "query_pre_attn_scalar": qpas,
            "causal_offset": s - l if causal else None,
            "window": window,
            "left_padding": left,
        }
    meta = {
        "case": json.dumps(
            {"torch": torch.__version__, "transformers": transformers.__version__, "cases": cases}
        )
    }
    with staged_file(OUT) as tmp:
        save_file(tensors, tmp, metadata=meta)
    print(f"wrote {os.path.abspath(OUT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
