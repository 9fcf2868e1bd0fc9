"""The green-list watermark: generated text carries it, human text does not."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import request

from tiny_mindie.engine.watermark import DELTA, GAMMA, apply_watermark, green_mask, z_score

HUMAN = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
         "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
         "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
         "was the winter of despair.")


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


def detect(text: str) -> str:
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "watermark-detect", "-"], input=text,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_server_marks_text_and_the_detector_finds_it(server):
    body = {"inputs": "Write a short story about a lighthouse keeper.",
            "parameters": {"watermark": True, "do_sample": True, "temperature": 1.0, "seed": 5,
                           "max_new_tokens": 120, "repetition_penalty": 1.1}}
    marked = json.loads(request(server, "POST", "/infer", body)[2])["generated_text"]
    body["parameters"]["watermark"] = False
    plain = json.loads(request(server, "POST", "/infer", body)[2])["generated_text"]
    out_marked, out_plain, out_human = detect(marked), detect(plain), detect(HUMAN)
    z = [float(o.split()[2]) for o in (out_marked, out_plain, out_human)]
    assert out_marked.endswith(": watermarked") and z[0] > 4, (out_marked, marked)
    assert out_plain.endswith("no watermark found") and z[1] < 2.5, out_plain
    assert out_human.endswith("no watermark found") and z[2] < 2.5, out_human


def test_detector_refuses_empty_text():
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "watermark-detect", "  "],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "non-empty text" in r.stderr
