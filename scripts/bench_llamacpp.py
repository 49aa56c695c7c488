#!/usr/bin/env python3
"""Prefill and decode speed of our Llama decoder beside llama.cpp's, at f32,
bf16 and q8_0 weights, on 2 threads; prints a Markdown table for
docs/benchmarks.md, with the machine's read bandwidth and each decode rate
as a share of it.

The folder is Llama-shaped at Qwen2.5-0.5B's size (24 layers, 896 wide, MLP
4864, GQA 14/2, vocabulary 32,000, tied embeddings: 0.39 B parameters) with
random bf16 weights, made here (nothing is downloaded) unless --folder names
one. Its tokenizer is a SentencePiece BPE of 8,000 pieces trained here on
generated text (tokenizer.model, and the tokenizer.json transformers converts
it to); llama.cpp's converter pads the vocabulary to 32,000 with unused
tokens. convert_hf_to_gguf.py writes one GGUF per dtype; --dtypes may also name
llama-quantize's types (q4_0, q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k), which it
writes from the f32 GGUF, and ours runs those from the same file, in the
blocks it stores (`--dtype ggml`). At this model's width (896, not a multiple
of 256) llama-quantize keeps the k-quants for ffn_down only and falls back to
Q5_0/Q5_1/Q8_0 for the rest, as it does for Qwen2.5-0.5B. `--shape 1b` makes
instead a folder at Llama-3.2-1B's size (16 layers, 2048 wide, MLP 8192, GQA
32/8, head 64, rope theta 500,000, the same vocabulary and tied embeddings:
1.04 B parameters), `llama-1b-shaped`: every weight matrix there is a multiple
of 256 wide, so Q4_K_M is Q4_K and Q6_K throughout, as for Llama 3.2 1B.
`--shape gemma3-1b` makes a Gemma 3 text folder at Gemma-3-1B's size (26 layers, 1152 wide, MLP 6912, 4
query heads and 1 key/value head of 256, sliding windows of 512 keys on five layers in six, the
262,144-token vocabulary tied to the head: 1.0 B parameters), `gemma3-1b-shaped`; `--shape phi4-mini`
a Phi-3 folder at Phi-4-mini's size (32 layers, 3072 wide, MLP 8192, GQA 24/8 of 128, 0.75 of each head
rotated, LongRoPE with an original context of 4096, the 200,064-token vocabulary tied: 3.8 B
parameters), `phi4-mini-shaped`.
`--runs 0` only makes the folder and the GGUF files, and prints nothing.

Each run, for each dtype, llama.cpp's side is
`llama-bench -m FILE -t 2 -p 128 -n N -r 3 -o json` (pp128 and tgN, the
mean of its 3 repetitions; N is --new-tokens, 32 unless given), ours is
`multihead generate --dtype D --format json --greedy` on a prompt of about
128 tokens, N new tokens (RAYON_NUM_THREADS=2; prefill = prompt tokens /
prefill time, decode = the N - 1 tokens after the first over their time);
the two sides alternate which goes first, `--runs` times. Printed: each
side's median, and as the ratio the median of the runs' own ratios (each
run's two sides minutes apart at most, so that a host whose speed drifts
over the runs moves both). A dtype our binary refuses is shown as n/a.
llama-bench's tgN decodes from an empty cache, ours after the prompt; at
these lengths the KV cache is under 1% of the bytes read per token. The
last column is our run's peak resident set (its own ru_maxrss, the median
over the runs) over the GGUF file's size.

The bandwidth is a C loop summing a 2 GiB buffer on 2 OpenMP threads
(compiled here with cc, best of 5 passes), probed before the runs and after
each run of either side: on a shared machine it moves by half within
minutes. A decode run's share is GGUF file size x tokens/s over the higher
of the two probes just before and after it (every weight matrix, the tied
embedding as the output head, is read once per token); the table gives each
side's median share over the runs. A run still meets the host's changes
within it: `cargo run --release --example bench_models -- decode-share
FOLDER DTYPE` probes between rounds of a tenth of a second of our steps.

With --agreement it measures accuracy instead: for each dtype but f32, the
share of positions where the top-1 token is f32's, llama.cpp's from
`llama-perplexity --kl-divergence` ("Same top p": chunks of 128 tokens of
the text `dtype_agreement --text` prints, repeated, the second half of each
chunk scored, the f32 GGUF's logits as the base) and ours from `cargo run
--release --example dtype_agreement -- FOLDER 128 DTYPES CHUNKS` (as many
128-token prompts of that text, the second half of each compared).

llama.cpp is built from the source that the llama-cpp-python sdist vendors
(CPU, native), its converter run with this venv (PYTHONPATH=gguf-py;
protobuf, in requirements.txt, is what transformers needs to turn
tokenizer.model into tokenizer.json):

    pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d SRC
    tar xzf SRC/llama_cpp_python-*.tar.gz -C SRC && cd SRC/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j2 --target llama-bench llama-perplexity llama-quantize   # --agreement, q4_0 ...
    .venv-ref/bin/python scripts/bench_llamacpp.py --llama-cpp SRC/llama_cpp_python-*/vendor/llama.cpp \
        [--folder DIR | --shape 0.39b|1b] [--work DIR] [--runs 3] [--dtypes f32,bf16,q8_0] [--agreement]
"""

