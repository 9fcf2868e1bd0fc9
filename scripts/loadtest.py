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

Against llama.cpp's own server (``--llama-server DIR``: the folder of llama.cpp's binaries, or
the ``llama-server`` binary): both servers run the same model file over plain HTTP (tiny_mindie
with ``--no-tls``, llama-server with ``-t CPUs -np 8``), and every client sends the same greedy
OpenAI ``/v1/completions`` stream (temperature 0, ``ignore_eos``, ``--new-tokens`` tokens). The
servers take turns level by level, ``--alternate`` times over (the host may be shared and noisy:
every figure is printed, then the per-turn ratios tiny_mindie / llama-server), after the CPU
model and its SIMD flags.

    python scripts/loadtest.py --llama-server /path/to/llama.cpp/build/bin --levels 1 8

``--json FILE`` writes the run as a results file (kind ``loadtest``, or
``loadtest-vs-llama-server`` with ``--llama-server``; the record every results file carries:
scripts/results.py) with one row per level: ``n`` clients, ``tok_s``, ``ttft50``/``ttft99``/
``tpot50``/``tpot99`` (ms), ``requests``, ``tokens``, ``wall_s``; against llama-server,
``tiny_mindie_tok_s``, ``llama_server_tok_s`` and ``ratios``, one per turn. ``--plot FIG``
draws it (scripts/plot.py: tok/s against concurrent streams). A server that does not get
ready: the last lines of its log are printed, and the script exits non-zero.

    python scripts/loadtest.py --levels 1 4 8 16 --json docs/design/results/loadtest-NAME.json \\
        --plot docs/design/results/loadtest-NAME.svg
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
from typing import NoReturn

from results import can_draw, cpu_line, draw, run_record, write

from tiny_mindie.config.load import load_config
from tiny_mindie.config.tls import tls_files
from tiny_mindie.server.tls import client_context

PROMPT = ("In the small harbour town the fishermen mended their nets while the gulls circled "
          "above the boats, and the old keeper of the lighthouse")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


#: tiny_mindie's KV-cache budget in the runs here unless ``--kv-cache-mb`` says otherwise.
KV_CACHE_MB = 1024


def start_server(backend: str | None, threads: int | None, home: str,
                 log_path: str | None = None, extra: list[str] | None = None,
                 schedule: dict | None = None, kv_cache_mb: int = KV_CACHE_MB
                 ) -> tuple[subprocess.Popen, int]:
    """Start the server in ``home`` and wait for its banner; returns (process, business port),
    the banner's text in ``process.banner``. Its log (stderr) goes to ``log_path``, or to a
    temporary file. ``schedule``: more ``ScheduleConfig`` keys; ``kv_cache_mb``: its KV-cache
    budget (``BackendConfig.kvCacheMB``, which bounds the sequences held at once). A server
    that exits (or stays silent past 300 s) before it is ready: the last lines of its log go
    to stderr, then SystemExit with a one-line message."""
    cfg = {"ServerConfig": {"port": 0, "managementPort": 0, "metricsPort": 0, "maxLinkNum": 256},
           "BackendConfig": {"kvCacheMB": kv_cache_mb,
                             "ScheduleConfig": {"maxBatchSize": 16, "maxPrefillBatchSize": 16,
                                                **(schedule or {})}}}
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    cmd = [sys.executable, "-m", "tiny_mindie", "--config", path, "--log-level", "warning"]
    if backend:
        cmd += ["--backend", backend]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    cmd += extra or []
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
    with log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + 300
        banner = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            banner += line
            # the listeners are announced at once, the model loaded after: wait for "ready in"
            m = re.search(r"listens\s+https?://127\.0\.0\.1:(\d+)", line)
            if m and " ready in " in banner:
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                proc.banner = banner
                return proc, int(m.group(1))
        not_started("tiny_mindie", proc, log, timed_out=bool(line))


def not_started(name: str, proc: subprocess.Popen, log, timed_out: bool,
                lines: int = 20) -> NoReturn:
    """Stop ``proc`` (the server ``name``, which exited or, ``timed_out``, did not get ready in
    time), print the last ``lines`` of its ``log`` (the file object its stderr went to) to
    stderr, and exit with a one-line message."""
    if timed_out:
        proc.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.seek(0)
    tail = log.read().rstrip().splitlines()[-lines:]
    print(f"--- the last {len(tail)} lines of {name}'s log:", file=sys.stderr)
    print("\n".join(tail) or "(empty)", file=sys.stderr)
    why = ("was not ready in 300 s" if timed_out
           else f"exited with code {proc.returncode} before it was ready")
    raise SystemExit(f"loadtest: {name} {why}; the last lines of its log are above")


