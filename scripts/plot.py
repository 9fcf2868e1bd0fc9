#!/usr/bin/env python3
"""Draw a results file of scripts/bench.py, loadtest.py, startup.py, kernelbench.py or quality.py,
or print it as Markdown (the run's date, CPU, versions and command, then its table).

    python scripts/plot.py docs/design/results/bench-qwen2.5-coder-1.5b.json  # -> .svg beside it
    python scripts/plot.py RESULTS.json -o FIG.png
    python scripts/plot.py RESULTS.json --markdown    # what docs/design/performance.md shows

What each kind draws (the kind is the file's ``kind``; files without one are told apart by
their rows):

    bench       decode and prefill tok/s per backend against llama.cpp (llama-bench) in the
                same interleaved run: ratio bars (median) with each repetition's ratio as a
                dot, and the tok/s themselves
    quality     KL divergence from the numpy reference (log scale) and top-1 agreement per
                engine and text
    loadtest    aggregate tok/s, TTFT and TPOT against the number of concurrent streams
    loadtest-vs-llama-server   both servers' tok/s per turn against the number of streams,
                and the per-turn ratio
    startup     each start's steps, in seconds
    draft-vs-llama-server   one stream's tok/s per prompt and mode for each server (with and
                without a draft model), and the draft's acceptance
    embed-vs-llama-server   embeddings/s of both servers against the number of concurrent
                clients, per text length, and the per-turn ratio
    kernelbench the custom kernels' time at M rows over their time at one row, per type and
                shape, with whole decode steps of M sequences where the run has them; and
                their time over MatMulNBits's at the same M

Every figure carries the run's date, CPU, versions and command beneath it. SVGs are written
reproducibly (no timestamp, fixed ids), so a figure changes only when its results do. Needs
matplotlib (``pip install '.[bench]'``); ``--markdown`` does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

KINDS = ("bench", "quality", "loadtest", "loadtest-vs-llama-server", "startup",
         "draft-vs-llama-server", "embed-vs-llama-server", "kernelbench")


# ---- reading a results file --------------------------------------------------------------------

def load(source: str | dict) -> dict:
    """A results file (path) or its parsed content, with ``kind`` set (see the module doc);
    ValueError for a file no kind fits."""
    if isinstance(source, dict):
        data = dict(source)
    else:
        with open(source) as fh:
            data = json.load(fh)
    if "kind" not in data:
        rows = data.get("results") or [{}]
        data["kind"] = ("bench" if "decode_tps" in rows[0] else
                        "quality" if "kl_mean" in rows[0] else None)
    if data["kind"] not in KINDS:
        raise ValueError(f"not a results file of a known kind: {data.get('kind')!r}")
    return data


def versions(data: dict) -> dict:
    """The run's versions (files that name only onnxruntime's: that one)."""
    found = data.get("versions") or {"onnxruntime": data.get("onnxruntime")}
    return {k: v for k, v in found.items() if v}


def command(data: dict) -> str:
    """The run's command line, its interpreter's path shortened to ``python``."""
    words = shlex.split(data.get("command", ""))
    if words and os.path.basename(words[0]).startswith("python"):
        words[0] = "python"
    return shlex.join(words)


def cpu_short(cpu: str) -> str:
    """``AMD EPYC, 2 CPUs, flags: avx ... avx512_vnni ...`` as ``AMD EPYC, 2 CPUs, AVX-512
    VNNI`` (the widest SIMD the flags name)."""
    head, _, flags = cpu.partition(", flags:")
    flags = set(flags.split())
    for flag, name in (("amx_tile", "AMX"), ("avx512_vnni", "AVX-512 VNNI"),
                       ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return f"{head}, {name}"
    return head


def load_average(data: dict) -> str | None:
    """The 1-minute load average at the run's start and end (``start -> end``), or at its end
    only; ``None`` where the file has none."""
    la = data.get("load_average")
    if isinstance(la, dict):
        return " -> ".join(f"{la[k]:.2f}" for k in ("start", "end") if k in la)
    return f"{la:.2f}" if isinstance(la, int | float) else None


def cpu(data: dict) -> str:
    """The CPU line, with the CPUs and threads a file names beside it."""
    named = {"cpus": "CPUs", "threads": "threads"}
    extra = [f"{data[k]} {named[k]}" for k in named
             if data.get(k) is not None and f"{data[k]} CPUs" not in data.get("cpu", "")]
    return data.get("cpu", "?") + (f" ({', '.join(extra)})" if extra else "")


def caption(data: dict) -> str:
    """Two lines under a figure: date, CPU, versions (, load average); the command."""
    parts = [data.get("date", "?"), cpu_short(cpu(data)),
             ", ".join(f"{k} {x}" for k, x in versions(data).items())]
    if load_average(data):
        parts.append(f"load average {load_average(data)}")
    return " | ".join(parts) + "\n" + command(data)


def engine_label(name: str) -> str:
    """``llama.cpp:/dir/model.Q4_0.gguf`` as ``llama.cpp Q4_0``, ``llama.cpp`` (the model's
    own GGUF) as ``llama.cpp (same GGUF)``; other names as they are."""
    kind, _, path = name.partition(":")
    if name == "llama.cpp":
        return "llama.cpp (same GGUF)"
    if kind == "llama.cpp" and path.endswith(".gguf"):
        return f"llama.cpp {os.path.basename(path)[:-5].rsplit('.', 1)[-1]}"
    return name


def bench_reference(data: dict) -> dict | None:
    """The row the bench's ratios are to: llama-bench, else llama.cpp, else none."""
    rows = data["results"]
    return next((r for r in rows if r["backend"] == "llama-bench"),
                next((r for r in rows if r["backend"] == "llama.cpp"), None))


