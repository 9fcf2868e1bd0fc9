#!/usr/bin/env python
"""How close each engine's next-token distributions are to the exact math, on two fixed texts.

The texts live in ``scripts/texts/`` (see its README for where they come from): ``english``, the
Gettysburg Address and the opening of the US Declaration of Independence (~530 tokens), and
``code``, ~550-600 tokens of ordinary Python. Each is tokenized with ``--model``'s own tokenizer
(plain text, no control tokens; a BOS where the model adds one) and fed to every engine one
position at a time -- a decode step at batch 1 per token, as users run -- and the log-softmax of
the vocabulary after each position is compared with the reference's. Per text and engine:

    NLL          mean negative log-likelihood of the text's actual next tokens, nats/token
    NLL/ref      its ratio to the reference's NLL (1.000 = as good as the exact math)
    KL mean/p99  KL(reference || engine) in nats per position: its mean and 99th percentile
                 (the divergence llama.cpp's ``llama-perplexity --kl-divergence`` reports)
    top-1        share of positions whose most likely token is the reference's

Engines (``--engines``, comma-separated; default ``numpy,onnxruntime:exact,onnxruntime:custom,
onnxruntime:compact,llama.cpp``):

    numpy                the reference: the GGUF's tensors dequantized to float32, float32
                         activations (tiny_mindie.model.reference.decoder.NumpyBackend)
    numpy:float16        the reference computing as the float16 standard graph does on an NPU,
                         emulated (:func:`float16_products`): the weight matrices and the KV
                         cache rounded to float16, every matrix product's operands and result
                         rounded to float16 (sums in float32), the rest float32 -- what the
                         CPU provider does not compute (it runs the graph's products in
                         float32 on the float16 weights)
    onnxruntime[:MODE]   the ONNX Runtime backend; MODE ``exact`` (the GGUF's weights on
                         onnxruntime's ``MatMulNBits``, the default), ``custom`` (the GGUF's
                         weights on tiny_mindie's own kernels, tiny_mindie/kernels), ``compact``
                         (every matrix requantized to 4-bit blocks of 64) or a block size
                         (``onnxruntime:128``); see ``WEIGHT_MODES``; or
                         ``standard`` (the standard graph, float16: ``--graph standard``) or
                         ``standard-float32`` (``--standard-dtype float32``)
    llama.cpp[:FILE]     llama.cpp through llama-cpp-python on ``--model``'s file, or on FILE (a
                         GGUF of the same model in another quantization, e.g. made by
                         ``llama-quantize``), scored against ``--model``'s reference all the same

The reference's log-probs are cached per (model sha256, text) in
``<tiny_mindie cache>/quality/<sha256[:16]>-<text>.npz`` (``$TINY_MINDIE_CACHE`` or
``~/.cache/tiny_mindie``): the numpy reference decodes a 1.5B model at ~0.3 s/token and holds
~6 GB of float32 weights. A cache file holds float32 ``[tokens - 1, vocab]`` log-probs (Qwen2.5,
vocabulary 151,936: ~0.6 MB per token, ~330 MB per text) and the token ids it was made for; a
later run reuses it when its ids start with this run's (``--max-tokens`` cuts a text), else the
reference runs again and replaces it. The reference is computed (or read) whether or not
``numpy`` is among the engines. Engines are loaded one at a time and closed before the next.

llama.cpp runs in a child process of the interpreter given by ``--llama-python`` (or
``$LLAMA_CPP_PYTHON``, or this one if it imports ``llama_cpp``), fed tiny_mindie's token ids of
the text, one token per ``eval`` batch (``logits_all``: every position's logits). Set up once,
outside the repository and never as a dependency of tiny_mindie (llama.cpp's libraries built as in
scripts/bench.py's docstring, in ``$LIB`` = ``.../vendor/llama.cpp/build/bin``)::

    python -m venv /work/bench/llvenv
    CMAKE_ARGS=-DLLAMA_BUILD=OFF /work/bench/llvenv/bin/pip install numpy \\
        /work/bench/sdist/llama_cpp_python-0.3.36.tar.gz

and pass ``--llama-python /work/bench/llvenv/bin/python --llama-lib $LIB`` (``--llama-lib``
sets ``$LLAMA_CPP_LIB_PATH`` for the child). llama.cpp's own quantization types of the same
model: ``--llama-quantize $LIB/llama-quantize Q4_0,Q8_0`` makes each missing
``<model>.<TYPE>.gguf`` in ``--quant-dir`` (default ``<tiny_mindie cache>/quality/gguf``; never
the repository) with ``llama-quantize --allow-requantize MODEL OUT TYPE`` and adds a
``llama.cpp:OUT`` engine for it. By hand, the same::

    $LIB/llama-quantize --allow-requantize MODEL.gguf /work/bench/q/MODEL.Q4_0.gguf Q4_0
    python scripts/quality.py --model MODEL.gguf --engines llama.cpp:/work/bench/q/MODEL.Q4_0.gguf

(Requantizing an already quantized GGUF stacks both errors: the KL then measures the type as
applied to this file, not to the original float weights.)

Examples::

    python scripts/quality.py --max-tokens 64                  # default model, default engines
    python scripts/quality.py --model qwen2.5-coder-0.5b-instruct --engines numpy,onnxruntime:128
    python scripts/quality.py --llama-python /work/bench/llvenv/bin/python --llama-lib $LIB \\
        --llama-quantize $LIB/llama-quantize Q4_0 --json /tmp/quality.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEXTS_DIR = os.path.join(HERE, "texts")
#: The fixed texts: name -> file in scripts/texts/.
TEXTS = {"english": "english.txt", "code": "code.py"}
DEFAULT_ENGINES = "numpy,onnxruntime:exact,onnxruntime:custom,onnxruntime:compact,llama.cpp"


# ---- the fixed texts and the arithmetic (tests/unit/test_quality_script.py) ------------------

def text_path(name: str) -> str:
    """Path of fixed text ``name`` (a key of :data:`TEXTS`)."""
    return os.path.join(TEXTS_DIR, TEXTS[name])


def load_text(name: str) -> str:
    """Fixed text ``name``, exactly as the file holds it (UTF-8)."""
    with open(text_path(name), encoding="utf-8") as fh:
        return fh.read()


def text_ids(tokenizer, name: str, max_tokens: int | None = None) -> np.ndarray:
    """int64 ``[n]``: fixed text ``name`` as ``tokenizer`` encodes plain text (the model's BOS
    where it adds one), cut to ``max_tokens``."""
    ids = tokenizer.encode(load_text(name), parse_special=False)
    return np.asarray(ids[:max_tokens] if max_tokens else ids, np.int64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis of ``logits`` (``[V]`` or ``[n, V]``)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(ref_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """float64 ``[n]``: KL(P || Q) in nats per row of two ``[n, V]`` log-probability arrays (P
    from ``ref_logp``); a token P gives probability 0 adds nothing."""
    p_log = np.asarray(ref_logp, np.float64)
    p = np.exp(p_log)
    with np.errstate(invalid="ignore"):             # 0 * (-inf - x) where P has a -inf
        terms = p * (p_log - np.asarray(logp, np.float64))
    return np.where(p > 0, terms, 0.0).sum(axis=-1)


def nll_rows(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 ``[n]``: ``-logp[i, targets[i]]``, the negative log-likelihood in nats of each
    row's actual next token."""
    logp = np.asarray(logp)
    return -logp[np.arange(len(targets)), np.asarray(targets)].astype(np.float64)


