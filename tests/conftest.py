"""Shared fixtures: one pulled model, one loaded model, one running server for the whole session."""

from __future__ import annotations

import os

import pytest

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")
TESTDATA = os.environ.get("TINY_MINDIE_TESTDATA", os.path.join(SHARED, "testdata"))


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), pulled on first use."""
    from tiny_mindie.model.registry import DEFAULT_MODEL, ensure_model

    return ensure_model(DEFAULT_MODEL)
