#!/usr/bin/env python3
"""Embedding fidelity: tiny_mindie's encoder (the onnxruntime graph and the numpy reference)
against llama.cpp's ``llama-server --embedding`` on the same GGUF, text by text.

The texts (:func:`texts`) are short questions and passages of about 128 and 512 tokens cut from
scripts/texts/, each with one of nomic's task prefixes (``search_query: ``,
``search_document: ``, ``classification: ``, ``clustering: ``). For each it prints:

    tokens      our token count ([CLS] and [SEP] included)
    ids         whether llama-server's ``/tokenize`` (``add_special``) gives the same ids, or
                the first position where they part
    graph/ref   1 - the cosine similarity of the onnxruntime graph's vector and the numpy
                reference's (the results file has the cosines themselves)
    graph/cpp   ... of the graph's vector and llama-server's ``/embedding`` of the text
    ref/cpp     ... of the reference's and llama-server's
    cpp(ids)    where the ids part: the cosine of llama-server's vector of *our* ids and the
                graph's, which tells a tokenization difference from a numerical one
    batch       the largest |difference| between a text's graph vector alone and in one batch
                with all the others (the batch-invariance promise: 0)

Goals: cosine similarity graph/ref >= 0.9999 and graph/cpp >= 0.999 for every text; the exit
status is 1 when a text misses either. ``--json FILE`` writes a results file (kind
``embedcheck``; scripts/results.py) with one row per text.

    python scripts/embedcheck.py --llama-server /path/to/llama.cpp/build/bin
    python scripts/embedcheck.py --llama-server DIR --model /models/nomic.gguf --json out.json

llama-server runs as ``-m GGUF --embedding --pooling mean -t THREADS -c CONTEXT -b CONTEXT
-ub CONTEXT -np 1`` over plain HTTP on 127.0.0.1 (``-ub``: one text must fit one micro-batch).
Not part of the test suite: it needs llama.cpp's binaries (the in-repo tests hold the graph to
the reference).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from loadtest import llama_server_version, start_llama_server  # noqa: E402
from results import cpu_line, run_record, write  # noqa: E402

from tiny_mindie.model.encoder_load import load_encoder  # noqa: E402
from tiny_mindie.model.ort.encoder_ort import EncoderSession  # noqa: E402
from tiny_mindie.model.reference.encoder import encode_one  # noqa: E402
from tiny_mindie.model.registry.catalog import resolve  # noqa: E402

GOAL_GRAPH_REF, GOAL_CPP = 0.9999, 0.999


def _read(name: str) -> str:
    with open(os.path.join(HERE, "texts", name), encoding="utf-8") as fh:
        return fh.read()


def cut(tokenizer, text: str, n: int) -> str:
    """The longest start of ``text`` (whole tokens) that encodes to at most ``n`` ids, [CLS]
    and [SEP] included."""
    enc = tokenizer.encode(text)
    if len(enc.ids) <= n:
        return text
    end = enc.offsets[n - 2][1]                  # the last word piece kept, before [SEP]
    return text[:end]


def texts(tokenizer) -> dict[str, str]:
    """The checked texts by name: two short questions, passages of ~128 and ~512 tokens."""
    english, code = _read("english.txt"), _read("code.py")
    return {
        "query-short": "search_query: what is a KV cache?",
        "query-words": "search_query: Who said that all men are created equal, and when?",
        "query-unicode": "search_query: Café naïve résumé \u2014 \u201cquotes\u201d, "
                         "\u6771\u4eac and 3.14%?",
        "doc-128": cut(tokenizer, "search_document: " + english, 128),
        "code-128": cut(tokenizer, "classification: " + code, 128),
        "doc-512": cut(tokenizer, "search_document: " + english, 512),
        "code-512": cut(tokenizer, "clustering: " + code, 512),
    }


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _post(port: int, path: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"embedcheck: llama-server {path}: HTTP {resp.status}: {raw[:300]!r}")
    return json.loads(raw)


def llama_ids(port: int, text: str) -> list[int]:
    """llama-server's token ids of ``text``, [CLS] and [SEP] added."""
    return [int(t) for t in _post(port, "/tokenize", {"content": text,
                                                       "add_special": True})["tokens"]]


