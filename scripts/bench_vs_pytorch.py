#!/usr/bin/env python3
"""Time our attention, candle's own paths and PyTorch on the same shapes, in
one run, and print a Markdown table of medians and ratios. The machine's
sgemm rate (2048², both libraries, paired as the works are) comes first,
with our kernels' FMA peak (`bench_models peak`), and each row's FLOPs
(the two products of attention, a causal mask's hidden pairs left out,
and an MHA's projections) as a share of our sgemm rate.

    .venv-ref/bin/python scripts/bench_vs_pytorch.py [--threads 2] [--pairs 21]
    .venv-ref/bin/python scripts/bench_vs_pytorch.py --models [--threads 2] [--pairs 21]
    .venv-ref/bin/python scripts/bench_vs_pytorch.py --linears [--isa avx2]
    .venv-ref/bin/python scripts/bench_vs_pytorch.py --decoders
    .venv-ref/bin/python scripts/bench_vs_pytorch.py --vit-bf16
    .venv-ref/bin/python scripts/bench_vs_pytorch.py --train [--threads 2] [--pairs 21]
    .venv-ref/bin/python scripts/bench_vs_pytorch.py [--models | --decoders] --isa avx2

`--models` times the models instead (`bench_models`): the machine's sgemm
rate and FMA peak as above, then timm's `vit_base_patch16_224` at batch
1 and 8 on the same random weights (timm's state_dict, loaded by both),
each row's FLOPs as a share of the measured sgemm rate, and the peak
resident memory of one forward beside timm's; then `nn.Transformer`'s
forward and its encode + 32 greedy steps.

The machine is shared and its speed drifts by tens of percent within
seconds, so the two sides take turns sample by sample: our example runs
as a server (`bench_attention --serve`, `bench_models serve`) that times
a work on request while PyTorch waits, and PyTorch times it here while
ours waits; a sample is the median of as many runs as take about 100 ms,
after two warm-up runs, and which side goes first alternates from pair
to pair. Each work gets `--pairs` pairs (21), and each table gives each
side's median sample and the median of the pairs' ratios, with their
quartiles in brackets (half the pairs fall between them). The attention
table's candle columns come from one full `bench_attention` run after
the pairs. Compare ratios within one run, not times across runs.

`--vit-bf16` times ViT-B/16 (timm's state_dict, random weights) at batch
1 and 8 four ways, each paired with ours: timm in f32 against ours in f32;
timm under `torch.autocast("cpu", dtype=torch.bfloat16)` against ours with
the weight matrices in bf16 (`vit --dtype bf16`); ONNX Runtime in f32 (the
model exported by `torch.onnx.export`, `onnxruntime` installed in the
venv) against ours in f32; and ours in bf16 against ours in f32. Without
AVX512-BF16 (`lscpu`: `avx512_bf16`), oneDNN and our kernels both widen
bf16 to f32 before the FMAs; with it, both multiply bf16 pairs with
`vdpbf16ps` (ours: `MULTIHEAD_CPU_ISA=avx512` turns that off).

`--train` times a training step of five models on both sides, each
side's parameters trainable (ours a `VarMap`'s variables, `bench_models
serve --train full`): `nn.MultiheadAttention(768, 12)` self-attention B8
N197, and the same with attention dropout 0.1; the same at D512 H8 with a
causal mask, B4 N512;
`nn.Transformer(512, 8, 6, 6, 2048)` B8 S64 T64 with a causal target mask;
timm's `vit_base_patch16_224` B8; and HF's `LlamaDecoderLayer` (hidden 512,
8 heads over 2 key/value heads, rotary, SwiGLU 1408, SDPA attention),
causal, B4 T512. A step is the forward (train mode, dropout 0 but in the
row that names it), the
backward of `(y * g).sum()` for a fixed random `g` of the output's shape,
and an SGD step (lr 1e-4; ours `optim::Sgd`, in place as torch.optim.SGD), so that every step sees new weights, as
training does; inputs take no gradient.

`--isa avx2` caps both sides at AVX2+FMA, as on an AVX2-only server:
PyTorch through `MKL_ENABLE_INSTRUCTIONS=AVX2`, `ATEN_CPU_CAPABILITY=avx2`
and `ONEDNN_MAX_CPU_ISA=AVX2` (read when torch loads, so set here before
it does), ours through `MULTIHEAD_CPU_ISA=avx2`. candle's own matmul (the
`gemm` crate) has no such cap, so with `--models` the sgemm row is our
`PackedLinear` (the served work `PackedLinear 2048`) rather than candle's
matmul, and the attention table's candle columns keep their AVX-512.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

# What `--isa avx2` sets, for PyTorch (before torch loads) and for ours.
AVX2_ENV = {
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MULTIHEAD_CPU_ISA": "avx2",
}
CAP_AVX2 = any(a == "--isa=avx2" for a in sys.argv) or any(
    a == "--isa" and b == "avx2" for a, b in zip(sys.argv, sys.argv[1:]))
if CAP_AVX2:
    os.environ.update(AVX2_ENV)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# A paired sample of a side is the median of as many runs as take about
# this long (after two warm-up runs).
SAMPLE_MS = 100
# Before each sample: PyTorch's OpenMP workers spin for a few ms after a
# call, which would take a core from our next sample.
GAP_S = 0.02


class Server:
    """One of our examples in its serve mode (`bench_attention --serve`,
    `bench_models serve`): `ms(work, n)` is its median of `n` runs of
    `work`."""

    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ms(self, work, n):
        self.proc.stdin.write(f"{n} {work}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"{self.proc.args[0]} stopped (exit status {self.proc.wait()}) on {work!r}")
        return json.loads(line)["median_ms"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def runs_ms(fn, n):
    """The median of `n` runs of `fn`, in ms."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def paired(ours, theirs, pairs):
    """`pairs` (ours, theirs) samples in ms, the two sides in turn, which
    one goes first alternating: `ours(n)` is our median of `n` runs,
    `theirs` one run of PyTorch's."""
    ours(1), runs_ms(theirs, 1)
    n_ours, n_theirs = (max(1, round(SAMPLE_MS / ms)) for ms in (ours(1), runs_ms(theirs, 1)))
    samples = []
    for i in range(pairs):
        time.sleep(GAP_S)
        if i % 2 == 0:
            o = ours(n_ours)
            time.sleep(GAP_S)
            t = runs_ms(theirs, n_theirs)
        else:
            t = runs_ms(theirs, n_theirs)
            time.sleep(GAP_S)
            o = ours(n_ours)
        samples.append((o, t))
    return samples


