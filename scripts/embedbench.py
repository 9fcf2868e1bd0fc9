#!/usr/bin/env python3
"""Embeddings per second over HTTP, tiny_mindie against llama.cpp's ``llama-server
--embedding`` on the same GGUF, side by side.

Both servers run at once on the same model file with the same thread count:

    tiny_mindie     --model '' --embedding-model GGUF --threads T   (mutual TLS, as deployed)
    llama-server    -m GGUF --embedding --pooling mean -t T -np MAX_LEVEL
                    -c MAX_LEVEL*MAX_LENGTH -ub B -b B   (plain HTTP; B: 512, llama.cpp's
                    default, or MAX_LENGTH or MAX_LEVEL where larger; more flags, e.g. another
                    -ub, with --llama-args at the end of the command line)

For each text length L (``--lengths``, default ~16, ~128 and ~512 tokens, [CLS] and [SEP]
included; passages of scripts/texts/ after nomic's ``search_document: ``, each request a
different one) and concurrency level N (``--levels``, default 1, 8, 64), N clients start at
once; each sends ``ceil(--texts / N)`` OpenAI ``/v1/embeddings`` requests of one text, one
after another, over a kept-alive connection. A cell's figure is its texts / its wall time
(embeddings per second) and the median request latency; for tiny_mindie also its encoder's
runs in the cell, the texts per run and the share of the wall time it ran (``/metrics``),
which tell the batching. The servers take turns cell by cell,
``--alternate`` times over (every turn is printed: the host may be noisy); then per cell the
per-turn ratios tiny_mindie / llama-server and the goals: at 64 texts of ~128 tokens at least
1.5 times llama-server's embeddings per second, and one text's latency at most 1.1 times
llama-server's.

    python scripts/embedbench.py --llama-server /path/to/llama.cpp/build/bin
    python scripts/embedbench.py --llama-server DIR --levels 1 8 64 --alternate 3 \\
        --json docs/design/results/embed-nomic-vs-llama-server.json \\
        --plot docs/design/results/embed-nomic-vs-llama-server.svg

``--json FILE`` writes a results file (kind ``embed-vs-llama-server``; scripts/results.py) with
one row per length and level: ``length`` (asked), ``tokens`` (the texts' mean), ``n``,
``tiny_mindie_emb_s``, ``llama_server_emb_s``, ``ratios`` (one per turn),
``tiny_mindie_p50_ms``, ``llama_server_p50_ms`` (median request latency, per turn),
``tiny_mindie_texts_per_run`` (per turn).
``--plot FIG`` draws it (scripts/plot.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time

from loadtest import (
    banner_lines,
    llama_server_version,
    run_clients,
    start_llama_server,
    start_server,
)
from results import can_draw, cpu_line, draw, run_record, write

from tiny_mindie.config.load import load_config
from tiny_mindie.config.tls import tls_files
from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.registry.catalog import resolve
from tiny_mindie.server.tls import client_context

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "search_document: "
POOL = 64                     # distinct texts per length


def corpus() -> str:
    """The prose and code of scripts/texts/, one after the other."""
    parts = []
    for name in ("english.txt", "code.py"):
        with open(os.path.join(HERE, "texts", name), encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n\n".join(parts)


def make_texts(tokenizer, length: int, count: int = POOL) -> list[str]:
    """``count`` different texts of about ``length`` tokens each ([CLS] and [SEP] included):
    ``PREFIX`` and a window of the corpus starting at a word, ending on a whole word."""
    text = corpus()
    enc = tokenizer.encode(text, add_special_tokens=False)
    room = length - 2 - len(tokenizer.encode(PREFIX, add_special_tokens=False).ids)
    words = [i for i, w in enumerate(enc.word_ids) if w is not None and
             (i == 0 or enc.word_ids[i - 1] != w) and i + room <= len(enc.ids)]
    out = []
    for j in range(count):
        start = words[(j * 7919) % len(words)]
        end = start + room - 1
        while end > start and enc.word_ids[end + 1:end + 2] == [enc.word_ids[end]]:
            end -= 1                                   # end on a whole word
        out.append(PREFIX + text[enc.offsets[start][0]:enc.offsets[end][1]])
    return out


class Client:
    """``/v1/embeddings`` requests of one text over one kept-alive connection (made again
    when the server closed it)."""

    def __init__(self, port: int, model: str, ctx=None) -> None:
        self.port, self.model, self.ctx, self.conn = port, model, ctx, None

    def _connect(self):
        if self.ctx is None:
            return http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx,
                                           timeout=600)

    def embed(self, text: str) -> float:
        """One request; its wall time, s. RuntimeError unless it answers one vector."""
        body = json.dumps({"model": self.model, "input": text})
        t0 = time.perf_counter()
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = self._connect()
            try:
                self.conn.request("POST", "/v1/embeddings", body,
                                  {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        wall = time.perf_counter() - t0
        if resp.status != 200 or len(json.loads(raw)["data"]) != 1:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        if resp.getheader("Connection", "").lower() == "close":
            self.conn.close()
            self.conn = None
        return wall


def run_cell(port: int, model: str, ctx, texts: list[str], n: int, total: int) -> dict:
    """``n`` clients at once, each sending ``ceil(total / n)`` requests of one text; returns
    ``{"texts", "wall_s", "emb_s", "p50_ms"}``."""
    per_client = max(1, math.ceil(total / n))
    latencies: list[float] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        c = Client(port, model, ctx)
        for r in range(per_client):
            s = c.embed(texts[(i * per_client + r) % len(texts)])
            with lock:
                latencies.append(s)

    wall = run_clients(n, worker)
    return {"texts": len(latencies), "wall_s": wall, "emb_s": len(latencies) / wall,
            "p50_ms": 1000 * statistics.median(latencies)}


def encoder_counters(port: int, ctx) -> dict[str, float]:
    """tiny_mindie's encoder runs, their inputs and the seconds they took (``/metrics``)."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for key, series in (("runs", "batch_size_count"), ("inputs", "batch_size_sum"),
                        ("seconds", "seconds_total")):
        m = re.search(rf"^tiny_mindie_embedding_{series}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else math.nan
    return out


def measure(name: str, server: tuple, texts: list[str], n: int, total: int) -> dict:
    """:func:`run_cell` on ``server``; for tiny_mindie also ``runs`` (encoder runs),
    ``batch`` (inputs per run) and ``busy`` (the share of the wall time its encoder ran)."""
    port, model, ctx = server
    before = encoder_counters(port, ctx) if name == "tiny_mindie" else None
    cell = run_cell(port, model, ctx, texts, n, total)
    if before is not None:
        after = encoder_counters(port, ctx)
        runs = after["runs"] - before["runs"]
        cell.update(runs=runs, batch=(after["inputs"] - before["inputs"]) / max(runs, 1),
                    busy=(after["seconds"] - before["seconds"]) / cell["wall_s"])
    return cell


def start_both(args, path: str, home: str):
    """Both servers, started; returns ``({name: (port, model, ctx)}, processes, banner)``."""
    procs = []
    try:
        tiny, tiny_port = start_server(None, args.threads, home,
                                       extra=["--model", "", "--embedding-model", path])
        procs.append(tiny)
        ctx = client_context(tls_files(load_config(os.path.join(home, "config.json"))))
        llama, llama_port = start_llama_server(args.llama_server, path, args.threads,
                                               parallel=max(args.levels),
                                               extra=llama_flags(args))
        procs.append(llama)
    except BaseException:
        stop(procs)
        raise
    servers = {"tiny_mindie": (tiny_port, os.path.splitext(os.path.basename(path))[0], ctx),
               "llama-server": (llama_port, "m", None)}
    conn = http.client.HTTPSConnection("127.0.0.1", tiny_port, context=ctx, timeout=60)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    servers["tiny_mindie"] = (tiny_port, model, ctx)
    return servers, procs, tiny.banner


def llama_flags(args) -> list[str]:
    """llama-server's flags beside ``-m -t -np``: embeddings, mean pooling, a context of one
    slot per client of the longest text, and a (micro-)batch of its default 512 tokens, or
    more where the longest text or one output per slot needs it; then ``--llama-args``."""
    longest, slots = max(args.lengths), max(args.levels)
    batch = str(max(512, longest, slots))
    return ["--embedding", "--pooling", "mean", "-c", str(slots * longest), "-ub", batch,
            "-b", batch, *args.llama_args]


def stop(procs) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)


