"""What an encoder's token vectors become: the pooling (as weights over the tokens), the bucket
a text is padded to, and the vector's finish (Matryoshka truncation, L2 normalization).

Pooling is a weighted sum over a text's tokens, the weights made here from the texts' lengths
(right padding): ``mean`` (``1/n`` on each of its ``n`` tokens), ``cls`` (1 on the first) or
``last`` (1 on the last); padding gets 0. Both encoders take the same weights.
"""

from __future__ import annotations

import numpy as np

POOLINGS = ("mean", "cls", "last")
#: the shortest padded length, and the padding step up to 256 tokens
MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The padded length a text of ``n >= 1`` tokens is run at: ``n`` rounded up to a multiple
    of 16 tokens up to 256, beyond that of an eighth of the largest power of two below ``n``
    (32 up to 512, 64 up to 1,024, ...), so padding adds at most about an eighth to a text's
    work. A text's length alone chooses its bucket, so its vector does not depend on which
    texts share its batch."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    step = max(MIN_BUCKET, (1 << ((n - 1).bit_length() - 1)) // 8)
    return -(-n // step) * step


def pool_weights(lengths: list[int], width: int, pooling: str) -> np.ndarray:
    """float32 ``[len(lengths), width]``: each row's weights over its tokens for ``pooling``
    (one of :data:`POOLINGS`); lengths are 1 .. ``width``."""
    w = np.zeros((len(lengths), width), dtype=np.float32)
    for i, n in enumerate(lengths):
        if pooling == "mean":
            w[i, :n] = np.float32(1.0) / np.float32(n)
        elif pooling == "cls":
            w[i, 0] = 1.0
        else:
            w[i, n - 1] = 1.0
    return w


def finish(v: np.ndarray, *, normalize: bool = True, dimensions: int | None = None,
           eps: float = 1e-12) -> np.ndarray:
    """Pooled vectors ``v [n, hidden]`` (float32) made into what a client gets.

    ``dimensions`` (Matryoshka, as nomic-embed-text-v1.5 is trained): each vector layer-normed
    (no scale or shift), cut to its first ``dimensions`` values and L2-normalized. Otherwise
    L2-normalized when ``normalize``. A vector of zero norm stays zero (no NaN). Returns float32
    ``[n, dimensions or hidden]``.
    """
    v = v.astype(np.float32, copy=True)
    if dimensions is not None and dimensions < v.shape[1]:
        mu = v.mean(-1, keepdims=True)
        v = (v - mu) / np.sqrt(np.square(v - mu).mean(-1, keepdims=True) + np.float32(1e-5))
        v = v[:, :dimensions]
        normalize = True
    if normalize:
        norm = np.linalg.norm(v, axis=-1, keepdims=True)
        v = np.where(norm > eps, v / np.maximum(norm, eps), 0.0).astype(np.float32)
    return v
