"""The results files of scripts/bench.py, loadtest.py, startup.py, draftbench.py, embedbench.py
and embedcheck.py: what every one records about its run, and writing it.

A results file is one JSON object::

    kind          "bench", "loadtest", "loadtest-vs-llama-server", "startup",
                  "draft-vs-llama-server" or "embed-vs-llama-server" (what scripts/plot.py
                  draws; scripts/quality.py's files carry no kind: "quality"), or
                  "embedcheck" (scripts/embedcheck.py's cosines, not drawn)
    date          when the run started, ISO 8601 in UTC
    cpu           CPU model, CPUs this process may use, SIMD flags (:func:`cpu_line`)
    cpus          CPUs this process may use
    machine       platform.machine()
    versions      python, numpy, onnxruntime, tiny_mindie (of the tree the script ran from)
    source        {"commit": the tree's git commit or null, "modified": uncommitted changes}
    command       the exact command line (shlex-quoted), and cwd, where it ran
    load_average  {"start": ..., "end": ...}: 1-minute load average at both ends of the run
    results       the script's own rows (its docstring describes them)

plus whatever settings the script adds (model, tokens, levels, ...).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_line() -> str:
    """The CPU model and its SIMD flags (from ``/proc/cpuinfo``), and how many CPUs we may use."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tiny_mindie.model.ort.providers import cpu_info

    model, flags = cpu_info()
    model = model or "unknown CPU"
    simd = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4", "vnni")))
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs, flags: {' '.join(simd) or '-'}"


def versions() -> dict:
    """Versions of python, numpy, onnxruntime and tiny_mindie (``None`` where not importable)."""
    out = {"python": platform.python_version()}
    for name in ("numpy", "onnxruntime", "tiny_mindie"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def source() -> dict:
    """The git commit of the tree these scripts are in, and whether it has uncommitted
    changes; ``{"commit": None, "modified": None}`` outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "modified": bool(status) if status is not None else None}


def run_record(kind: str, argv: list[str] | None = None) -> dict:
    """The record of a run of ``kind`` starting now (``argv``: the command line, default
    ``sys.argv``); :func:`write` completes it."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    argv = sys.argv if argv is None else argv
    return {"kind": kind,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu": cpu_line(), "cpus": len(os.sched_getaffinity(0)),
            "machine": platform.machine(), "versions": versions(), "source": source(),
            "command": shlex.join(["python", *argv]), "cwd": os.getcwd(),
            "load_average": {"start": os.getloadavg()[0]}}


def write(path: str, record: dict, results: list, **fields) -> dict:
    """Write ``record`` (of :func:`run_record`) with ``fields``, ``results`` and the load
    average now to ``path`` as JSON; returns what was written."""
    out = {**record, **fields, "results": results}
    out["load_average"] = {**record["load_average"], "end": os.getloadavg()[0]}
    with open(path, "w") as fh:
        json.dump(_no_nan(out), fh, indent=1, allow_nan=False)
        fh.write("\n")
    print(f"wrote {path}")
    return out


def _no_nan(value):
    """``value`` with every float NaN (a percentile of no samples) made ``None`` (JSON null)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def can_draw() -> None:
    """SystemExit (saying what to install) unless matplotlib, which :func:`draw` needs,
    imports: called before a run, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("drawing needs matplotlib: pip install '.[bench]'") from None


def draw(results_path: str, figure_path: str) -> None:
    """Draw the results file ``results_path`` into ``figure_path`` (``.svg`` or ``.png``) with
    scripts/plot.py (matplotlib: ``pip install '.[bench]'``)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import plot as plot_script

    plot_script.render(results_path, figure_path)
    print(f"wrote {figure_path}")