def sweep(args, servers: dict, texts: dict[int, list[str]]) -> dict:
    """Every cell on each server in turn, ``--alternate`` times; ``{(server, length, n):
    [cell per turn]}``."""
    for length in args.lengths:                               # warm up every shape
        for port, model, ctx in servers.values():
            run_cell(port, model, ctx, texts[length], min(8, max(args.levels)), 8)
    figures: dict = {}
    for turn in range(args.alternate):
        for length in args.lengths:
            for n in args.levels:
                for name, server in servers.items():
                    cell = measure(name, server, texts[length], n, max(args.texts, n))
                    figures.setdefault((name, length, n), []).append(cell)
                    runs = (f"  {cell['runs']:.0f} encoder runs of {cell['batch']:.1f} texts, "
                            f"busy {100 * cell['busy']:.0f} %" if "runs" in cell else "")
                    print(f"  turn {turn}  {length:4d} tokens  {n:3d} clients  {name:12s} "
                          f"{cell['emb_s']:8.1f} emb/s  p50 {cell['p50_ms']:8.1f} ms{runs}",
                          flush=True)
    return figures


def table(args, figures: dict, tokens: dict[int, float]) -> list[dict]:
    """The rows of the results file (see the module doc), printed."""
    print(f"\n{'tokens':>6} {'clients':>7}  {'tiny_mindie emb/s':<22} {'llama-server emb/s':<22} "
          f"{'ratio per turn':<18} {'p50 ms tiny / llama'}")
    rows = []
    for length in args.lengths:
        for n in args.levels:
            a, b = figures[("tiny_mindie", length, n)], figures[("llama-server", length, n)]
            row = {"length": length, "tokens": tokens[length], "n": n,
                   "tiny_mindie_emb_s": [c["emb_s"] for c in a],
                   "llama_server_emb_s": [c["emb_s"] for c in b],
                   "tiny_mindie_p50_ms": [c["p50_ms"] for c in a],
                   "llama_server_p50_ms": [c["p50_ms"] for c in b],
                   "tiny_mindie_texts_per_run": [c.get("batch") for c in a]}
            row["ratios"] = [x / y for x, y in zip(row["tiny_mindie_emb_s"],
                                                   row["llama_server_emb_s"], strict=True)]
            rows.append(row)
            lat = (f"{statistics.median(row['tiny_mindie_p50_ms']):.1f} / "
                   f"{statistics.median(row['llama_server_p50_ms']):.1f}")
            print(f"{tokens[length]:6.0f} {n:7d}  "
                  f"{' '.join(f'{x:.1f}' for x in row['tiny_mindie_emb_s']):<22} "
                  f"{' '.join(f'{x:.1f}' for x in row['llama_server_emb_s']):<22} "
                  f"{' '.join(f'{x:.2f}' for x in row['ratios']):<18} {lat}")
    return rows


