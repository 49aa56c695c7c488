#!/usr/bin/env python3
"""`multihead serve` beside llama.cpp's `llama-server`, both with continuous
batching on the same weights at Q8_0 and 2 threads, measured as their users
meet them: over HTTP, with OpenAI's `/v1/completions`, streamed. Prints
Markdown tables for docs/benchmarks.md.

Measured on each side, for each N in `--parallel` (4 and 16) and for N = 1
(the single stream the others are compared with), a server started with N
slots (ours `--parallel N`, llama.cpp's `--parallel N`, `-c` N x 512):

- aggregate decode throughput: N clients (threads, one connection each),
  released together, each POST a streamed completion of a prompt of about 32
  tokens (different for each client from its first word on), `max_tokens`
  64, `temperature` 0, `ignore_eos`, `stream_options.include_usage`. Tokens
  are the `completion_tokens` of the usage chunks (content chunks are counted
  where a server sends none), over the time from the first request sent to the
  last stream's `data: [DONE]`. Ours at 16 over ours at 1 is the batching's gain
  over the single stream.
- at the largest N (16), time to first token of a new request with a prompt of
  about 128 tokens: first on the idle server, then (another prompt of the same
  length) while N - 1 others stream (each has sent its first chunk, none has
  ended; prompts of about 32 tokens, up to 256 tokens each). The probe asks
  for one token, streamed, and its TTFT is the time from sending to its first
  `data:` event. Only one token is asked because our server sends no chunk
  for a token whose text is empty (llama-server sends one), and the random
  model below mostly generates such tokens (its vocabulary is padded past
  the tokenizer's): a one-token reply's first event comes when that token is
  sampled on both sides, its text empty or not.

Each server gets one warm-up request after `GET /health` answers 200, and is
killed after its measurements. The two sides alternate which goes first,
`--runs` times (3 unless given); printed are each side's medians and, as the
ratios, the medians of the runs' own ratios, each run's two sides minutes
apart at most (as in bench_llamacpp.py). The load average before and after
is printed: on a shared host the figures move with it.

The sides (P: a free port; 2 threads each, the machine's HTTP threads aside):

    multihead serve --model FOLDER --dtype q8_0 --parallel N --threads 2 --host 127.0.0.1 --port P
    llama-server -m GGUF --parallel N -t 2 -tb 2 --host 127.0.0.1 --port P -c N*512 --cont-batching

The folder and its Q8_0 GGUF are bench_llamacpp.py's (a Llama-shaped 0.39 B
with random bf16 weights, made there; its docstring also builds llama.cpp,
from the llama-cpp-python sdist). llama-server is one more target of the same
build; `--work` keeps the folder and the GGUF:

    cmake --build build -j2 --target llama-server llama-bench
    .venv-ref/bin/python scripts/bench_llamacpp.py --llama-cpp DIR --work WORK --dtypes q8_0 --runs 1
    cargo build --release
    .venv-ref/bin/python scripts/bench_serve.py --llama-cpp DIR --folder WORK/llama-0.39b-shaped \\
        --gguf WORK/llama-0.39b-shaped-q8_0.gguf [--runs 3] [--parallel 4,16] [--only llama|ours]

The clients are the standard library's (threads, http.client, the SSE lines
parsed here); the prompts are sized with the folder's tokenizer.json
(`tokenizers`, in the venv). Each side's prompt lengths as its server counted
them are printed.
"""

import argparse
import datetime
import http.client
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
THREADS = 2
SHORT_PROMPT = 32  # tokens of each client's prompt
LONG_PROMPT = 128  # tokens of the TTFT probe's prompt
MAX_TOKENS = 64  # tokens each client decodes in the throughput test
BACKGROUND_TOKENS = 256  # at most, for each of the streams that the loaded probe meets
CTX_PER_SLOT = 512  # llama-server's -c is this times --parallel
START_TIMEOUT = 600  # seconds for a server to answer /health with 200
READY_TIMEOUT = 120  # seconds for the background streams to send their first chunks

WORDS = ("The quick brown fox jumps over the lazy dog while a committee of seven reviewers reads every page of "
         "the long report on bandwidth, caches and the cost of moving weights from memory to the cores that "
         "multiply them, one token after another, until the summary is done.").split()