def banner_lines(banner: str) -> dict:
    """The ``model`` and ``backend`` lines of the server's banner, e.g. ``{"model":
    "smollm2-135m-instruct (SmolLM2-135M-Instruct.Q4_1.gguf, llama, ...)", "backend":
    "onnxruntime on CPU (2 threads), exact weights"}``."""
    out = {}
    for line in banner.splitlines():
        key, _, value = line.strip().partition(" ")
        if key in ("model", "backend") and value.strip():
            out[key] = value.strip()
    return out


class Client:
    """One streaming request at a time over a kept-alive TLS connection."""

    def __init__(self, port: int, ctx: ssl.SSLContext):
        self.conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=600)

    def stream(self, body: dict) -> tuple[float, list[float], int]:
        """Returns (TTFT s, inter-token gaps s, tokens)."""
        t0 = time.perf_counter()
        times = []
        for event in sse_events(self.conn, "/infer", body):
            times.append(time.perf_counter())
            if b'"error"' in event[:20]:
                raise RuntimeError(event.decode())
        return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], len(times)


def sse_events(conn: http.client.HTTPConnection, path: str, body: dict):
    """POST ``body`` as JSON to ``path`` on ``conn`` and yield each ``data: `` event of the
    streamed answer as it arrives (bytes, ``data: `` included); RuntimeError unless HTTP 200."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                yield event


def run_clients(n: int, worker) -> float:
    """Run ``worker(i)`` for ``i`` in ``range(n)`` in ``n`` threads at once; the wall time, s.
    A worker that raises stops there; the level then ends with SystemExit naming the first
    error (reported, not hidden)."""
    errors: list[str] = []

    def guarded(i: int) -> None:
        try:
            worker(i)
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"level {n}: {len(errors)} failed requests, first: {errors[0]}")
    return time.perf_counter() - t0


def run_level(n: int, port: int, ctx, rounds: int, new_tokens: int) -> dict:
    ttft, tpot, tokens = [], [], [0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        c = Client(port, ctx)
        for r in range(rounds):
            body = {"inputs": PROMPT, "stream": True,
                    "parameters": {"max_new_tokens": new_tokens, "seed": 1000 * i + r,
                                   "temperature": 0.8, "top_k": 50, "top_p": 0.95}}
            first, gaps, k = c.stream(body)
            with lock:
                ttft.append(first * 1000)
                tpot.extend(g * 1000 for g in gaps)
                tokens[0] += k

    wall = run_clients(n, worker)
    return {"n": n, "tok_s": tokens[0] / wall, "ttft50": percentile(ttft, 50),
            "ttft99": percentile(ttft, 99), "tpot50": percentile(tpot, 50),
            "tpot99": percentile(tpot, 99), "requests": len(ttft), "tokens": tokens[0],
            "wall_s": wall}


class PlainClient:
    """Greedy OpenAI ``/v1/completions`` streams over plain HTTP, a new connection for each
    (llama-server closes a connection after a stream without saying so)."""

    def __init__(self, port: int, model: str):
        self.port = port
        self.model = model

    def stream(self, new_tokens: int) -> tuple[float, list[float], int]:
        """Returns (TTFT s, gaps between token events s, token events)."""
        body = {"model": self.model, "prompt": PROMPT, "stream": True, "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        times = []
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        for event in sse_events(conn, "/v1/completions", body):
            if event.startswith(b"data: [DONE]"):
                continue
            if ((json.loads(event[6:]).get("choices") or [{}])[0]).get("text"):
                times.append(time.perf_counter())
        conn.close()
        return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], len(times)


def plain_level(n: int, port: int, model: str, rounds: int, new_tokens: int) -> dict:
    """Like :func:`run_level`, with :class:`PlainClient` streams."""
    tokens = [0]
    lock = threading.Lock()

    def worker(_: int) -> None:
        c = PlainClient(port, model)
        for _ in range(rounds):
            _, _, k = c.stream(new_tokens)
            with lock:
                tokens[0] += k

    wall = run_clients(n, worker)
    return {"n": n, "tok_s": tokens[0] / wall, "tokens": tokens[0]}


def start_llama_server(where: str, model: str, threads: int, parallel: int = 8,
                       extra: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """llama.cpp's ``llama-server`` (``where``: the binary or its folder) on ``model``, plain
    HTTP on a free port, ``-t threads -np parallel`` and ``extra`` arguments; waits until
    ``/health`` answers 200. One that exits or is not healthy in 300 s: the last lines of its
    log go to stderr, then SystemExit with a one-line message."""
    import socket

    binary = llama_server_binary(where)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([binary, "-m", model, "-t", str(threads), "-np", str(parallel),
                                 "--host", "127.0.0.1", "--port", str(port), *(extra or [])],
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return proc, port
            except OSError:
                pass
            time.sleep(0.5)
        not_started(f"llama-server ({binary})", proc, log, timed_out=proc.poll() is None)


def llama_server_binary(where: str) -> str:
    """The ``llama-server`` binary: ``where`` itself, or the one in the folder ``where``."""
    return os.path.join(where, "llama-server") if os.path.isdir(where) else where


def llama_server_version(where: str) -> str | None:
    """What ``llama-server --version`` says its version is (e.g. ``version: 1 (0c1e570)``)."""
    try:
        proc = subprocess.run([llama_server_binary(where), "--version"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")]
    return found[0].strip() if found else None


def server_flags(args) -> list[str]:
    """The tiny_mindie flags this run's options ask for (beside backend and threads)."""
    extra = ["--no-speculation"] if args.no_speculation else []
    if args.parallel_runs is not None:
        extra += ["--parallel-runs", str(args.parallel_runs)]
    if args.weights:
        extra += ["--weights", args.weights]
    if args.draft_model:
        extra += ["--draft-model", args.draft_model]
    if args.model and not args.llama_server:
        extra += ["--model", args.model]
    return extra


