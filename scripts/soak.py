#!/usr/bin/env python3
"""Soak test: N clients against a real server over real mutual TLS for a while.

The clients send a mix of well-behaved requests, vanish mid-request and send bad input; the
server's memory and descriptors are sampled as it runs, and its log is kept.

Each client loops until the time is up, choosing per request (its own seeded RNG):

    stream      streaming ``/infer`` read to the end                     expects 200
    infer       plain ``/infer``                                         expects 200
    chat        ``/v1/chat/completions``, streamed or not                 expects 200
    vanish      a streaming request whose client closes the socket right after sending it,
                or after the first bytes of the answer                    expects nothing
    bad         malformed JSON, a wrong type, an unknown route            expects its 4xx
    probe       ``GET /health``, ``/v1/models``                           expects 200

At the end it reads ``/metrics`` and prints a table. It exits 1 when a request got an answer it
should not have (a 5xx, a wrong status, a broken connection that was not its own doing), when
``request_failed_total{reason="internal"}`` is not 0, when the server logged a traceback, or
when the server's RSS grew by more than ``--max-rss-growth`` MB, or its open descriptors by more
than 8, between the end of the first quarter of the run and the end (after the clients finish).

    python scripts/soak.py                      # 16 clients, 180 s
    python scripts/soak.py --clients 4 --seconds 30
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadtest import start_server  # noqa: E402  (a sibling script)

from tiny_mindie.config.load import load_config  # noqa: E402
from tiny_mindie.config.tls import tls_files  # noqa: E402
from tiny_mindie.server.tls import client_context  # noqa: E402

PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time",
           "Explain what a KV cache is in one sentence."]
KINDS = [("stream", 30), ("infer", 15), ("chat", 20), ("vanish", 15), ("bad", 10), ("probe", 10)]


def rss_and_fds(pid: int) -> tuple[float, int]:
    """Resident set size in MB and the number of open descriptors of process ``pid``."""
    with open(f"/proc/{pid}/status") as fh:
        rss_kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Soak:
    def __init__(self, port: int, ctx: ssl.SSLContext, deadline: float):
        self.port, self.ctx, self.deadline = port, ctx, deadline
        self.lock = threading.Lock()
        self.done: Counter = Counter()
        self.errors: list[str] = []

    def conn(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=300)

    def expect(self, c: http.client.HTTPSConnection, method: str, path: str, body, status: int,
               kind: str) -> bytes:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
        c.request(method, path, data, {"Content-Type": "application/json"})
        resp = c.getresponse()
        raw = resp.read()
        if resp.status != status:
            raise AssertionError(f"{kind}: {method} {path} -> {resp.status} "
                                 f"(expected {status}): {raw[:200]!r}")
        return raw

    def vanish(self, rng: random.Random) -> None:
        body = json.dumps({"inputs": rng.choice(PROMPTS), "stream": True,
                           "parameters": {"max_new_tokens": 64}}).encode()
        head = (f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as raw:
            with self.ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(head + body)
                if rng.random() < 0.5:
                    s.recv(1)                       # wait for the head, then leave mid-stream
                time.sleep(rng.random() * 0.2)
                # closing without reading the rest: the server must cancel and count "cancelled"

    def one(self, c: http.client.HTTPSConnection, kind: str, rng: random.Random, i: int) -> None:
        prompt = rng.choice(PROMPTS)
        n = rng.randint(4, 32)
        if kind == "stream":
            raw = self.expect(c, "POST", "/infer", {
                "inputs": prompt, "stream": True,
                "parameters": {"max_new_tokens": n, "do_sample": True, "seed": i,
                               "temperature": 0.8},
            }, 200, kind)
            if b'"error"' in raw:
                raise AssertionError(f"stream: error event {raw[-200:]!r}")
        elif kind == "infer":
            self.expect(c, "POST", "/infer", {"inputs": prompt, "stream": False,
                                              "parameters": {"max_new_tokens": n}}, 200, kind)
        elif kind == "chat":
            self.expect(c, "POST", "/v1/chat/completions", {
                "model": "smollm2-135m-instruct", "max_tokens": n, "stream": rng.random() < 0.5,
                "messages": [{"role": "user", "content": prompt}]}, 200, kind)
        elif kind == "bad":
            path, body, status = rng.choice([
                ("/infer", b'{"inputs": "x", ', 422),
                ("/infer", {"inputs": "x", "parameters": {"max_new_tokens": "many"}}, 422),
                ("/v1/chat/completions", {"model": "smollm2-135m-instruct", "messages": 7}, 400),
                ("/no/such/route", {}, 404)])
            self.expect(c, "POST", path, body, status, kind)
        elif kind == "probe":
            self.expect(c, "GET", rng.choice(["/health", "/v1/models"]), None, 200, kind)

    def client(self, k: int) -> None:
        rng = random.Random(k)
        c = self.conn()
        names, weights = zip(*KINDS, strict=True)
        i = 0
        while time.monotonic() < self.deadline:
            kind = rng.choices(names, weights)[0]
            i += 1
            try:
                if kind == "vanish":
                    self.vanish(rng)
                else:
                    self.one(c, kind, rng, 1000 * k + i)
            except Exception as exc:   # report every unexpected answer; keep going
                with self.lock:
                    self.errors.append(f"client {k}: {exc!r}")
                c.close()
                c = self.conn()
                continue
            with self.lock:
                self.done[kind] += 1
        c.close()


def failed_by_reason(metrics_text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tiny_mindie_request_failed_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$',
        metrics_text, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", help="keep the server's log in this file (default: a temporary one)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--max-rss-growth", type=float, default=32.0, help="MB")
    ap.add_argument("--backend", choices=["onnxruntime", "numpy"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-soak-") as home:
        log_path = args.log or os.path.join(home, "server.log")
        proc, port = start_server(args.backend, None, home, log_path)
        try:
            ctx = client_context(tls_files(load_config(os.path.join(home, "config.json"))))
            t0 = time.monotonic()
            soak = Soak(port, ctx, t0 + args.seconds)
            threads = [threading.Thread(target=soak.client, args=(k,)) for k in range(args.clients)]
            for t in threads:
                t.start()
            samples = []
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - t0, *rss_and_fds(proc.pid)))
                time.sleep(5)
            for t in threads:
                t.join()
            time.sleep(1.0)                       # let vanished connections finish closing
            end = (time.monotonic() - t0, *rss_and_fds(proc.pid))
            c = soak.conn()
            text = soak.expect(c, "GET", "/metrics", None, 200, "metrics").decode()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        with open(log_path) as fh:
            log_text = fh.read()
    tracebacks = log_text.count("Traceback (most recent call last)")
    failed = failed_by_reason(text)
    received = re.search(r"^tiny_mindie_request_received_total\{[^}]*\} (\S+)$", text, re.M)
    quarter = next((s for s in samples if s[0] >= args.seconds / 4), samples[-1])
    print(f"{args.clients} clients, {args.seconds:.0f} s, load average {os.getloadavg()[0]:.2f}")
    print("requests by kind:", dict(sorted(soak.done.items())), "errors:", len(soak.errors))
    print("server counted: received", received.group(1) if received else "?",
          "failed", {k: int(v) for k, v in failed.items()})
    print(f"RSS MB: start {samples[0][1]:.0f}, at {quarter[0]:.0f} s {quarter[1]:.0f}, "
          f"max {max(s[1] for s in samples):.0f}, end {end[1]:.0f}")
    print(f"descriptors: start {samples[0][2]}, at {quarter[0]:.0f} s {quarter[2]}, "
          f"max {max(s[2] for s in samples)}, end {end[2]}")
    print("RSS MB every 5 s:", " ".join(f"{s[1]:.0f}" for s in samples))
    print(f"server log: {len(log_text.splitlines())} lines, {tracebacks} tracebacks")
    for e in soak.errors[:10]:
        print("  error:", e)
    ok = (not soak.errors and failed.get("internal", 0) == 0 and not tracebacks
          and end[1] - quarter[1] <= args.max_rss_growth and end[2] <= quarter[2] + 8)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