def llama_vector(port: int, content) -> np.ndarray:
    """llama-server's pooled vector of ``content`` (a text, or token ids taken as they are)."""
    return np.asarray(_post(port, "/embedding", {"content": content})[0]["embedding"][0],
                      np.float64)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (their shorter length if one is a
    prefix of the other), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(model, session: EncoderSession, port: int, named: dict[str, str]) -> list[dict]:
    """One row per text (see the module doc)."""
    tok, cfg = model.tokenizer, model.config
    ids = {k: tok.encode(t).ids for k, t in named.items()}
    batch = session.encode(list(ids.values()))
    rows = []
    for (name, text), together in zip(named.items(), batch, strict=True):
        ours = ids[name]
        graph = session.encode([ours])[0]
        ref = encode_one(ours, model.weights, cfg)
        cpp_ids = llama_ids(port, text)
        cpp = llama_vector(port, text)
        part = first_difference(ours, cpp_ids)
        row = {"text": name, "tokens": len(ours), "llama_tokens": len(cpp_ids),
               "ids_differ_at": part, "graph_ref": cosine(graph, ref),
               "graph_cpp": cosine(graph, cpp), "ref_cpp": cosine(ref, cpp),
               "batch_max_abs": float(np.abs(graph - together).max())}
        if part is not None:
            row["graph_cpp_our_ids"] = cosine(graph, llama_vector(port, ours))
            row["ids_around"] = {"ours": ours[max(0, part - 2):part + 3],
                                 "llama": cpp_ids[max(0, part - 2):part + 3]}
        rows.append(row)
        print_row(row)
    return rows


def print_row(r: dict) -> None:
    ids = "same" if r["ids_differ_at"] is None else f"differ at {r['ids_differ_at']}"
    extra = (f"  cpp(our ids) {r['graph_cpp_our_ids']:.8f} {r['ids_around']}"
             if "graph_cpp_our_ids" in r else "")
    print(f"{r['text']:13s} {r['tokens']:6d}  {ids:14s} {1 - r['graph_ref']:9.1e}  "
          f"{1 - r['graph_cpp']:9.1e}  {1 - r['ref_cpp']:9.1e}  {r['batch_max_abs']:.1e}{extra}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", metavar="DIR", required=True,
                    help="llama.cpp's binaries folder, or the llama-server binary")
    ap.add_argument("--model", default="nomic-embed-text-v1.5",
                    help="a nomic-bert .gguf or a registry name")
    ap.add_argument("--threads", type=int, default=2, help="both sides' threads")
    ap.add_argument("--json", metavar="FILE", help="write the results file (scripts/results.py)")
    args = ap.parse_args(argv)
    record = run_record("embedcheck")
    path = resolve(args.model, task="embedding")
    model = load_encoder(path)
    session = EncoderSession(model, threads=args.threads)
    named = texts(model.tokenizer)
    ctx = str(model.config.context)
    proc, port = start_llama_server(args.llama_server, path, args.threads, parallel=1, extra=[
        "--embedding", "--pooling", model.config.pooling, "-c", ctx, "-b", ctx, "-ub", ctx])
    print(cpu_line())
    print(f"{os.path.basename(path)}; llama-server "
          f"{llama_server_version(args.llama_server) or '(version unknown)'}, "
          f"-t {args.threads}; goals: cosine similarity graph/ref >= {GOAL_GRAPH_REF} "
          f"(1 - cos <= {1 - GOAL_GRAPH_REF:.0e}), graph/cpp >= {GOAL_CPP} "
          f"(1 - cos <= {1 - GOAL_CPP:.0e})")
    print(f"{'':13s} {'':6s}  {'':14s} {'1 - cosine similarity':31s}")
    print(f"{'text':13s} {'tokens':>6s}  {'ids':14s} {'graph/ref':>9s}  {'graph/cpp':>9s}  "
          f"{'ref/cpp':>9s}  batch", flush=True)
    try:
        rows = check(model, session, port, named)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ok = all(r["graph_ref"] >= GOAL_GRAPH_REF and r["graph_cpp"] >= GOAL_CPP for r in rows)
    print("all texts meet the goals" if ok else "some texts miss a goal")
    if args.json:
        write(args.json, record, rows, model=os.path.basename(path), threads=args.threads,
              texts=named, llama_server={"version": llama_server_version(args.llama_server)})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