def settings(args) -> str:
    """This run's tiny_mindie settings that are not the defaults, for the printed header."""
    return (f"{', no speculation' if args.no_speculation else ''}"
            f"{f', KV cache {args.kv_cache_mb} MB' if args.kv_cache_mb != KV_CACHE_MB else ''}"
            f"{f', {args.weights} weights' if args.weights else ''}"
            f"{f', draft model {args.draft_model}' if args.draft_model else ''}")


def run_settings(args) -> dict:
    """This run's settings for its results file."""
    return {"prompt": PROMPT, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "levels": args.levels, "backend": args.backend, "threads": args.threads,
            "parallel_runs": args.parallel_runs, "speculation": not args.no_speculation,
            "weights": args.weights, "draft_model": args.draft_model}


def save(args, record: dict, rows: list[dict], **fields) -> None:
    """Write the results file (``--json``) and the figure (``--plot``) this run asks for."""
    if not (args.json or args.plot):
        return
    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        path = args.json or os.path.join(tmp, "results.json")
        write(path, record, rows, **run_settings(args), **fields)
        if args.plot:
            draw(path, args.plot)


def versus_llama_server(args) -> int:
    """tiny_mindie (plain HTTP) against llama-server on the same model, turns alternating."""
    from tiny_mindie.model.gguf import ModelFileError
    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL, resolve

    record = run_record("loadtest-vs-llama-server")
    try:
        model = resolve(args.model or DEFAULT_MODEL)
    except ModelFileError as exc:
        raise SystemExit(f"loadtest: {exc}") from None
    cpus = len(os.sched_getaffinity(0))
    extra = ["--no-tls", "--model", model, *server_flags(args)]
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-load-") as home:
        tiny, tiny_port = start_server(args.backend, args.threads, home, extra=extra,
                                       kv_cache_mb=args.kv_cache_mb)
        procs = [tiny]
        try:
            llama, llama_port = start_llama_server(args.llama_server, model, cpus)
            procs.append(llama)
            conn = http.client.HTTPConnection("127.0.0.1", tiny_port, timeout=60)
            conn.request("GET", "/v1/models")
            name = json.loads(conn.getresponse().read())["data"][0]["id"]
            servers = {"tiny_mindie": (tiny_port, name), "llama-server": (llama_port, "m")}
            for port, m in servers.values():            # warm up
                PlainClient(port, m).stream(4)
            figures: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.alternate):
                for n in args.levels:
                    for label, (port, m) in servers.items():
                        r = plain_level(n, port, m, args.rounds, args.new_tokens)
                        figures.setdefault((label, n), []).append(r["tok_s"])
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    print(cpu_line())
    print(f"{os.path.basename(model)}: greedy /v1/completions streams, {args.new_tokens} tokens, "
          f"{args.rounds} per client, plain HTTP; tiny_mindie threads "
          f"{args.threads if args.threads is not None else 'default'}, parallel runs "
          f"{args.parallel_runs if args.parallel_runs is not None else 'default'}"
          f"{settings(args)}; llama-server "
          f"-t {cpus} -np 8; load average {os.getloadavg()[0]:.2f}")
    print(f"{'clients':>7}  {'tiny_mindie tok/s':<28} {'llama-server tok/s':<28} ratio per turn")
    rows = []
    for n in args.levels:
        a, b = figures[("tiny_mindie", n)], figures[("llama-server", n)]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        rows.append({"n": n, "tiny_mindie_tok_s": a, "llama_server_tok_s": b, "ratios": ratios})
        print(f"{n:>7}  {' '.join(f'{x:.1f}' for x in a):<28} "
              f"{' '.join(f'{x:.1f}' for x in b):<28} {' '.join(f'{x:.2f}' for x in ratios)}")
    save(args, record, rows, model=os.path.basename(model), alternate=args.alternate,
         server=banner_lines(tiny.banner), api="/v1/completions, greedy, plain HTTP",
         llama_server={"version": llama_server_version(args.llama_server),
                       "flags": f"-t {cpus} -np 8"})
    return 0


