"""The results files of scripts/bench.py and scripts/loadtest.py (scripts/results.py) and their
figures (scripts/plot.py): what a file records, that every kind draws, that
docs/design/performance.md shows each file in docs/design/results as scripts/plot.py prints it.
scripts/loadtest.py's own runs: tests/e2e/test_loadtest_script.py. No speed is asserted: the runs
here are a few tokens long."""

from __future__ import annotations

import json
import math
import os

import pytest
from results_files import RECORD_KEYS, is_figure
from script_modules import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")
RESULTS_DIR = os.path.join(REPO, "docs", "design", "results")
RESULT_FILES = sorted(f for f in os.listdir(RESULTS_DIR) if f.endswith(".json"))


def _script(name: str):
    """scripts/NAME.py as a module (scripts/ stays off sys.path)."""
    return load_script(name, f"{name}_script")


plot = _script("plot")
results = _script("results")


@pytest.mark.parametrize("name", RESULT_FILES)
def test_every_results_file_in_docs_draws(name, tmp_path):
    out = tmp_path / "fig.svg"
    assert plot.main([os.path.join(RESULTS_DIR, name), "-o", str(out)]) == 0
    assert is_figure(out)
    svg = out.read_text()
    with open(os.path.join(RESULTS_DIR, name), encoding="utf-8") as fh:
        cpu = json.load(fh)["cpu"]
    assert cpu and cpu.split(",")[0] in svg     # the run's CPU is printed under the figure
    plot.render(os.path.join(RESULTS_DIR, name), str(tmp_path / "again.svg"))
    assert (tmp_path / "again.svg").read_text() == svg      # no timestamp, fixed ids


def test_a_png_too(tmp_path):
    out = tmp_path / "fig.png"
    plot.render(os.path.join(RESULTS_DIR, RESULT_FILES[0]), str(out))
    assert is_figure(out)


def test_performance_doc_shows_each_results_file_as_plot_prints_it():
    with open(os.path.join(REPO, "docs", "design", "performance.md")) as fh:
        doc = fh.read()
    for name in RESULT_FILES:
        stem = os.path.splitext(name)[0]
        assert f"results/{name}" in doc, name
        assert f"results/{stem}.svg" in doc, name
        assert os.path.exists(os.path.join(RESULTS_DIR, stem + ".svg")), name
        assert plot.markdown(os.path.join(RESULTS_DIR, name)) in doc, name


def test_the_record_of_a_run(tmp_path):
    record = results.run_record("loadtest", ["scripts/loadtest.py", "--levels", "1", "a b"])
    assert record["command"] == "python scripts/loadtest.py --levels 1 'a b'"
    assert set(record["versions"]) == {"python", "numpy", "onnxruntime", "tiny_mindie"}
    assert all(record["versions"].values())
    assert "CPUs" in record["cpu"] and record["cpus"] >= 1
    rows = [{"n": 1, "tok_s": 1.0, "ttft50": 2.0, "ttft99": 2.0, "tpot50": math.nan,
             "tpot99": math.nan, "requests": 1}]
    path = tmp_path / "r.json"
    results.write(str(path), record, rows, new_tokens=1)
    data = json.loads(path.read_text())       # strict JSON: no NaN
    assert RECORD_KEYS <= set(data) and data["new_tokens"] == 1
    assert data["results"][0]["tpot50"] is None
    assert set(data["load_average"]) == {"start", "end"}
    plot.render(str(path), str(tmp_path / "r.svg"))        # a row without TPOT still draws
    assert is_figure(tmp_path / "r.svg")


def test_kinds_without_a_file_in_docs_draw(tmp_path):
    """The shapes loadtest.py --llama-server, startup.py and embedbench.py write (numbers made
    up)."""
    record = results.run_record("loadtest-vs-llama-server", ["scripts/loadtest.py"])
    versus = {**record, "model": "m.gguf", "results": [
        {"n": n, "tiny_mindie_tok_s": [1.0, 2.0], "llama_server_tok_s": [2.0, 2.0],
         "ratios": [0.5, 1.0]} for n in (1, 4)]}
    startup = {**results.run_record("startup", ["scripts/startup.py"]), "model": "m.gguf",
               "results": [{"start": "cold", "built": True, "steps": {"graph": 1.0, "total": 2.0}},
                           {"start": "warm 1", "built": False, "steps": {"total": 1.0}}]}
    embed = {**results.run_record("embed-vs-llama-server", ["scripts/embedbench.py"]),
             "model": "m.gguf", "results": [
                 {"length": 16, "tokens": 15.5, "n": n, "tiny_mindie_emb_s": [4.0, 6.0],
                  "llama_server_emb_s": [2.0, 3.0], "ratios": [2.0, 2.0],
                  "tiny_mindie_p50_ms": [9.0, 8.0], "llama_server_p50_ms": [9.0, 9.0],
                  "tiny_mindie_texts_per_run": [1.0, None]} for n in (1, 4)]}
    for i, data in enumerate((versus, startup, embed)):
        plot.render(data, str(tmp_path / f"{i}.svg"))
        assert is_figure(tmp_path / f"{i}.svg")
        assert "| 4 |" in plot.markdown(data) or "| warm 1 |" in plot.markdown(data)
    assert "| 16 | 4 | 5.0 | 2.5 | 2.00 (2.00-2.00) | 8.5 / 9.0 | 1.0 |" in plot.markdown(embed)


def test_a_file_of_no_known_kind_is_refused():
    with pytest.raises(ValueError):
        plot.load({"results": [{"x": 1}]})
