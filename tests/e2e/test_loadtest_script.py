"""scripts/loadtest.py against a real server it starts: the results file and figure it writes,
and why it stops when the server does not start. No speed is asserted: the runs are a few tokens
long."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from results_files import RECORD_KEYS, is_figure

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loadtest(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "loadtest.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.e2e
def test_loadtest_writes_its_results_and_figure(tmp_path, model_path):
    out, fig = tmp_path / "load.json", tmp_path / "load.svg"
    proc = _loadtest("--model", model_path, "--levels", "1", "2", "--rounds", "1",
                     "--new-tokens", "3", "--json", str(out), "--plot", str(fig))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert RECORD_KEYS <= set(data) and data["kind"] == "loadtest"
    assert set(data["versions"]) == {"python", "numpy", "onnxruntime", "tiny_mindie"}
    assert "scripts/loadtest.py" in data["command"] and "--new-tokens 3" in data["command"]
    assert [r["n"] for r in data["results"]] == [1, 2]
    assert [r["requests"] for r in data["results"]] == [1, 2]
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in data["results"])
    assert os.path.basename(model_path) in data["server"]["model"]
    assert is_figure(fig)


@pytest.mark.e2e
def test_loadtest_shows_why_the_server_did_not_start(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    proc = _loadtest("--model", missing, "--levels", "1", "--json", str(tmp_path / "x.json"),
                     timeout=120)
    assert proc.returncode != 0
    assert f"model file not found: {missing}" in proc.stderr      # the server's own words
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loadtest: tiny_mindie exited with code") and "log" in last
    assert not (tmp_path / "x.json").exists()