import argparse
import datetime
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import types

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
THREADS = 2
PROMPT_TOKENS = 128
NEW_TOKENS = 32

# The made folders' shapes (--shape), the config's arguments beside those they share: Qwen2.5-0.5B's size,
# Llama-3.2-1B's (every matrix a multiple of 256 wide, for ggml's k-quants), and Gemma-3-1B's (a Gemma 3
# text model: 26 layers, 1152 wide, MLP 6912, 4 query heads and 1 key/value head of 256, windows of 512
# keys on five layers in six, its 262,144-token vocabulary tied to the head).
SHAPES = {
    "0.39b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, rope_theta=10000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0),
    "gemma3-1b": dict(family="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      sliding_window=512, query_pre_attn_scalar=256),
    "phi4-mini": dict(family="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                      partial_rotary_factor=0.75),
}


def folder_name(shape):
    """The made folder's name: `llama-0.39b-shaped`, `llama-1b-shaped`, `gemma3-1b-shaped`, `phi4-mini-shaped`."""
    return f"{shape}-shaped" if "family" in SHAPES[shape] else f"llama-{shape}-shaped"


MAKE = """
import json, os, random, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import sentencepiece as spm, torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
folder, shape = sys.argv[1], json.loads(sys.argv[2])
family = shape.pop("family", "llama")
os.makedirs(folder, exist_ok=True)
# Text of made-up words, enough for a BPE of 8,000 pieces (32,000 would need far more text).
rng = random.Random(0)
cons = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl".split()
vows = "a e i o u ai ea ou io".split()
words = sorted({"".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 3))) for _ in range(6000)})
lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))).capitalize() + rng.choice(".?!,;")
         for _ in range(20000)]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=os.path.join(folder, "tokenizer"),
    vocab_size=8000, model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
    pad_id=-1, num_threads=1, minloglevel=2)
os.remove(os.path.join(folder, "tokenizer.vocab"))
LlamaTokenizer.from_pretrained(folder).save_pretrained(folder)  # tokenizer.json, tokenizer_config.json
torch.manual_seed(0)
if family == "phi3":
    from transformers import Phi3Config, Phi3ForCausalLM
    # Phi-4-mini's LongRoPE: a factor per rotated pair (0.75 of 128: 48), an original context of 4096.
    pairs = int(shape["hidden_size"] // shape["num_attention_heads"] * shape["partial_rotary_factor"]) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": shape["partial_rotary_factor"],
            "short_factor": [1.0 + 0.02 * i for i in range(pairs)], "long_factor": [1.0 + 0.5 * i for i in range(pairs)]}
    cfg = Phi3Config(**shape, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.set_default_dtype(torch.bfloat16)  # 3.8 B: made in bf16, not in f32 then rounded (15 GB)
    model = Phi3ForCausalLM(cfg)
elif family == "gemma3":
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**shape, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
else:
    cfg = LlamaConfig(vocab_size=32000, **shape, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True, max_shard_size="10GB")
"""

BANDWIDTH = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    size_t bytes = strtoull(argv[1], NULL, 10), n = bytes / 8;
    int passes = atoi(argv[2]);
    uint64_t *a = aligned_alloc(64, n * 8), sink = 0;
    double best = 0;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = i;  /* first touch by the thread that reads it */
    for (int p = 0; p < passes; p++) {
        uint64_t s = 0;
        double t = omp_get_wtime();
#pragma omp parallel for schedule(static) reduction(+ : s)
        for (size_t i = 0; i < n; i++) s += a[i];
        t = omp_get_wtime() - t;
        sink += s;
        if (bytes / t > best) best = bytes / t;
    }
    printf("%.3f %llu\n", best / 1e9, (unsigned long long)sink);
    return 0;
}
"""


def bandwidth_probe(tmp):
    """The probe, compiled: a function giving the best read bandwidth in GB/s of THREADS threads over
    2 GiB."""
    src, exe = os.path.join(tmp, "bw.c"), os.path.join(tmp, "bw")
    with open(src, "w") as f:
        f.write(BANDWIDTH)
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", src, "-o", exe], check=True)

    def probe():
        out = subprocess.run([exe, str(2 << 30), "5"], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(THREADS), "OMP_PROC_BIND": "spread"})
        return float(out.stdout.split()[0])
    return probe


def convert(llama_cpp, folder, dtype, path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(llama_cpp, "gguf-py"),
                                                                        os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), folder,
                          "--outtype", dtype, "--outfile", path], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"convert_hf_to_gguf.py --outtype {dtype} failed:\n{out.stderr[-3000:]}")


def llama_bench(exe, gguf, new_tokens):
    """(prefill, decode) tokens/s: llama-bench's means of pp128 and of `new_tokens` decoded."""
    out = subprocess.run([exe, "-m", gguf, "-t", str(THREADS), "-p", str(PROMPT_TOKENS), "-n", str(new_tokens),
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    tests = json.loads(out.stdout)
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == PROMPT_TOKENS and t["n_gen"] == 0)
    tg = next(t["avg_ts"] for t in tests if t["n_prompt"] == 0 and t["n_gen"] == new_tokens)
    return pp, tg


# The types llama-quantize writes from the f32 GGUF (--dtypes names), and its names for them. Ours runs
# each from that same file, in the blocks it stores (`--dtype ggml`).
QUANTIZED = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q3_k_m": "Q3_K_M",
             "q2_k": "Q2_K"}


def quantize(llama_cpp, f32_gguf, dtype, out_path):
    exe = os.path.join(llama_cpp, "build", "bin", "llama-quantize")
    if not os.access(exe, os.X_OK):
        sys.exit(f"no {exe}: build it with cmake --build build --target llama-quantize")
    out = subprocess.run([exe, f32_gguf, out_path, QUANTIZED[dtype]], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"llama-quantize {QUANTIZED[dtype]} failed:\n{out.stderr[-3000:]}")


def ours(binary, folder, dtype, prompt, new_tokens, refused, gguf=None):
    """(prefill, decode) tokens/s and the prompt's length, or None when the binary refuses the dtype; a
    llama-quantize type runs from its GGUF file."""
    base = [binary, "generate", "--model", gguf if dtype in QUANTIZED else folder, "--format", "json",
            "--max-new-tokens", str(new_tokens), "--min-new-tokens", str(new_tokens), "--greedy"]
    env = {**os.environ, "RAYON_NUM_THREADS": str(THREADS)}
    dtype_arg = "ggml" if dtype in QUANTIZED else dtype
    out = run_measured(base + ["--dtype", dtype_arg, prompt], env)
    if out.returncode != 0 and dtype == "f32" and "--dtype" in out.stderr:
        out = run_measured(base + [prompt], env)  # before --dtype existed
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        refused[dtype] = next((line for line in lines if line.lower().startswith("error")), lines[-1])
        return None
    (r,) = json.loads(out.stdout)
    if r["new_tokens"] != new_tokens:
        sys.exit(f"ours at {dtype}: {r['new_tokens']} new tokens, expected {new_tokens}")
    return r["prompt_tokens"] / (r["prefill_ms"] / 1e3), r["decode_tokens_per_s"], r["prompt_tokens"], out.peak_rss


def run_measured(cmd, env):
    """`cmd` run to its end: returncode, stdout, stderr and peak_rss, its peak resident set in bytes
    (wait4's ru_maxrss, the child's own)."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        stdout = p.stdout.read()
        p.stdout.close()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return types.SimpleNamespace(returncode=p.returncode, stdout=stdout,
                                     stderr=err.read().decode(errors="replace"), peak_rss=usage.ru_maxrss * 1024)


def agreement(llama_cpp, ggufs, folder, dtypes, tmp):
    """Prints, per dtype but f32, llama.cpp's and our top-1 agreement with f32's logits."""
    perplexity = os.path.join(llama_cpp, "build", "bin", "llama-perplexity")
    if not os.access(perplexity, os.X_OK):
        sys.exit(f"no {perplexity}: build it with cmake --build build --target llama-perplexity")
    text, base = os.path.join(tmp, "agreement.txt"), os.path.join(tmp, "f32.kld")
    example = ["cargo", "run", "--release", "--quiet", "--example", "dtype_agreement", "--"]
    repeated = subprocess.run(example + ["--text"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    with open(text, "w") as f:
        f.write(repeated * 40)
    run = [perplexity, "-f", text, "-c", str(PROMPT_TOKENS), "-t", str(THREADS), "--kl-divergence-base", base]
    subprocess.run(run + ["-m", ggufs["f32"]], capture_output=True, text=True, check=True)
    others = [d for d in dtypes if d != "f32"]
    theirs, n_chunks = {}, None
    for dtype in others:
        out = subprocess.run(run + ["-m", ggufs[dtype], "--kl-divergence"], capture_output=True, text=True,
                             check=True)
        log = out.stdout + out.stderr
        same = re.search(r"Same top p:\s*([0-9.]+)\s*±\s*([0-9.]+)", log)
        chunks = re.search(r"computing over (\d+) chunks", log)
        theirs[dtype] = (f"{same[1]} ± {same[2]} % ({int(chunks[1]) * PROMPT_TOKENS // 2} positions)"
                         if same and chunks else "n/a")
        n_chunks = n_chunks or (chunks and int(chunks[1]))
    # Ours over as many chunks of the same text, the second half of each
    # compared, as llama-perplexity scores them.
    chunk_args = [str(n_chunks)] if n_chunks else []
    # llama-quantize's types: ours loads their GGUF files, kept in blocks.
    ours_args = [ggufs[d] if d in QUANTIZED else d for d in others]
    out = subprocess.run(example + [folder, str(PROMPT_TOKENS), ",".join(ours_args)] + chunk_args, cwd=ROOT,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "RAYON_NUM_THREADS": str(THREADS)})
    ours = {}
    for line in out.stdout.splitlines():
        if m := re.match(r"\s*(\S+): top-1 equal at (\d+)/(\d+) positions \(([0-9.]+) %\)", line):
            ours[m[1]] = f"{m[4]} % ({m[2]}/{m[3]} positions)"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}, {cpu_model()}\n")
    print("| weights | top-1 equal to f32: llama.cpp | ours |")
    print("|---|---|---|")
    for dtype in others:
        print(f"| {dtype} | {theirs[dtype]} | {ours.get(dtype, 'n/a')} |")


def make_prompt(folder):
    """Words of English that the folder's tokenizer.json makes PROMPT_TOKENS tokens of (or just under): a
    word that would go past is skipped, so the short ones fill the end."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    words = ("The quick brown fox jumps over the lazy dog while a committee of seven reviewers reads "
             "every page of the long report on bandwidth, caches and the cost of moving weights from memory "
             "to the cores that multiply them, one token after another, until the summary is done.").split()
    prompt, n = "", 0
    for i in range(10 * PROMPT_TOKENS):
        longer = (prompt + " " + words[i % len(words)]).strip()
        if (m := len(tok.encode(longer).ids)) <= PROMPT_TOKENS:
            prompt, n = longer, m
        if n == PROMPT_TOKENS:
            break
    return prompt


