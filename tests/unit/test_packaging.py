"""The install requirements (setup.cfg): exactly one ONNX Runtime distribution on every platform
-- ``onnxruntime-cann`` where PyPI has its 1.24.4 wheels (Linux x86_64/aarch64, CPython
3.11-3.13), plain ``onnxruntime`` elsewhere, so ``pip install .`` works on macOS and Windows."""

from __future__ import annotations

import configparser
import os

import pytest
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORT = {"onnxruntime", "onnxruntime-cann"}


def _requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    lines = cfg["options"]["install_requires"].splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def _env(system: str, machine: str, python: str) -> dict[str, str]:
    sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
    return {"platform_system": system, "platform_machine": machine, "python_version": python,
            "python_full_version": python + ".0", "sys_platform": sys_platform,
            "os_name": "nt" if system == "Windows" else "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _ort_for(env: dict[str, str]) -> list[str]:
    return [r.name for r in _requirements()
            if r.name in ORT and (r.marker is None or r.marker.evaluate(env))]


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_linux_with_a_cann_wheel_gets_onnxruntime_cann(machine, python):
    assert _ort_for(_env("Linux", machine, python)) == ["onnxruntime-cann"]


@pytest.mark.parametrize("system, machine, python", [
    ("Darwin", "arm64", "3.11"), ("Darwin", "arm64", "3.13"), ("Darwin", "x86_64", "3.12"),
    ("Windows", "AMD64", "3.11"), ("Windows", "ARM64", "3.12"),
    ("Linux", "x86_64", "3.14"), ("Linux", "armv7l", "3.11"), ("Linux", "ppc64le", "3.12"),
])
def test_everywhere_else_gets_plain_onnxruntime(system, machine, python):
    assert _ort_for(_env(system, machine, python)) == ["onnxruntime"]


def test_both_are_the_same_version():
    pins = {str(r.specifier) for r in _requirements() if r.name in ORT}
    assert pins == {"==1.24.4"}


def test_a_non_editable_install_ships_the_chat_page(tmp_path):
    """setuptools' ``build_py`` (what ``pip install .`` copies into site-packages) takes the
    chat page along: it is package data, not a module."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                    "build_py", "-d", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    page = tmp_path / "tiny_mindie" / "api" / "webui.html"
    assert page.read_bytes() == open(os.path.join(REPO, "tiny_mindie", "api", "webui.html"),
                                     "rb").read()
