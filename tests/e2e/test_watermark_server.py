"""The green-list watermark over the server: generated text carries it, text generated without
it and human text do not (``python -m tiny_mindie watermark-detect``)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import request

HUMAN = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
         "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
         "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
         "was the winter of despair.")


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
