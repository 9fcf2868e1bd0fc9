#!/usr/bin/env python
"""Speed of the ONNX Runtime backend against the numpy reference and llama.cpp.

One run measures every backend on the same GGUF file and the same prompt token ids, each in
its own child process (so each one's peak RSS is its own), and prints one table:

    prefill tok/s   prompt of --prompt-tokens tokens (default 256) in one forward call
    decode tok/s    --gen-tokens greedy tokens (default 128) at batch 1, after that prompt
    TTFT ms         prompt forward + argmax of the first token (what a client waits for)
    load s          start-up (for onnxruntime: graph cache hit or build, session creation)
    RSS MB          resident memory after load, and the peak over the whole run
    vs llama.cpp    ratio of decode and prefill tok/s to llama.cpp's in this same run

The backends run *interleaved* (all children stay loaded): in each of ``--reps`` repetitions
every backend prefills the prompt in turn, then they take turns decoding ``--segment`` tokens
(16) until each has ``--gen-tokens``; the table shows medians over repetitions, and the
same-repetition ratios to llama.cpp are printed too. The machine this was written on is a shared
2-vCPU VM whose load comes and goes within seconds; measured one after the other, a backend's
speed there varied up to 3x between runs, interleaved the ratios hold within about +-10 %.

The speed anchor is llama.cpp's own ``llama-bench`` binary on the same GGUF (backend
``llama-bench``, binary from ``--llama-bench`` or ``$LLAMA_BENCH``): each prefill is one
``llama-bench -p N -n 0 -r 1`` and each decode segment one ``-n k -d pos`` (k tokens decoded
after ``pos`` tokens of context), timed by llama-bench itself (model load and the context
prefill of ``-d`` excluded). Build it from the ``llama-cpp-python==0.3.36`` source
distribution, never as a dependency of this project::

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sd
    tar xzf /tmp/sd/llama_cpp_python-0.3.36.tar.gz -C /tmp/sd
    cd /tmp/sd/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench llama-server      # ~20 min on 2 cores

Backend ``llama.cpp`` is the same library through ``llama-cpp-python`` in this interpreter or
the one given by ``--llama-python`` (or ``$LLAMA_CPP_PYTHON``): a Python call per token makes
it ~40 % slower than llama-bench on a small model, so it serves as a correctness oracle (its
greedy tokens are printed), not as the anchor. The same number of threads is given to every
backend.

The sampler's share of a decode step is measured on the onnxruntime backend's logits: greedy
and a typical sampled configuration (temperature 0.7, top-k 50, top-p 0.9, repetition penalty
1.1), each as a percentage of one batch-1 decode step.

    python scripts/bench.py --llama-bench PATH  # default model from the registry
    python scripts/bench.py --model gemma3-270m --threads 2 --backends onnxruntime,llama-bench
    python scripts/bench.py --concurrency       # then the HTTP sweep: 1, 4, 8, 16 clients
    python scripts/bench.py --llama-bin DIR --concurrency 1 8   # llama.cpp's binaries in DIR:
                                    # llama-bench in process, llama-server over plain HTTP
    python scripts/bench.py --sampler           # only: the batch sampler's share of a decode step
    python scripts/bench.py --mask              # only: the grammar masks' share of a decode step
    python scripts/bench.py --prefix-cache [--llama-bin DIR]   # only: prefix caching (below)
    python scripts/bench.py --llama-bin DIR --json docs/design/results/bench-NAME.json \\
        --plot docs/design/results/bench-NAME.svg      # the results file and its figure

``--json FILE`` writes the main table's run as a results file (kind ``bench``, with the record
every results file carries: scripts/results.py): one row per backend with ``decode_tps``,
``prefill_tps`` (medians), ``decode_tps_all``/``prefill_tps_all`` (each repetition),
``ttft_ms``, ``load_s``, the RSS figures and, where known, the weight bytes read per token.
``--plot FIG`` draws it (scripts/plot.py). The ``--sampler``, ``--mask``, ``--prefix-cache``
and ``--speculation`` tables are printed only.

``--prefix-cache`` measures TTFT over plain HTTP (streaming ``/v1/completions``, greedy) on two
tiny_mindie servers, one with ``prefixCaching`` on and one with it off, and with ``--llama-bin``
on ``llama-server`` (``cache_prompt``) too, taking turns: (1) a multi-turn chat, the second turn
of a ~1,500-token conversation against its first turn (a new conversation each repetition);
(2) 8 users at once sharing a 500-token system prompt, each with its own question, p50 TTFT
over ``--reps`` rounds after one request with that system prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PROMPT_TEXT = (
    "The history of computing is a story of people who wanted to calculate faster than they "
    "could by hand. Early mechanical calculators were followed by electromechanical machines, "
    "then by vacuum tubes, transistors and integrated circuits. Each step made machines smaller, "
    "cheaper and more reliable, and each step changed who could use them and for what. "
)


def rss_mb() -> float:
    """Resident set in MB (10**6 bytes, the unit the GGUF size is printed in)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


# ---- children ----------------------------------------------------------------------------------
#
# Each backend lives in its own child process for the whole run and obeys one JSON command per
# line on stdin (answering one JSON line on stdout), so the parent can interleave the backends:
# the machine this runs on is shared, and load that comes and goes then hits every backend
# alike instead of whichever happened to run at that moment.
#
#   {"op": "warm"}              the prompt once in another slot (first-run allocations)
#   {"op": "prefill"}           the prompt from position 0 in slot 0; answers seconds (prompt
#                               forward + argmax of the first token) and the first token
#   {"op": "decode", "n": k}    k more greedy tokens after that; answers seconds and the tokens
#   {"op": "finish"}            answers the final statistics and exits

class _Runner:
    """Greedy prefill / decode of one prompt on one backend (``prefill_fn(ids, warm)`` and
    ``decode_fn(tok, pos)`` return logits)."""

    def __init__(self, prefill_fn, decode_fn, prompt: list[int]):
        self.prefill_fn, self.decode_fn, self.prompt = prefill_fn, decode_fn, prompt
        self.tok, self.pos, self.logits = 0, 0, None

    def serve(self, stats) -> None:
        import numpy as np

        ready = stats()
        ready["ready"] = True
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "warm":                # the whole prompt once: first-run allocations
                self.prefill_fn(self.prompt, warm=True)
                out = {}
            elif op == "prefill":
                t0 = time.perf_counter()
                self.logits = self.prefill_fn(self.prompt, warm=False)
                self.tok = int(np.argmax(self.logits))
                out = {"s": time.perf_counter() - t0, "tokens": [self.tok]}
                self.pos = len(self.prompt)
            elif op == "decode":
                toks = []
                t0 = time.perf_counter()
                for _ in range(cmd["n"]):
                    self.logits = self.decode_fn(self.tok, self.pos)
                    self.tok = int(np.argmax(self.logits))
                    self.pos += 1
                    toks.append(self.tok)
                out = {"s": time.perf_counter() - t0, "tokens": toks}
            elif op == "finish":
                out = stats(final=True, logits=self.logits, step_s=cmd.get("step_s"))
                print(json.dumps(out), flush=True)
                return
            else:
                raise ValueError(op)
            print(json.dumps(out), flush=True)


