"""Execution providers and threads (tiny_mindie/model/providers.py)."""

from __future__ import annotations

import os

from tiny_mindie.model import providers
from tiny_mindie.model.providers import select_providers


def test_providers_fall_back_to_cpu_silently(monkeypatch, capfd):
    monkeypatch.setattr(providers, "ascend_available", lambda: False)
    assert select_providers() == ["CPUExecutionProvider"]
    monkeypatch.setattr(providers, "ascend_available", lambda: True)
    chosen = select_providers(device_id=3)
    assert chosen[0] == ("CANNExecutionProvider", {"device_id": "3"})
    assert select_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_default_threads_leave_a_core():
    n = len(os.sched_getaffinity(0))
    assert providers.default_threads() == max(1, n - 1)
