#!/usr/bin/env python
"""Start-up time of the ONNX Runtime backend: cold (graph built) and warm (graph cached).

Each start runs in its own child process, the way the server loads a model (``load_model``
with the server's defaults: the tokenizer is read while the backend loads), against a graph
cache in a scratch directory: the first start builds the graph (cold), the next ones find it
(warm). ``load_model`` is the whole start-up; graph, session and batch check its backend's
steps; total adds the imports; cpu is the CPU time the start used (user + system, all threads:
less sensitive to other work on the machine than the wall-clock times). The GGUF's pages stay
in the OS page cache between starts (a first start after a reboot also reads the file from
disk). Prints one line per start with each step's seconds.

    python scripts/startup.py ~/.cache/tiny_mindie/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/startup.py MODEL.gguf --warm 3 --profile      # cProfile of the cold start
    python scripts/startup.py MODEL.gguf --json startup.json --plot startup.svg

``--json FILE`` writes the starts as a results file (kind ``startup``, with the record every
results file carries: scripts/results.py): one row per start, ``start`` (``cold``, ``warm 1``,
...), ``built`` and its ``steps`` in seconds. ``--plot FIG`` draws it (scripts/plot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(path: str, cache_dir: str, profile: str | None) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    t0 = time.perf_counter()
    import logging
    logging.basicConfig(level=logging.INFO, format="      log: %(message)s")
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.options import BackendOptions

    steps = {"import": time.perf_counter() - t0}
    # the graph cache sits next to the GGUF: a link to it in the scratch directory
    link = os.path.join(cache_dir, os.path.basename(path))
    if not os.path.exists(link):
        os.symlink(os.path.abspath(path), link)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    _, _, _, be = load_model(link, BackendOptions(), max_seq_len=2560, kv_cache_mb=1024,
                             max_batch=200)     # the server's defaults
    steps["load_model"] = time.perf_counter() - t
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    steps.update(be.load_seconds)
    steps["total"] = time.perf_counter() - t0
    getattr(be, "huge_page_bytes", 0)             # the move to huge pages may run on: its end
    import resource
    use = resource.getrusage(resource.RUSAGE_SELF)
    steps["cpu"] = use.ru_utime + use.ru_stime     # CPU seconds of the whole start, all threads
    print(json.dumps({"built": be.built, "steps": steps}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--cache-dir", help="graph cache (default: a new scratch directory: cold)")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the cold start's backend load")
    ap.add_argument("--log", action="store_true", help="print each start's log lines")
    ap.add_argument("--json", metavar="FILE", help="write the results file (scripts/results.py)")
    ap.add_argument("--plot", metavar="FIG",
                    help="draw the results into FIG (.svg or .png; needs matplotlib)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.cache_dir, args.profile)
        return
    from results import can_draw, draw, run_record, write

    if args.plot:
        can_draw()
    record = run_record("startup")
    rows = []
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        cache = args.cache_dir or tmp
        print(f"{os.path.basename(args.model)} ({os.path.getsize(args.model) / 1e6:.0f} MB), "
              f"graph cache {cache}")
        for i in range(1 + args.warm):
            cmd = [sys.executable, __file__, args.model, "--child", "--cache-dir", cache]
            if i == 0 and args.profile:
                cmd += ["--profile", args.profile]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"start {i} failed:\n{proc.stderr}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            kind = "cold" if r["built"] else "warm"
            steps = "  ".join(f"{k} {v:.2f}" for k, v in r["steps"].items())
            print(f"  {kind}: {steps}")
            if args.log:
                print(proc.stderr.rstrip())
            rows.append({"start": "cold" if i == 0 else f"warm {i}", **r})
        if args.json or args.plot:
            path = args.json or os.path.join(tmp, "results.json")
            write(path, record, rows, model=os.path.basename(args.model),
                  model_bytes=os.path.getsize(args.model), graph_cache_given=bool(args.cache_dir))
            if args.plot:
                draw(path, args.plot)


if __name__ == "__main__":
    main()