def summarize(kl: np.ndarray, nll: np.ndarray, same_top1: np.ndarray,
              ref_nll: float | None = None) -> dict:
    """The table's numbers from per-position arrays: ``nll`` (mean), ``nll_ratio`` (to
    ``ref_nll``), ``kl_mean``, ``kl_p99`` and ``top1`` (share of positions agreeing)."""
    nll_mean = float(np.mean(nll))
    return {"positions": len(nll), "nll": nll_mean,
            "nll_ratio": nll_mean / ref_nll if ref_nll else None,
            "kl_mean": float(np.mean(kl)), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1": float(np.mean(same_top1))}


def score(ref_logp: np.ndarray, rows, targets: np.ndarray, ref_nll: float | None = None) -> dict:
    """:func:`summarize` of an engine's logits or log-probs ``rows`` (any iterable of ``[V]``
    rows, one per position) against the reference's log-probs ``ref_logp [n, V]``."""
    n = len(targets)
    kl, nll, same = np.empty(n), np.empty(n), np.empty(n, bool)
    i = -1
    for i, row in enumerate(rows):
        q = log_softmax(row)
        p = log_softmax(ref_logp[i])                # float32 cached: normalized in float64
        kl[i] = kl_rows(p[None], q[None])[0]
        nll[i] = -q[targets[i]]
        same[i] = int(np.argmax(p)) == int(np.argmax(q))
    if i != n - 1:
        raise ValueError(f"{i + 1} rows for {n} positions")
    return summarize(kl, nll, same, ref_nll)


# ---- engines -----------------------------------------------------------------------------------

def decode_rows(backend, ids: np.ndarray):
    """The logits after each of ``ids[:-1]`` (``[V]`` each), one decode step at batch 1 each
    (slot 0, from position 0)."""
    from tiny_mindie.model.backend import SeqChunk

    for pos in range(len(ids) - 1):
        yield backend.forward([SeqChunk(0, pos, ids[pos:pos + 1])])[0]


#: ``onnxruntime:MODE`` suffixes of the standard graph -> its ``GraphOptions.standard_dtype``
STANDARD_MODES = {"standard": "float16", "standard-float32": "float32"}


def graph_options(mode: str):
    """The ``GraphOptions`` of an ``onnxruntime:MODE`` suffix: a weight mode or block size
    (:func:`compact_of`), or a standard graph (:data:`STANDARD_MODES`)."""
    from tiny_mindie.model.onnx.graph_options import GraphOptions

    if mode in STANDARD_MODES:
        return GraphOptions(flavour="standard", standard_dtype=STANDARD_MODES[mode])
    return GraphOptions(compact=compact_of(mode),
                        kernels="custom" if mode == "custom" else "onnxruntime")


def compact_of(mode: str) -> int:
    """``GraphOptions.compact`` of an ``onnxruntime:MODE`` suffix (``""``: exact)."""
    try:                                        # where it lives has moved once already
        from tiny_mindie.model import WEIGHT_MODES
    except ImportError:
        from tiny_mindie.model.onnx.graph import WEIGHT_MODES

    if not mode or mode == "custom":
        return 0
    if mode in WEIGHT_MODES:
        return WEIGHT_MODES[mode]
    try:
        return int(mode)
    except ValueError:
        raise SystemExit(f"onnxruntime:{mode}: a weight mode ({', '.join(WEIGHT_MODES)}), a "
                         f"block size or a standard graph ({', '.join(STANDARD_MODES)})"
                         ) from None


def _half(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to float16, as float32."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


@contextlib.contextmanager
def float16_products(f, cfg, max_len: int):
    """A numpy reference backend (one slot of ``max_len`` positions) whose matrix products
    round as the float16 standard graph's do on an NPU: weight matrices and embedding rounded
    to float16 once; each product (the layers' ``linear``, the attention's two, the LM head)
    takes float16-rounded operands and its float32 sum is rounded to float16; norms, rotary,
    softmax and activations stay float32. Patches the reference's module functions while the
    context is open."""
    from tiny_mindie.model.reference import decoder as reference
    from tiny_mindie.model.reference import layers

    be = reference.NumpyBackend(f, cfg, num_slots=1, max_seq_len=max_len)
    w = be.weights
    tied = w.lm_head.base is w.embedding
    w.embedding[...] = _half(w.embedding)
    if not tied:
        w.lm_head = _half(w.lm_head)
    for layer in w.layers:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            setattr(layer, name, _half(getattr(layer, name)))
    linear, attention, logits = layers.linear, layers.attention, reference._logits

    def attention16(q, k, v, mask, scale=None):
        B, n, heads, hd = q.shape
        kv, T = k.shape[1], k.shape[2]
        g = heads // kv
        q = q.reshape(B, n, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, kv, g * n, hd)
        q = _half(q * np.float32(1.0 / np.sqrt(hd) if scale is None else scale))
        s = _half(q @ _half(k).swapaxes(-1, -2)).reshape(B, kv, g, n, T) + mask[:, None, None]
        p = _half(layers.softmax(s).reshape(B, kv, g * n, T))
        o = _half(p @ _half(v)).reshape(B, kv, g, n, hd).transpose(0, 3, 1, 2, 4)
        return o.reshape(B, n, heads * hd)

    layers.linear = lambda x, m: _half(linear(_half(x), m))
    layers.attention = attention16
    reference._logits = lambda ws, x: _half(
        _half(layers.rms_norm(x, ws.norm, ws.cfg.rms_eps)) @ ws.lm_head)
    try:
        yield be
    finally:
        layers.linear, layers.attention, reference._logits = linear, attention, logits
        be.close()


def reference_cache_path(sha256: str, text: str) -> str:
    from tiny_mindie.model.registry.catalog import cache_root

    return os.path.join(cache_root(), "quality", f"{sha256[:16]}-{text}.npz")


def cached_reference(path: str, sha256: str, ids: np.ndarray) -> np.ndarray | None:
    """float32 ``[len(ids) - 1, V]`` log-probs from the cache file at ``path`` when it was made
    for this model and its ids start with ``ids``; else None."""
    try:
        with np.load(path) as z:
            if str(z["model_sha256"]) != sha256:
                return None
            cached = z["ids"]
            if len(cached) < len(ids) or not np.array_equal(cached[:len(ids)], ids):
                return None
            return np.array(z["logp"][:len(ids) - 1])
    except (OSError, KeyError, ValueError):
        return None


def save_reference(path: str, sha256: str, ids: np.ndarray, logp: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, model_sha256=np.array(sha256), ids=ids, logp=logp)
    os.replace(tmp, path)


LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
model, ids_path, out_path, threads = sys.argv[1:5]
ids = np.load(ids_path).tolist()
t0 = time.perf_counter()
llm = Llama(model_path=model, n_ctx=len(ids) + 8, n_batch=1, n_ubatch=1, n_threads=int(threads),
            n_threads_batch=int(threads), logits_all=True, verbose=False)
load_s = time.perf_counter() - t0
n_vocab = llm.n_vocab()
if max(ids) >= n_vocab:
    sys.exit(f"token id {max(ids)} outside this file's vocabulary of {n_vocab}")
t0 = time.perf_counter()
llm.eval(ids)                                   # n_batch 1: one decode step per token
run_s = time.perf_counter() - t0
out = np.lib.format.open_memmap(out_path, "w+", np.float32, (len(ids), n_vocab))
for i in range(len(ids)):                       # log-softmax row by row, in float64
    x = np.asarray(llm.scores[i], np.float64)
    x -= x.max()
    out[i] = x - np.log(np.exp(x).sum())
out.flush()
del out
print(json.dumps({"version": llama_cpp.__version__, "load_s": load_s, "run_s": run_s,
                  "n_vocab": n_vocab,
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}))
"""


def find_llama_python(given: str | None) -> str | None:
    """The first of ``given``, ``$LLAMA_CPP_PYTHON`` and this interpreter that imports
    ``llama_cpp`` (with this process's environment, ``$LLAMA_CPP_LIB_PATH`` included)."""
    for python in ([given] if given else []) + [os.environ.get("LLAMA_CPP_PYTHON"), sys.executable]:
        if python and subprocess.run([python, "-c", "import llama_cpp"],
                                     capture_output=True).returncode == 0:
            return python
    return None


def llama_logp(python: str, model: str, ids: np.ndarray, threads: int, tmp: str):
    """``(float32 [len(ids) - 1, V] log-probs as a memory map, the child's JSON report)`` of
    llama.cpp on ``model`` fed ``ids`` (see :data:`LLAMA_CHILD`)."""
    ids_path, out = os.path.join(tmp, "ids.npy"), os.path.join(tmp, "logp.npy")
    np.save(ids_path, ids[:-1])
    # idle OpenMP threads sleep instead of spinning: on a busy machine spinning llama.cpp took
    # 15x longer (this measures quality, not speed)
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    proc = subprocess.run([python, "-c", LLAMA_CHILD, model, ids_path, out, str(threads)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:                    # llama.cpp's own chatter is shown only then
        raise RuntimeError(f"llama.cpp failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return np.load(out, mmap_mode="r"), json.loads(proc.stdout.strip().splitlines()[-1])


def quantize(binary: str, src: str, types: list[str], folder: str, threads: int) -> list[str]:
    """``folder/<src stem>.<TYPE>.gguf`` for each of ``types``, made by llama.cpp's
    ``llama-quantize --allow-requantize`` where missing."""
    inside = os.path.realpath(folder) + os.sep
    if inside.startswith(os.path.realpath(ROOT) + os.sep):
        raise SystemExit(f"--quant-dir {folder}: inside the repository; choose another folder")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(os.path.basename(src))[0]
    outs = []
    for qtype in types:
        out = os.path.join(folder, f"{stem}.{qtype}.gguf")
        if not os.path.isfile(out):
            print(f"llama-quantize {qtype}: {out}", flush=True)
            proc = subprocess.run([binary, "--allow-requantize", src, out + ".tmp", qtype,
                                   str(threads)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"llama-quantize {qtype} failed (exit {proc.returncode}):\n"
                                 f"{(proc.stdout + proc.stderr)[-2000:]}")
            os.replace(out + ".tmp", out)
        outs.append(out)
    return outs


# ---- the run -----------------------------------------------------------------------------------

def _versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import onnxruntime
        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        out["onnxruntime"] = None
    return out


def _free(backend) -> None:
    backend.close()
    del backend
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Engines, the cache and llama.cpp: see the module "
                                        "docstring (scripts/quality.py).")
    ap.add_argument("--model", help="a .gguf file or a registry name (default: the registry's "
                                    "default model)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES,
                    help="comma-separated: numpy[:float16], onnxruntime[:exact|custom|compact|"
                         "BLOCK|standard|standard-float32], "
                         "llama.cpp[:FILE.gguf] (default: %(default)s)")
    ap.add_argument("--texts", default=",".join(TEXTS),
                    help="comma-separated fixed texts of scripts/texts (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, help="cut each text to this many tokens "
                                                   "(default: all of it)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="onnxruntime's intra-op threads and llama.cpp's (default: %(default)s)")
    ap.add_argument("--graph-cache", metavar="DIR",
                    help="where onnxruntime graphs are cached (default: next to the GGUF)")
    ap.add_argument("--llama-python", help="interpreter that imports llama_cpp "
                                           "(default: $LLAMA_CPP_PYTHON, else this one)")
    ap.add_argument("--llama-lib", default=os.environ.get("LLAMA_CPP_LIB_PATH"), metavar="DIR",
                    help="llama.cpp's shared libraries, as $LLAMA_CPP_LIB_PATH for the child "
                         "(default: $LLAMA_CPP_LIB_PATH)")
    ap.add_argument("--llama-quantize", nargs=2, metavar=("BIN", "TYPES"),
                    help="llama.cpp's llama-quantize binary and comma-separated types "
                         "(Q4_0,Q8_0,...): also run llama.cpp on --model requantized to each")
    ap.add_argument("--quant-dir", metavar="DIR",
                    help="where --llama-quantize writes (default: <tiny_mindie cache>/quality/"
                         "gguf; never inside the repository)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)

    sys.path.insert(0, ROOT)
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.ort.providers import cpu_info
    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL, cache_root, resolve, sha256_of
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        kind, _, arg = e.partition(":")
        if kind == "onnxruntime":
            if arg not in STANDARD_MODES:
                compact_of(arg)
        elif kind not in ("numpy", "llama.cpp") or (kind == "numpy" and arg not in ("",
                                                                               "float16")):
            raise SystemExit(f"--engines: unknown engine {e!r}")
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    for t in texts:
        if t not in TEXTS:
            raise SystemExit(f"--texts: unknown text {t!r} (known: {', '.join(TEXTS)})")
    if args.llama_lib:
        os.environ["LLAMA_CPP_LIB_PATH"] = os.path.abspath(args.llama_lib)

    path = resolve(args.model or DEFAULT_MODEL)
    sha = sha256_of(path)
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    tok = load_tokenizer(f)
    ids = {t: text_ids(tok, t, args.max_tokens) for t in texts}
    for t, x in ids.items():
        if len(x) < 2:
            raise SystemExit(f"text {t}: {len(x)} token(s); nothing to score")
    max_len = max(len(x) for x in ids.values()) + 8
    if args.llama_quantize:
        binary, types = args.llama_quantize
        folder = args.quant_dir or os.path.join(cache_root(), "quality", "gguf")
        engines += [f"llama.cpp:{out}" for out in
                    quantize(binary, path, [q for q in types.split(",") if q], folder,
                             args.threads)]
    cpu = cpu_info()[0]
    print(f"model {path} ({os.path.getsize(path) / 1e6:.1f} MB, sha256 {sha[:16]}...), "
          f"vocabulary {cfg.vocab_size}; texts: "
          + ", ".join(f"{t} {len(x)} tokens" for t, x in ids.items())
          + f"; {args.threads} threads; CPU {cpu or '?'}", flush=True)
    t_start = time.perf_counter()

    # the reference first (cached per model sha256 and text); one engine in memory at a time
    ref: dict[str, np.ndarray] = {}
    ref_info: dict[str, dict] = {}
    for t in texts:
        cache = reference_cache_path(sha, t)
        hit = cached_reference(cache, sha, ids[t])
        if hit is not None:
            ref[t] = hit
            ref_info[t] = {"cached": cache}
    missing = [t for t in texts if t not in ref]
    if missing:
        from tiny_mindie.model.reference.decoder import NumpyBackend

        t0 = time.perf_counter()
        be = NumpyBackend(f, cfg, num_slots=1, max_seq_len=max_len)
        load_s = time.perf_counter() - t0
        for t in missing:
            print(f"numpy reference: {t}, {len(ids[t])} tokens ...", flush=True)
            t0 = time.perf_counter()
            logp = np.empty((len(ids[t]) - 1, cfg.vocab_size), np.float32)
            for i, row in enumerate(decode_rows(be, ids[t])):
                logp[i] = log_softmax(row)
            run_s = time.perf_counter() - t0
            cache = reference_cache_path(sha, t)
            save_reference(cache, sha, ids[t], logp)
            ref[t] = logp
            ref_info[t] = {"load_s": load_s, "run_s": run_s, "saved": cache}
        _free(be)
    targets = {t: ids[t][1:] for t in texts}
    ref_res = {t: score(ref[t], ref[t], targets[t]) for t in texts}
    ref_nll = {t: ref_res[t]["nll"] for t in texts}

    results: list[dict] = []

    def record(engine: str, t: str, res: dict, **extra) -> None:
        res.update(text=t, engine=engine, **extra)
        results.append(res)
        print(f"  {engine} / {t}: NLL {res['nll']:.4f}, KL {res['kl_mean']:.5f}, "
              f"top-1 {100 * res['top1']:.1f} % ({res.get('run_s', 0):.1f} s)", flush=True)

    llama_python = None
    for engine in engines:
        kind, _, arg = engine.partition(":")
        if kind == "numpy" and arg:
            t0 = time.perf_counter()
            with float16_products(f, cfg, max_len) as be:
                load_s = time.perf_counter() - t0
                for t in texts:
                    t0 = time.perf_counter()
                    res = score(ref[t], decode_rows(be, ids[t]), targets[t], ref_nll[t])
                    record(engine, t, res, load_s=load_s, run_s=time.perf_counter() - t0)
        elif kind == "numpy":
            for t in texts:
                record(engine, t, dict(ref_res[t], nll_ratio=1.0), **ref_info[t])
        elif kind == "onnxruntime":
            from tiny_mindie.model.options import BackendOptions
            from tiny_mindie.model.ort.ort_backend import OrtBackend

            t0 = time.perf_counter()
            # spinning off: a shared machine; speed is not measured here
            be = OrtBackend(f, cfg, BackendOptions(threads=args.threads, parallel_runs=1,
                                                   batch_invariant=False, spinning=False),
                            num_slots=1, max_seq_len=max_len, cache_dir=args.graph_cache,
                            graph_options=graph_options(arg))
            load_s = time.perf_counter() - t0
            for t in texts:
                t0 = time.perf_counter()
                res = score(ref[t], decode_rows(be, ids[t]), targets[t], ref_nll[t])
                record(engine, t, res, load_s=load_s, run_s=time.perf_counter() - t0,
                       graph="built" if be.built else "cached")
            _free(be)
        else:                                   # llama.cpp[:FILE]
            if llama_python is None:
                llama_python = find_llama_python(args.llama_python) or ""
            if not llama_python:
                print(f"{engine}: llama-cpp-python not importable (give --llama-python and "
                      "--llama-lib, see the docstring); skipped", flush=True)
                continue
            gguf = os.path.abspath(arg) if arg else path
            with tempfile.TemporaryDirectory(prefix="tiny_mindie-quality-") as tmp:
                for t in texts:
                    try:
                        logp, info = llama_logp(llama_python, gguf, ids[t], args.threads, tmp)
                    except RuntimeError as exc:
                        print(f"{engine} / {t}: {exc}", flush=True)
                        break
                    if logp.shape[1] != cfg.vocab_size:
                        print(f"{engine}: vocabulary of {logp.shape[1]} against the model's "
                              f"{cfg.vocab_size}; skipped", flush=True)
                        break
                    res = score(ref[t], logp, targets[t], ref_nll[t])
                    del logp
                    record(engine, t, res, file=gguf,
                           file_mb=os.path.getsize(gguf) / 1e6, load_s=info["load_s"],
                           run_s=info["run_s"], llama_cpp_python=info["version"],
                           system_info=info["system_info"])
    wall = time.perf_counter() - t_start

    print()
    w = max([18] + [len(_label(r)) for r in results])
    print(f"{'text':<8} {'engine':<{w}} {'tokens':>6} {'NLL':>7} {'NLL/ref':>8} {'KL mean':>9} "
          f"{'KL p99':>8} {'top-1':>7} {'s/token':>8}")
    for t in texts:
        for r in (r for r in results if r["text"] == t):
            per = (f"{r['run_s'] / r['positions']:.4f}" if "run_s" in r else "cached")
            print(f"{t:<8} {_label(r):<{w}} {r['positions'] + 1:>6} {r['nll']:7.4f} "
                  f"{r['nll_ratio']:8.4f} {r['kl_mean']:9.5f} {r['kl_p99']:8.4f} "
                  f"{100 * r['top1']:6.1f}% {per:>8}")
    print(f"(tokens: of the text fed, scored at every position but the last; KL in nats; "
          f"s/token: decode steps as run here, idle threads not spinning: not a benchmark; "
          f"{wall:.0f} s in all)")
    if args.json:
        report = {"date": datetime.datetime.now(datetime.UTC).isoformat(
                      timespec="seconds"),
                  "command": shlex.join([sys.executable] + sys.argv), "cwd": os.getcwd(),
                  "cpu": cpu, "machine": platform.machine(), "cpus": os.cpu_count(),
                  "threads": args.threads, "versions": _versions(),
                  "model": {"path": path, "sha256": sha, "bytes": os.path.getsize(path),
                            "vocab_size": cfg.vocab_size},
                  "texts": {t: {"path": os.path.relpath(text_path(t), ROOT), "tokens": len(ids[t]),
                                "max_tokens": args.max_tokens} for t in texts},
                  "results": results, "seconds": wall}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


def _label(r: dict) -> str:
    if r["engine"].startswith("llama.cpp:"):
        return "llama.cpp:" + os.path.basename(r["engine"].partition(":")[2])
    return r["engine"] + (" (reference)" if r["engine"] == "numpy" else "")


if __name__ == "__main__":
    sys.exit(main())
