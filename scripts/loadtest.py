#!/usr/bin/env python3
"""Concurrency sweep over HTTP: N streaming clients against a real server, real TLS.

For each concurrency level N (default 1, 4, 8, 16) it starts N client threads at once; each sends
``--rounds`` streaming ``/infer`` requests one after another (a fixed prompt of about 30
tokens, ``--new-tokens`` generated, sampled with its own seed). It prints:

    agg tok/s   generated tokens of all clients / wall time of the level
    TTFT p50/p99   ms from sending the request to its first token event
    TPOT p50/p99   ms between token events of one stream (time per output token)
    vs 1        aggregate tok/s relative to the single-client level

The server is started here (``python -m tiny_mindie --config ...``, a fresh config home with its
own certificates; ``--backend`` and ``--threads`` are passed on). Traffic goes to 127.0.0.1 only;
every level is bounded by its request count.

    python scripts/loadtest.py                         # default backend, levels 1 4 8 16
    python scripts/loadtest.py --backend numpy --levels 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import threading
import time

from tiny_mindie.config import load_config
from tiny_mindie.security import tls_files
from tiny_mindie.server.tls import client_context

PROMPT = ("In the small harbour town the fishermen mended their nets while the gulls circled "
          "above the boats, and the old keeper of the lighthouse")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def start_server(backend: str | None, threads: int | None, home: str,
                 log_path: str | None = None) -> tuple[subprocess.Popen, int]:
    """Start the server in ``home`` and wait for its banner; returns (process, business port).
    Its log (stderr) goes to ``log_path``, or nowhere."""
    cfg = {"ServerConfig": {"port": 0, "managementPort": 0, "metricsPort": 0, "maxLinkNum": 256},
           "BackendConfig": {"kvCacheMB": 1024,
                             "ScheduleConfig": {"maxBatchSize": 16, "maxPrefillBatchSize": 16}}}
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    cmd = [sys.executable, "-m", "tiny_mindie", "--config", path, "--log-level", "warning"]
    if backend:
        cmd += ["--backend", backend]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    stderr = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    deadline = time.monotonic() + 300
    banner = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        banner += line
        m = re.search(r"listens\s+https://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.kill()
    raise SystemExit("server did not start:\n" + banner)


class Client:
    """One streaming request at a time over a kept-alive TLS connection."""

    def __init__(self, port: int, ctx: ssl.SSLContext):
        self.conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=600)

    def stream(self, body: dict) -> tuple[float, list[float], int]:
        """Returns (TTFT s, inter-token gaps s, tokens)."""
        t0 = time.perf_counter()
        self.conn.request("POST", "/infer", json.dumps(body), {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        times = []
        buf = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    times.append(time.perf_counter())
                    if b'"error"' in event[:20]:
                        raise RuntimeError(event.decode())
        return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], len(times)


def run_level(n: int, port: int, ctx, rounds: int, new_tokens: int) -> dict:
    ttft, tpot, tokens = [], [], [0]
    lock = threading.Lock()
    errors: list[str] = []

    def worker(i: int) -> None:
        c = Client(port, ctx)
        for r in range(rounds):
            body = {"inputs": PROMPT, "stream": True,
                    "parameters": {"max_new_tokens": new_tokens, "seed": 1000 * i + r,
                                   "temperature": 0.8, "top_k": 50, "top_p": 0.95}}
            try:
                first, gaps, k = c.stream(body)
            except Exception as exc:   # report, do not hide
                errors.append(repr(exc))
                return
            with lock:
                ttft.append(first * 1000)
                tpot.extend(g * 1000 for g in gaps)
                tokens[0] += k

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"level {n}: {len(errors)} failed requests, first: {errors[0]}")
    return {"n": n, "tok_s": tokens[0] / wall, "ttft50": percentile(ttft, 50),
            "ttft99": percentile(ttft, 99), "tpot50": percentile(tpot, 50),
            "tpot99": percentile(tpot, 99), "requests": len(ttft)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backend", choices=["onnxruntime", "numpy"])
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-load-") as home:
        proc, port = start_server(args.backend, args.threads, home)
        try:
            ctx = client_context(tls_files(load_config(os.path.join(home, "config.json"))))
            Client(port, ctx).stream({"inputs": "warm up", "stream": True,
                                      "parameters": {"max_new_tokens": 4}})
            rows = [run_level(n, port, ctx, args.rounds, args.new_tokens) for n in args.levels]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    base = rows[0]["tok_s"]
    print(f"prompt ~{len(PROMPT.split())} words, {args.new_tokens} new tokens, {args.rounds} "
          f"rounds per client, backend {args.backend or 'default'}, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'clients':>7} {'requests':>8} {'agg tok/s':>9} {'vs 1':>5} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    for r in rows:
        print(f"{r['n']:>7} {r['requests']:>8} {r['tok_s']:>9.1f} {r['tok_s'] / base:>5.2f} "
              f"{r['ttft50']:>9.1f} {r['ttft99']:>9.1f} {r['tpot50']:>9.1f} {r['tpot99']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