def child_tiny(backend: str, model: str, prompt: list[int], threads: int, root: str) -> None:
    """``backend`` is ``numpy``, ``onnxruntime`` or ``onnxruntime:MODE`` (a weight mode of
    ``WEIGHT_MODES``, a block size for 4-bit requantized weights, ``standard``: the standard
    graph, default-domain operators only, or ``custom``: the exact graph on tiny_mindie's own
    kernels)."""
    sys.path.insert(0, root)
    backend, _, mode = backend.partition(":")
    import numpy as np

    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.gguf import GGUFFile

    if backend == "onnxruntime":
        import onnxruntime  # noqa: F401  (the library counts as "interpreter + libraries")
    base = rss_mb()
    t0 = time.perf_counter()
    f = GGUFFile(model)
    cfg = ModelConfig.from_gguf(f)
    t_open = time.perf_counter() - t0
    rss_open = rss_mb()
    extra = {}
    if backend == "onnxruntime":
        from tiny_mindie.model.ort.ort_backend import OrtBackend
        kw = {}
        if mode == "standard":
            from tiny_mindie.model.onnx.graph_options import GraphOptions
            kw["graph_options"] = GraphOptions(flavour="standard")
        elif mode == "custom":             # the GGUF-block kernels (tiny_mindie/kernels)
            from tiny_mindie.model.onnx.graph_options import GraphOptions
            kw["graph_options"] = GraphOptions(kernels="custom")
        elif mode:                         # (a tree older than the weight modes takes none)
            from tiny_mindie.model import WEIGHT_MODES
            from tiny_mindie.model.onnx.graph_options import GraphOptions
            compact = WEIGHT_MODES[mode] if mode in WEIGHT_MODES else int(mode)
            kw["graph_options"] = GraphOptions(compact=compact)
        from tiny_mindie.model.options import BackendOptions
        be = OrtBackend(f, cfg, BackendOptions(threads=threads), num_slots=4, max_seq_len=1024,
                        **kw)
        extra = {"graph": "built" if be.built else "cached", "device": be.device,
                 "graph_s": be.load_seconds["graph"], "session_s": be.load_seconds["session"],
                 "threads": threads, "huge_mb": getattr(be, "huge_page_bytes", 0) / 1e6}
        sys.path.insert(0, HERE)
        try:                               # a source tree laid out before model/gguf.py
            from footprint import graph_weight_bytes
        except ImportError:
            pass
        else:
            wb = graph_weight_bytes(be.graph_path)
            extra.update(weight_bytes=wb.per_token, weight_resident_bytes=wb.resident)
    else:
        from tiny_mindie.model.reference.decoder import NumpyBackend
        be = NumpyBackend(f, cfg, num_slots=4, max_seq_len=1024)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()

    def prefill(ids, warm):
        return be.forward([SeqChunk(1 if warm else 0, 0, np.array(ids, np.int64))])[0]

    def decode(tok, pos):
        return be.forward([SeqChunk(0, pos, np.array([tok], np.int64))])[0]

    runner = _Runner(prefill, decode, prompt)

    def stats(final=False, logits=None, step_s=None):
        res = dict(extra, backend=backend, load_s=load_s, open_s=t_open, rss_base_mb=base,
                   rss_open_mb=rss_open, rss_loaded_mb=rss_loaded)
        if final:
            res["rss_peak_mb"] = peak_rss_mb()
            if backend == "onnxruntime":
                try:                       # (a source tree older than these counts)
                    from tiny_mindie.model.ort.memory import file_resident_bytes, resident_split
                except ImportError:
                    pass
                else:
                    own, files = resident_split()
                    res.update(rss_own_mb=own / 1e6, rss_file_mb=files / 1e6,
                               rss_gguf_mb=file_resident_bytes(model) / 1e6)
            if backend == "onnxruntime" and logits is not None and step_s:
                res.update(_sampler_share(logits, step_s, prompt))
        return res

    runner.serve(stats)


def _sampler_share(logits, step_s: float, prompt: list[int]) -> dict:
    import numpy as np

    try:
        from tiny_mindie.engine.request import SamplingParams
        from tiny_mindie.engine.sampling import make_rng, sample
    except ImportError:
        return {}
    seen = np.array(prompt, np.int64)
    out = {}
    for label, params in (("greedy", SamplingParams()),
                          ("sampled", SamplingParams(do_sample=True, temperature=0.7, top_k=50,
                                                     top_p=0.9, repetition_penalty=1.1, seed=1))):
        rng = make_rng(1)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            sample(logits, params, seen, rng)
            n += 1
        dt = (time.perf_counter() - t0) / n
        out[f"sampler_{label}_ms"] = dt * 1e3
        out[f"sampler_{label}_share"] = dt / (step_s + dt)
    return out


# ---- --sampler: the batch sampler's share of a batch-8 decode step -------------------------------

SAMPLER_MODEL = "gemma3-270m"         # the largest vocabulary in the registry: 262,144 tokens
SAMPLER_PROMPTS = (
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three laws of thermodynamics are", "My favourite recipe for pancakes",
    "In 1969, astronauts", "The quick brown fox", "Translate to German: Good morning, how are you?")


def _sampler_configs():
    """``(label, [SamplingParams or (SamplingParams, top_n)] * 8)`` for the table."""
    from tiny_mindie.engine.request import SamplingParams as P

    mindie = P(do_sample=True, temperature=0.5, top_k=10, top_p=0.95, typical_p=0.5,
               repetition_penalty=1.03)            # the README's /infer example
    kinds = [("greedy", P()),
             ("temperature 0.7", P(do_sample=True, temperature=0.7)),
             ("MindIE example: T 0.5, top-k 10, top-p 0.95, typical 0.5, rep. 1.03", mindie),
             ("top-p 0.9 alone", P(do_sample=True, top_p=0.9)),
             ("typical-p 0.9 alone", P(do_sample=True, typical_p=0.9)),
             ("watermark + temperature 0.7", P(do_sample=True, temperature=0.7, watermark=True))]
    mixed = [p for _, p in kinds] + [
        (P(do_sample=True, top_k=40, top_p=0.95), 5),                  # with top_logprobs 5
        P(do_sample=True, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3)]
    return [(label, [p] * 8) for label, p in kinds] + [("mixed: one row of each above, top-k 40 "
                                                        "+ top_logprobs, penalties + top-p", mixed)]