def cpu_model():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, metavar="DIR",
                    help="llama.cpp source tree with build/bin/llama-bench and convert_hf_to_gguf.py")
    ap.add_argument("--folder", help="an HF Llama folder (default: one made here, of --shape)")
    ap.add_argument("--shape", choices=SHAPES, default="0.39b",
                    help="the made folder's size: 0.39b (Qwen2.5-0.5B's, the default), 1b (Llama-3.2-1B's) or "
                    "gemma3-1b (a Gemma 3 text model of Gemma-3-1B's size) or phi4-mini (a Phi-3 of Phi-4-mini's)")
    ap.add_argument("--work", metavar="DIR", help="keep the made folder and the GGUF files here, reused if present "
                    "(default: a temporary folder, removed)")
    ap.add_argument("--runs", type=int, default=3, help="0: only make the folder and the GGUF files")
    ap.add_argument("--dtypes", default="f32,bf16,q8_0",
                    help="convert_hf_to_gguf.py's --outtype names, and llama-quantize's types from the f32 file: "
                    + ", ".join(QUANTIZED))
    ap.add_argument("--agreement", action="store_true",
                    help="top-1 agreement with f32 on each side instead of speed (needs llama-perplexity)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                    help=f"tokens decoded a run on each side (default {NEW_TOKENS}); more even out a busy host")
    args = ap.parse_args()
    new_tokens = args.new_tokens
    dtypes = args.dtypes.split(",")
    if args.agreement and "f32" not in dtypes:
        dtypes = ["f32"] + dtypes  # the base the others are compared with
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    bench = os.path.join(args.llama_cpp, "build", "bin", "llama-bench")
    only_files = args.runs == 0 and not args.agreement
    if not args.agreement and not only_files and not os.access(bench, os.X_OK):
        sys.exit(f"no {bench}: build it with cmake --build build --target llama-bench")
    if not only_files:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    binary = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "multihead")

    theirs_runs = {d: [] for d in dtypes}
    ours_runs = {d: [] for d in dtypes}
    refused = {}
    sizes = {}
    # Each run's bandwidth, per side: the higher of the probes just before and after it.
    bw_beside = {side: {d: [] for d in dtypes} for side in ("theirs", "ours")}
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        folder = args.folder or os.path.join(work, folder_name(args.shape))
        if not glob.glob(os.path.join(folder, "*.safetensors")):
            subprocess.run([sys.executable, "-c", MAKE, folder, json.dumps(SHAPES[args.shape])], check=True)
        ggufs = {}
        name = lambda dtype: os.path.join(work, f"{os.path.basename(os.path.normpath(folder))}-{dtype}.gguf")
        for dtype in dtypes:
            ggufs[dtype] = name(dtype)
            if not os.path.exists(ggufs[dtype]):
                if dtype in QUANTIZED:
                    if not os.path.exists(name("f32")):
                        convert(args.llama_cpp, folder, "f32", name("f32"))
                    quantize(args.llama_cpp, name("f32"), dtype, ggufs[dtype])
                else:
                    convert(args.llama_cpp, folder, dtype, ggufs[dtype])
            sizes[dtype] = os.path.getsize(ggufs[dtype])
        if args.agreement:
            agreement(args.llama_cpp, ggufs, folder, dtypes, tmp)
            return
        if only_files:
            return
        prompt = make_prompt(folder)
        bandwidth = bandwidth_probe(tmp)
        probes = [bandwidth()]
        for run in range(args.runs):
            for dtype in dtypes:
                sides = [("theirs", lambda: theirs_runs[dtype].append(llama_bench(bench, ggufs[dtype], new_tokens))),
                         ("ours", lambda: ours_runs[dtype].append(
                             ours(binary, folder, dtype, prompt, new_tokens, refused, ggufs[dtype])))]
                for name, side in sides if run % 2 == 0 else reversed(sides):
                    side()
                    probes.append(bandwidth())
                    bw_beside[name][dtype].append(max(probes[-2:]))

    def median(runs, i):
        got = [r[i] for r in runs if r is not None]
        return statistics.median(got) if got else None

    def fmt(x, spec=".1f"):
        return "n/a" if x is None else format(x, spec)

    def ratio(dtype, i):
        """The median of the runs' ratios: each run's two sides ran minutes apart at most, so a host that
        speeds up or slows down over the runs moves both."""
        got = [o[i] / t[i] for o, t in zip(ours_runs[dtype], theirs_runs[dtype]) if o is not None]
        return f"{statistics.median(got):.2f}" if got else "n/a"

    def share(dtype, side, runs):
        """The median over the runs of each decode's share of the bandwidth probed beside it."""
        got = [sizes[dtype] * r[1] / (bw * 1e9) for r, bw in zip(runs, bw_beside[side][dtype]) if r is not None]
        return f"{100 * statistics.median(got):.0f}%" if got else "n/a"

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}, {cpu_model()}, {THREADS} threads\n")
    print(f"    {command}\n")
    print(f"read bandwidth ({THREADS} threads, 2 GiB): median {statistics.median(probes):.1f} GB/s of "
          f"{len(probes)} probes, {min(probes):.1f} to {max(probes):.1f}; "
          f"medians of {args.runs} alternating runs; "
          f"llama.cpp: pp{PROMPT_TOKENS} and tg{new_tokens}; "
          f"ours: a {fmt(median(sum(ours_runs.values(), []), 2), '.0f')}-token prompt, {new_tokens} new tokens; "
          "ratios: the median of each run's, ours over the llama.cpp run beside it; shares: the median of each "
          "run's decode over the bandwidth probed beside it\n")
    print("| weights | GGUF (MB) | prefill tok/s llama.cpp | ours | ours / llama.cpp | decode tok/s llama.cpp "
          "| ours | ours / llama.cpp | decode share of bandwidth llama.cpp | ours | ours: peak RSS / GGUF |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        size = sizes[dtype]
        tpp, ttg = median(theirs_runs[dtype], 0), median(theirs_runs[dtype], 1)
        opp, otg, rss = median(ours_runs[dtype], 0), median(ours_runs[dtype], 1), median(ours_runs[dtype], 3)
        print(f"| {dtype} | {size / 1e6:.0f} | {fmt(tpp)} | {fmt(opp)} | {ratio(dtype, 0)} | {fmt(ttg, '.2f')} "
              f"| {fmt(otg, '.2f')} | {ratio(dtype, 1)} | {share(dtype, 'theirs', theirs_runs[dtype])} "
              f"| {share(dtype, 'ours', ours_runs[dtype])} | {fmt(rss and rss / size, '.2f')} |")
    print("\nEach run (prefill/decode tok/s), to judge the spread:\n")
    for dtype in dtypes:
        runs = [" ".join(f"{pp:.0f}/{tg:.1f}" for pp, tg, *_ in side) or "n/a"
                for side in (theirs_runs[dtype], [r for r in ours_runs[dtype] if r is not None])]
        beside = [" ".join(f"{bw:.1f}" for bw in bw_beside[side][dtype]) for side in ("theirs", "ours")]
        print(f"- {dtype}: llama.cpp {runs[0]} (bandwidth beside each: {beside[0]} GB/s); "
              f"ours {runs[1]} ({beside[1]} GB/s)")
    for dtype, why in refused.items():
        print(f"\nours at {dtype}: n/a ({why})")


if __name__ == "__main__":
    main()
