"""The green-list watermark (tiny_mindie/engine/watermark.py): its green lists and z-score, and
the detector's refusal of empty text. Generated text carrying it:
tests/e2e/test_watermark_server.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tiny_mindie.engine.watermark import DELTA, GAMMA, apply_watermark, green_mask, z_score


def test_green_list_is_a_gamma_fraction_after_any_previous_token():
    for prev in (0, 17, 18, 49151):
        assert abs(green_mask(prev, 49152).mean() - GAMMA) < 0.01
    x = np.zeros(49152, dtype=np.float32)
    apply_watermark(x, 17)
    assert set(np.unique(x)) == {0.0, DELTA} and (x > 0).tolist() == green_mask(17, 49152).tolist()


def test_green_lists_of_different_previous_tokens_overlap_like_independent_ones_on_average():
    masks = np.array([green_mask(prev, 49152) for prev in range(400)])
    overlap = (masks[:200] & masks[200:]).mean(axis=1)   # arcs of one circle: 0 .. GAMMA per pair
    assert abs(overlap.mean() - GAMMA * GAMMA) < 0.02
    assert overlap.min() < 0.01 and overlap.max() > 0.2


def test_z_score_judges_each_token_by_the_mask_after_its_predecessor():
    ids = np.random.default_rng(1).integers(0, 49152, 300).tolist()
    green = sum(int(green_mask(p, 49152)[t]) for p, t in zip(ids, ids[1:], strict=False))
    assert z_score(ids, 49152)[1:] == (green, 299)
    with pytest.raises(ValueError):
        z_score([1, 49152], 49152)


def test_z_score_of_unmarked_random_tokens_is_small():
    ids = np.random.default_rng(0).integers(0, 49152, 400).tolist()
    z, green, scored = z_score(ids, 49152)
    assert scored == 399 and abs(z) < 3


def test_detector_refuses_empty_text():
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "watermark-detect", "  "],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "non-empty text" in r.stderr
