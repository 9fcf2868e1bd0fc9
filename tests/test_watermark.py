"""The green-list watermark: generated text carries it, human text does not."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tiny_mindie.engine.watermark import DELTA, GAMMA, apply_watermark, green_mask, z_score
from test_e2e_infer import request

HUMAN = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
         "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
         "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
         "was the winter of despair.")


def test_green_list_is_a_gamma_fraction_and_depends_on_the_previous_token():
    a, b = green_mask(17, 49152), green_mask(18, 49152)
    assert abs(a.mean() - GAMMA) < 0.01 and abs(b.mean() - GAMMA) < 0.01
    assert abs((a & b).mean() - GAMMA * GAMMA) < 0.01           # independent lists overlap ~ gamma^2
    x = np.zeros(49152, dtype=np.float32)
    apply_watermark(x, 17)
    assert set(np.unique(x)) == {0.0, DELTA} and (x > 0).tolist() == a.tolist()


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
