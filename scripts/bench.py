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

llama.cpp runs through ``llama-cpp-python`` when it can be imported, either here or in the
interpreter given by ``--llama-python`` (or ``$LLAMA_CPP_PYTHON``); it is a benchmark-only
dependency that compiles from source, best kept in its own virtualenv. The same number of
threads is given to every backend.

The sampler's share of a decode step is measured on the onnxruntime backend's logits: greedy
and a typical sampled configuration (temperature 0.7, top-k 50, top-p 0.9, repetition penalty
1.1), each as a percentage of one batch-1 decode step.

    python scripts/bench.py                     # default model from the registry
    python scripts/bench.py --model x.gguf --threads 2 --llama-python /work/benchvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
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
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- children ----------------------------------------------------------------------------------

def _measure(prefill, decode, prompt: list[int], gen: int, reps: int) -> dict:
    """Warm up, then ``reps`` times: one prompt forward and ``gen`` greedy decode steps.

    Each metric is the median over the repetitions (the machine may be shared)."""
    import numpy as np

    prefill(prompt[:8], warm=True)
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits = prefill(prompt, warm=False)
        tok = int(np.argmax(logits))
        t1 = time.perf_counter()
        tokens = [tok]
        for i in range(gen):
            logits = decode(tok, len(prompt) + i)
            tok = int(np.argmax(logits))
            tokens.append(tok)
        t2 = time.perf_counter()
        runs.append((t1 - t0, t2 - t1))
    ttft = float(np.median([r[0] for r in runs]))
    dec = float(np.median([r[1] for r in runs]))
    return {"prefill_tps": len(prompt) / ttft, "ttft_ms": ttft * 1e3, "decode_tps": gen / dec,
            "decode_tps_all": [gen / r[1] for r in runs], "tokens": tokens[:16],
            "last_logits": logits}


def child_tiny(backend: str, model: str, prompt: list[int], gen: int, threads: int,
               reps: int) -> dict:
    sys.path.insert(0, ROOT)
    import numpy as np

    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.config import ModelConfig
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
        from tiny_mindie.model.ort_backend import OrtBackend
        be = OrtBackend(f, cfg, num_slots=4, max_seq_len=1024, threads=threads)
        extra = {"graph": "built" if be.built else "cached", "device": be.device,
                 "graph_s": be.load_seconds["graph"], "session_s": be.load_seconds["session"]}
    else:
        from tiny_mindie.model.reference import NumpyBackend
        be = NumpyBackend(f, cfg, num_slots=4, max_seq_len=1024)
    load_s = time.perf_counter() - t0
    rss_loaded = rss_mb()

    def prefill(ids, warm):
        return be.forward([SeqChunk(1 if warm else 0, 0, np.array(ids, np.int64))])[0]

    def decode(tok, pos):
        return be.forward([SeqChunk(0, pos, np.array([tok], np.int64))])[0]

    res = _measure(prefill, decode, prompt, gen, reps)
    if backend == "onnxruntime":
        res.update(_sampler_share(res["last_logits"], 1.0 / res["decode_tps"], prompt))
    del res["last_logits"]
    res.update(extra, backend=backend, load_s=load_s, open_s=t_open, rss_base_mb=base,
               rss_open_mb=rss_open, rss_loaded_mb=rss_loaded, rss_peak_mb=peak_rss_mb())
    return res


def _sampler_share(logits, step_s: float, prompt: list[int]) -> dict:
    import numpy as np

    try:
        from tiny_mindie.engine.request import SamplingParams
        from tiny_mindie.engine.sampler import make_rng, sample
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


def child_llama(model: str, prompt: list[int], gen: int, threads: int, reps: int) -> dict:
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

    res = _measure(prefill, decode, prompt, gen, reps)
    del res["last_logits"]
    res.update(backend="llama.cpp", load_s=load_s, rss_base_mb=base, rss_loaded_mb=rss_loaded,
               rss_peak_mb=peak_rss_mb(), version=getattr(sys.modules["llama_cpp"], "__version__", "?"),
               system_info=llama_cpp.llama_print_system_info().decode(errors="replace")[:200])
    return res


# ---- parent ------------------------------------------------------------------------------------

def prompt_ids(model: str, n: int) -> list[int]:
    sys.path.insert(0, ROOT)
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer import load_tokenizer

    tok = load_tokenizer(GGUFFile(model))
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT_TEXT, add_bos=False)
    return ids[:n]