LEADS = ("Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliett Kilo Lima Mike November Oscar Papa "
         "Quebec Romeo Sierra Tango Uniform Victor Whiskey Xray Yankee Zulu").split()


def cpu():
    """The CPU's model name and which of the ISA extensions that matter here it has."""
    name, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "?":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'none of avx2/avx512f/avx512_vnni/avx512_bf16'})"


class Prompts:
    """Prompts of about a given length in the folder's tokenizer.json's tokens, each from its own first
    word on (a server that reuses a cached prefix gets nothing from an earlier one)."""

    def __init__(self, folder):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.count = 0

    def new(self, tokens):
        i, self.count = self.count, self.count + 1
        lead = f"{LEADS[i % len(LEADS)]} {i // len(LEADS) + 1}:"
        prompt, n = lead, len(self.tok.encode(lead).ids)
        for j in range(10 * tokens):  # a word that would go past is skipped, so the short ones fill the end
            longer = f"{prompt} {WORDS[(i + j) % len(WORDS)]}"
            if (m := len(self.tok.encode(longer).ids)) <= tokens:
                prompt, n = longer, m
            if n == tokens:
                break
        return prompt


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, up once /health answers 200; killed on leaving."""

    def __init__(self, side, command, log):
        self.side, self.command, self.log = side, command, log

    def __enter__(self):
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.command]
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                self._fail(f"exited with {self.proc.returncode} before /health answered")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if resp.status == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self._fail(f"/health not 200 after {START_TIMEOUT} s")
            time.sleep(0.2)

    def _fail(self, why):
        self.stop()
        with open(self.log) as f:
            tail = f.read()[-3000:]
        sys.exit(f"{self.side}: {shlex.join(self.command)}: {why}\n{tail}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # ours drains in-flight streams on SIGTERM
        self.proc.wait()
        self.out.close()

    def __exit__(self, *exc):
        self.stop()


def complete(port, prompt, max_tokens, start=None, first=None):
    """One streamed completion: a dict with the times it was sent, of its first `data:` event and of its
    end, its completion and prompt tokens (usage's, else the content chunks counted) and whether usage came.
    `start`: a barrier to wait at, connected, before sending; `first`: an Event set at the first chunk."""
    body = json.dumps({"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()
    if start is not None:
        start.wait()
    r = {"sent": time.perf_counter(), "first": None, "end": None, "tokens": 0, "prompt_tokens": None,
         "usage": False}
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        chunks = 0
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if r["first"] is None:
                r["first"] = time.perf_counter()
                if first is not None:
                    first.set()
            if data == b"[DONE]":
                r["end"] = time.perf_counter()
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            if chunk.get("choices"):
                chunks += 1
            if usage := chunk.get("usage"):
                r["usage"] = True
                r["tokens"], r["prompt_tokens"] = usage["completion_tokens"], usage["prompt_tokens"]
        if r["end"] is None:
            raise RuntimeError("the stream ended without data: [DONE]")
        if not r["usage"]:
            r["tokens"] = chunks  # the last chunk (a finish_reason) may carry no token: near enough
    finally:
        conn.close()
    return r


def concurrently(calls):
    """Runs each call in its own thread; their results in order, or the first exception raised."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except Exception as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def throughput(port, prompts, n):
    """Aggregate decode tokens/s of n streams sent at once, and each stream's prompt tokens."""
    start = threading.Barrier(n)
    rs = concurrently([lambda p=prompts.new(SHORT_PROMPT): complete(port, p, MAX_TOKENS, start=start)
                       for _ in range(n)])
    t0, t1 = min(r["sent"] for r in rs), max(r["end"] for r in rs)
    if any(r["tokens"] != MAX_TOKENS for r in rs if r["usage"]):
        raise RuntimeError(f"completion tokens {[r['tokens'] for r in rs]}, expected {MAX_TOKENS} each")
    return sum(r["tokens"] for r in rs) / (t1 - t0), [r["prompt_tokens"] for r in rs], all(r["usage"] for r in rs)


def ttft(port, prompts, others):
    """Seconds to the first event of a one-token probe of LONG_PROMPT tokens, on the idle server and then
    while `others` streams decode; the probes' prompt tokens; the streams that had started by then."""
    alone = complete(port, prompts.new(LONG_PROMPT), 1)
    firsts = [threading.Event() for _ in range(others)]
    background = []

    def stream(i, p):
        try:
            background.append(complete(port, p, BACKGROUND_TOKENS, first=firsts[i]))
        except (OSError, RuntimeError, http.client.HTTPException):
            pass  # cut off when the server is killed: expected
    threads = [threading.Thread(target=stream, args=(i, prompts.new(SHORT_PROMPT)), daemon=True)
               for i in range(others)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + READY_TIMEOUT
    for e in firsts:
        e.wait(max(0.0, deadline - time.monotonic()))
    started = sum(e.is_set() for e in firsts)
    loaded = complete(port, prompts.new(LONG_PROMPT), 1)
    ended = sum(1 for r in background if r["end"] < loaded["first"])
    if ended:
        print(f"  warning: {ended} of the {others} background streams ended before the probe's first token",
              file=sys.stderr)
    return (alone["first"] - alone["sent"], loaded["first"] - loaded["sent"],
            (alone["prompt_tokens"], loaded["prompt_tokens"]), started, threads)


def measure(side, command_for, levels, prompts, tmp, run):
    """One run of one side: {N: tokens/s}, then (TTFT alone, TTFT loaded) at the largest N, and what the
    server counted of the prompts."""
    tput, counted, ttfts, threads = {}, {}, None, []
    for n in levels:
        with Server(side, command_for(n), os.path.join(tmp, f"{side}-{n}-{run}.log")) as server:
            complete(server.port, prompts.new(SHORT_PROMPT), 4)  # warm-up
            tput[n], counted[f"short prompt, N={n}"], usage = throughput(server.port, prompts, n)
            if not usage:
                print(f"  warning: {side} at N={n} sent no usage; content chunks counted", file=sys.stderr)
            if n == levels[-1]:
                alone, loaded, probe_tokens, started, threads = ttft(server.port, prompts, n - 1)
                counted["probe prompt"] = probe_tokens
                ttfts = (alone, loaded, started)
    for t in threads:  # cut off with their server
        t.join(10)
    print(f"  run {run + 1}, {side}: " + ", ".join(f"N={n} {tput[n]:.1f} tok/s" for n in levels)
          + f"; TTFT alone {1e3 * ttfts[0]:.0f} ms, with {ttfts[2]} streaming {1e3 * ttfts[1]:.0f} ms",
          file=sys.stderr)
    return tput, ttfts, counted


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multihead", default=os.path.join("target", "release", "multihead"), metavar="BIN",
                    help="our binary (default: target/release/multihead)")
    ap.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp source tree with build/bin/llama-server")
    ap.add_argument("--folder", required=True, help="the HF Llama folder (ours serves it; its tokenizer.json "
                    "sizes the prompts)")
    ap.add_argument("--gguf", help="the folder's Q8_0 GGUF, for llama-server")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parallel", default="4,16", help="slot counts measured besides 1 (default 4,16); the "
                    "largest also gives the TTFT")
    ap.add_argument("--only", choices=("llama", "ours"), help="measure one side only")
    args = ap.parse_args()
    levels = sorted({1} | {int(n) for n in args.parallel.split(",")})
    if levels[-1] < 2:
        sys.exit("--parallel: at least one N above 1")
    sides = [s for s in ("llama", "ours") if args.only in (None, s)]
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])

    commands = {}
    if "llama" in sides:
        if not args.llama_cpp or not args.gguf:
            sys.exit("llama.cpp's side needs --llama-cpp and --gguf (or --only ours)")
        server = os.path.join(args.llama_cpp, "build", "bin", "llama-server")
        if not os.access(server, os.X_OK):
            sys.exit(f"no {server}: build it with cmake --build build --target llama-server")
        version = subprocess.run([server, "--version"], capture_output=True, text=True)
        version = next((line.strip() for line in (version.stdout + version.stderr).splitlines()
                        if line.startswith("version")), "version ?")
        commands["llama"] = lambda n: [server, "-m", args.gguf, "--parallel", str(n), "-t", str(THREADS), "-tb",
                                       str(THREADS), "--host", "127.0.0.1", "--port", "{port}",
                                       "-c", str(n * CTX_PER_SLOT), "--cont-batching"]
    if "ours" in sides:
        binary = os.path.normpath(os.path.join(ROOT, args.multihead))  # an absolute BIN stays as given
        if not os.access(binary, os.X_OK):
            sys.exit(f"no {binary}: cargo build --release (or --only llama)")
        commands["ours"] = lambda n: [binary, "serve", "--model", args.folder, "--dtype", "q8_0", "--parallel",
                                      str(n), "--threads", str(THREADS), "--host", "127.0.0.1", "--port", "{port}"]

    prompts = Prompts(args.folder)
    results = {s: [] for s in sides}  # per run: (tput, ttfts, counted)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for run in range(args.runs):
            for side in sides if run % 2 == 0 else list(reversed(sides)):
                results[side].append(measure(side, commands[side], levels, prompts, tmp, run))
    load_after = os.getloadavg()

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def fmt(x, spec=".1f"):
        return "n/a" if x is None else format(x, spec)

    def tput(side, n):
        return med([r[0][n] for r in results.get(side, [])])

    def ttft(side, i):
        return med([r[1][i] for r in results.get(side, [])])

    def run_ratios(f):
        """The median over the runs of f(ours' run, llama.cpp's run)."""
        if len(sides) < 2:
            return None
        return med([f(o, t) for o, t in zip(results["ours"], results["llama"])])

    top = levels[-1]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}, {cpu()}, {THREADS} threads a server\n")
    print(f"    {command}\n")
    if "llama" in sides:
        print(f"llama-server {version}: `{shlex.join(commands['llama'](top)).replace('{port}', 'P')}`")
    if "ours" in sides:
        print(f"ours: `{shlex.join(commands['ours'](top)).replace('{port}', 'P')}`")
    print(f"\nMedians of {args.runs} runs, the sides alternating which goes first; ratios: the median of each "
          f"run's. Load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after.\n")
    print(f"Aggregate decode throughput: N clients, each a ~{SHORT_PROMPT}-token prompt and {MAX_TOKENS} tokens "
          "streamed, from the first request sent to the last stream's end:\n")
    print("| clients = slots | tok/s llama.cpp | ours | ours / llama.cpp | llama.cpp / its 1 | ours / its 1 |")
    print("|---|---|---|---|---|---|")
    for n in levels:
        scale = {s: med([r[0][n] / r[0][1] for r in results.get(s, [])]) for s in ("llama", "ours")}
        ratio = run_ratios(lambda o, t: o[0][n] / t[0][n])
        print(f"| {n} | {fmt(tput('llama', n))} | {fmt(tput('ours', n))} | {fmt(ratio, '.2f')} "
              f"| {fmt(scale['llama'], '.2f')} | {fmt(scale['ours'], '.2f')} |")
    print(f"\nTime to first token of a ~{LONG_PROMPT}-token prompt (one token asked, streamed), on the idle "
          f"{top}-slot server and while {top - 1} others stream:\n")
    print("| | llama.cpp | ours | ours / llama.cpp |")
    print("|---|---|---|---|")
    for i, what in ((0, "TTFT alone (ms)"), (1, f"TTFT with {top - 1} streaming (ms)")):
        ratio = run_ratios(lambda o, t: o[1][i] / t[1][i])
        print(f"| {what} | {fmt(ttft('llama', i) and 1e3 * ttft('llama', i), '.0f')} "
              f"| {fmt(ttft('ours', i) and 1e3 * ttft('ours', i), '.0f')} | {fmt(ratio, '.2f')} |")
    slow = {s: med([r[1][1] / r[1][0] for r in results.get(s, [])]) for s in ("llama", "ours")}
    print(f"| with {top - 1} streaming / alone | {fmt(slow['llama'], '.2f')} | {fmt(slow['ours'], '.2f')} | |")

    print("\nEach run, to judge the spread:\n")
    for side in sides:
        for run, (tp, (alone, loaded, started), counted) in enumerate(results[side]):
            print(f"- {side}, run {run + 1}: " + ", ".join(f"N={n} {tp[n]:.1f} tok/s" for n in levels)
                  + f"; TTFT alone {1e3 * alone:.0f} ms, loaded {1e3 * loaded:.0f} ms "
                  f"({started}/{top - 1} background streams had sent a chunk)")
    for side in sides:
        counted = results[side][0][2]
        lengths = "; ".join(f"{k}: {sorted(set(v)) if isinstance(v, list) else v}" for k, v in counted.items())
        print(f"\nPrompt tokens as the {'llama.cpp' if side == 'llama' else 'our'} server counted them "
              f"(run 1): {lengths}")


if __name__ == "__main__":
    main()
