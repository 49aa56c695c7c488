#!/usr/bin/env python3
"""Time our attention, candle's own paths and PyTorch on the same shapes, in
one run, and print a Markdown table of medians and ratios.

    .venv-ref/bin/python scripts/bench_vs_pytorch.py [--threads 2] [--rounds 3]

Our side is `cargo run --release --example bench_attention` (JSON lines);
PyTorch runs here with the same thread count. Both take the median of at
least 5 timed runs (3 for runs over a second; ~2 s per case) after a
warm-up. The machine is shared and its speed drifts by tens of percent
within minutes, so the two sides alternate: each round runs all of ours,
then all of PyTorch's, and the table gives each time's median over the
rounds and the median of the per-round ratios. Compare ratios within one
run, not times across runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def median_ms(fn):
    t = time.perf_counter()
    fn()
    min_runs = 3 if time.perf_counter() - t > 1 else 5
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < 2 and len(times) < 200):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def torch_sdpa(b, h, l, s, d, causal):
    q, k, v = torch.randn(b, h, l, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    kw = {}
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        kw["attn_mask"] = causal_lower_right(l, s)
    with torch.no_grad():
        return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kw))


def torch_mha(b, n, e, h):
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    x = torch.randn(b, n, e)
    with torch.no_grad():
        return median_ms(lambda: mha(x, x, x, need_weights=False))


# work label (as bench_attention prints it) -> PyTorch function
CASES = {
    "sdpa B8 N197 H12 hd64": ("SDPA", lambda: torch_sdpa(8, 12, 197, 197, 64, False)),
    "sdpa B1 N1024 H8 hd64": ("SDPA", lambda: torch_sdpa(1, 8, 1024, 1024, 64, False)),
    "sdpa B1 N4096 H8 hd64": ("SDPA", lambda: torch_sdpa(1, 8, 4096, 4096, 64, False)),
    "sdpa causal B1 N1024 H8 hd64": ("SDPA", lambda: torch_sdpa(1, 8, 1024, 1024, 64, True)),
    "decode B1 H8 hd64 1 query x 2048 keys": ("SDPA", lambda: torch_sdpa(1, 8, 1, 2048, 64, False)),
    "MHA B8 N197 D768 H12": ("nn.MultiheadAttention", lambda: torch_mha(8, 197, 768, 12)),
}


def run_ours(env):
    out = subprocess.run(
        [os.path.join(ROOT, "target", "release", "examples", "bench_attention")],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout
    rust = {}
    for line in out.splitlines():
        r = json.loads(line)
        rust.setdefault(r["work"], {})[r["path"]] = r["median_ms"]
    return rust


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    subprocess.run(["cargo", "build", "--release", "--example", "bench_attention"], cwd=ROOT, check=True)
    torch.set_num_threads(args.threads)
    rounds = []
    for _ in range(args.rounds):
        rust = run_ours(env)
        rounds.append((rust, {work: fn() for work, (_, fn) in CASES.items()}))
    rss = subprocess.run(
        [os.path.join(ROOT, "target", "release", "examples", "bench_attention"), "--peak-rss", "16384"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout

    med = statistics.median
    nan = float("nan")
    print(f"torch {torch.__version__}, {args.threads} threads, f32, medians in ms over {args.rounds} rounds")
    print()
    print("| work | PyTorch | ours | PyTorch / ours | candle matmul+softmax | candle flash_attn (CPU) |")
    print("|---|---|---|---|---|---|")
    for work, (what, _) in CASES.items():
        pt = [torch_ms[work] for _, torch_ms in rounds]
        ours = [rust.get(work, {}).get("ours", nan) for rust, _ in rounds]
        ratio = med([p / o for p, o in zip(pt, ours)])
        paths = [[rust.get(work, {}).get(p) for rust, _ in rounds] for p in ("candle_matmul_softmax", "candle_flash_attn")]
        fmt = lambda xs: "–" if None in xs else f"{med(xs):.2f}"
        print(f"| {work} | {what} {med(pt):.2f} | {med(ours):.2f} | **{ratio:.2f}×** | {fmt(paths[0])} | {fmt(paths[1])} |")
    print()
    r = json.loads(rss)
    print(f"{r['work']}: {r['peak_rss_mib']:.0f} MiB peak RSS, {r['seconds']:.1f} s "
          f"(the full score matrix alone would be {8 * 16384 * 16384 * 4 / 2**30:.1f} GiB)")


if __name__ == "__main__":
    sys.exit(main())