def run_child(python: str, args: list[str], payload: dict) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(payload["threads"])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([python, os.path.abspath(__file__), "--child", *args],
                          input=json.dumps(payload), capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child {args} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def find_llama_python(given: str | None) -> str | None:
    for python in ([given] if given else []) + [os.environ.get("LLAMA_CPP_PYTHON"), sys.executable]:
        if not python:
            continue
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return python
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the registry's default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--backends", default="onnxruntime,numpy,llama.cpp")
    ap.add_argument("--llama-python", help="interpreter that can import llama_cpp")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        p = json.loads(sys.stdin.read())
        if args.child[0] == "llama.cpp":
            res = child_llama(p["model"], p["prompt"], p["gen"], p["threads"], p["reps"])
        else:
            res = child_tiny(args.child[0], p["model"], p["prompt"], p["gen"], p["threads"],
                             p["reps"])
        print(json.dumps(res))
        return 0

    model = args.model
    if not model:
        sys.path.insert(0, ROOT)
        from tiny_mindie.model.registry import DEFAULT_MODEL, ensure_model
        model = ensure_model(DEFAULT_MODEL)
    prompt = prompt_ids(model, args.prompt_tokens)
    payload = {"model": model, "prompt": prompt, "gen": args.gen_tokens, "threads": args.threads,
               "reps": args.reps}
    print(f"model {model} ({os.path.getsize(model) / 1e6:.1f} MB), prompt {len(prompt)} tokens, "
          f"{args.gen_tokens} decode tokens, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")

    results = []
    for name in args.backends.split(","):
        if name == "llama.cpp":
            python = find_llama_python(args.llama_python)
            if python is None:
                print("llama.cpp: llama-cpp-python not importable (give --llama-python); skipped")
                continue
            results.append(run_child(python, ["llama.cpp"], payload))
        else:
            results.append(run_child(sys.executable, [name], payload))
        r = results[-1]
        print(f"  {r['backend']}: done ({r['prefill_tps']:.0f} / {r['decode_tps']:.1f} tok/s)",
              flush=True)

    ref = next((r for r in results if r["backend"] == "llama.cpp"), None)
    size_mb = os.path.getsize(model) / 1e6
    print()
    print(f"{'backend':<12} {'prefill tok/s':>13} {'decode tok/s':>12} {'TTFT ms':>8} {'load s':>7} "
          f"{'RSS load MB':>11} {'RSS peak MB':>11} {'prefill/llama':>13} {'decode/llama':>12}")
    for r in results:
        pr = f"{r['prefill_tps'] / ref['prefill_tps']:.2f}" if ref else "-"
        dr = f"{r['decode_tps'] / ref['decode_tps']:.2f}" if ref else "-"
        print(f"{r['backend']:<12} {r['prefill_tps']:>13.1f} {r['decode_tps']:>12.1f} "
              f"{r['ttft_ms']:>8.1f} {r['load_s']:>7.2f} {r['rss_loaded_mb']:>11.1f} "
              f"{r['rss_peak_mb']:>11.1f} {pr:>13} {dr:>12}")
    for r in results:
        if r["backend"] == "onnxruntime":
            print(f"\nonnxruntime: device {r['device']}, graph {r['graph']} "
                  f"({r['graph_s']:.2f} s, includes the GGUF sha256), session {r['session_s']:.2f} s, "
                  f"GGUF open {r['open_s']:.2f} s")
            own = r["rss_loaded_mb"] - r["rss_open_mb"]
            print(f"RSS: interpreter + libraries {r['rss_base_mb']:.0f} MB, + GGUFFile (metadata "
                  f"parsed by the gguf reader) {r['rss_open_mb'] - r['rss_base_mb']:.0f} MB, + this "
                  f"backend {own:.0f} MB = {own / size_mb:.2f}x the GGUF; total "
                  f"{r['rss_loaded_mb']:.0f} MB = {r['rss_loaded_mb'] / size_mb:.2f}x")
            if "sampler_greedy_ms" in r:
                print(f"sampler per decode step: greedy {r['sampler_greedy_ms']:.3f} ms "
                      f"({100 * r['sampler_greedy_share']:.1f} % of a step), sampled "
                      f"{r['sampler_sampled_ms']:.3f} ms ({100 * r['sampler_sampled_share']:.1f} %)")
        if r["backend"] == "llama.cpp":
            print(f"llama.cpp: llama-cpp-python {r['version']}")
    same = {tuple(r["tokens"][:8]) for r in results}
    print("decode tok/s of each repetition: " + ", ".join(
        f"{r['backend']} {' '.join(f'{x:.1f}' for x in r['decode_tps_all'])}" for r in results))
    print(f"first greedy tokens agree across backends: {len(same) == 1} "
          + " ".join(f"{r['backend']}={r['tokens'][:8]}" for r in results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