def summary(samples):
    """(our median, PyTorch's median, the median of the pairs' ratios
    PyTorch / ours, their quartiles as text) of `paired`'s samples."""
    med = statistics.median
    ratios = [t / o for o, t in samples]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return med([o for o, _ in samples]), med([t for _, t in samples]), med(ratios), f"({q1:.2f}–{q3:.2f})"


def torch_sdpa(b, h, l, s, d, causal):
    q, k, v = torch.randn(b, h, l, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    kw = {}
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        kw["attn_mask"] = causal_lower_right(l, s)
    return lambda: F.scaled_dot_product_attention(q, k, v, **kw)


def torch_mha(b, n, e, h):
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    x = torch.randn(b, n, e)
    return lambda: mha(x, x, x, need_weights=False)


_BUILT = set()


def example(name):
    """The path of our example `name`, built (release) the first time a
    run asks for it."""
    if name not in _BUILT:
        subprocess.run(["cargo", "build", "--release", "--example", name], cwd=ROOT, check=True)
        _BUILT.add(name)
    return os.path.join(ROOT, "target", "release", "examples", name)


def sdpa_gflop(b, h, l, s, d, causal):
    """The two products' FLOPs (2 · multiply-adds) of an sdpa call, the
    (query, key) pairs a causal mask hides left out."""
    pairs = sum(min(s, s - l + i + 1) for i in range(l)) if causal else l * s
    return 4 * b * h * pairs * d / 1e9


def mha_gflop(b, n, e, h):
    """The four projections' and the attention's FLOPs of a self-attention
    call."""
    return 2 * b * n * e * 4 * e / 1e9 + sdpa_gflop(b, h, n, n, e // h, False)


def sdpa_case(b, h, l, s, d, causal):
    """A `CASES` entry for PyTorch's SDPA on these shapes."""
    return ("SDPA", lambda: torch_sdpa(b, h, l, s, d, causal), sdpa_gflop(b, h, l, s, d, causal))


# work label (as bench_attention names it) -> what PyTorch runs, one call
# of it, and its GFLOP
CASES = {
    "sdpa B8 N197 H12 hd64": sdpa_case(8, 12, 197, 197, 64, False),
    "sdpa B1 N1024 H8 hd64": sdpa_case(1, 8, 1024, 1024, 64, False),
    "sdpa B1 N4096 H8 hd64": sdpa_case(1, 8, 4096, 4096, 64, False),
    "sdpa causal B1 N1024 H8 hd64": sdpa_case(1, 8, 1024, 1024, 64, True),
    "decode B1 H8 hd64 1 query x 2048 keys": sdpa_case(1, 8, 1, 2048, 64, False),
    "MHA B8 N197 D768 H12": ("nn.MultiheadAttention", lambda: torch_mha(8, 197, 768, 12),
                             mha_gflop(8, 197, 768, 12)),
}
SGEMM_GFLOP = 2 * 2048**3 / 1e9


def fma_peak(env):
    """(instruction set, GFLOP/s) of `bench_models peak`: our kernels' width
    (AVX2 under `--isa avx2`), independent FMA chains on every core at once,
    summed."""
    out = subprocess.run([example("bench_models"), "peak"],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    # The FMA's line; with AVX512-BF16 a `vdpbf16ps` line follows.
    r = json.loads(out.splitlines()[0])
    return r["isa"], r["gflops"]


def sgemm_rates(ours_ms, theirs_ms):
    """GFLOP/s of the two sides' 2048² sgemm from their median times."""
    return {"ours": SGEMM_GFLOP / (ours_ms * 1e-3), "torch": SGEMM_GFLOP / (theirs_ms * 1e-3)}


def rate_lines(rates, peak):
    """The header lines of the sgemm rates (`{"ours": .., "torch": ..}`,
    GFLOP/s) and the FMA peak they are shares of."""
    label = "PackedLinear (AVX2)" if CAP_AVX2 else "candle"
    isa, gflops = peak
    sgemm = f"sgemm 2048²: {label} {rates['ours']:.0f} GFLOP/s, torch {rates['torch']:.0f} GFLOP/s"
    if not gflops:
        return f"{sgemm}\nFMA peak: not measured (our kernels: {isa})"
    return (f"{sgemm}\nFMA peak ({isa}, `bench_models peak`, every core at once): {gflops:.0f} GFLOP/s; "
            f"the sgemm rates are {rates['ours'] / gflops * 100:.0f} % and {rates['torch'] / gflops * 100:.0f} % of it")


def capped():
    """What the tables' headers say of `--isa avx2`."""
    return ", AVX2 on both sides (--isa avx2)" if CAP_AVX2 else ""


def run_ours(env):
    """`bench_attention`'s medians by work and path, every case and path."""
    out = subprocess.run(
        [example("bench_attention")],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout
    rust = {}
    for line in out.splitlines():
        r = json.loads(line)
        rust.setdefault(r["work"], {})[r["path"]] = r["median_ms"]
    return rust


def forward_peak_mib(fn):
    """Peak resident memory of one call of `fn`, in MiB (Linux: writing 5
    to clear_refs resets VmHWM to the current resident set)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024


def models(args, env):
    import tempfile

    import timm
    from safetensors.torch import save_file

    exe = example("bench_models")
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    tmp = tempfile.mkdtemp()
    weights = os.path.join(tmp, "vit_base_patch16_224.safetensors")
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, weights)
    vit_gflop = 35.1  # 2 * multiply-adds of one 224² image (timm's profile: 17.6 GMACs)
    torch.manual_seed(0)
    tr = torch.nn.Transformer(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                              dim_feedforward=2048, dropout=0.0, batch_first=True).eval()
    tr_weights = os.path.join(tmp, "transformer.safetensors")
    save_file({k: v.contiguous() for k, v in tr.state_dict().items()}, tr_weights)
    src, tgt = torch.randn(8, 64, 512), torch.randn(8, 64, 512)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(64)

    def torch_decode():
        # PyTorch's decoder has no cache: each step runs over the prefix.
        memory = tr.encoder(src)
        y = torch.zeros(8, 1, 512)
        for _ in range(32):
            n = y.shape[1]
            out = tr.decoder(y, memory, tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(n),
                             tgt_is_causal=True)
            y = torch.cat([y, out[:, -1:]], dim=1)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    imgs = {1: torch.randn(1, 3, 224, 224), 8: torch.randn(8, 3, 224, 224)}
    # work -> one call of theirs
    theirs = {
        "sgemm 2048": lambda: a @ b,
        "vit_base_patch16_224 B1": lambda: vit(imgs[1]),
        "vit_base_patch16_224 B8": lambda: vit(imgs[8]),
        "nn.Transformer B8 S64 T64 forward": lambda: tr(src, tgt, tgt_mask=causal, tgt_is_causal=True),
        "nn.Transformer B8 S64 encode + 32 greedy steps": torch_decode,
    }
    # candle's matmul has no AVX2 cap: the capped sgemm row is ours.
    ours_name = {"sgemm 2048": "PackedLinear 2048"} if CAP_AVX2 else {}
    rss_ours = {}
    for n in (1, 8):
        out = subprocess.run([exe, "vit-b16", str(n), weights], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True).stdout
        rss_ours[n] = json.loads(out)["peak_rss_mib"]
    peak = fma_peak(env)
    server = Server([exe, "serve", "--sgemm", "--vit", weights, "--transformer", tr_weights], env)
    with torch.no_grad():
        rss_theirs = {n: forward_peak_mib(lambda: vit(imgs[n])) for n in (1, 8)}
        rows = {work: summary(paired(lambda n: server.ms(ours_name.get(work, work), n), fn, args.pairs))
                for work, fn in theirs.items()}
    server.close()
    gflop = {"sgemm 2048": SGEMM_GFLOP, "vit_base_patch16_224 B1": vit_gflop, "vit_base_patch16_224 B8": 8 * vit_gflop}
    ours_ms, theirs_ms, *_ = rows["sgemm 2048"]
    rate = sgemm_rates(ours_ms, theirs_ms)
    print(f"torch {torch.__version__}, timm {timm.__version__}, {args.threads} threads, f32{capped()}, "
          f"medians in ms over {args.pairs} pairs")
    print(rate_lines(rate, peak))
    print()
    print("| work | PyTorch / timm | ours | PyTorch / ours | ours, % of sgemm rate | peak RSS of a forward: timm / ours (MiB) |")
    print("|---|---|---|---|---|---|")
    for work, (ours, pt, ratio, spread) in rows.items():
        share = f"{gflop[work] / (ours * 1e-3) / rate['ours'] * 100:.0f} %" if work in gflop else "–"
        rss = "–"
        if work.startswith("vit"):
            n = int(work.split("B")[-1])
            rss = f"{rss_theirs[n]:.0f} / {rss_ours[n]:.0f}"
        print(f"| {work} | {pt:.2f} | {ours:.2f} | **{ratio:.2f}×** {spread} | {share} | {rss} |")


def vit_bf16(args, env):
    import tempfile

    import onnxruntime
    import timm
    from safetensors.torch import save_file

    exe = example("bench_models")
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    tmp = tempfile.mkdtemp()
    weights = os.path.join(tmp, "vit_base_patch16_224.safetensors")
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, weights)
    imgs = {1: torch.randn(1, 3, 224, 224), 8: torch.randn(8, 3, 224, 224)}
    onnx_path = os.path.join(tmp, "vit.onnx")
    torch.onnx.export(vit, (imgs[1],), onnx_path, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    ort = onnxruntime.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
    arrays = {n: x.numpy() for n, x in imgs.items()}

    def autocast(n):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            vit(imgs[n])

    server = Server([exe, "serve", "--vit", weights, "--vit-bf16", weights], env)
    rows = {}
    with torch.no_grad():
        for n in (1, 8):
            f32, bf16 = f"vit_base_patch16_224 B{n}", f"vit_base_patch16_224 bf16 B{n}"
            rows[f"B{n}: timm f32 / ours f32"] = summary(
                paired(lambda r: server.ms(f32, r), lambda: vit(imgs[n]), args.pairs))
            rows[f"B{n}: timm bf16 autocast / ours bf16"] = summary(
                paired(lambda r: server.ms(bf16, r), lambda: autocast(n), args.pairs))
            rows[f"B{n}: ONNX Runtime f32 / ours f32"] = summary(
                paired(lambda r: server.ms(f32, r), lambda: ort.run(None, {"x": arrays[n]}), args.pairs))
            rows[f"B{n}: ours f32 / ours bf16"] = summary(
                paired(lambda r: server.ms(bf16, r), lambda: server.ms(f32, 1), args.pairs))
    server.close()
    print(f"torch {torch.__version__}, timm {timm.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"{args.threads} threads{capped()}, medians in ms over {args.pairs} pairs; "
          f"CPU bf16 capability: torch {torch.backends.cpu.get_cpu_capability()}, "
          f"avx512_bf16 {'yes' if has_avx512_bf16() else 'no'}")
    print()
    print("| ViT-B/16 | theirs (ms) | ours (ms) | theirs / ours |")
    print("|---|---|---|---|")
    for work, (ours, theirs, ratio, spread) in rows.items():
        print(f"| {work} | {theirs:.2f} | {ours:.2f} | **{ratio:.2f}×** {spread} |")


def has_avx512_bf16():
    with open("/proc/cpuinfo") as f:
        return "avx512_bf16" in f.read()


def linears(args, env):
    """One linear layer (no bias) at the models' shapes, `torch.nn.Linear`
    against our `PackedLinear` (`bench_models serve --linear MxKxN`), with
    one thread and with `--threads`, in pairs."""
    exe = example("bench_models")
    # ViT-B/16 B1's qkv and fc2; nn.Transformer B8 S64's (512 rows) in_proj,
    # out_proj, and feed-forward in and out.
    shapes = [(197, 768, 2304), (197, 3072, 768), (512, 512, 1536), (512, 512, 512),
              (512, 512, 2048), (512, 2048, 512)]
    rows = {}
    with torch.no_grad():
        for t in sorted({1, args.threads}):
            flags = [a for m, k, n in shapes for a in ("--linear", f"{m}x{k}x{n}")]
            server = Server([exe, "serve"] + flags, dict(env, RAYON_NUM_THREADS=str(t)))
            torch.set_num_threads(t)
            for m, k, n in shapes:
                lin, x = torch.nn.Linear(k, n, bias=False), torch.randn(m, k)
                rows[(m, k, n), t] = summary(paired(lambda r: server.ms(f"linear {m}x{k}x{n}", r),
                                                    lambda: lin(x), args.pairs))
            server.close()
    print(f"torch {torch.__version__}, f32{capped()}, medians in ms over {args.pairs} pairs")
    print()
    print("| linear | threads | PyTorch GFLOP/s | ours GFLOP/s | PyTorch / ours |")
    print("|---|---|---|---|---|")
    order = lambda row: (shapes.index(row[0][0]), row[0][1])  # noqa: E731
    for ((m, k, n), t), (ours, pt, ratio, spread) in sorted(rows.items(), key=order):
        gflop = 2 * m * k * n / 1e9
        print(f"| {m} × {k} → {n} | {t} | {gflop / (pt * 1e-3):.0f} | {gflop / (ours * 1e-3):.0f} "
              f"| **{ratio:.2f}×** {spread} |")


def train(args, env):
    """`--train`: a training step (forward, backward, SGD) of each model,
    ours (`bench_models serve --train full`) paired with PyTorch's."""
    import timm
    import transformers
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    def step_of(model, forward):
        """One training step of `model` through `forward()`."""
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        with torch.no_grad():
            g = torch.randn(forward().shape)

        def step():
            opt.zero_grad(set_to_none=True)
            (forward() * g).sum().backward()
            opt.step()
        return step

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(768, 12, batch_first=True)
    x_mha = torch.randn(8, 197, 768)
    mha_dropout = torch.nn.MultiheadAttention(768, 12, dropout=0.1, batch_first=True)
    causal_mha = torch.nn.MultiheadAttention(512, 8, batch_first=True)
    x_causal = torch.randn(4, 512, 512)
    mask_causal = torch.nn.Transformer.generate_square_subsequent_mask(512)
    tr = torch.nn.Transformer(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                              dim_feedforward=2048, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(8, 64, 512), torch.randn(8, 64, 512)
    mask_tgt = torch.nn.Transformer.generate_square_subsequent_mask(64)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False)
    imgs = torch.randn(8, 3, 224, 224)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
                      rms_norm_eps=1e-6, rope_theta=10000.0, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    x_llama = torch.randn(4, 512, 512)
    with torch.no_grad():
        # Positions 0.. once; with no mask, SDPA takes is_causal.
        rope = LlamaRotaryEmbedding(config=cfg)(x_llama, torch.arange(512)[None])
    # work (as `bench_models serve --train full` names it) -> one step of theirs
    theirs = {
        "train MHA B8 N197 D768 H12": step_of(mha, lambda: mha(x_mha, x_mha, x_mha, need_weights=False)[0]),
        "train MHA B8 N197 D768 H12 dropout 0.1": step_of(mha_dropout, lambda: mha_dropout(
            x_mha, x_mha, x_mha, need_weights=False)[0]),
        "train MHA causal B4 N512 D512 H8": step_of(causal_mha, lambda: causal_mha(
            x_causal, x_causal, x_causal, attn_mask=mask_causal, is_causal=True, need_weights=False)[0]),
        "train nn.Transformer B8 S64 T64": step_of(tr, lambda: tr(src, tgt, tgt_mask=mask_tgt,
                                                                    tgt_is_causal=True)),
        "train vit_base_patch16_224 B8": step_of(vit, lambda: vit(imgs)),
        "train Llama decoder layer B4 T512 D512 H8/2 SwiGLU 1408": step_of(layer, lambda: layer(
            x_llama, position_embeddings=rope)),
    }
    theirs = {work: fn for work, fn in theirs.items() if args.only is None or args.only in work}
    server = Server([example("bench_models"), "serve", "--train", "full"], env)
    rows = {work: summary(paired(lambda n: server.ms(work, n), fn, args.pairs)) for work, fn in theirs.items()}
    server.close()
    print(f"torch {torch.__version__}, timm {timm.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, f32{capped()}, a training step (forward, backward, SGD), "
          f"medians in ms over {args.pairs} pairs")
    print()
    print("| work | PyTorch | ours | PyTorch / ours |")
    print("|---|---|---|---|")
    for work, (ours, pt, ratio, spread) in rows.items():
        print(f"| {work} | {pt:.2f} | {ours:.2f} | **{ratio:.2f}×** {spread} |")


def decoders(args, env):
    """A Llama-shaped decoder (GQA, rotary, SwiGLU) and a GPT-2-shaped one
    (learned positions, tanh GELU), random weights saved once and loaded by
    both: one decode step over a 2048-position cache, and a 512-token
    prefill, HF transformers (its default attention) vs ours."""
    import tempfile

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    exe = example("bench_models")
    cache_len, prompt_len = 2048, 512
    models = {
        "Llama-shaped: hidden 512, 4 layers, 8 heads / 2 kv heads, SwiGLU 1408, vocab 8000": (
            LlamaForCausalLM,
            LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=8000, max_position_embeddings=4096,
                        rope_theta=10000.0, tie_word_embeddings=False),
        ),
        "GPT-2-shaped: n_embd 512, 4 layers, 8 heads, gelu_new 2048, vocab 8000": (
            GPT2LMHeadModel,
            GPT2Config(n_embd=512, n_layer=4, n_head=8, vocab_size=8000, n_positions=4096),
        ),
    }
    for label, (cls, cfg) in models.items():
        torch.manual_seed(0)
        model = cls(cfg).eval()
        tmp = tempfile.mkdtemp()
        model.save_pretrained(tmp, safe_serialization=True)
        print(f"weights: {tmp} (for target/release/examples/bench_models decoder {tmp})", file=sys.stderr)
        ids = lambda n: torch.tensor([[(i * 7919 + 13) % cfg.vocab_size for i in range(n)]])

        with torch.no_grad():
            cache = DynamicCache(config=cfg)
            model(ids(cache_len), past_key_values=cache, use_cache=True)
            token = ids(1)
            pos = torch.tensor([[cache_len]])

            def step():
                model(token, past_key_values=cache, position_ids=pos, use_cache=True)
                cache.crop(-1)

            prompt = ids(prompt_len)
            theirs = {
                f"decode step, cache {cache_len}": step,
                f"prefill {prompt_len} tokens": lambda: model(prompt, use_cache=True),
            }
            server = Server([exe, "serve", "--decoder", tmp], env)
            rows = {work: summary(paired(lambda n: server.ms(work, n), fn, args.pairs))
                    for work, fn in theirs.items()}
            server.close()
        print(f"torch {torch.__version__}, transformers {transformers.__version__} "
              f"({model.config._attn_implementation} attention), {args.threads} threads, f32{capped()}, "
              f"{label}; medians in ms over {args.pairs} pairs")
        print()
        print("| work | HF transformers | ours | HF / ours |")
        print("|---|---|---|---|")
        for work, (ours, pt, ratio, spread) in rows.items():
            print(f"| {work} | {pt:.2f} | {ours:.2f} | **{ratio:.2f}×** {spread} |")
        print()


class Tee:
    """Standard output kept as well as printed, for `--write`."""

    def __init__(self, out):
        self.out, self.lines = out, []

    def write(self, text):
        self.lines.append(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


def machine():
    """The CPU's model name and the vector extensions the kernels use, from
    `lscpu`."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = set(fields.get("Flags", "").split())
    isa = [label for flag, label in [("avx512f", "AVX-512F"), ("avx512_bf16", "AVX512-BF16"),
                                     ("avx512_vnni", "AVX512-VNNI"), ("avx2", "AVX2"), ("fma", "FMA")]
           if flag in flags]
    cores = fields.get("CPU(s)", "?").strip()
    return f'"{name}", {cores} CPUs, {", ".join(isa) or "no AVX2"}'


def write_section(path, key, command, body):
    """Replaces the table between `<!-- bench: KEY -->` and `<!-- end bench:
    KEY -->` in `path` (appended under a heading of its own where there is
    none) with `body`, headed by the date, the machine and the command."""
    start, end = f"<!-- bench: {key} -->", f"<!-- end bench: {key} -->"
    # A paragraph of notes becomes one line (tables stay as they are), so
    # that docs/benchmarks.md holds every current table in a few pages.
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", body.strip()) if p.strip()]
    paragraphs = [p if p.startswith("|") else "; ".join(p.splitlines()) for p in paragraphs]
    block = (f"{start}\n{time.strftime('%Y-%m-%d')}, {machine()}: `{command}`\n\n"
             + "\n\n".join(paragraphs) + f"\n{end}")
    with open(path) as f:
        text = f.read()
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## {key}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=21, help="paired samples per work")
    # Refused with a note: the sides take turns sample by sample (--pairs).
    ap.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--models", action="store_true", help="time the models, not the attention")
    ap.add_argument("--decoders", action="store_true", help="time a Llama-shaped and a GPT-2-shaped decoder against HF transformers")
    ap.add_argument("--vit-bf16", action="store_true",
                    help="time ViT-B/16 in bf16 (ours, timm under autocast) and in f32 (ours, timm, ONNX Runtime)")
    ap.add_argument("--linears", action="store_true",
                    help="time one linear layer at the models' shapes against torch.nn.Linear, one thread and --threads")
    ap.add_argument("--train", action="store_true",
                    help="time a training step (forward, backward, SGD) of five models against PyTorch")
    ap.add_argument("--only", metavar="TEXT", help="with --train: only the works whose name holds TEXT")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: cap both sides at AVX2+FMA, as on an AVX2-only server")
    ap.add_argument("--write", metavar="FILE",
                    help="also put the table into FILE (docs/benchmarks.md), in place of the "
                         "one this mode wrote there before, with the date, machine and command")
    args = ap.parse_args()
    if args.write and args.only:
        ap.error("--only times part of a table; --write replaces the whole one")
    if args.write:
        tee = sys.stdout = Tee(sys.stdout)
        mode = ("decoders" if args.decoders else "models" if args.models
                else "linears" if args.linears else "vit-bf16" if args.vit_bf16
                else "train" if args.train else "attention")
        key = mode + (", AVX2 on both sides" if CAP_AVX2 else "")
        command = ".venv-ref/bin/python scripts/bench_vs_pytorch.py " + " ".join(
            a for a in sys.argv[1:] if not a.startswith("--write") and a != args.write)
        status = run(args)
        sys.stdout = tee.out
        write_section(args.write, key, command.strip(), "".join(tee.lines))
        return status
    return run(args)


def run(args):
    """The mode `args` asks for; its table on standard output."""
    if args.rounds is not None:
        print(f"--rounds {args.rounds} is gone: the sides now take turns sample by sample, "
              f"--pairs {args.pairs} a work", file=sys.stderr)
    if CAP_AVX2 and torch.backends.cpu.get_cpu_capability() != "AVX2":
        sys.exit(f"--isa avx2: torch runs {torch.backends.cpu.get_cpu_capability()}, not AVX2")
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    if args.decoders:
        torch.set_num_threads(args.threads)
        return decoders(args, env)
    if args.models:
        torch.set_num_threads(args.threads)
        return models(args, env)
    if args.linears:
        return linears(args, env)
    if args.vit_bf16:
        torch.set_num_threads(args.threads)
        return vit_bf16(args, env)
    if args.train:
        torch.set_num_threads(args.threads)
        return train(args, env)
    torch.set_num_threads(args.threads)
    peak = fma_peak(env)
    # The machine's sgemm rate, both sides, paired as the works are (ours
    # through `bench_models`; under the AVX2 cap our `PackedLinear`, as
    # with `--models`).
    sgemm = Server([example("bench_models"), "serve", "--sgemm"], env)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    sgemm_work = "PackedLinear 2048" if CAP_AVX2 else "sgemm 2048"
    ours_ms, theirs_ms, *_ = summary(paired(lambda n: sgemm.ms(sgemm_work, n), lambda: a @ b, args.pairs))
    sgemm.close()
    rate = sgemm_rates(ours_ms, theirs_ms)
    server = Server([example("bench_attention"), "--serve"], env)
    with torch.no_grad():
        rows = {work: summary(paired(lambda n: server.ms(work, n), make(), args.pairs))
                for work, (_, make, _) in CASES.items()}
    server.close()
    candle = run_ours(env)
    rss = subprocess.run(
        [example("bench_attention"), "--peak-rss", "16384"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout

    print(f"torch {torch.__version__}, {args.threads} threads, f32{capped()}, medians in ms over {args.pairs} pairs")
    print(rate_lines(rate, peak))
    print()
    print("| work | PyTorch | ours | PyTorch / ours | ours, % of sgemm rate | candle matmul+softmax "
          "| candle flash_attn (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for work, (what, _, gflop) in CASES.items():
        ours, pt, ratio, spread = rows[work]
        share = gflop / (ours * 1e-3) / rate["ours"] * 100
        paths = [candle.get(work, {}).get(p) for p in ("candle_matmul_softmax", "candle_flash_attn")]
        fmt = lambda x: "–" if x is None else f"{x:.2f}"
        print(f"| {work} | {what} {pt:.2f} | {ours:.2f} | **{ratio:.2f}×** {spread} | {share:.0f} % "
              f"| {fmt(paths[0])} | {fmt(paths[1])} |")
    print()
    r = json.loads(rss)
    print(f"{r['work']}: {r['peak_rss_mib']:.0f} MiB peak RSS, {r['seconds']:.1f} s "
          f"(the full score matrix alone would be {8 * 16384 * 16384 * 4 / 2**30:.1f} GiB)")


if __name__ == "__main__":
    sys.exit(main())
