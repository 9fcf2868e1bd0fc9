"""scripts/quality.py: its KL / NLL arithmetic on small hand-made log-prob arrays, and its two
fixed texts (scripts/texts/) present (their length in the default model's tokens:
tests/model/test_quality_texts.py)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from script_modules import load_script

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
quality = load_script("quality", "quality_script")


def test_log_softmax_normalizes_and_ignores_shifts():
    logp = quality.log_softmax(np.array([[0.0, math.log(3.0)], [100.0, 100.0 + math.log(3.0)]]))
    assert logp.dtype == np.float64
    np.testing.assert_allclose(np.exp(logp), [[0.25, 0.75], [0.25, 0.75]], rtol=1e-12)
    np.testing.assert_allclose(quality.log_softmax(np.array([1.0, 1.0])), np.log([0.5, 0.5]))


def test_kl_of_identical_rows_is_zero():
    logp = quality.log_softmax(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, -5.0]], np.float32))
    assert quality.kl_rows(logp, logp).tolist() == [0.0, 0.0]


def test_kl_of_a_two_way_distribution():
    p, q = np.log([[0.5, 0.5]]), np.log([[0.9, 0.1]])
    # KL(P || Q) = 0.5 ln(0.5 / 0.9) + 0.5 ln(0.5 / 0.1) = 0.5 ln(25 / 9) = 0.5108 nats
    assert quality.kl_rows(p, q)[0] == pytest.approx(0.5 * math.log(25 / 9), rel=1e-12)
    assert quality.kl_rows(p, q)[0] == pytest.approx(0.510826, abs=1e-6)
    # not symmetric: KL(Q || P) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.3681
    assert quality.kl_rows(q, p)[0] == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2),
                                                    rel=1e-12)


def test_kl_where_the_reference_gives_a_token_no_probability():
    p = np.array([[0.0, -np.inf]])              # P = (1, 0)
    q = np.log([[0.5, 0.5]])
    assert quality.kl_rows(p, q)[0] == pytest.approx(math.log(2), rel=1e-12)


def test_nll_of_known_tokens():
    logp = np.log([[0.25, 0.75], [0.5, 0.5], [0.1, 0.9]])
    nll = quality.nll_rows(logp, np.array([1, 0, 0]))
    np.testing.assert_allclose(nll, [-math.log(0.75), math.log(2), math.log(10)], rtol=1e-12)


def test_summarize_and_score():
    s = quality.summarize(np.arange(101) / 100, np.array([1.0, 3.0]), np.array([True, False]),
                          ref_nll=4.0)
    assert s["kl_mean"] == pytest.approx(0.5) and s["kl_p99"] == pytest.approx(0.99)
    assert s["nll"] == 2.0 and s["nll_ratio"] == 0.5 and s["top1"] == 0.5
    ref = np.log([[0.5, 0.5], [0.2, 0.8]]).astype(np.float32)
    targets = np.array([0, 1])
    same = quality.score(ref, ref, targets)
    assert same["kl_mean"] == 0 and same["top1"] == 1 and same["positions"] == 2
    assert same["nll"] == pytest.approx((math.log(2) - math.log(0.8)) / 2, rel=1e-6)
    # the engine's rows may be raw logits: a row shifted by a constant is the same distribution
    other = quality.score(ref, [np.array([0.0, 0.0]) + 7, np.log([0.9, 0.1])], targets,
                          ref_nll=same["nll"])
    assert other["top1"] == 0.5
    assert other["kl_mean"] == pytest.approx(
        (0.2 * math.log(0.2 / 0.9) + 0.8 * math.log(0.8 / 0.1)) / 2, rel=1e-6)
    assert other["nll"] == pytest.approx((math.log(2) - math.log(0.1)) / 2, rel=1e-6)
    with pytest.raises(ValueError):
        quality.score(ref, ref[:1], targets)


def test_fixed_texts_exist():
    for name in quality.TEXTS:
        text = quality.load_text(name)
        assert len(text) > 1500, name
    assert quality.load_text("english").startswith("Four score and seven years ago")
    compile(quality.load_text("code"), quality.text_path("code"), "exec")    # Python that parses
