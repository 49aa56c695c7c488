#!/usr/bin/env python3
"""Write the PyTorch fixtures for the transformer encoder-decoder's tests.

Each case is one safetensors file in tests/fixtures/transformer/: an
`nn.Transformer` state_dict under `model.` (PyTorch's own names, every
parameter randomised), the inputs `src` and `tgt`, the masks, and PyTorch's
outputs `memory` (the encoder's) and `output` (the decoder's). The case's
description is a JSON string in the metadata under "case": `config` (the
constructor arguments, as `TransformerConfig` reads them) and, for each of
`src`, `tgt` and `memory`, which masks are set and of which kind:
`attn` ("ignore_where_true" | "additive" | null, tensor `<part>_mask`),
`key_padding` ("pad_where_true" | "additive" | null, tensor
`<part>_key_padding_mask`) and `causal` ("top_left" | null: PyTorch got
`<part>_is_causal=True` together with the matching explicit mask, which the
Rust side replaces by `Causal::TopLeft`).

PyTorch runs in eval mode with autograd on: that keeps it on the reference
path (its fast path zeroes the encoder output at padded positions).

Regenerate (a second; the venv of scripts/requirements.txt):

    .venv-ref/bin/python scripts/make_transformer_fixtures.py

The files are written to a temporary folder and replace the committed ones
only when every case has been written.

The Rust side is crates/models/tests/transformer_pytorch.rs.
"""

import json
import os

import torch
import torch.nn as nn
from safetensors.torch import save_file

from staging import staged

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "transformer")
# Where `save` writes: a temporary folder while `main` runs (see staging.py).
DEST = OUT

torch.manual_seed(0)

E, H, FF = 16, 4, 32
B, S, T = 3, 7, 5
SRC_LENS = [7, 4, 2]
TGT_LENS = [5, 3, 4]


def randomize(model):
    """Every parameter non-trivial (PyTorch zeroes biases, ones LayerNorm weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))


def padding(lengths, n):
    """Boolean (len(lengths), n), True = padding (right-padded)."""
    return torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]


def causal(q, k):
    """Boolean (q, k), True = masked: key j hidden from query i iff j > i."""
    return torch.arange(k)[None, :] > torch.arange(q)[:, None]


def random_ignore(shape):
    """Random boolean mask, True = masked, that never masks key 0 (no row is fully masked)."""
    m = torch.rand(shape) < 0.3
    m[..., 0] = False
    return m


def to_additive(mask):
    """Boolean (True = masked) -> float with -inf where masked and small noise elsewhere."""
    return torch.where(mask, torch.tensor(float("-inf")), 0.1 * torch.randn(mask.shape))


def save(name, tensors, case):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        if v.dtype == torch.bool:
            tensors[k] = v.to(torch.uint8)
    save_file(tensors, os.path.join(DEST, f"{name}.safetensors"), metadata={"case": json.dumps(case)})


def case(name, *, norm_first, activation="relu", batch_first=True, bias=True, eps=1e-5,
         unbatched=False, src=None, tgt=None, memory=None, layers=(2, 2)):
    """`src`, `tgt`, `memory`: dicts with optional `attn` (tensor, kind), `key_padding`
    (tensor, kind), `causal` (bool) - the batch-first problem's masks."""
    cfg = dict(
        d_model=E, nhead=H, num_encoder_layers=layers[0], num_decoder_layers=layers[1],
        dim_feedforward=FF, dropout=0.0, activation=activation, layer_norm_eps=eps,
        batch_first=batch_first, norm_first=norm_first, bias=bias,
    )
    model = nn.Transformer(**cfg)
    randomize(model)
    model.eval()
    x_src = torch.randn(S, E) if unbatched else torch.randn(B, S, E)
    x_tgt = torch.randn(T, E) if unbatched else torch.randn(B, T, E)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors["src"], tensors["tgt"] = x_src, x_tgt
    kwargs, desc = {}, {}
    torch_names = {
        "src": ("src_mask", "src_key_padding_mask", "src_is_causal"),
        "tgt": ("tgt_mask", "tgt_key_padding_mask", "tgt_is_causal"),
        "memory": ("memory_mask", "memory_key_padding_mask", "memory_is_causal"),
    }
    for part, spec in (("src", src), ("tgt", tgt), ("memory", memory)):
        spec = spec or {}
        attn_name, kp_name, causal_name = torch_names[part]
        d = {"attn": None, "key_padding": None, "causal": None}
        if "attn" in spec:
            t, kind = spec["attn"]
            kwargs[attn_name] = t
            tensors[f"{part}_mask"] = t
            d["attn"] = kind
        if "key_padding" in spec:
            t, kind = spec["key_padding"]
            kwargs[kp_name] = t
            tensors[f"{part}_key_padding_mask"] = t
            d["key_padding"] = kind
        if spec.get("causal"):
            kwargs[causal_name] = True
            d["causal"] = "top_left"
        desc[part] = d
    # PyTorch's seq-first inputs; masks stay as they are (batch-first shapes).
    a, b = (x_src, x_tgt) if (batch_first or unbatched) else (x_src.transpose(0, 1), x_tgt.transpose(0, 1))
    memory_out = model.encoder(a, mask=kwargs.get("src_mask"),
                               src_key_padding_mask=kwargs.get("src_key_padding_mask"),
                               is_causal=kwargs.get("src_is_causal"))
    out = model(a, b, **kwargs)
    if not (batch_first or unbatched):
        tensors["src"], tensors["tgt"] = a, b
    assert torch.isfinite(out).all() and torch.isfinite(memory_out).all(), name
    tensors["memory"], tensors["output"] = memory_out, out
    save(name, tensors, {"config": cfg, "masks": desc, "unbatched": unbatched})
    print(name, tuple(out.shape))