def bench_ratios(row: dict, ref: dict, what: str) -> list[float]:
    """Same-repetition ratios of ``row`` to ``ref`` of ``what`` (``decode`` or ``prefill``)."""
    key = f"{what}_tps_all"
    return [a / b for a, b in zip(row[key], ref[key], strict=True)]


# ---- Markdown ----------------------------------------------------------------------------------

def markdown(source: str | dict) -> str:
    """The run (date, CPU, versions, load average, command) and its table, as Markdown."""
    data = load(source)
    v = ", ".join(f"{k} {x}" for k, x in versions(data).items())
    head = [f"- date: {data.get('date', '?')}", f"- CPU: {cpu(data)}", f"- versions: {v}",
            f"- load average (1 min): {load_average(data) or 'not recorded'}",
            f"- command: `{command(data)}`", ""]
    rows = TABLES[data["kind"]](data)
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(head + table) + "\n"


def _bench_table(data: dict) -> list[list[str]]:
    ref = bench_reference(data)
    name = ref["backend"] if ref else "llama.cpp"
    out = [["backend", "decode tok/s", "prefill tok/s", "TTFT ms",
            f"decode vs {name} (range)", f"prefill vs {name} (range)",
            "weight MB read per token", "RSS after load MB"]]
    for r in data["results"]:
        ratios = []
        for what in ("decode", "prefill"):
            if ref is None:
                ratios.append("-")
                continue
            x = bench_ratios(r, ref, what)
            ratios.append("1" if r is ref else
                          f"{statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f})")
        wb = r.get("weight_bytes")
        out.append([r["backend"], f"{r['decode_tps']:.1f}", f"{r['prefill_tps']:.1f}",
                    f"{r['ttft_ms']:.0f}", *ratios, f"{wb / 1e6:,.0f}" if wb else "-",
                    f"{r['rss_loaded_mb']:,.0f}"])
    return out


