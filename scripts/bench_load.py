#!/usr/bin/env python3
"""Load time and peak memory of a real-sized decoder folder, ours beside HF
transformers', in one run; prints a Markdown table for docs/benchmarks.md.

The folder has Qwen2.5-0.5B's config (24 layers, 896 wide, GQA 14/2,
vocabulary 151,936, tied embeddings) with random bf16 weights (988 MB), as
the hub stores it; it is made here (nothing is downloaded) unless --folder
names one. The tokenizer is the llama3 text fixture's (its ids fit the
vocabulary). Each side loads the folder, then generates 4 tokens greedily
from a 5-token prompt, in a process of its own, 2 threads, `--runs` times
alternating; the medians are printed. Ours runs with `--dtype f32` (the
weights widened at load) and `--dtype bf16` (kept as stored), HF with
`dtype=torch.float32` and `torch.bfloat16`.

    .venv-ref/bin/python scripts/bench_load.py [--folder DIR] [--runs 3]
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

MAKE = """
import os, sys, torch
os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True,
                                                         max_shard_size="10GB")
"""

HF = """
import os, sys, time, resource
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[sys.argv[2]]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=dtype).eval()
loaded = time.time() - t
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
total = time.time() - t
print(f"load {loaded:.3f} total {total:.3f} peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} base {base}")
"""


def ours(binary, folder, dtype):
    out = subprocess.run(
        ["/usr/bin/time", "-f", "peak %M wall %e", binary, "generate", "--model", folder, "--dtype", dtype,
         "--max-new-tokens", "4", "--min-new-tokens", "4", "Hello world"],
        capture_output=True, text=True, check=True, env={**os.environ, "RAYON_NUM_THREADS": "2"},
    )
    load = float(re.search(r"loaded .* in (\d+) ms", out.stderr).group(1)) / 1e3
    peak, wall = re.search(r"peak (\d+) wall ([\d.]+)", out.stderr).groups()
    return load, float(wall), int(peak) / 1024


def hf(folder, dtype):
    out = subprocess.run([sys.executable, "-c", HF, folder, dtype], capture_output=True, text=True, check=True)
    load, total, peak, base = re.search(r"load ([\d.]+) total ([\d.]+) peak (\d+) base (\d+)", out.stdout).groups()
    return float(load), float(total), int(peak) / 1024, int(base) / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    binary = os.path.join(ROOT, "target", "release", "multihead")
    tmp = None
    folder = args.folder
    if folder is None:
        tmp = tempfile.mkdtemp(prefix="bench-load-")
        folder = os.path.join(tmp, "qwen2.5-0.5b-shaped")
        subprocess.run([sys.executable, "-c", MAKE, folder], check=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, "tests", "fixtures", "text", "llama3", f), folder)
    size = os.path.getsize(os.path.join(folder, "model.safetensors")) / 1e6
    rows = {"ours f32": [], "ours bf16": [], "HF f32": [], "HF bf16": []}
    try:
        for _ in range(args.runs):
            for dtype in ("f32", "bf16"):
                rows[f"ours {dtype}"].append(ours(binary, folder, dtype))
                rows[f"HF {dtype}"].append(hf(folder, dtype)[:3])
    finally:
        if tmp:
            shutil.rmtree(tmp)
    print(f"weights file: {size:.0f} MB bf16 ({2 * size:.0f} MB as f32); medians of {args.runs} alternating runs\n")
    print("| | load (s) | load + 4 tokens (s) | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(f"| {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.0f} |")


if __name__ == "__main__":
    main()