def main():
    global DEST
    with staged(OUT, replace_all=True) as DEST:
        write_cases()


def write_cases():
    src_pad = padding(SRC_LENS, S)
    tgt_pad = padding(TGT_LENS, T)
    tgt_causal = causal(T, T)

    # The seq2seq shape: padded sources, causal padded targets, memory padding.
    for norm_first in (False, True):
        tag = "pre_norm" if norm_first else "post_norm"
        case(f"{tag}_padded", norm_first=norm_first,
             src={"key_padding": (src_pad, "pad_where_true")},
             tgt={"attn": (tgt_causal, "ignore_where_true"), "causal": True,
                  "key_padding": (tgt_pad, "pad_where_true")},
             memory={"key_padding": (src_pad, "pad_where_true")})
        # Every mask kind at once: bool and float attention masks, 2-D and
        # (B*H, L, S), float key padding.
        case(f"{tag}_every_mask", norm_first=norm_first, activation="gelu",
             src={"attn": (random_ignore((S, S)), "ignore_where_true"),
                  "key_padding": (to_additive(src_pad), "additive")},
             tgt={"attn": (to_additive(tgt_causal), "additive"),
                  "key_padding": (to_additive(tgt_pad), "additive")},
             memory={"attn": (random_ignore((B * H, T, S)), "ignore_where_true"),
                     "key_padding": (src_pad, "pad_where_true")})
        # Seq-first (PyTorch's default layout), float 3-D memory mask.
        case(f"{tag}_seq_first", norm_first=norm_first, batch_first=False,
             src={"key_padding": (src_pad, "pad_where_true")},
             tgt={"attn": (tgt_causal, "ignore_where_true"), "causal": True},
             memory={"attn": (to_additive(random_ignore((B * H, T, S))), "additive"),
                     "key_padding": (src_pad, "pad_where_true")})

    # No biases anywhere (LayerNorm(bias=False) too), another epsilon,
    # causal encoder and a causal memory mask.
    case("no_bias_causal_src_memory", norm_first=True, activation="gelu", bias=False, eps=1e-3,
         src={"attn": (causal(S, S), "ignore_where_true"), "causal": True},
         tgt={"attn": (tgt_causal, "ignore_where_true"), "causal": True},
         memory={"attn": (causal(T, S), "ignore_where_true"), "causal": True})
    # Unbatched 2-D inputs, no masks at all, one layer each side.
    case("unbatched_no_mask", norm_first=False, activation="gelu", unbatched=True, layers=(1, 1))
    # Three layers, no masks: the plain stack.
    case("three_layers_no_mask", norm_first=False, layers=(3, 3))


if __name__ == "__main__":
    main()
