#!/usr/bin/env python
"""How far each backend's next-token distributions are from the model's own.

For every position of a fixed English text (``tests/data/english_paragraph.txt`` unless
``--text``), the float reference -- the numpy backend: the GGUF's tensors dequantized to float32,
float32 activations -- gives the next-token distribution P, and each backend gives Q through its
decode path (one token per forward call, as it serves). Printed per backend:

    NLL            mean negative log-likelihood of the text, nats per token
    KL mean / p99  KL(P || Q) in nats, over positions (what llama.cpp's ``perplexity
                   --kl-divergence`` reports against an F16 model)
    top-1          share of positions where Q's most likely token is P's

Backends: the onnxruntime graph with its default options; one more onnxruntime graph per
``--graph KEY=VALUE[,KEY=VALUE]`` (``GraphOptions`` fields, e.g. ``lm_head_block=32``); and
llama.cpp (``llama-cpp-python`` with ``logits_all``, one token per batch) when importable here or
in ``--llama-python``, on the same file.

    python scripts/quality.py --model gemma3-270m --llama-python /work/benchvenv/bin/python
    python scripts/quality.py --model gemma3-270m --graph lm_head_block=32
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench import find_llama_python  # noqa: E402
from hf_math import PARAGRAPH, kl_rows, log_softmax  # noqa: E402  (float64 helpers shared with the tests)

LLAMA_CHILD = """
import sys, numpy as np
from llama_cpp import Llama
model, ids_path, out_path, threads = sys.argv[1:5]
ids = np.load(ids_path).tolist()
llm = Llama(model_path=model, n_ctx=len(ids) + 8, n_batch=1, n_ubatch=1, n_threads=int(threads),
            logits_all=True, verbose=False)
llm.eval(ids)
np.save(out_path, np.asarray(llm.scores[:len(ids)], np.float32))
"""


def compare(ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray,
            rows: int = 32) -> dict:
    """NLL of ``targets`` under ``logits [n, V]``, and KL / top-1 against ``ref_logits [n, V]``,
    ``rows`` positions at a time (float64 ``[n, V]`` at once would be 2 GB for Gemma)."""
    kl, nll, top1 = [], [], []
    for a in range(0, len(targets), rows):
        r, x = ref_logits[a:a + rows], logits[a:a + rows]
        kl.append(kl_rows(r, x))
        nll.append(-log_softmax(x)[np.arange(len(x)), targets[a:a + rows]])
        top1.append(r.argmax(axis=1) == x.argmax(axis=1))
    kl_all = np.concatenate(kl)
    return {"nll": float(np.concatenate(nll).mean()), "kl": float(kl_all.mean()),
            "kl_p99": float(np.quantile(kl_all, 0.99)), "top1": float(np.concatenate(top1).mean())}


def decode_logits(backend, ids: np.ndarray) -> np.ndarray:
    """``float32 [n - 1, V]``: the logits after each of ``ids[:-1]``, one decode step each."""
    from tiny_mindie.model.backend import SeqChunk
    out = np.empty((len(ids) - 1, backend.config.vocab_size), np.float32)
    for pos in range(len(ids) - 1):
        out[pos] = backend.forward([SeqChunk(0, pos, ids[pos:pos + 1])])[0]
    return out


def graph_options(spec: str):
    from tiny_mindie.model.graph import GraphOptions
    fields = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    try:
        return GraphOptions(**{k: int(v) for k, v in fields.items()})
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"--graph {spec!r}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file or a registry name (default: the default model)")
    ap.add_argument("--text", default=PARAGRAPH, help="UTF-8 text file (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=1024, help="at most this many tokens of it")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--graph", action="append", default=[], metavar="KEY=VALUE[,...]",
                    help="also an onnxruntime graph with these GraphOptions (repeatable)")
    ap.add_argument("--llama-python", help="interpreter that can import llama_cpp")
    args = ap.parse_args(argv)
    variants = [("onnxruntime", graph_options(""))] + [
        (f"onnxruntime {spec}", graph_options(spec)) for spec in args.graph]

    from tiny_mindie.model.config import ModelConfig
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.ort_backend import OrtBackend
    from tiny_mindie.model.reference import NumpyBackend, prefill
    from tiny_mindie.model.registry import DEFAULT_MODEL, resolve
    from tiny_mindie.model.tokenizer import load_tokenizer

    path = resolve(args.model or DEFAULT_MODEL)
    f = GGUFFile(path)
    config = ModelConfig.from_gguf(f)
    with open(args.text, encoding="utf-8") as fh:
        ids = np.array(load_tokenizer(f).encode(fh.read().strip()), np.int64)[:args.tokens]
    n = len(ids)
    print(f"model {path}, {n} tokens of {args.text}, {args.threads} threads")
    ref = NumpyBackend(f, config, num_slots=1, max_seq_len=n + 8)
    ref_logits = prefill(ref.weights, ref.cache, 0, 0, ids, all_logits=True)[:-1]
    del ref
    targets = ids[1:]
    rows = [("float reference (numpy)", compare(ref_logits, ref_logits, targets))]
    for name, options in variants:
        be = OrtBackend(f, config, num_slots=1, max_seq_len=n + 8, threads=args.threads,
                        parallel_runs=1, graph_options=options)
        rows.append((name, compare(ref_logits, decode_logits(be, ids), targets)))
        be.close()
    python = find_llama_python(args.llama_python)
    if python is None:
        print("llama.cpp: llama-cpp-python not importable (give --llama-python); skipped")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            np.save(os.path.join(tmp, "ids.npy"), ids[:-1])
            out = os.path.join(tmp, "logits.npy")
            proc = subprocess.run([python, "-c", LLAMA_CHILD, path, os.path.join(tmp, "ids.npy"),
                                   out, str(args.threads)], capture_output=True, text=True)
            if proc.returncode != 0:            # llama.cpp's own chatter is shown only then
                raise SystemExit(f"llama.cpp failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-2000:]}")
            rows.append(("llama.cpp", compare(ref_logits, np.load(out, mmap_mode="r"), targets)))

    print(f"\n{'backend':<36} {'NLL':>7} {'KL mean':>9} {'KL p99':>8} {'top-1':>7}")
    for name, r in rows:
        print(f"{name:<36} {r['nll']:7.4f} {r['kl']:9.5f} {r['kl_p99']:8.4f} {r['top1']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