def sampler_table(model: str | None, reps: int) -> int:
    """Time :func:`~tiny_mindie.engine.sampling.sample_batch` on real logits: Gemma 3 270M on the
    onnxruntime backend with the server's default threads, 8 prompts prefilled into 8 slots.

    Each repetition runs one batch-8 decode step (timed: the step's median is the reference),
    then samples its ``[8, 262144]`` logits with one configuration (timed) and feeds the sampled
    tokens to the next step -- so the sampler sees the cache state it sees in the server. Prints
    ms per batch, its ratio to the forward pass, and its share of a decode step (the forward
    pass plus the sampling, as the engine runs them one after the other); the goal is a share
    under 10 % for each configuration.
    """
    import numpy as np

    sys.path.insert(0, ROOT)
    from tiny_mindie.engine import sampling
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.ort.ort_backend import OrtBackend
    from tiny_mindie.model.registry.catalog import resolve
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    path = resolve(model or SAMPLER_MODEL)
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    tok = load_tokenizer(f)
    configs = _sampler_configs()
    prompts = [tok.encode(t) for t in SAMPLER_PROMPTS]
    steps_needed = reps + len(configs) * (reps + 1)
    be = OrtBackend(f, cfg, num_slots=8, max_seq_len=max(map(len, prompts)) + steps_needed + 8)
    seqs = [list(ids) for ids in prompts]
    logits = be.forward([SeqChunk(i, 0, np.array(ids, np.int64)) for i, ids in enumerate(prompts)])
    steps: list[float] = []

    def step(next_ids):
        for i, t in enumerate(next_ids):
            seqs[i].append(int(t))
        t0 = time.perf_counter()
        out = be.forward([SeqChunk(i, len(s) - 1, np.array(s[-1:], np.int64))
                          for i, s in enumerate(seqs)])
        steps.append(time.perf_counter() - t0)
        return out

    for _ in range(reps):                    # warm-up, and the first step times
        logits = step(np.argmax(logits, axis=1))
    results = []
    for label, kinds in configs:
        spec = [k if isinstance(k, tuple) else (k, 0) for k in kinds]
        rngs = [sampling.make_rng(1000 + i) for i in range(8)]
        times = []
        for r in range(reps + 1):
            rows = [sampling.SampleRow(p, np.array(s, np.int64), g, n, len(ids))
                    for (p, n), s, g, ids in zip(spec, seqs, rngs, prompts, strict=True)]
            own = logits.copy()              # the engine hands over its own array, as here
            t0 = time.perf_counter()
            out = sampling.sample_batch(own, rows, overwrite=True)
            if r:                            # the first call sets up the scratch arrays
                times.append(time.perf_counter() - t0)
            logits = step([t for t, _, _ in out])
        results.append((label, _median(times)))
    be.close()
    step_s = _median(steps)
    print(f"model {os.path.basename(path)} (vocabulary {cfg.vocab_size}), onnxruntime on "
          f"{be.device}, {getattr(be, 'threads', '?')} intra-op thread(s), "
          f"{getattr(be, 'parallel_runs', 1)} parallel run(s), {os.cpu_count()} CPUs; batch-8 "
          f"decode step: median {step_s * 1e3:.1f} ms over {len(steps)} steps "
          f"(min {min(steps) * 1e3:.1f}); sampler: median of {reps} calls, each right after a "
          f"decode step; load average {os.getloadavg()[0]:.2f}\n")
    w = max(len(label) for label, _ in results)
    print(f"{'sampler configuration (8 rows)':<{w}} {'ms / batch':>10} {'/ forward %':>11} "
          f"{'% of step':>9}")
    for label, t in results:
        print(f"{label:<{w}} {t * 1e3:>10.2f} {100 * t / step_s:>11.1f} "
              f"{100 * t / (step_s + t):>9.1f}")
    return 0


# ---- --mask: constrained decoding's share of a batch-8 decode step ------------------------------

MASK_MODELS = ("gemma3-270m", "smollm2-135m-instruct")    # 262,144 and 49,152 tokens


def _timed_forward(be, chunks, masks=None):
    """``(seconds, logits)`` of one forward pass; with ``masks = (pool, matchers, V)`` the
    matchers' masks are computed on the pool's thread meanwhile (and waited for)."""
    from tiny_mindie.engine.constraint import fill_masks

    t0 = time.perf_counter()
    job = masks[0].submit(fill_masks, *masks[1:]) if masks else None
    out = be.forward(chunks)
    if job is not None:
        job.result()
    return time.perf_counter() - t0, out


def mask_table(models: list[str], reps: int) -> int:
    """Time the token masks of constrained decoding on real decode steps: per model, 8 prompts
    in 8 slots on onnxruntime (the server's default threads), each row held to the JSON schema
    of scripts/grammar_libs.py (a fresh matcher when one completes), greedy on the masked logits.

    Each repetition times the 8 masks (:func:`~tiny_mindie.engine.constraint.fill_masks`) and
    their application to the ``[8, V]`` logits (:func:`~.constraint.apply_bitmask`) after a
    decode step, as the engine runs them, and the share of the step they cost: ``(masks +
    apply) / (step + masks + apply)``; the goal is under 10 %. For the alternative -- masks on
    a helper thread during the forward pass -- it also runs the same step twice (same
    positions: the second writes the same cache entries again), alone and with the masks
    alongside, in alternating order: ``(step with masks + apply - step) / (step with masks +
    apply)``. Medians.
    """
    import json as _json
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from grammar_libs import SCHEMA

    from tiny_mindie.engine.constraint import apply_bitmask, compile_constraint, fill_masks
    from tiny_mindie.engine.request import Constraint
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.ort.ort_backend import OrtBackend
    from tiny_mindie.model.registry.catalog import resolve
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    pool = ThreadPoolExecutor(1)
    rows = []
    for model in models:
        path = resolve(model)
        f = GGUFFile(path)
        cfg = ModelConfig.from_gguf(f)
        tok = load_tokenizer(f)
        t0 = time.perf_counter()
        compiled = compile_constraint(tok, Constraint("json_schema", _json.dumps(SCHEMA)))
        first_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_constraint(tok, Constraint("json_schema", _json.dumps({**SCHEMA, "title": "x"})))
        compile_s = time.perf_counter() - t0
        prompts = [tok.encode(t + " Answer in JSON: ") for t in SAMPLER_PROMPTS]
        be = OrtBackend(f, cfg, num_slots=8, max_seq_len=max(map(len, prompts)) + reps + 16)
        seqs = [list(ids) for ids in prompts]
        matchers = [compiled.matcher() for _ in range(8)]
        logits = be.forward([SeqChunk(i, 0, np.array(ids, np.int64))
                             for i, ids in enumerate(prompts)])
        alone, overlapped, serial, applied = [], [], [], []
        for r in range(reps + 1):
            bitmask = fill_masks(matchers, tok.vocab_size)
            t0 = time.perf_counter()
            apply_bitmask(logits, bitmask)
            t_apply = time.perf_counter() - t0
            for i, t in enumerate(np.argmax(logits, axis=1)):
                seqs[i].append(int(t))
                if not matchers[i].consume(int(t)) or matchers[i].done:
                    matchers[i] = compiled.matcher()
            chunks = [SeqChunk(i, len(s) - 1, np.array(s[-1:], np.int64))
                      for i, s in enumerate(seqs)]

            first_with = r % 2 == 0            # alternate which of the two runs first
            t_a, logits = _timed_forward(be, chunks, (pool, matchers, tok.vocab_size)
                                         if first_with else None)
            t_b, _ = _timed_forward(be, chunks, None if first_with else
                                    (pool, matchers, tok.vocab_size))
            t_over, t_alone = (t_a, t_b) if first_with else (t_b, t_a)
            t0 = time.perf_counter()
            fill_masks(matchers, tok.vocab_size)
            t_serial = time.perf_counter() - t0
            if r:                                   # the first: warm-up
                alone.append(t_alone)
                overlapped.append(t_over)
                serial.append(t_serial)
                applied.append(t_apply)
        be.close()
        step, over, ser, app = map(_median, (alone, overlapped, serial, applied))
        rows.append((f"{os.path.basename(path)} ({cfg.vocab_size:,})", first_compile, compile_s,
                     step, ser, app, over, (over + app - step) / (over + app),
                     (ser + app) / (step + ser + app)))
    pool.shutdown()
    print(f"{os.cpu_count()} CPUs, onnxruntime, batch 8, greedy, medians of {reps} decode steps; "
          f"schema of scripts/grammar_libs.py; load average {os.getloadavg()[0]:.2f}\n")
    head = (f"{'model (vocabulary)':<40} {'tokenizer+1st s':>15} {'compile ms':>10} "
            f"{'step ms':>8} {'8 masks ms':>10} {'apply ms':>8} {'share %':>7} "
            f"{'step beside masks ms':>20} {'share if beside %':>17}")
    print(head)
    for name, first, comp, step, ser, app, over, share, serial_share in rows:
        print(f"{name:<40} {first:>15.2f} {comp * 1e3:>10.1f} {step * 1e3:>8.1f} "
              f"{ser * 1e3:>10.2f} {app * 1e3:>8.2f} {100 * serial_share:>7.1f} "
              f"{over * 1e3:>20.1f} {100 * share:>17.1f}")
    return 0