def own_server(args) -> int:
    """The sweep against tiny_mindie alone, over mutual TLS (``/infer`` streams, sampled)."""
    record = run_record("loadtest")
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-load-") as home:
        proc, port = start_server(args.backend, args.threads, home, extra=server_flags(args),
                                  kv_cache_mb=args.kv_cache_mb)
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
          f"rounds per client, backend {args.backend or 'default'}"
          f"{settings(args)}, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'clients':>7} {'requests':>8} {'agg tok/s':>9} {'vs 1':>5} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    for r in rows:
        print(f"{r['n']:>7} {r['requests']:>8} {r['tok_s']:>9.1f} {r['tok_s'] / base:>5.2f} "
              f"{r['ttft50']:>9.1f} {r['ttft99']:>9.1f} {r['tpot50']:>9.1f} {r['tpot99']:>9.1f}")
    save(args, record, rows, server=banner_lines(proc.banner),
         api="/infer streams over mutual TLS, temperature 0.8, top-k 50, top-p 0.95")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backend", choices=["onnxruntime", "numpy"])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--parallel-runs", type=int, help="tiny_mindie's --parallel-runs")
    ap.add_argument("--no-speculation", action="store_true",
                    help="tiny_mindie with --no-speculation (one token per decode step)")
    ap.add_argument("--weights", choices=("exact", "compact"), help="tiny_mindie's --weights")
    ap.add_argument("--draft-model", help="tiny_mindie's --draft-model")
    ap.add_argument("--kv-cache-mb", type=int, default=KV_CACHE_MB,
                    help="tiny_mindie's KV-cache budget (BackendConfig.kvCacheMB), which bounds "
                         "the sequences it holds at once: a 1.5B needs 1,200 MB for 8 of "
                         "2,560 tokens, as many as llama-server's -np 8")
    ap.add_argument("--model", help="a .gguf file or a registry name (default: the server's)")
    ap.add_argument("--llama-server", metavar="DIR",
                    help="llama.cpp's binaries folder (or llama-server): compare against it")
    ap.add_argument("--alternate", type=int, default=3,
                    help="turns of each server per level (with --llama-server)")
    ap.add_argument("--json", metavar="FILE", help="write the results file (scripts/results.py)")
    ap.add_argument("--plot", metavar="FIG",
                    help="draw the results into FIG (.svg or .png; needs matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        can_draw()
    if args.llama_server:
        return versus_llama_server(args)
    return own_server(args)

if __name__ == "__main__":
    sys.exit(main())
