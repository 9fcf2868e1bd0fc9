"""The numpy reference encoder: one text at a time, unpadded, float32 throughout; what the
onnxruntime graph (:mod:`.encoder_graph`) is held to in the tests.

BERT (Devlin et al. 2019): embeddings = word + absolute position + token type, layer-normed;
each block post-LN: ``x = LN(x + attn(x))``, ``x = LN(x + W2 gelu(W1 x))`` with the exact (erf)
GELU and biases on every projection. nomic-bert (Nussbaum et al. 2024): no position embeddings
but rotary positions on q and k (GPT-NeoX's ``rotate_half`` pairing, base ``rope_base``),
SwiGLU (``down(up(x) * silu(gate(x)))``), no biases; post-LN the same. Attention is
bidirectional (every token sees every token of its text). Pooling and what follows it
(normalization, Matryoshka truncation) are :mod:`.encoder_pool`'s.
"""

from __future__ import annotations

import math

import numpy as np

from ..encoder_load import EncoderConfig, EncoderLayer, EncoderWeights
from ..encoder_pool import pool_weights


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis; float32 ``[..., d]``."""
    mu = x.mean(-1, keepdims=True)
    var = np.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, ``x * Phi(x)`` (erf form), float32."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(np.float32)


def rotary(x: np.ndarray, base: float) -> np.ndarray:
    """Rotary positions on ``x [heads, n, head_dim]`` at positions ``0 .. n-1``, pairing
    ``x[i]`` with ``x[i + head_dim/2]``."""
    n, dh = x.shape[1], x.shape[2]
    half = dh // 2
    inv = base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / dh)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]        # [n, half]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def block(x: np.ndarray, w: EncoderLayer, cfg: EncoderConfig) -> np.ndarray:
    """One encoder block on ``x [n, hidden]`` (one text); returns ``[n, hidden]``."""
    n, h, dh = x.shape[0], cfg.heads, cfg.head_dim
    qkv = x @ w.qkv + w.qkv_b                                            # [n, 3d]
    q, k, v = (qkv[:, i * cfg.hidden:(i + 1) * cfg.hidden].reshape(n, h, dh).transpose(1, 0, 2)
               for i in range(3))                                        # [h, n, dh]
    if cfg.arch == "nomic-bert":
        q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
    s = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(dh))             # [h, n, n]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(1, 0, 2).reshape(n, cfg.hidden)
    x = layer_norm(x + ctx @ w.out + w.out_b, w.ln1_w, w.ln1_b, cfg.eps)
    if w.gate is not None:
        g = x @ w.gate
        y = (x @ w.up) * (g / (1.0 + np.exp(-g)))
    else:
        y = gelu(x @ w.up + w.up_b)
    return layer_norm(x + y @ w.down + w.down_b, w.ln2_w, w.ln2_b, cfg.eps)


def encode_one(ids: list[int], weights: EncoderWeights, cfg: EncoderConfig) -> np.ndarray:
    """The pooled (not yet normalized) vector of one text's token ids (``[CLS] ... [SEP]``):
    float32 ``[hidden]``.

    Raises:
        ValueError: no ids, more than ``cfg.context``, or an id outside the vocabulary.
    """
    n = len(ids)
    if not 0 < n <= cfg.context or min(ids) < 0 or max(ids) >= cfg.vocab:
        raise ValueError(f"{n} ids (1 to {cfg.context}, each 0 to {cfg.vocab - 1})")
    a = np.asarray(ids, dtype=np.int64)
    x = weights.tokens[a] + weights.types[0]
    if weights.positions is not None:
        x = x + weights.positions[:n]
    x = layer_norm(x.astype(np.float32), weights.norm_w, weights.norm_b, cfg.eps)
    for layer in weights.layers:
        x = block(x, layer, cfg)
    return (pool_weights([n], n, cfg.pooling)[0] @ x).astype(np.float32)
