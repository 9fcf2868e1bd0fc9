"""A pytest plugin (loaded by tests/conftest.py): in CI (``$CI`` set, as ``.ci/run`` sets it) a
``model`` or ``e2e`` test that skips fails instead, so a run where a model could not be pulled or a
server could not start does not pass with only the unit tier run."""

from __future__ import annotations

import os

import pytest

GATED_TIERS = ("model", "e2e")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Turn the skip report of a gated tier's test into a failure when ``$CI`` is set."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("CI")) or hasattr(report, "wasxfail"):
        return
    tiers = [m.name for m in item.iter_markers() if m.name in GATED_TIERS]
    if not tiers:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"{tiers[0]} test skipped in CI ($CI is set), where it must run: "
                       f"{reason}")