def child_llama(model: str, prompt: list[int], threads: int) -> None:
    import numpy as np
    from llama_cpp import Llama, llama_cpp

    base = rss_mb()
    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()

    n_vocab = llm.n_vocab()

    def last_logits():     # llama-cpp-python >= 0.3 no longer copies them into llm.scores
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def prefill(ids, warm):
        llm.reset()
        llm.eval(ids)
        out = np.array(last_logits(), copy=True)
        if warm:
            llm.reset()
        return out

    def decode(tok, pos):
        llm.eval([tok])
        return last_logits()

    def stats(final=False, logits=None, step_s=None):
        res = dict(backend="llama.cpp", load_s=load_s, rss_base_mb=base, rss_loaded_mb=rss_loaded,
                   version=getattr(sys.modules["llama_cpp"], "__version__", "?"),
                   system_info=llama_cpp.llama_print_system_info().decode(errors="replace")[:200])
        if final:
            res["rss_peak_mb"] = peak_rss_mb()
        return res

    _Runner(prefill, decode, prompt).serve(stats)


def child_llama_bench(binary: str, model: str, prompt: list[int], threads: int) -> None:
    """llama.cpp's ``llama-bench`` behind the child protocol (see the module docstring): one
    binary run per command, its own timing of that command's work."""
    def bench(*args: str) -> dict:
        proc = subprocess.run([binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json",
                               *args], capture_output=True, text=True)
        try:
            if proc.returncode != 0:
                raise ValueError(proc.stderr.strip()[-300:] or f"exit status {proc.returncode}")
            (res,) = json.loads(proc.stdout)
            return res
        except ValueError as exc:           # JSONDecodeError too: not llama-bench's output
            raise SystemExit(f"{binary} {' '.join(args)}: not a working llama-bench "
                             f"({exc})") from None

    t0 = time.perf_counter()
    first = bench("-p", "1", "-n", "0")
    load_s = time.perf_counter() - t0 - first["avg_ns"] / 1e9     # roughly: process + model load
    pos = 0

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6

    def stats(final=False):
        return dict(backend="llama-bench", load_s=load_s, rss_base_mb=0.0, rss_loaded_mb=peak(),
                    rss_peak_mb=peak(), version=f"{first.get('build_commit', '?')} "
                    f"(build {first.get('build_number', '?')})", cpu=first.get("cpu_info", "?"))

    ready = stats()
    ready["ready"] = True
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "warm":
            bench("-p", str(len(prompt)), "-n", "0")
            out = {}
        elif cmd["op"] == "prefill":
            out = {"s": bench("-p", str(len(prompt)), "-n", "0")["avg_ns"] / 1e9, "tokens": []}
            pos = len(prompt)
        elif cmd["op"] == "decode":
            out = {"s": bench("-p", "0", "-n", str(cmd["n"]), "-d", str(pos))["avg_ns"] / 1e9,
                   "tokens": []}
            pos += cmd["n"]
        elif cmd["op"] == "finish":
            print(json.dumps(stats(final=True)), flush=True)
            return
        else:
            raise ValueError(cmd["op"])
        print(json.dumps(out), flush=True)


# ---- parent ------------------------------------------------------------------------------------

def prompt_ids(model: str, n: int) -> list[int]:
    sys.path.insert(0, ROOT)
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    tok = load_tokenizer(GGUFFile(model))
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT_TEXT, add_bos=False)
    return ids[:n]