def _quality_table(data: dict) -> list[list[str]]:
    out = [["engine", "text", "NLL", "NLL ratio", "KL mean", "KL p99", "top-1"]]
    for r in data["results"]:
        out.append([engine_label(r["engine"]), r["text"], f"{r['nll']:.3f}",
                    f"{r['nll_ratio']:.3f}", f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.3f}",
                    f"{100 * r['top1']:.1f} %"])
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _loadtest_table(data: dict) -> list[list[str]]:
    out = [["streams", "requests", "tok/s", "vs 1 stream", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p99 ms"]]
    base = data["results"][0]["tok_s"]
    for r in data["results"]:
        out.append([str(r["n"]), str(r["requests"]), f"{r['tok_s']:.1f}",
                    f"{r['tok_s'] / base:.2f}", _ms(r["ttft50"]), _ms(r["ttft99"]),
                    _ms(r["tpot50"]), _ms(r["tpot99"])])
    return out


def _versus_table(data: dict) -> list[list[str]]:
    out = [["streams", "tiny_mindie tok/s per turn", "llama-server tok/s per turn",
            "ratio per turn", "median ratio"]]
    for r in data["results"]:
        out.append([str(r["n"]), ", ".join(f"{x:.1f}" for x in r["tiny_mindie_tok_s"]),
                    ", ".join(f"{x:.1f}" for x in r["llama_server_tok_s"]),
                    ", ".join(f"{x:.2f}" for x in r["ratios"]),
                    f"{statistics.median(r['ratios']):.2f}"])
    return out


def _startup_table(data: dict) -> list[list[str]]:
    steps = list(dict.fromkeys(k for r in data["results"] for k in r["steps"]))
    out = [["start", *(f"{s} s" for s in steps)]]
    for r in data["results"]:
        out.append([r["start"], *(f"{r['steps'][s]:.2f}" if s in r["steps"] else "-"
                                  for s in steps)])
    return out


def _draft_rows(data: dict) -> tuple[list[str], list[str], dict]:
    """The servers and the ``prompt mode`` cases in run order, and each one's rows."""
    rows = data["results"]
    servers = list(dict.fromkeys(r["server"] for r in rows))
    cases = list(dict.fromkeys(f"{r['prompt']} {r['mode']}" for r in rows))
    by: dict = {}
    for r in rows:
        by.setdefault((r["server"], f"{r['prompt']} {r['mode']}"), []).append(r)
    return servers, cases, by


def _draft_table(data: dict) -> list[list[str]]:
    servers, cases, by = _draft_rows(data)
    plain = statistics.mean(r["tok_s"] for r in data["results"] if r["server"] == "llama-server")
    out = [["server", *(f"{c} tok/s" for c in cases), "mean tok/s", "vs llama-server",
            "draft tokens kept", "RSS MB"]]
    for s in servers:
        mine = [r for r in data["results"] if r["server"] == s]
        mean = statistics.mean(r["tok_s"] for r in mine)
        proposed = sum(r.get("proposed", 0) for r in mine)
        kept = (f"{sum(r.get('accepted', 0) for r in mine):.0f} / {proposed:.0f}"
                if proposed else "-")
        out.append([s, *(f"{statistics.mean(r['tok_s'] for r in by[s, c]):.1f}"
                         for c in cases), f"{mean:.1f}", f"{mean / plain:.2f}", kept,
                    f"{max(r['rss_mb'] for r in mine):,.0f}"])
    return out


def _embed_table(data: dict) -> list[list[str]]:
    med = statistics.median
    out = [["tokens", "clients", "tiny_mindie emb/s", "llama-server emb/s", "ratio (range)",
            "p50 ms tiny_mindie / llama-server", "texts per encoder run"]]
    for r in data["results"]:
        per_run = [x for x in r.get("tiny_mindie_texts_per_run") or [] if x is not None]
        out.append([f"{r['tokens']:.0f}", str(r["n"]), f"{med(r['tiny_mindie_emb_s']):.1f}",
                    f"{med(r['llama_server_emb_s']):.1f}",
                    f"{med(r['ratios']):.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})",
                    f"{med(r['tiny_mindie_p50_ms']):.1f} / {med(r['llama_server_p50_ms']):.1f}",
                    f"{med(per_run):.1f}" if per_run else "-"])
    return out


def _kernel_label(r: dict) -> str:
    return "decode step" if r["type"] == "step" else f"{r['type']} {r['N']}x{r['K']}"


def _threads(data: dict) -> str:
    n = data.get("threads", "?")
    return f"{n} thread" + ("" if n == 1 else "s")


def _kernel_table(data: dict) -> list[list[str]]:
    rows = data["results"]
    ms = sorted({r["M"] for r in rows})
    out = [["product", *(f"M={m}: ms (x M=1)" for m in ms)]]
    for label in dict.fromkeys(_kernel_label(r) for r in rows):
        by = {r["M"]: r for r in rows if _kernel_label(r) == label}
        out.append([label, *(f"{by[m]['op_ms']:.3f} ({by[m]['vs_m1']:.2f})"
                             if m in by and by[m]["vs_m1"] else "-" for m in ms)])
    return out


TABLES = {"bench": _bench_table, "quality": _quality_table, "loadtest": _loadtest_table,
          "loadtest-vs-llama-server": _versus_table, "startup": _startup_table,
          "draft-vs-llama-server": _draft_table, "embed-vs-llama-server": _embed_table,
          "kernelbench": _kernel_table}


# ---- figures -----------------------------------------------------------------------------------

def _bars(ax, labels: list[str], series: dict[str, list[float]],
          dots: dict[str, list[list[float]]] | None = None) -> None:
    """Grouped bars: one group per label, one bar per series; ``dots``: each bar's single
    measurements, drawn on it."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=name)
        for x, points in zip(xs, (dots or {}).get(name, []), strict=False):
            ax.plot([x] * len(points), points, "k.", markersize=3)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _draw_bench(fig, data: dict) -> None:
    rows, ref = data["results"], bench_reference(data)
    others = [r for r in rows if r is not ref]
    axes = fig.subplots(1, 2 if ref else 1, squeeze=False)[0]
    if ref:
        ax = axes[0]
        ratios = {w: [bench_ratios(r, ref, w) for r in others] for w in ("decode", "prefill")}
        _bars(ax, [r["backend"] for r in others],
              {w: [statistics.median(x) for x in ratios[w]] for w in ratios}, ratios)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_ylabel(f"tok/s relative to {ref['backend']} (same repetition)")
        ax.set_title(f"against {ref['backend']} (= 1)")
    ax = axes[-1]
    _bars(ax, [r["backend"] for r in rows],
          {w: [r[f"{w}_tps"] for r in rows] for w in ("decode", "prefill")},
          {w: [r[f"{w}_tps_all"] for r in rows] for w in ("decode", "prefill")})
    ax.set_ylabel("tok/s (median; dots: each repetition)")
    ax.set_title(data.get("model", ""))


def _draw_quality(fig, data: dict) -> None:
    rows = [r for r in data["results"] if r["kl_mean"] > 0]     # not the reference itself
    engines = list(dict.fromkeys(engine_label(r["engine"]) for r in rows))
    texts = list(dict.fromkeys(r["text"] for r in rows))

    def series(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {t: [scale * next(r[key] for r in rows if r["text"] == t
                                 and engine_label(r["engine"]) == e) for e in engines]
                for t in texts}

    ax_kl, ax_top = fig.subplots(1, 2)
    _bars(ax_kl, engines, series("kl_mean"))
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(reference || engine), mean over positions, nats")
    ax_kl.set_title("distance from the numpy reference (lower is closer)")
    _bars(ax_top, engines, series("top1", 100.0))
    ax_top.set_ylim(min(min(v) for v in series("top1", 100.0).values()) - 5, 100)
    ax_top.set_ylabel("% of positions where the top token is the reference's")
    ax_top.set_title("top-1 agreement")
    fig.suptitle(os.path.basename((data.get("model") or {}).get("path", "")))


def _draw_loadtest(fig, data: dict) -> None:
    rows = data["results"]
    n = [r["n"] for r in rows]
    ax_tps, ax_ms = fig.subplots(1, 2)
    ax_tps.plot(n, [r["tok_s"] for r in rows], "o-")
    ax_tps.set_ylim(bottom=0)
    ax_tps.set_ylabel("generated tok/s, all streams")
    ax_tps.set_title(f"throughput: {(data.get('server') or {}).get('model', '').split(' (')[0]}")
    for key, label in (("ttft50", "TTFT p50"), ("ttft99", "TTFT p99"),
                       ("tpot50", "TPOT p50"), ("tpot99", "TPOT p99")):
        pts = [(r["n"], r[key]) for r in rows if r[key] is not None]
        ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("ms")
    ax_ms.set_title("latency: first token (TTFT), per output token (TPOT)")
    ax_ms.legend(fontsize=8)
    _streams_axes((ax_tps, ax_ms), n)


def _draw_versus(fig, data: dict) -> None:
    rows = data["results"]
    n = [r["n"] for r in rows]
    ax_tps, ax_ratio = fig.subplots(1, 2)
    for key, label in (("tiny_mindie_tok_s", "tiny_mindie"), ("llama_server_tok_s",
                                                              "llama-server")):
        line, = ax_tps.plot(n, [statistics.median(r[key]) for r in rows], "-", label=label)
        for r in rows:
            ax_tps.plot([r["n"]] * len(r[key]), r[key], ".", color=line.get_color())
    ax_tps.set_ylabel("generated tok/s, all streams (line: median of turns)")
    ax_tps.legend(fontsize=8)
    ax_tps.set_title(data.get("model", ""))
    ax_ratio.plot(n, [statistics.median(r["ratios"]) for r in rows], "-")
    for r in rows:
        ax_ratio.plot([r["n"]] * len(r["ratios"]), r["ratios"], "k.")
    ax_ratio.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax_ratio.set_ylabel("tiny_mindie / llama-server, per turn")
    ax_ratio.set_title("ratio (above 1: tiny_mindie faster)")
    _streams_axes((ax_tps, ax_ratio), n)


def _streams_axes(axes, n: list[int]) -> None:
    """The x axis of a figure over numbers of concurrent streams ``n``."""
    for ax in axes:
        ax.set_xlabel("concurrent streams")
        ax.set_xticks(n)
        ax.grid(alpha=0.3)


def _draw_startup(fig, data: dict) -> None:
    rows = data["results"]
    steps = list(dict.fromkeys(k for r in rows for k in r["steps"]))
    ax = fig.subplots()
    _bars(ax, steps, {r["start"]: [r["steps"].get(s, 0.0) for s in steps] for r in rows})
    ax.set_ylabel("seconds")
    ax.set_title(f"start-up of {data.get('model', '')}")


def _draw_draft(fig, data: dict) -> None:
    servers, cases, by = _draft_rows(data)
    ax_tps, ax_kept = fig.subplots(1, 2, width_ratios=(3, 1))
    _bars(ax_tps, cases, {s: [statistics.mean(r["tok_s"] for r in by[s, c]) for c in cases]
                          for s in servers})
    ax_tps.set_ylabel("tok/s, one stream (wall time of the request)")
    ax_tps.set_title(f"{(data.get('settings') or {}).get('target', '')}, draft "
                     f"{(data.get('settings') or {}).get('draft', '')}")
    drafted = [s for s in servers if any(r.get("proposed") for r in data["results"]
                                         if r["server"] == s)]
    kept = [100 * sum(r.get("accepted", 0) for r in data["results"] if r["server"] == s)
            / sum(r.get("proposed", 0) for r in data["results"] if r["server"] == s)
            for s in drafted]
    ax_kept.barh(drafted, kept)
    ax_kept.set_xlim(0, 100)
    ax_kept.set_xlabel("% of drafted tokens kept")
    ax_kept.set_title("acceptance")


def _draw_embed(fig, data: dict) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = data["results"]
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    n = sorted({r["n"] for r in rows})
    ax_eps, ax_ratio = fig.subplots(1, 2)
    for length in lengths:
        mine = [r for r in rows if r["length"] == length]
        label = f"~{statistics.mean(r['tokens'] for r in mine):.0f} tokens"
        line, = ax_eps.plot([r["n"] for r in mine],
                            [statistics.median(r["tiny_mindie_emb_s"]) for r in mine], "o-",
                            label=f"tiny_mindie, {label}")
        ax_eps.plot([r["n"] for r in mine],
                    [statistics.median(r["llama_server_emb_s"]) for r in mine], "s--",
                    color=line.get_color(), label=f"llama-server, {label}")
        ax_ratio.plot([r["n"] for r in mine], [statistics.median(r["ratios"]) for r in mine],
                      "o-", color=line.get_color(), label=label)
        for r in mine:
            ax_ratio.plot([r["n"]] * len(r["ratios"]), r["ratios"], ".",
                          color=line.get_color())
    ax_eps.set_yscale("log")
    ax_eps.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_eps.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_eps.yaxis.set_minor_formatter(NullFormatter())
    ax_eps.set_ylabel("embeddings/s (median of turns)")
    ax_eps.set_title(data.get("model", ""))
    ax_eps.legend(fontsize=7)
    ax_ratio.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax_ratio.set_ylim(bottom=0)
    ax_ratio.set_ylabel("tiny_mindie / llama-server embeddings/s (dots: each turn)")
    ax_ratio.set_title("ratio (above 1: tiny_mindie faster)")
    ax_ratio.legend(fontsize=7)
    for ax in (ax_eps, ax_ratio):
        ax.set_xscale("log")
        ax.set_xticks(n, [str(x) for x in n])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrent clients, one text per request")
        ax.grid(alpha=0.3)


def _draw_kernels(fig, data: dict) -> None:
    rows = data["results"]
    ax_m1, ax_mlas = fig.subplots(1, 2)
    for label in dict.fromkeys(_kernel_label(r) for r in rows):
        mine = sorted((r for r in rows if _kernel_label(r) == label), key=lambda r: r["M"])
        step = label == "decode step"
        name = f"decode step of {data['model']}" if step and data.get("model") else label
        ax_m1.plot([r["M"] for r in mine], [r["vs_m1"] for r in mine], "k-o" if step else ".-",
                   label=name, linewidth=2.5 if step else 1)
        if not step:
            ax_mlas.plot([r["M"] for r in mine], [r["vs_mlas"] for r in mine], ".-",
                         label=label)
    ms = sorted({r["M"] for r in rows})
    ax_m1.plot(ms, ms, ":", color="grey", label="M times one row")
    ax_m1.set_title(f"time at M rows / time at one row ({data.get('isa', '')}, "
                    f"{_threads(data)})")
    ax_mlas.axhline(1.0, color="grey", linewidth=0.8)
    ax_mlas.set_title("custom operator / MatMulNBits at the same M (below 1: faster)")
    for ax in (ax_m1, ax_mlas):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("rows M")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


DRAW = {"bench": _draw_bench, "quality": _draw_quality, "loadtest": _draw_loadtest,
        "loadtest-vs-llama-server": _draw_versus, "startup": _draw_startup,
        "draft-vs-llama-server": _draw_draft, "embed-vs-llama-server": _draw_embed,
        "kernelbench": _draw_kernels}


def render(source: str | dict, out: str) -> None:
    """Draw the results file ``source`` (path or content) into ``out`` (``.svg``, ``.png``, or
    another format matplotlib knows by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load(source)
    with plt.rc_context({"svg.hashsalt": "tiny_mindie", "svg.fonttype": "none",
                         "font.size": 9}):
        fig = plt.figure(figsize=(11, 5.2), layout="constrained")
        DRAW[data["kind"]](fig, data)
        fig.text(0.0, -0.01, caption(data), fontsize=7, va="top", wrap=True)
        metadata = {"Date": None} if out.endswith(".svg") else {}
        fig.savefig(out, bbox_inches="tight", metadata=metadata)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a results file (JSON)")
    ap.add_argument("-o", "--output", help="the figure (default: the results file's name with "
                                           ".svg)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the run and its table as Markdown instead")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown(args.results))
        return 0
    out = args.output or os.path.splitext(args.results)[0] + ".svg"
    render(args.results, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
