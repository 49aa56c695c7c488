#!/usr/bin/env python3
"""Write the PyTorch fixtures for multihead-attention's tests.

Each case is one safetensors file in tests/fixtures/mha/: the module's
state_dict under `mha.` (PyTorch's own names), the inputs, the masks and
PyTorch's outputs; the case's description (config and forward options) is a
JSON string in the file's metadata under "case".

Regenerate (a few seconds; the venv of scripts/requirements.txt):

    python3 -m venv .venv-ref && .venv-ref/bin/pip install -r scripts/requirements.txt
    .venv-ref/bin/python scripts/make_mha_fixtures.py

The files are written to a temporary folder and replace the committed ones
only when every case has been written.

The Rust side is crates/attention/tests/mha_pytorch.rs.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from staging import staged

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "mha")
# Where `save` writes: a temporary folder while `main` runs (see staging.py).
DEST = OUT

torch.manual_seed(0)


def randomize(module):
    """PyTorch initialises biases to zero; fixtures want every parameter non-trivial."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.4)


def padding_from_lengths(kv_len, lengths):
    """Boolean (len(lengths), kv_len), True = padding, from per-row valid lengths."""
    return torch.arange(kv_len)[None, :] >= torch.tensor(lengths)[:, None]


def causal_ignore(q_len, kv_len, offset):
    """Boolean (q_len, kv_len), True = masked: key j hidden from query i iff j > i + offset."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    return j > i + offset


def save(name, tensors, case):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        if v.dtype == torch.bool:
            tensors[k] = v.to(torch.uint8)
    save_file(tensors, os.path.join(DEST, f"{name}.safetensors"), metadata={"case": json.dumps(case)})


def mha_case(
    name,
    *,
    E=16,
    H=4,
    B=2,
    L=5,
    S=None,
    bias=True,
    add_bias_kv=False,
    add_zero_attn=False,
    kdim=None,
    vdim=None,
    self_attn=None,
    layout="batch_first",
    unbatched=False,
    need_weights="averaged",
    key_padding=None,
    attn_mask=None,
    causal=None,
):
    """One nn.MultiheadAttention case.

    key_padding: None | ("pad_where_true" | "additive", lengths)
    attn_mask: None | (kind, rank) with kind in ignore_where_true / additive and rank 2 or 3
    causal: None | "top_left" | "bottom_right" | {"offset": n}: given to Rust as our
        Causal rule and to PyTorch as the equivalent boolean attn_mask.
    """
    S = L if S is None else S
    if self_attn is None:
        self_attn = kdim is None and vdim is None and S == L
    mha = torch.nn.MultiheadAttention(
        E,
        H,
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=kdim,
        vdim=vdim,
        batch_first=(layout == "batch_first"),
    )
    randomize(mha)
    mha.eval()
    kd, vd = kdim or E, vdim or E

    def shape(t_len, dim):
        if unbatched:
            return (t_len, dim)
        return (B, t_len, dim) if layout == "batch_first" else (t_len, B, dim)

    query = torch.randn(shape(L, E))
    if self_attn:
        key = value = query
    else:
        key = torch.randn(shape(S, kd))
        value = torch.randn(shape(S, vd))

    tensors = {f"mha.{k}": v for k, v in mha.state_dict().items()}
    # Self-attention cases store only `query`: the Rust test passes it as
    # key and value too, which is what selects the fused projection.
    tensors["query"] = query
    if not self_attn:
        tensors.update(key=key, value=value)
    kw = {}
    nb = 1 if unbatched else B
    if key_padding is not None:
        kind, lengths = key_padding
        assert len(lengths) == nb, name
        kp = padding_from_lengths(S, lengths)
        if kind == "additive":
            kp = torch.zeros(kp.shape).masked_fill(kp, float("-inf")) + torch.randn(kp.shape) * 0.5 * (~kp)
        if unbatched:
            kp = kp[0]
        kw["key_padding_mask"] = kp
        tensors["key_padding_mask"] = kp
    torch_mask = None
    if attn_mask is not None:
        kind, rank = attn_mask
        shape_m = (L, S) if rank == 2 else (nb * H, L, S)
        # Random mask that keeps key 0 visible, so no row is fully masked
        # (PyTorch gives NaN there, we give zeros).
        m = torch.rand(shape_m) < 0.35
        m[..., 0] = False
        if kind == "additive":
            m = torch.randn(shape_m).masked_fill(m, float("-inf"))
        torch_mask = m
        tensors["attn_mask"] = m
    if causal is not None:
        offset = {"top_left": 0, "bottom_right": S - L}.get(causal) if isinstance(causal, str) else causal["offset"]
        cm = causal_ignore(L, S, offset)
        if torch_mask is None:
            torch_mask = cm
        elif torch_mask.dtype == torch.bool:
            torch_mask = torch_mask | cm
        else:
            torch_mask = torch_mask.masked_fill(cm, float("-inf"))
    if torch_mask is not None:
        kw["attn_mask"] = torch_mask
    with torch.no_grad():
        out, w = mha(
            query,
            key,
            value,
            need_weights=need_weights != "no",
            average_attn_weights=need_weights == "averaged",
            **kw,
        )
    tensors["output"] = out
    if w is not None:
        tensors["weights"] = w
    assert torch.isfinite(out).all(), name
    case = {
        "kind": "mha",
        "config": {
            "embed_dim": E,
            "num_heads": H,
            "bias": bias,
            "add_bias_kv": add_bias_kv,
            "add_zero_attn": add_zero_attn,
            "kdim": kdim,
            "vdim": vdim,
        },
        "self_attn": self_attn,
        "layout": layout,
        "need_weights": need_weights,
        "key_padding": None if key_padding is None else key_padding[0],
        "attn_mask": None if attn_mask is None else attn_mask[0],
        "causal": causal,
    }
    save(name, tensors, case)


def sdpa_case(name, *, B=2, H=4, KH=None, L=5, S=7, D=8, Dv=None, mask=None, causal=None, scale=None):
    """One F.scaled_dot_product_attention case on (B, H, L, D) tensors.

    mask: None | ("attend_where_true" | "additive", shape)
    causal: None | "top_left" | "bottom_right"
    """
    KH = KH or H
    Dv = Dv or D
    q = torch.randn(B, H, L, D)
    k = torch.randn(B, KH, S, D)
    v = torch.randn(B, KH, S, Dv)
    tensors = dict(q=q, k=k, v=v)
    kw = {}
    if mask is not None:
        kind, shape_m = mask
        m = torch.rand(shape_m) > 0.3
        m[..., 0] = True
        if kind == "additive":
            m = torch.randn(shape_m).masked_fill(~m, float("-inf"))
        tensors["attn_mask"] = m
        kw["attn_mask"] = m
    if causal == "top_left":
        kw["is_causal"] = True
    elif causal == "bottom_right":
        from torch.nn.attention.bias import causal_lower_right

        kw["attn_mask"] = causal_lower_right(L, S)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=KH != H, **kw)
    assert torch.isfinite(out).all(), name
    tensors["output"] = out
    case = {"kind": "sdpa", "attn_mask": None if mask is None else mask[0], "causal": causal, "scale": scale}
    save(name, tensors, case)


def main():
    global DEST
    # The committed fixtures are replaced only once every case is written;
    # cases no longer made are removed then.
    with staged(OUT, replace_all=True) as DEST:
        write_cases()
    n = len([f for f in os.listdir(OUT) if f.endswith(".safetensors")])
    print(f"wrote {n} cases to {os.path.normpath(OUT)}", file=sys.stderr)


def write_cases():
    # Self-attention and weights.
    mha_case("self_basic")
    mha_case("self_per_head_weights", need_weights="per_head")
    mha_case("self_no_weights", need_weights="no")
    mha_case("self_no_bias", bias=False)
    mha_case("self_one_head", H=1)
    mha_case("self_wide", E=32, H=8, B=3, L=9)
    # Cross-attention.
    mha_case("cross_same_dims", L=4, S=7, self_attn=False)
    mha_case("cross_kdim_vdim", L=4, S=6, kdim=12, vdim=10)
    mha_case("cross_kdim_vdim_per_head", L=3, S=8, kdim=20, vdim=6, need_weights="per_head")
    mha_case("cross_kdim_vdim_no_bias", L=4, S=6, kdim=12, vdim=10, bias=False)
    # Extra keys.
    mha_case("add_bias_kv", add_bias_kv=True)
    mha_case("add_zero_attn", add_zero_attn=True)
    mha_case("bias_kv_zero_attn_key_padding", add_bias_kv=True, add_zero_attn=True, key_padding=("pad_where_true", [5, 3]))
    mha_case("zero_attn_causal", add_zero_attn=True, causal="top_left", need_weights="per_head")
    mha_case("cross_kdim_vdim_bias_kv", L=4, S=6, kdim=12, vdim=10, add_bias_kv=True, attn_mask=("ignore_where_true", 2))
    # Masks.
    mha_case("key_padding_bool", key_padding=("pad_where_true", [5, 2]))
    mha_case("key_padding_additive", key_padding=("additive", [4, 5]))
    mha_case("attn_mask_2d_bool", attn_mask=("ignore_where_true", 2))
    mha_case("attn_mask_2d_additive", attn_mask=("additive", 2))
    mha_case("attn_mask_3d_bool", attn_mask=("ignore_where_true", 3), need_weights="per_head")
    mha_case("attn_mask_3d_additive", attn_mask=("additive", 3))
    mha_case("causal_top_left", causal="top_left", need_weights="per_head")
    mha_case("causal_bottom_right_cross", L=3, S=7, self_attn=False, causal="bottom_right")
    mha_case("causal_offset_cross", L=3, S=8, self_attn=False, causal={"offset": 2})
    mha_case("causal_and_key_padding", causal="top_left", key_padding=("pad_where_true", [5, 4]))
    mha_case("key_padding_bool_attn_additive", key_padding=("pad_where_true", [3, 5]), attn_mask=("additive", 2))
    mha_case("key_padding_and_attn_3d_bool", key_padding=("pad_where_true", [4, 5]), attn_mask=("ignore_where_true", 3))
    mha_case("batch3_key_padding_per_head", B=3, key_padding=("pad_where_true", [5, 1, 3]), need_weights="per_head")
    # Layouts.
    mha_case("seq_first", layout="seq_first")
    mha_case("seq_first_cross_kdim_vdim", layout="seq_first", L=4, S=6, kdim=12, vdim=10, key_padding=("pad_where_true", [6, 2]))
    mha_case("unbatched", unbatched=True)
    mha_case("unbatched_masks", unbatched=True, key_padding=("pad_where_true", [4]), attn_mask=("ignore_where_true", 3), need_weights="per_head")
    mha_case("unbatched_cross", unbatched=True, L=3, S=6, kdim=12, vdim=10)
    # scaled_dot_product_attention itself.
    sdpa_case("sdpa_plain")
    sdpa_case("sdpa_bool_4d", mask=("attend_where_true", (2, 1, 5, 7)))
    sdpa_case("sdpa_additive_2d", mask=("additive", (5, 7)))
    sdpa_case("sdpa_causal_top_left", L=6, S=6, causal="top_left")
    sdpa_case("sdpa_causal_bottom_right", L=3, S=7, causal="bottom_right")
    sdpa_case("sdpa_scale", scale=0.7, D=16, Dv=12)
    sdpa_case("sdpa_gqa", H=6, KH=2, causal="top_left", L=7, S=7)
    sdpa_case("sdpa_mqa_decode", H=4, KH=1, L=1, S=9)


if __name__ == "__main__":
    main()
