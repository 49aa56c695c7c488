#!/usr/bin/env python3
"""The PyTorch side of `examples/dtype_agreement.rs` for Q8_0: how often an HF
decoder folder's top-1 token survives llama.cpp's Q8_0, computed by HF
transformers with the format emulated, so that our figure can be told apart
from the format's own.

Every `nn.Linear` weight and the embedding table are rounded through Q8_0
(blocks of 32 along the input, `d = max|x| / 127` stored as f16,
`q = round(x / d)`), and every linear layer's input is rounded the same way
before the product, as llama.cpp quantizes activations for `vec_dot_q8_0`.
The prompt is the example's: its English text from the folder's
`tokenizer.json`, repeated to `--tokens`. Prints the share of positions
whose top-1 equals f32's, with weights alone and with activations too, and
the median top-1 margin (a random-init model's is small, so its top-1 moves
more easily than a trained model's).

    .venv-ref/bin/python scripts/q8_agreement.py --folder DIR [--tokens 128]
"""

import argparse

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

# examples/dtype_agreement.rs's TEXT.
TEXT = ("The committee read every page of the long report on bandwidth, caches and the cost of "
        "moving weights from memory to the cores that multiply them. One token follows another "
        "until the summary is done, and the reviewers check each figure against the machine it "
        "came from before they sign. ")


def q8_0(x):
    """`x` through Q8_0 and back, blocks of 32 along the last dim. Ties round
    to even here and away from zero in llama.cpp; they are rare enough not to
    move the figure."""
    blocks = x.reshape(-1, 32)
    d = (blocks.abs().amax(1, keepdim=True) / 127).half().float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def top1_agreement(logits, reference):
    same = (logits.argmax(-1) == reference.argmax(-1)).sum().item()
    worst = ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()
    return f"top-1 equal at {same}/{len(reference)} positions ({100 * same / len(reference):.1f} %), " \
           f"largest logit difference {worst:.2e} of the largest logit"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    tok = Tokenizer.from_file(f"{args.folder}/tokenizer.json")
    ids = []
    while len(ids) < args.tokens:
        ids += tok.encode(TEXT, add_special_tokens=False).ids
    x = torch.tensor([ids[:args.tokens]])

    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        reference = model(x).logits[0]
        for m in linears + [model.get_input_embeddings()]:
            m.weight.copy_(q8_0(m.weight))
        weights_only = model(x).logits[0]
        for m in linears:
            m.register_forward_pre_hook(lambda _m, inputs: (q8_0(inputs[0]),))
        both = model(x).logits[0]
    print(f"{args.folder}: {len(reference)} positions, HF with Q8_0 emulated against HF f32")
    print(f"  Q8_0 weights:               {top1_agreement(weights_only, reference)}")
    print(f"  Q8_0 weights and inputs:    {top1_agreement(both, reference)}")
    top2 = reference.topk(2, -1).values
    margin = ((top2[:, 0] - top2[:, 1]) / reference.abs().amax(-1)).median().item()
    print(f"  median top-1 margin: {margin:.2e} of the largest logit")


if __name__ == "__main__":
    main()
