"""Cross-check tiny_mindie against llama.cpp on the tiny random GGUFs of
tests/model/test_architectures.py: greedy tokens for 16 steps and the top-5 log-probabilities.

For each case of ``test_architectures.CASES`` (plus Phi-3 and Llama without their sliding window,
see :func:`variants`) this writes the file (``write_tiny``, its own 300-token byte-level
vocabulary, which llama.cpp loads), starts ``llama-server -m F --port P -t 2 -c 128``, posts
``/completion`` with the prompt as token ids (``n_predict`` 16, ``temperature`` 0, ``n_probs`` 5,
``ignore_eos``, ``return_tokens``), and loads tiny_mindie's ``LLM`` in-process with each backend
(numpy reference, onnxruntime) to run the same ids through its backend, end-of-generation tokens
masked as llama.cpp's ``ignore_eos`` masks them. It prints, per case and backend, whether the 16
greedy tokens agree or the first step where they part with our top-1/top-2 margin there, and,
teacher-forced on llama.cpp's tokens, the largest difference of the log-probabilities of
llama.cpp's top 5 at any step.

``--f32`` writes F32 matrices: llama.cpp then computes in F32 (KV cache F16) and the numpy
backend should match it to ~1e-2 log-prob; with the default Q8_0 matrices llama.cpp quantizes
activations to 8 bits (as onnxruntime's default graph does), ~0.1-0.3 log-prob of noise.

Usage::

    python scripts/crosscheck_llamacpp.py /path/to/llama.cpp/build/bin [--f32] [--cases a,b]

Not part of the test suite: it needs llama.cpp's binaries. Exit status 1 when any run parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(REPO, "tests", "model"), os.path.join(REPO, "tests", "support"), REPO]

from test_architectures import CASES, PROMPTS, write_tiny  # noqa: E402

from tiny_mindie.llm import LLM  # noqa: E402
from tiny_mindie.model.backend import SeqChunk  # noqa: E402

STEPS, N_PROBS = 16, 5


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def llama_server_run(bin_dir: str, model: str, port: int, prompt: list[int]) -> tuple[list, list]:
    """llama-server's greedy tokens on ``model`` and, per token, its top-5 ``{id: logprob}``
    (``None`` for a token that ends inside a UTF-8 character: the server reports probabilities
    per emitted piece)."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([os.path.join(bin_dir, "llama-server"), "-m", model, "--port",
                             str(port), "-t", "2", "-c", "128", "-np", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"llama-server did not start:\n{log.read()[-3000:]}")
            time.sleep(0.3)
        out = _post(port, "/completion", {"prompt": prompt, "n_predict": STEPS,
                                          "temperature": 0, "n_probs": N_PROBS,
                                          "ignore_eos": True, "cache_prompt": False,
                                          "return_tokens": True})
        probs, tokens, tops, k = out["completion_probabilities"], list(out["tokens"]), [], 0
        for t in tokens:
            if k < len(probs) and probs[k]["id"] == t:
                tops.append({p["id"]: p["logprob"] for p in probs[k]["top_logprobs"]})
                k += 1
            else:
                tops.append(None)
        return tokens, tops
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        os.unlink(log.name)


def run(llm: LLM, prompt: list[int], forced: list[int] | None = None) -> tuple[list, list]:
    """``STEPS`` tokens of ``llm``'s backend after ``prompt`` -- greedy, or ``forced`` (teacher
    forcing) -- with each step's log-probabilities ``[vocab]``; end-of-generation tokens are
    masked as llama.cpp's ``ignore_eos`` does (a -inf logit bias)."""
    be, mask = llm.backend, sorted(llm.tokenizer.eog_ids)
    logits = be.forward([SeqChunk(0, 0, np.array(prompt, np.int64))])[0]
    tokens, lps = [], []
    for pos in range(STEPS):
        z = np.array(logits, np.float64)
        lps.append(z - z.max() - np.log(np.exp(z - z.max()).sum()))   # as llama.cpp's n_probs:
        z[mask] = -np.inf                                              # before the bias
        tokens.append(int(np.argmax(z)) if forced is None else forced[pos])
        logits = be.forward([SeqChunk(0, len(prompt) + pos, np.array(tokens[-1:], np.int64))])[0]
    return tokens, lps


def variants() -> dict:
    """The cases, Phi-3's with hidden = heads x head_dim (llama.cpp's Phi-3 tensor shapes), and
    without its sliding window too (llama.cpp disables Phi-3's SWA)."""
    out = dict(CASES)
    phi = dataclasses.replace(CASES["phi3-longrope"], hidden=128)
    out["phi3-longrope"] = phi
    out["phi3-longrope-nowindow"] = dataclasses.replace(phi, window=0)
    out["llama-linear-nowindow"] = dataclasses.replace(CASES["llama-linear-swa"], window=0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bin_dir", help="llama.cpp's build/bin folder (with llama-server)")
    cases = variants()
    ap.add_argument("--cases", default=",".join(cases), help="comma-separated case names")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--f32", action="store_true",
                    help="F32 matrices instead of Q8_0 (llama.cpp then keeps activations in F32)")
    args = ap.parse_args()
    prompt = [int(i) for i in PROMPTS[0]]
    work = tempfile.mkdtemp(prefix="crosscheck-")
    ok = True
    for name in args.cases.split(","):
        path = os.path.join(work, f"tiny-{name}.gguf")
        write_tiny(path, cases[name], f32=args.f32)
        cpp_tok, cpp_top = llama_server_run(args.bin_dir, path, args.port, prompt)
        for backend in ("numpy", "onnxruntime"):
            llm = LLM(path, backend=backend, max_seq_len=128, max_input_len=64, num_slots=1,
                      threads=2, log=None)
            try:
                ours, lps = run(llm, prompt)
                _, forced = run(llm, prompt, cpp_tok)
            finally:
                llm.close()
            split = next((i for i, (a, b) in enumerate(zip(ours, cpp_tok, strict=True))
                          if a != b), None)
            # teacher-forced on llama.cpp's tokens: our log-probabilities of its top 5, each step
            diffs = [max(abs(lp[i] - v) for i, v in top.items())
                     for lp, top in zip(forced, cpp_top, strict=True) if top is not None]
            worst = max(diffs)
            if split is None:
                verdict = "agree"
            else:
                srt = np.sort(lps[split])
                verdict = (f"diverge at step {split} (our top-1/top-2 log-prob margin "
                           f"{srt[-1] - srt[-2]:.3f} after masking)")
                ok = False
            print(f"{name:23s} {backend:11s} {verdict}; top-5 log-probs on llama.cpp's tokens: "
                  f"max |diff| {worst:.3f} (step {diffs.index(worst)}), first step "
                  f"{diffs[0]:.3f}", flush=True)
            if split is not None:
                print(f"    ours      {ours}\n    llama.cpp {cpp_tok}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
