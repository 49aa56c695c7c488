#!/usr/bin/env python3
"""Write the oracle for the decoders with half-precision weight matrices.

For each decoder fixture folder of tests/fixtures/decoders (written by
make_decoder_fixtures.py), HF transformers' model with every 2-D weight (the
linear layers and the embedding tables) rounded to bfloat16 or float16 and
computed in float32, as `multihead generate --dtype bf16|f16` keeps them:

* `{name}.{dtype}.logits`: `model(input_ids).logits`, the prompt's;
* `{name}.{dtype}.steps`: the logits at positions 6.. of
  `model(greedy_ids)`, teacher-forced over the f32 model's greedy tokens
  (the logits that chose greedy_ids[:, 7 + i] in the f32 fixture's
  `step_logits`).

and for `multihead generate --kv-dtype bf16|f16`, the f32 model with its
cache storing keys and values rounded to that dtype (a `DynamicCache` that
rounds what it is given, after the rotary embedding, before attention reads
it back):

* `{name}.kv_{dtype}.logits`, `{name}.kv_{dtype}.steps`: as above.

Everything lands in tests/fixtures/decoders/half_expected.safetensors, with
the torch / transformers versions in its metadata under "case". It also prints each
model's largest error against the f32 logits, relative to their largest
magnitude: what rounding the weights costs, whoever computes it.

    .venv-ref/bin/python scripts/make_half_fixtures.py [--only NAME ...]

(`--only` recomputes those models' entries and keeps the others as they are.)
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DIR = os.path.join(ROOT, "tests", "fixtures", "decoders")
MODELS = ["gpt2", "llama", "mistral", "llama3", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2",
          "gemma3"]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


class RoundingCache(DynamicCache):
    """A cache that stores (and hands back) keys and values rounded to
    `dtype`, in f32."""

    def __init__(self, dtype, **kwargs):
        super().__init__(**kwargs)
        self.rounding = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def r(t):
            return t.to(self.rounding).float()

        return super().update(r(key_states), r(value_states), layer_idx, *args, **kwargs)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=MODELS, metavar="NAME",
                        help="recompute these models' entries, keeping the file's others")
    args = parser.parse_args()
    path = os.path.join(DIR, "half_expected.safetensors")
    out = {}
    if args.only:
        out = {k: v for k, v in load_file(path).items() if k.split(".")[0] not in args.only}
    for name in args.only or MODELS:
        f = load_file(os.path.join(DIR, f"{name}_expected.safetensors"))
        greedy = f["greedy_ids"].long()
        steps = f["step_logits"].shape[1]
        for short, dtype in DTYPES.items():
            model = AutoModelForCausalLM.from_pretrained(
                os.path.join(DIR, name), dtype=torch.float32, attn_implementation="eager"
            ).eval()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.copy_(p.to(dtype).float())
                logits = model(f["input_ids"].long()).logits.float()
                stepped = model(greedy).logits.float()[:, 6 : 6 + steps]
            out[f"{name}.{short}.logits"] = logits.contiguous()
            out[f"{name}.{short}.steps"] = stepped.contiguous()
            print(
                f"{name} {short}: relative error against f32, prompt {rel(logits, f['logits']):.2e}, "
                f"steps {rel(stepped, f['step_logits']):.2e}"
            )
            model = AutoModelForCausalLM.from_pretrained(
                os.path.join(DIR, name), dtype=torch.float32, attn_implementation="eager"
            ).eval()

            def rounding(m):
                return {"past_key_values": RoundingCache(dtype, config=m.config), "use_cache": True}

            with torch.no_grad():
                logits = model(f["input_ids"].long(), **rounding(model)).logits.float()
                stepped = model(greedy, **rounding(model)).logits.float()[:, 6 : 6 + steps]
            out[f"{name}.kv_{short}.logits"] = logits.contiguous()
            out[f"{name}.kv_{short}.steps"] = stepped.contiguous()
            print(
                f"{name} kv {short}: relative error against f32, prompt {rel(logits, f['logits']):.2e}, "
                f"steps {rel(stepped, f['step_logits']):.2e}"
            )
    case = {
        "what": "HF logits with every 2-D weight, or the cached keys and values, rounded to bf16 / f16, "
        "computed in f32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    save_file(out, path, metadata={"case": json.dumps(case)})


if __name__ == "__main__":
    main()