def goals(rows: list[dict]) -> None:
    """Print the two goals against the medians of the turns."""
    for r in rows:
        if r["length"] == 128 and r["n"] == 64:
            print(f"64 texts of ~128 tokens: {statistics.median(r['ratios']):.2f} x "
                  "llama-server's embeddings/s (goal >= 1.5)")
        if r["n"] == 1:
            lat = [x / y for x, y in zip(r["tiny_mindie_p50_ms"], r["llama_server_p50_ms"],
                                         strict=True)]
            print(f"one text of ~{r['tokens']:.0f} tokens: latency {statistics.median(lat):.2f}"
                  " x llama-server's (goal <= 1.1)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", metavar="DIR", required=True,
                    help="llama.cpp's binaries folder, or the llama-server binary")
    ap.add_argument("--model", default="nomic-embed-text-v1.5",
                    help="a nomic-bert .gguf or a registry name")
    ap.add_argument("--threads", type=int, default=2, help="both servers' threads")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512],
                    help="tokens per text, [CLS] and [SEP] included")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 64],
                    help="concurrent clients")
    ap.add_argument("--texts", type=int, default=64, help="texts per cell (at least N)")
    ap.add_argument("--alternate", type=int, default=3, help="turns of each server per cell")
    ap.add_argument("--llama-args", nargs=argparse.REMAINDER, default=[],
                    help="more llama-server arguments (the rest of the command line)")
    ap.add_argument("--json", metavar="FILE", help="write the results file (scripts/results.py)")
    ap.add_argument("--plot", metavar="FIG",
                    help="draw the results into FIG (.svg or .png; needs matplotlib)")
    args = ap.parse_args(argv)
    if args.plot:
        can_draw()
    record = run_record("embed-vs-llama-server")
    path = resolve(args.model, task="embedding")
    tok = load_encoder(path).tokenizer
    texts = {n: make_texts(tok, n) for n in args.lengths}
    tokens = {n: statistics.mean(len(tok.encode(t).ids) for t in texts[n]) for n in texts}
    print(cpu_line())
    print(f"{os.path.basename(path)}: /v1/embeddings, one text per request; tiny_mindie over "
          f"mutual TLS, --threads {args.threads}; llama-server "
          f"{llama_server_version(args.llama_server) or '(version unknown)'} over plain HTTP, "
          f"-t {args.threads} -np {max(args.levels)} {' '.join(llama_flags(args))}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="embedbench-") as home:
        servers, procs, banner = start_both(args, path, home)
        try:
            figures = sweep(args, servers, texts)
        finally:
            stop(procs)
    rows = table(args, figures, tokens)
    goals(rows)
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json or args.plot:
        with tempfile.TemporaryDirectory(prefix="embedbench-") as tmp:
            out = args.json or os.path.join(tmp, "results.json")
            write(out, record, rows, model=os.path.basename(path), threads=args.threads,
                  alternate=args.alternate, texts_per_cell=args.texts,
                  server=banner_lines(banner),
                  api="/v1/embeddings, one text per request; tiny_mindie over mutual TLS",
                  llama_server={"version": llama_server_version(args.llama_server),
                                "flags": f"-t {args.threads} -np {max(args.levels)} "
                                         + " ".join(llama_flags(args))})
            if args.plot:
                draw(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