class Child:
    """One backend's child process (see the command protocol above)."""

    def __init__(self, python: str, spec: str, payload: dict):
        name, _, root = spec.partition("@")
        root = os.path.abspath(root) if root else ROOT
        payload = dict(payload, root=root)
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(payload["threads"])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.name = spec if root == ROOT else f"{name}@{os.path.basename(root)}"
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--child", name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read()
                raise RuntimeError(f"child {self.name} failed (exit {self.proc.wait()}):\n"
                                   f"{err[-2000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def finish(self, **cmd) -> dict:
        out = self.ask(op="finish", **cmd)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        return out


def run_interleaved(children: list[Child], prompt_len: int, gen: int, reps: int,
                    segment: int) -> dict[str, dict]:
    """``reps`` repetitions; in each, every backend prefills (one after the other), then the
    backends take turns decoding ``segment`` tokens until each has ``gen``. Per backend and
    repetition: prefill seconds and the summed decode seconds."""
    runs = {c.name: {"prefill_s": [], "decode_s": [], "tokens": None} for c in children}
    for c in children:
        c.ask(op="warm")
    for _ in range(reps):
        toks = {}
        for c in children:
            r = c.ask(op="prefill")
            runs[c.name]["prefill_s"].append(r["s"])
            toks[c.name] = list(r["tokens"])
        spent = {c.name: 0.0 for c in children}
        done = 0
        while done < gen:
            n = min(segment, gen - done)
            order = children if (done // segment) % 2 == 0 else children[::-1]
            for c in order:                 # alternate who goes first
                r = c.ask(op="decode", n=n)
                spent[c.name] += r["s"]
                toks[c.name] += r["tokens"]
            done += n
        for c in children:
            runs[c.name]["decode_s"].append(spent[c.name])
            if runs[c.name]["tokens"] is None:
                runs[c.name]["tokens"] = toks[c.name]
    return runs


def read_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """This machine's memory read bandwidth in bytes/s: ``threads`` threads each sum their own
    part of one float32 array of ``mib`` MiB (numpy releases the GIL while it sums), the best
    of ``reps`` passes after one pass that faults the pages in. The array is far larger than
    the caches, so every pass reads memory."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mib * (1 << 20) // 4, np.float32)
    parts = np.array_split(a, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def wall_table(results: list[dict], model: str, threads: int) -> None:
    """Each engine's decode against the memory wall: weight bytes read per decoded token
    (``scripts/footprint.py``), times its decode tok/s, as a share of this machine's
    read bandwidth (:func:`read_bandwidth`, measured now with the same threads)."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from footprint import gguf_weight_bytes

    from tiny_mindie.model.gguf import GGUFFile

    llama = gguf_weight_bytes(GGUFFile(model))
    bw = read_bandwidth(threads)
    print(f"\nthe memory wall: read bandwidth {bw / 1e9:.1f} GB/s ({threads} threads, numpy sums "
          f"of a 1 GiB array); bytes = weight bytes read per decoded token")
    w = max(16, *(len(r["backend"]) for r in results))
    print(f"{'engine':<{w}} {'bytes MB':>9} {'vs llama.cpp':>12} {'decode tok/s':>12} "
          f"{'GB/s':>6} {'of the wall':>11} {'resident MB':>11}")
    for r in results:
        if r["backend"] in ("llama-bench", "llama.cpp"):
            per, res = llama.per_token, llama.resident
        elif "weight_bytes" in r:
            per, res = r["weight_bytes"], r["weight_resident_bytes"]
        else:
            continue                       # the numpy reference reads float32 weights
        rate = per * r["decode_tps"]
        r.update(weight_bytes=per, weight_resident_bytes=res, read_gbs=rate / 1e9,
                 wall_share=rate / bw, bandwidth_gbs=bw / 1e9)
        print(f"{r['backend']:<{w}} {per / 1e6:>9.1f} {per / llama.per_token:>12.2f} "
              f"{r['decode_tps']:>12.1f} {rate / 1e9:>6.1f} {100 * rate / bw:>10.0f}% "
              f"{res / 1e6:>11.1f}")


def find_llama_python(given: str | None) -> str | None:
    for python in ([given] if given else []) + [os.environ.get("LLAMA_CPP_PYTHON"), sys.executable]:
        if not python:
            continue
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return python
    return None


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


# ---- prefix caching over HTTP -----------------------------------------------------------------

CHAT_LINES = [
    "User: I am planning a vegetable garden behind the house. Where should I start?",
    "Assistant: Start with the light: most vegetables want six to eight hours of sun a day, so "
    "watch where the shadows of the house and the trees fall in the morning and the evening.",
    "User: The corner by the fence gets sun from ten until five. Is that enough for tomatoes?",
    "Assistant: Seven hours is enough for tomatoes, peppers and beans. Keep lettuce and spinach "
    "for the half-shaded strip along the wall, where they bolt less in July.",
    "User: The soil there is heavy clay that cracks in summer. What can I do about it?",
    "Assistant: Dig in compost or well-rotted manure every autumn, about five centimetres a "
    "year, and never work the clay while it is wet. Raised beds also help it drain.",
    "User: How wide should a raised bed be, and how high?",
    "Assistant: One metre twenty wide at most, so you reach the middle from both sides without "
    "stepping on the soil; thirty centimetres high is plenty on clay.",
    "User: What about watering? I am away most weekends in summer.",
    "Assistant: A soaker hose on a cheap timer under a layer of straw mulch keeps the beds moist "
    "for several days and wastes far less water than a sprinkler.",
]
SYSTEM_PROMPT_LINES = [
    "You are the support assistant of a company that sells garden tools online.",
    "Answer in at most three sentences, politely and precisely, in the customer's language.",
    "Orders ship within two working days; delivery takes three to five days in the country.",
    "Returns are free within thirty days if the tool is unused and in its original box.",
    "Spare parts for every mower, trimmer and pump are sold for ten years after the last sale.",
    "Never promise discounts, never give legal advice, and never ask for payment details.",
    "If a question is about safety, tell the customer to stop using the tool and call us.",
    "The hotline is open Monday to Friday from eight to six, Saturdays from nine to one.",
]
QUESTIONS = ["Where is my order 4411?", "Can I return a used hedge trimmer?",
             "Do you sell blades for the R-40 mower?", "Is the hotline open on Sunday?",
             "My pump makes a burning smell, what now?", "Do you ship to the islands?",
             "How long is the warranty on batteries?", "Can I change my delivery address?",
             "Which oil does the T-200 need?", "Is there a discount for schools?",
             "My parcel arrived damaged.", "How do I sharpen secateurs?"]


def _text_of_tokens(tok, lines: list[str], n: int) -> str:
    """``lines`` repeated until the text has about ``n`` tokens."""
    text, k = "", 0
    while len(tok.encode(text)) < n:
        text += lines[k % len(lines)] + "\n"
        k += 1
    return text


def _ttft(port: int, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """One greedy streaming ``/v1/completions`` over plain HTTP: (TTFT s, generated text)."""
    import http.client

    from loadtest import sse_events

    body = {"model": model, "prompt": prompt, "stream": True, "max_tokens": max_tokens,
            "temperature": 0}     # llama-server: cache_prompt is true by default
    t0 = time.perf_counter()
    first, text = None, ""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for event in sse_events(conn, "/v1/completions", body):
        if event.startswith(b"data: [DONE]"):
            continue
        piece = ((json.loads(event[6:]).get("choices") or [{}])[0]).get("text") or ""
        if first is None:
            first = time.perf_counter() - t0
        text += piece
    conn.close()
    return first if first is not None else float("nan"), text


def _stop(procs) -> None:
    """Terminate the servers ``procs`` and wait for each."""
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def prefix_cache_table(args) -> int:
    """The two prefix-cache workloads of the docstring; prints the table."""
    import tempfile
    import threading

    sys.path.insert(0, HERE)
    from loadtest import start_llama_server, start_server
    from results import cpu_line

    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL, resolve
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    model = resolve(args.model or DEFAULT_MODEL)
    tok = load_tokenizer(GGUFFile(model))
    chat = _text_of_tokens(tok, CHAT_LINES, 1450)
    system = _text_of_tokens(tok, SYSTEM_PROMPT_LINES, 500)
    procs, servers = [], {}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-prefix-") as home:
        try:
            for label, on in (("cache on", True), ("cache off", False)):
                folder = os.path.join(home, label.replace(" ", "-"))
                os.makedirs(folder)
                proc, port = start_server(None, None, folder,
                                          extra=["--no-tls", "--model", model],
                                          schedule={"prefixCaching": on, "maxBatchSize": 8,
                                                    "maxPrefillBatchSize": 8})
                procs.append(proc)
                servers[label] = (port, "smollm2-135m-instruct" if args.model is None
                                  else os.path.basename(model))
            if args.llama_bin:
                cpus = len(os.sched_getaffinity(0))
                proc, port = start_llama_server(args.llama_bin, model, cpus, 8,
                                                ["-c", str(8 * 2560)])
                procs.append(proc)
                servers["llama-server"] = (port, "m")
            for port, name in servers.values():                 # warm up
                _ttft(port, name, "Hello", 2)
            turns: dict[str, list[tuple[float, float]]] = {k: [] for k in servers}
            users: dict[str, list[list[float]]] = {k: [] for k in servers}
            for rep in range(args.reps):
                for label, (port, name) in servers.items():     # (1) two chat turns
                    first_prompt = f"Conversation {rep} on {label}:\n{chat}Assistant:"
                    t1, answer = _ttft(port, name, first_prompt, 24)
                    second = (first_prompt + answer + "\nUser: And which vegetables are the "
                              "easiest for a beginner?\nAssistant:")
                    t2, _ = _ttft(port, name, second, 24)
                    turns[label].append((t1, t2))
            for label, (port, name) in servers.items():         # (2) a shared system prompt
                _ttft(port, name, f"{system}User: Hello!\nAssistant:", 2)
                for rep in range(args.reps):
                    times = [0.0] * 8

                    def user(i: int, rep=rep, port=port, name=name, times=times) -> None:
                        q = QUESTIONS[(rep * 8 + i) % len(QUESTIONS)]
                        times[i], _ = _ttft(port, name, f"{system}User: {q} (ticket {rep}-{i})"
                                            "\nAssistant:", 8)
                    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    users[label].append(times)
        finally:
            _stop(procs)
    print(cpu_line())
    print(f"{os.path.basename(model)}; load average {load0:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {args.reps} repetitions")
    print(f"chat prompt {len(tok.encode(chat))} tokens, system prompt "
          f"{len(tok.encode(system))} tokens")
    print(f"{'server':<14} {'turn 1 TTFT ms':<22} {'turn 2 TTFT ms':<22} "
          f"{'turn2/turn1 (median)':<21} {'8 users p50 TTFT ms':<21} {'p50 vs cache off'}")
    base = sorted(t for r in users["cache off"] for t in r)[len(users["cache off"]) * 4]
    for label in servers:
        t1 = [a * 1000 for a, _ in turns[label]]
        t2 = [b * 1000 for _, b in turns[label]]
        ratio = _median([b / a for a, b in turns[label]])
        flat = sorted(t for r in users[label] for t in r)
        p50 = flat[len(flat) // 2]
        print(f"{label:<14} {' '.join(f'{x:.0f}' for x in t1):<22} "
              f"{' '.join(f'{x:.0f}' for x in t2):<22} {ratio:<21.3f} {p50 * 1000:<21.0f} "
              f"{p50 / base:.3f}")
        rounds = ", ".join(f"{sorted(r)[4] * 1000:.0f}" for r in users[label])
        print(f"{'':<14} 8-user rounds p50 ms: {rounds}")
    return 0


SPEC_PARAGRAPH = (
    "Small language models run well on edge devices when their weights are quantized to four "
    "bits. A server that speaks the same API as the big one in the data centre saves rewriting "
    "every client, and mutual TLS keeps the traffic private on the factory network. The KV "
    "cache holds the keys and values of every position, so its size grows with the context; "
    "the prefix cache reuses it when a new request starts with the same tokens. Continuous "
    "batching lets many users share one forward pass, and each of them still gets the same "
    "answer as when alone.")
SPEC_CODE = (
    "def parse_line(line):\n    fields = line.strip().split(',')\n    name = fields[0]\n"
    "    count = int(fields[1])\n    price = float(fields[2])\n    return name, count, price\n"
    "\n\ndef total(lines):\n    result = 0.0\n    for line in lines:\n"
    "        name, count, price = parse_line(line)\n        result += count * price\n"
    "    return result\n")
SPEC_WORKLOADS = {
    "extractive: fix typos": "Rewrite this paragraph with its spelling mistakes fixed:\n\n" + (
        SPEC_PARAGRAPH.replace("quantized", "quantised").replace("private", "privat")
        .replace("context", "contxt").replace("answer", "anwser")),
    "extractive: code edit": "Rename the variable `result` to `amount` in this code, and "
                             "show the whole code:\n\n```python\n" + SPEC_CODE + "```",
}
#: Free chat, where little repeats: speculation must not cost here (each prompt is reported,
#: and the geometric mean of their on/off ratios).
SPEC_FREE_CHAT = {
    "free: a story": "Tell me a story about a lighthouse keeper and a storm.",
    "free: a question": "What should I know before adopting a dog?",
    "free: an explanation": "Explain how a refrigerator works.",
    "free: a poem": "Write a poem about autumn leaves.",
    "free: advice": "Give me three tips for a job interview.",
    "free: a letter": "Write a short letter to a friend who moved abroad.",
}
SPEC_WORKLOADS.update(SPEC_FREE_CHAT)


def _decode_rate(port: int, model: str, content: str, max_tokens: int) -> tuple[float, int]:
    """One greedy streaming chat completion over plain HTTP: (decode tok/s after the first
    token, tokens)."""
    import http.client

    from loadtest import sse_events

    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "stream": True, "max_tokens": max_tokens, "temperature": 0}
    times = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for event in sse_events(conn, "/v1/chat/completions", body):
        if event.startswith(b"data: [DONE]"):
            continue
        delta = ((json.loads(event[6:]).get("choices") or [{}])[0]).get("delta") or {}
        if delta.get("content"):
            times.append(time.perf_counter())
    conn.close()
    # one content event per token (a verification's tokens are sent one by one, at once);
    # a token whose text is held back (a partial UTF-8 character) is counted with the next
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0, len(times)


def speculation_table(args) -> int:
    """Single-stream decode speed with speculative decoding on and off (docstring)."""
    import tempfile

    sys.path.insert(0, HERE)
    from loadtest import start_server
    from results import cpu_line

    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL, resolve

    model = resolve(args.model or DEFAULT_MODEL)
    procs, servers = [], {}
    load0 = os.getloadavg()[0]
    rates: dict[tuple[str, str], list[float]] = {}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="tiny_mindie-spec-") as home:
        try:
            for label, on in (("on", True), ("off", False)):
                folder = os.path.join(home, label)
                os.makedirs(folder)
                proc, port = start_server(None, None, folder,
                                          extra=["--no-tls", "--model", model],
                                          schedule={"speculativeDecoding": on})
                procs.append(proc)
                servers[label] = port
            name = _served_model(servers["on"])
            for port in servers.values():                        # warm up
                _decode_rate(port, name, "Hello", 4)
            for rep in range(args.reps):
                # which server goes first alternates: in process, speculation always run
                # first measured 0.91-0.92x on a free-chat story, 0.98x with the order rotated
                order = list(servers.items())[::-1 if rep % 2 else 1]
                for work, content in SPEC_WORKLOADS.items():
                    for label, port in order:
                        rate, n = _decode_rate(port, name, content, args.gen_tokens)
                        rates.setdefault((work, label), []).append(rate)
                        counts[work] = n
            spec = _spec_counters(servers["on"])
        finally:
            _stop(procs)
    print(cpu_line())
    print(f"{os.path.basename(model)}; one stream, greedy /v1/chat/completions over plain HTTP, "
          f"up to {args.gen_tokens} tokens; load average {load0:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {args.reps} repetitions, the servers taking turns")
    print(f"{'workload':<24} {'events':>6} {'on tok/s (median)':>18} {'off tok/s':>10} "
          f"{'on/off':>7}  per repetition")
    for work in SPEC_WORKLOADS:
        on, off = rates[(work, "on")], rates[(work, "off")]
        per = ", ".join(f"{_ratio(a, b):.2f}" for a, b in zip(on, off, strict=True))
        print(f"{work:<24} {counts[work]:>6} {_median(on):>18.1f} {_median(off):>10.1f} "
              f"{_ratio(_median(on), _median(off)):>7.2f}  {per}")
    free = [_ratio(_median(rates[(w, "on")]), _median(rates[(w, "off")])) for w in SPEC_FREE_CHAT]
    print(f"free chat, geometric mean of the {len(free)} on/off ratios: "
          f"{math.prod(free) ** (1 / len(free)):.3f} (lowest {min(free):.2f})")
    print(f"proposed {spec[0]:.0f} tokens, kept {spec[1]:.0f} "
          f"({spec[1] / spec[0] * 100 if spec[0] else 0:.0f} %)")
    return 0


def _ratio(a: float, b: float) -> float:
    """a / b; NaN when b is 0 (an answer of one token has no decode rate)."""
    return a / b if b else float("nan")


def _served_model(port: int) -> str:
    """The model name a server answers to (``/v1/models``)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v1/models")
    name = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return name


def _spec_counters(port: int) -> tuple[float, float]:
    """(proposed, kept) speculated tokens from a server's /metrics."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        if line.startswith("tiny_mindie_spec_decode_num_"):
            key, value = line.rsplit(" ", 1)
            values[key.split("{")[0]] = float(value)
    return (values.get("tiny_mindie_spec_decode_num_draft_tokens_total", 0.0),
            values.get("tiny_mindie_spec_decode_num_accepted_tokens_total", 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file or a registry name, e.g. gemma3-270m "
                                    "(default: the registry's default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (medians are reported)")
    ap.add_argument("--segment", type=int, default=16,
                    help="decode tokens a backend runs before the next one takes its turn")
    ap.add_argument("--backends", default="onnxruntime,numpy,llama-bench",
                    help="comma-separated; 'onnxruntime:MODE' with a weight mode (exact, compact) "
                         "or a block size of 4-bit requantized weights (64, 128), "
                         "'onnxruntime:standard' for the standard graph, or "
                         "'onnxruntime:custom' for the GGUF-block kernels; "
                         "'onnxruntime@DIR' runs the tiny_mindie source tree in "
                         "DIR (e.g. an older commit unpacked with git archive) for an A/B")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="llama.cpp's llama-bench binary (the speed anchor; default $LLAMA_BENCH)")
    ap.add_argument("--llama-bin", metavar="DIR",
                    help="llama.cpp's binaries folder: llama-bench from there (unless "
                         "--llama-bench), and with --concurrency llama-server as the HTTP baseline")
    ap.add_argument("--llama-python", help="interpreter that can import llama_cpp")
    ap.add_argument("--json", metavar="FILE",
                    help="also write the results file here (scripts/results.py; with "
                         "--concurrency the sweep's beside it, FILE-loadtest.json)")
    ap.add_argument("--plot", metavar="FIG",
                    help="also draw the results into FIG (.svg or .png; scripts/plot.py, needs "
                         "matplotlib)")
    ap.add_argument("--concurrency", type=int, nargs="*", metavar="N",
                    help="also run the HTTP concurrency sweep of scripts/loadtest.py with these "
                         "numbers of streaming clients (default levels: 1 4 8 16)")
    ap.add_argument("--sampler", action="store_true",
                    help="instead: the batch sampler's share of a batch-8 decode step (Gemma 3 "
                         "270M unless --model, onnxruntime with the server's default threads; "
                         "--reps repetitions, at least 10)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="instead: TTFT with the prefix cache on and off (and llama-server with "
                         "--llama-bin): a second chat turn, 8 users sharing a system prompt")
    ap.add_argument("--speculation", action="store_true",
                    help="only: one stream's decode speed with speculative decoding on and off")
    ap.add_argument("--mask", action="store_true",
                    help="instead: the grammar masks' share of a batch-8 decode step (Gemma 3 "
                         "270M and SmolLM2-135M unless --model; --reps, at least 30)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.speculation:
        return speculation_table(args)
    if args.prefix_cache:
        return prefix_cache_table(args)

    if args.sampler:
        return sampler_table(args.model, max(30, args.reps))      # medians of 30: a noisy host
    if args.mask:
        return mask_table([args.model] if args.model else list(MASK_MODELS), max(30, args.reps))

    if args.child:
        p = json.loads(sys.stdin.readline())
        if args.child[0] == "llama.cpp":
            child_llama(p["model"], p["prompt"], p["threads"])
        elif args.child[0] == "llama-bench":
            child_llama_bench(p["llama_bench"], p["model"], p["prompt"], p["threads"])
        else:
            child_tiny(args.child[0], p["model"], p["prompt"], p["threads"], p.get("root", ROOT))
        return 0

    if args.llama_bin and not args.llama_bench:
        args.llama_bench = os.path.join(args.llama_bin, "llama-bench")
    sys.path.insert(0, ROOT)
    from results import can_draw, cpu_line, run_record

    from tiny_mindie.model.registry.catalog import DEFAULT_MODEL, resolve

    if args.plot:
        can_draw()
    record = run_record("bench")
    # a .gguf path or a registry name, pulled if missing
    model = resolve(args.model or DEFAULT_MODEL)
    prompt = prompt_ids(model, args.prompt_tokens)
    payload = {"model": model, "prompt": prompt, "threads": args.threads}
    print(cpu_line())
    print(f"model {model} ({os.path.getsize(model) / 1e6:.1f} MB), prompt {len(prompt)} tokens, "
          f"{args.gen_tokens} decode tokens, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"{args.reps} interleaved repetitions (segments of {args.segment} decode tokens), "
          f"load average {os.getloadavg()[0]:.2f}")

    children: list[Child] = []
    try:
        for name in args.backends.split(","):
            kind, _, mode = name.partition("@")[0].partition(":")
            if mode and (kind != "onnxruntime" or not (
                    mode in ("exact", "compact", "standard", "custom") or mode.isdigit())):
                raise SystemExit(f"--backends: {name!r}: only onnxruntime takes ':MODE' (exact, "
                                 f"compact, a block size, standard: the standard graph, or "
                                 f"custom: the GGUF-block kernels)")
            if name == "llama.cpp":
                python = find_llama_python(args.llama_python)
                if python is None:
                    print("llama.cpp: llama-cpp-python not importable (give --llama-python); "
                          "skipped")
                    continue
                children.append(Child(python, name, payload))
            elif name == "llama-bench":
                if not args.llama_bench:
                    print("llama-bench: no binary (give --llama-bench or $LLAMA_BENCH; how to "
                          "build it: see this script's docstring); skipped")
                    continue
                if not (os.path.isfile(args.llama_bench) and os.access(args.llama_bench, os.X_OK)):
                    print(f"llama-bench: {args.llama_bench} is not an executable file; skipped")
                    continue
                try:
                    children.append(Child(sys.executable, name, dict(
                        payload, llama_bench=os.path.abspath(args.llama_bench))))
                except RuntimeError as exc:     # the child said why on its last line
                    print(f"llama-bench: skipped: {str(exc).strip().splitlines()[-1]}")
            else:
                children.append(Child(sys.executable, name, payload))
        t0 = time.perf_counter()
        runs = run_interleaved(children, len(prompt), args.gen_tokens, args.reps, args.segment)
        wall = time.perf_counter() - t0
        results = []
        for c in children:
            r = runs[c.name]
            dec_tps = [args.gen_tokens / s for s in r["decode_s"]]
            pre_tps = [len(prompt) / s for s in r["prefill_s"]]
            step_s = _median(r["decode_s"]) / args.gen_tokens
            res = dict(c.info)
            res.update(c.finish(step_s=step_s))
            res["backend"] = c.name
            res.update(prefill_tps=len(prompt) / _median(r["prefill_s"]),
                       ttft_ms=_median(r["prefill_s"]) * 1e3,
                       decode_tps=args.gen_tokens / _median(r["decode_s"]),
                       decode_tps_all=dec_tps, prefill_tps_all=pre_tps, tokens=r["tokens"][:16])
            results.append(res)
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()

    ref = next((r for r in results if r["backend"] == "llama-bench"),
               next((r for r in results if r["backend"] == "llama.cpp"), None))
    size_mb = os.path.getsize(model) / 1e6
    print(f"(interleaved run took {wall:.0f} s, load average now {os.getloadavg()[0]:.2f})\n")
    w = max(12, *(len(r["backend"]) for r in results))
    print(f"{'backend':<{w}} {'prefill tok/s':>13} {'decode tok/s':>12} {'TTFT ms':>8} "
          f"{'load s':>7} {'RSS load MB':>11} {'RSS peak MB':>11} {'prefill/llama':>13} "
          f"{'decode/llama':>12}")
    if ref is not None:
        print(f"(ratios to {ref['backend']}; llama-bench's RSS is its peak, load included)")
    for r in results:
        pr = f"{r['prefill_tps'] / ref['prefill_tps']:.2f}" if ref else "-"
        dr = f"{r['decode_tps'] / ref['decode_tps']:.2f}" if ref else "-"
        print(f"{r['backend']:<{w}} {r['prefill_tps']:>13.1f} {r['decode_tps']:>12.1f} "
              f"{r['ttft_ms']:>8.1f} {r['load_s']:>7.2f} {r['rss_loaded_mb']:>11.1f} "
              f"{r['rss_peak_mb']:>11.1f} {pr:>13} {dr:>12}")
    if ref is None:
        print("(no llama.cpp in this run, so no ratios: add llama-bench to --backends and give "
              "--llama-bench)")
    else:
        print(f"\nsame-repetition ratios to {ref['backend']} (each repetition's backends ran "
              "interleaved):")
        for r in results:
            if r is ref:
                continue
            d = [a / b for a, b in zip(r["decode_tps_all"], ref["decode_tps_all"], strict=True)]
            p = [a / b for a, b in zip(r["prefill_tps_all"], ref["prefill_tps_all"], strict=True)]
            print(f"  {r['backend']:<{w}} decode {' '.join(f'{x:.2f}' for x in d)}  (median "
                  f"{_median(d):.2f}, min {min(d):.2f});  prefill "
                  f"{' '.join(f'{x:.2f}' for x in p)} (median {_median(p):.2f}, min {min(p):.2f})")
    for r in results:
        if r["backend"].startswith("onnxruntime"):
            print(f"\n{r['backend']}: device {r['device']}, {r['threads']} threads, "
                  f"graph {r['graph']} ({r['graph_s']:.2f} s, includes the GGUF sha256), "
                  f"session {r['session_s']:.2f} s ({r.get('huge_mb', 0):.0f} MB moved to huge "
                  f"pages), GGUF open {r['open_s']:.2f} s")
            own = r["rss_loaded_mb"] - r["rss_open_mb"]
            print(f"RSS: interpreter + libraries {r['rss_base_mb']:.0f} MB, + GGUFFile "
                  f"(metadata parsed by the gguf reader) "
                  f"{r['rss_open_mb'] - r['rss_base_mb']:.0f} MB, + this backend {own:.0f} MB = "
                  f"{own / size_mb:.2f}x the GGUF; total "
                  f"{r['rss_loaded_mb']:.0f} MB = {r['rss_loaded_mb'] / size_mb:.2f}x")
            if "rss_own_mb" in r:
                print(f"RSS after the run: {r['rss_own_mb']:.0f} MB of its own + "
                      f"{r['rss_file_mb']:.0f} MB of mapped file pages, of them "
                      f"{r['rss_gguf_mb']:.0f} MB of the GGUF's read in place (shared with other "
                      f"processes mapping it, reclaimable)")
            if "sampler_greedy_ms" in r:
                print(f"sampler per decode step: greedy {r['sampler_greedy_ms']:.3f} ms "
                      f"({100 * r['sampler_greedy_share']:.1f} % of a step), sampled "
                      f"{r['sampler_sampled_ms']:.3f} ms "
                      f"({100 * r['sampler_sampled_share']:.1f} %)")
        if r["backend"] == "llama.cpp":
            print(f"llama.cpp: llama-cpp-python {r['version']}")
        if r["backend"] == "llama-bench":
            print(f"llama-bench: llama.cpp {r['version']}, CPU {r['cpu']}")
    wall_table(results, model, args.threads)
    # llama-bench gives no tokens; other weights (onnxruntime:compact) may answer otherwise
    greedy = [r for r in results if r["tokens"]]
    same = {tuple(r["tokens"][:8]) for r in greedy}
    print("decode tok/s of each repetition: " + ", ".join(
        f"{r['backend']} {' '.join(f'{x:.1f}' for x in r['decode_tps_all'])}" for r in results))
    if len(greedy) > 1:
        print(f"first greedy tokens agree across backends: {len(same) == 1} "
              + " ".join(f"{r['backend']}={r['tokens'][:8]}" for r in greedy))
    save(args, record, results, model=os.path.basename(model), prompt_tokens=len(prompt),
         gen_tokens=args.gen_tokens, reps=args.reps, segment=args.segment, threads=args.threads,
         seconds=wall)
    if args.concurrency is not None:
        print("\nconcurrency sweep over HTTP(S) (scripts/loadtest.py):", flush=True)
        cmd = [sys.executable, os.path.join(HERE, "loadtest.py")]
        if args.concurrency:
            cmd += ["--levels", *map(str, args.concurrency)]
        if args.llama_bin:
            cmd += ["--llama-server", args.llama_bin, "--model", model]
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                stem, ext = os.path.splitext(path)
                cmd += [flag, f"{stem}-loadtest{ext}"]
        subprocess.run(cmd, check=True)
    return 0


def save(args, record: dict, results: list[dict], **fields) -> None:
    """Write the results file (``--json``) and its figure (``--plot``) this run asks for."""
    import tempfile

    from results import draw, write

    if not (args.json or args.plot):
        return
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        path = args.json or os.path.join(tmp, "results.json")
        write(path, record, results, **fields)
        if args.plot:
            draw(path, args.plot)


if __name__ == "__main__":
    sys.exit(main())
