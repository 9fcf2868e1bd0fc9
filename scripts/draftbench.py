#!/usr/bin/env python3
"""Speculative decoding with a draft model, side by side with llama.cpp: one stream over HTTP.

Each server in turn runs the target model over plain HTTP, and one client sends it, one after
another, three prompts (a code completion, a chat answer, a summary; Qwen's ChatML written out,
so both servers see the same tokens) as OpenAI ``/v1/completions`` requests of ``--new-tokens``
tokens (``ignore_eos``), greedy and then sampled (temperature 0.7, a fixed seed). The servers:

    tiny_mindie                      --no-tls --model TARGET
    tiny_mindie + draft              ... --draft-model DRAFT
    llama-server                     -m TARGET -t CPUs -np 1
    llama-server + draft (N)         ... -md DRAFT --spec-type draft-simple --spec-draft-n-max N
                                     for each N of --n-max

For every server, prompt and mode it prints tok/s (generated tokens / the request's wall time)
and, where the server reports them, the draft's proposed and accepted tokens (tiny_mindie: its
``/metrics`` counters; llama-server: the response's ``timings.draft_n`` and
``draft_n_accepted``); then each server's mean over the six requests and its ratio to plain
llama-server, to the best llama-server with the draft, and the servers' resident memory once
loaded. The whole sweep runs ``--alternate`` times (the host may be noisy: every figure is
printed), after the CPU model and its SIMD flags.

    python scripts/draftbench.py --llama-server /path/to/llama.cpp/build/bin \\
        --json docs/design/results/draft-qwen2.5-coder-1.5b.json

``--json FILE`` writes a results file (kind ``draft-vs-llama-server``; scripts/results.py) with one
row per server, prompt and mode of each turn.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import tempfile
import time

from loadtest import llama_server_version, start_llama_server, start_server
from results import cpu_line, run_record, write
from soak import rss_and_fds

from tiny_mindie.model.registry.catalog import resolve

CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}" \
       "<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "code": "import json\nimport os\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config "
            "file and return it as a dict, with defaults for missing keys.\"\"\"\n",
    "chat": CHAT.format("Write a Python function that checks whether a string is a palindrome, "
                        "and explain how it works."),
    "summary": CHAT.format(
        "Summarize the following text in three sentences.\n\nA key-value cache stores, for "
        "every token a language model has already read, the keys and values its attention "
        "layers computed. When the model produces the next token it only computes the new "
        "token's query, key and value, and attends to everything in the cache, instead of "
        "running the whole sequence again. This makes each decoding step cost about the same "
        "however long the text is, at the price of memory that grows with the sequence: for a "
        "model with 28 layers, two key-value heads of 128 dimensions and 32-bit numbers, each "
        "token takes 57 kilobytes. Servers therefore bound the number of sequences they keep, "
        "reuse the cache of shared prompt prefixes, and sometimes store it in fewer bits."),
}
MODES = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.7, "seed": 42}}


def metrics(port: int) -> dict[str, float]:
    """tiny_mindie's draft counters from ``/metrics`` (plain HTTP)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for name in ("draft_model_tokens_total", "draft_model_accepted_tokens_total"):
        m = re.search(rf"^tiny_mindie_spec_decode_{name}{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def model_id(port: int) -> str:
    """The id the server gives its model in ``/v1/models``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def complete(port: int, prompt: str, new_tokens: int, mode: dict) -> tuple[float, dict, int]:
    """One ``/v1/completions`` request; returns (wall s, its ``timings`` or {}, tokens)."""
    body = {"model": model_id(port), "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
            **mode}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    wall = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"draftbench: HTTP {resp.status}: {raw[:300]!r}")
    ans = json.loads(raw)
    return wall, ans.get("timings") or {}, ans["usage"]["completion_tokens"]


def run_server(name: str, proc, port: int, args, tiny: bool, turn: int) -> list[dict]:
    """Every prompt and mode on one started server, then stop it."""
    rows = []
    try:
        complete(port, "Hello", 4, MODES["greedy"])           # warm up
        time.sleep(args.settle)     # tiny_mindie moves its weights to huge pages meanwhile
        memory = rss_and_fds(proc.pid)[0]
        for prompt_name, prompt in PROMPTS.items():
            for mode_name, mode in MODES.items():
                before = metrics(port) if tiny else {}
                wall, timings, n = complete(port, prompt, args.new_tokens, mode)
                row = {"turn": turn, "server": name, "prompt": prompt_name, "mode": mode_name,
                       "tokens": n, "tok_s": n / wall, "rss_mb": memory}
                if tiny:
                    after = metrics(port)
                    row["proposed"] = after["draft_model_tokens_total"] - \
                        before["draft_model_tokens_total"]
                    row["accepted"] = after["draft_model_accepted_tokens_total"] - \
                        before["draft_model_accepted_tokens_total"]
                elif "draft_n" in timings:
                    row["proposed"], row["accepted"] = timings["draft_n"], \
                        timings["draft_n_accepted"]
                rate = (f"  accepted {row['accepted']:.0f}/{row['proposed']:.0f}"
                        if row.get("proposed") else "")
                print(f"  {name:28s} {prompt_name:8s} {mode_name:7s} {row['tok_s']:6.1f} tok/s"
                      f"{rate}", flush=True)
                rows.append(row)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def servers(args, target: str, draft: str, threads: int):
    """``(name, start)`` for every server of the comparison; ``start()`` returns
    ``(process, port, is_tiny_mindie)``."""
    def tiny(extra):
        def start():
            home = tempfile.mkdtemp(prefix="draftbench-")   # the server's config folder
            proc, port = start_server(None, None, home, extra=["--no-tls", "--model", target,
                                                                *extra])
            return proc, port, True
        return start

    def llama(extra):
        def start():
            proc, port = start_llama_server(args.llama_server, target, threads, parallel=1,
                                            extra=extra)
            return proc, port, False
        return start

    yield "tiny_mindie", tiny([])
    yield "tiny_mindie + draft", tiny(["--draft-model", draft])
    yield "llama-server", llama([])
    for n in args.n_max:
        yield f"llama-server + draft (n-max {n})", llama(
            ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n)])


def summary(rows: list[dict]) -> dict[str, float]:
    """Each server's mean tok/s over all its rows."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["server"], []).append(r["tok_s"])
    return {k: sum(v) / len(v) for k, v in by.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", metavar="DIR", required=True,
                    help="llama.cpp's binaries folder, or the llama-server binary")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                    help="the target: a .gguf file or a registry name")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                    help="the draft: a .gguf file or a registry name")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--n-max", type=int, nargs="+", default=[3, 8, 16],
                    help="llama-server's --spec-draft-n-max values to try")
    ap.add_argument("--alternate", type=int, default=1, help="sweeps over all servers")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds between a server's warm-up and its first measured request")
    ap.add_argument("--json", metavar="FILE", help="write the results file (scripts/results.py)")
    args = ap.parse_args(argv)
    record = run_record("draft-vs-llama-server")
    target, draft = resolve(args.model), resolve(args.draft)
    threads = os.cpu_count() or 1
    print(cpu_line())
    print(f"target {os.path.basename(target)}, draft {os.path.basename(draft)}, "
          f"{args.new_tokens} tokens per request; llama-server "
          f"{llama_server_version(args.llama_server) or '(version unknown)'}, -t {threads}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict] = []
    for turn in range(args.alternate):
        for name, start in servers(args, target, draft, threads):
            proc, port, is_tiny = start()
            rows += run_server(name, proc, port, args, is_tiny, turn)
    means = summary(rows)
    plain = means["llama-server"]
    best = max(v for k, v in means.items() if k.startswith("llama-server + draft"))
    print(f"\nmean tok/s over {len(PROMPTS) * len(MODES)} requests x {args.alternate} "
          f"(vs llama-server / vs its best with the draft); load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, v in means.items():
        mem = max(r["rss_mb"] for r in rows if r["server"] == name)
        print(f"  {name:34s} {v:6.1f}   {v / plain:5.2f}x  {v / best:5.2f}x   {mem:6.0f} MB")
    if args.json:
        write(args.json, record, rows,
              settings={"target": os.path.basename(target), "draft": os.path.basename(draft),
                        "new_tokens": args.new_tokens, "n_max": args.n_max,
                        "prompts": PROMPTS, "modes": MODES},
              means=means)
    return 0


if __name__ == "__main__":
    sys.exit(main())
