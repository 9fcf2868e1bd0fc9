"""Float64 building blocks of the tests' independent Hugging Face-layout recomputations
(test_reference, test_qwen2, test_gemma3), and the measurements the Gemma 3 tests of both
backends share (test_gemma3, test_gemma3_ort): written once, used by each."""

from __future__ import annotations

import os

import numpy as np


def weight64(f, name: str) -> np.ndarray:
    """GGUF tensor ``name`` (``[out, in]`` for matrices: HF's nn.Linear weight) as float64."""
    return f.dequantize(name).astype(np.float64)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x: np.ndarray) -> np.ndarray:
    """HF's rotary helper: ``[x1, x2] -> [-x2, x1]`` over the last axis (NEOX pairing)."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, kv_heads: int,
              cos: np.ndarray, sin: np.ndarray, mask: np.ndarray, scale: float,
              q_norm=None, k_norm=None) -> np.ndarray:
    """HF's eager grouped-query attention, float64: ``q [n, heads*hd]``, ``k, v
    [n, kv_heads*hd]`` -> ``[n, heads*hd]``. Query head ``j`` reads K/V head
    ``j // (heads // kv_heads)`` (``repeat_kv``); NEOX rope with ``cos, sin [n, r]`` on the
    first ``r <= hd`` elements of each head (HF's partial rotary), none when ``cos`` is
    ``None``; then ``softmax(q k^T * scale + mask) v``. ``q_norm``/``k_norm``: per-head
    functions applied before the rope (Gemma 3's and Qwen3's q/k norms)."""
    hd = q.shape[1] // heads
    out = []
    for j in range(heads):
        kv = j // (heads // kv_heads)
        qj, kj = q[:, j * hd:(j + 1) * hd], k[:, kv * hd:(kv + 1) * hd]
        if q_norm is not None:
            qj, kj = q_norm(qj), k_norm(kj)
        if cos is not None:
            r = cos.shape[-1]
            qj = np.concatenate([qj[:, :r] * cos + rotate_half(qj[:, :r]) * sin, qj[:, r:]], -1)
            kj = np.concatenate([kj[:, :r] * cos + rotate_half(kj[:, :r]) * sin, kj[:, r:]], -1)
        s = qj @ kj.T * scale + mask
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        out.append((a / a.sum(axis=-1, keepdims=True)) @ v[:, kv * hd:(kv + 1) * hd])
    return np.concatenate(out, axis=-1)


QUESTION = "Question: What is the capital of France?\nAnswer:"   # a base model answers " Paris"
PARAGRAPH = os.path.join(os.path.dirname(__file__), "data", "english_paragraph.txt")


def paragraph_ids(tok) -> np.ndarray:
    """int64 ``[n]``: tests/support/data/english_paragraph.txt as ``tok`` encodes it (BOS
    included)."""
    with open(PARAGRAPH, encoding="utf-8") as fh:
        return np.array(tok.encode(fh.read().strip()), dtype=np.int64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 ``[n, V]`` log-probabilities of ``logits [n, V]``."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def mean_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Average negative log-likelihood in nats of ``targets`` (int ``[n]``) under ``logits``
    (``[n, V]``, row ``i`` predicting ``targets[i]``), in float64."""
    return float(-np.mean(log_softmax(logits)[np.arange(len(targets)), targets]))


def kl_rows(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """float64 ``[n]``: KL(P_ref || P) in nats per row, the next-token distributions of two
    ``[n, V]`` logit arrays (the divergence llama.cpp's ``perplexity --kl-divergence`` reports)."""
    p, q = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(p) * (p - q)).sum(axis=1)


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean of :func:`kl_rows`."""
    return float(np.mean(kl_rows(ref_logits, logits)))


#: A greedy token whose log-probability leads the runner-up's by less than this (nats) may be
#: another token on another CPU: measured on one AVX2 CPU, two MLAS kernels computing the same
#: graph moved a row's logits by up to 0.46 and the lead of a greedy token by up to 0.2. Tests
#: that assert a greedy text assert this margin for its tokens too.
MIN_MARGIN = 0.5


def greedy_margins(backend, ids: np.ndarray, n: int,
                   slot: int = 0) -> tuple[list[int], list[float]]:
    """The ``n`` tokens ``backend`` picks greedily after prefilling ``ids`` into ``slot``, and
    for each the lead of its log-probability over the runner-up's (nats)."""
    from tiny_mindie.model.backend import SeqChunk
    logits = backend.forward([SeqChunk(slot, 0, ids)])[0]
    out: list[int] = []
    margins: list[float] = []
    for pos in range(len(ids), len(ids) + n):
        second, first = np.sort(logits.astype(np.float64))[-2:]
        out.append(int(logits.argmax()))
        margins.append(float(first - second))          # log-softmax shifts both alike
        logits = backend.forward([SeqChunk(slot, pos, np.array(out[-1:]))])[0]
    return out, margins


def greedy_tokens(backend, ids: np.ndarray, n: int, slot: int = 0) -> list[int]:
    """The ``n`` tokens ``backend`` picks greedily after prefilling ``ids`` into ``slot``."""
    return greedy_margins(backend, ids, n, slot)[0]
