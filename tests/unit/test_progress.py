"""Progress lines of slow start-up steps (tiny_mindie/model/registry/progress.py)."""

from __future__ import annotations

import logging
import time

import pytest

from tiny_mindie.model.registry.progress import slow_step

log = logging.getLogger("tiny_mindie.test_progress")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_a_slow_step_is_announced_and_timed_a_quick_one_is_silent(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    with slow_step(log, "quick", after=0.5):
        pass
    assert _lines(caplog) == []
    with slow_step(log, "hashing x.gguf (491 MB)", after=0.05):
        time.sleep(0.3)
    first, last = _lines(caplog)
    assert first == "hashing x.gguf (491 MB) ..."
    assert last.startswith("hashing x.gguf (491 MB): done in ") and last.endswith(" s")
    assert 0.25 <= float(last.split()[-2]) < 60     # seconds, not milliseconds


def test_a_slow_step_that_fails_says_so(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    with pytest.raises(ValueError), slow_step(log, "building", after=0.05):
        time.sleep(0.2)
        raise ValueError("no")
    assert _lines(caplog)[-1].startswith("building: failed after ")
