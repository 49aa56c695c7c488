#!/usr/bin/env python3
"""A soak of `multihead serve`: many requests from concurrent clients, a mix
of well-formed ones, malformed bodies, oversized fields and clients that hang
up mid-request or mid-stream. Checks that the server stays up, that every
well-formed request is answered (200, its greedy text the same every time),
that every bad one gets a 4xx, and that the server's resident memory after
the run comes back to within --rss-margin (10 %) of its figure after a
warm-up. Exits 1 if any check fails. Standard library only.

    cargo build --release
    python3 scripts/serve_soak.py --model tests/fixtures/text/llama3 [--requests 1000] [--clients 16]

tests/serve.rs runs a smaller version of the same mix on every test run.
"""

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def post(base, path, body, timeout=300):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--multihead", default="target/release/multihead")
    ap.add_argument("--model", default="tests/fixtures/text/llama3")
    ap.add_argument("--dtype")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rss-margin", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="0.4,0.3,0.3",
                    help="shares of well-formed, bad and hung-up requests")
    args = ap.parse_args()

    cmd = [args.multihead, "serve", "--model", args.model, "--port", "0", "--threads", "2",
           "--parallel", str(args.parallel), "--queue", str(args.requests)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    addr = None
    for line in server.stderr:
        m = re.match(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
            break
    if addr is None:
        sys.exit("the server did not start")
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    base = f"http://{addr}"
    host, port = addr.rsplit(":", 1)

    good = {"prompt": "Hello world", "max_tokens": args.max_tokens, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": args.max_tokens,
            "temperature": 0}
    want = {}
    kinds = [("/v1/completions", good), ("/v1/chat/completions", chat)]
    for path, body in list(kinds):
        status, text = post(base, path, body)
        if path == "/v1/chat/completions" and status == 400 and b"no chat template" in text:
            kinds.pop()  # a folder without a template: completions only
            continue
        assert status == 200, text
        want[path] = json.loads(text)["choices"][0]

    counts = {"good": 0, "good_ok": 0, "bad": 0, "bad_4xx": 0, "hang_up": 0}
    failures = []
    lock = threading.Lock()

    def one(rng):
        kind = rng.random()
        good_share, bad_share, _ = (float(x) for x in args.mix.split(","))
        if kind < good_share:
            path, body = rng.choice(kinds)
            stream = rng.random() < 0.5
            b = dict(body, stream=stream)
            status, text = post(base, path, b)
            ok = status == 200
            if ok and not stream:
                ok = json.loads(text)["choices"][0] == want[path]
            if ok and stream:
                ok = text.rstrip().endswith(b"data: [DONE]")
            with lock:
                counts["good"] += 1
                counts["good_ok"] += ok
                if not ok:
                    failures.append((path, status, text[:200]))
        elif kind < good_share + bad_share:
            body = rng.choice([
                b"{not json",
                b"[1, 2, 3]",
                json.dumps({"prompt": "x", "max_tokens": "many"}).encode(),
                json.dumps({"prompt": "x", "temperature": 9}).encode(),
                json.dumps({"messages": [{"role": "user", "content": "x"}] * 5000}).encode(),
                json.dumps({"prompt": "word " * 100_000}).encode(),
                json.dumps({"prompt": "x", "stop": ["a"] * 50}).encode(),
                json.dumps({"prompt": "x", "max_tokens": 10**12}).encode(),
                b"x" * (9 << 20),
            ])
            try:
                status, text = post(base, rng.choice(["/v1/completions", "/v1/chat/completions"]), body)
            except urllib.error.URLError:
                # The server answered 413 and closed before the whole body
                # was sent: the client sees its write fail.
                status, text = 413, b""
            with lock:
                counts["bad"] += 1
                counts["bad_4xx"] += 400 <= status < 500
                if not 400 <= status < 500:
                    failures.append(("bad", status, text[:200]))
        else:
            body = json.dumps({"prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                               "stream": rng.random() < 0.5}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n").encode()
            s = socket.create_connection((host, int(port)))
            cut = rng.choice([len(body), len(body) // 2])
            s.sendall(head + body[:cut])
            s.settimeout(rng.choice([0.001, 0.05, 0.2]))
            try:
                s.recv(256)
            except OSError:
                pass
            s.close()
            with lock:
                counts["hang_up"] += 1

    def client(i, n):
        rng = random.Random(args.seed * 1000 + i + n)
        for _ in range(n // args.clients):
            one(rng)

    def run(n):
        threads = [threading.Thread(target=client, args=(i, n)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # A warm-up of the same traffic, a tenth as long: the thread pools and
    # the allocator's arenas reach their working size; that is the idle
    # figure the run must come back to.
    run(max(args.requests // 10, args.clients))
    time.sleep(1.0)
    idle = rss_kib(server.pid)
    for k in counts:
        counts[k] = 0
    failures.clear()
    start = time.time()
    run(args.requests)
    elapsed = time.time() - start
    time.sleep(1.0)
    alive = server.poll() is None
    # Still answering, and the same text.
    status, text = post(base, "/v1/completions", good)
    after = rss_kib(server.pid) if alive else 0
    server.terminate()
    try:
        code = server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        code = "still running 120 s after SIGTERM"

    total = counts["good"] + counts["bad"] + counts["hang_up"]
    print(f"{total} requests from {args.clients} clients in {elapsed:.1f} s: {counts}")
    print(f"RSS idle {idle / 1024:.1f} MiB, after {after / 1024:.1f} MiB ({after / idle:.3f}x); "
          f"exit status after SIGTERM {code}")
    ok = (alive and status == 200 and json.loads(text)["choices"][0] == want["/v1/completions"]
          and counts["good"] == counts["good_ok"] and counts["bad"] == counts["bad_4xx"]
          and after <= idle * (1 + args.rss_margin) and code == 0)
    for f in failures[:10]:
        print("failure:", f)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
