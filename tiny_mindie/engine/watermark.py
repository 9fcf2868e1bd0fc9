"""Green-list watermark of Kirchenbauer et al. 2023 ("A Watermark for Large Language Models").

At each step the vocabulary is split, from the previous token, into a "green" fraction
``GAMMA`` and the rest; ``DELTA`` is added to the green logits before sampling (sec. 3, soft
watermark). A detector that knows the split counts green tokens in a text: without the mark
each token is green with probability ``GAMMA``, so the count's z-score (sec. 3, eq. 2)

    z = (|s|_G - GAMMA * T) / sqrt(T * GAMMA * (1 - GAMMA))

stays near 0 for human text and grows like sqrt(T) for marked text.

Choices: ``GAMMA = 0.25`` and ``DELTA = 2.0``, the setting the paper's main experiments use
(sec. 6): a smaller green list gives a larger z for the same number of tokens, so shorter
answers are detectable, while δ = 2 costs little perplexity. (TGI uses γ = 0.5.)
The split is a keyed hash of (previous token, token) instead of the paper's seeded random
permutation: each token is green with probability γ independently, as in the paper, and the
whole vocabulary is classified with a few vectorised integer operations (no permutation of
262,144 ids per step).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

GAMMA = 0.25
DELTA = 2.0
KEY = 15485863          # the hash key (the paper's example key, the millionth prime)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_THRESHOLD = np.uint64(int(GAMMA * 2**32))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014): a bijective uint64 -> uint64 scramble."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=256)
def green_mask(prev_token: int, vocab_size: int, key: int = KEY) -> np.ndarray:
    """bool ``[vocab_size]``: which next tokens are green after ``prev_token`` (read-only;
    the last 256 lists are kept, 64 MB at most for a 262,144-token vocabulary)."""
    seed = _mix(np.array([(key * 1_000_003 + prev_token) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    h = _mix(np.arange(vocab_size, dtype=np.uint64) ^ seed)
    mask = (h >> np.uint64(32)) < _THRESHOLD
    mask.flags.writeable = False
    return mask


def apply_watermark(logits: np.ndarray, prev_token: int, key: int = KEY) -> np.ndarray:
    """Add ``DELTA`` to the green logits (in place). logits: float32 ``[vocab]``."""
    np.add(logits, np.float32(DELTA), out=logits, where=green_mask(prev_token, logits.shape[0], key))
    return logits


def z_score(token_ids: Sequence[int], vocab_size: int, key: int = KEY) -> tuple[float, int, int]:
    """Detect the watermark in ``token_ids`` (each token judged after its predecessor).

    Returns:
        ``(z, green, scored)``: the z-score, the number of green tokens and of tokens scored
        (``len(token_ids) - 1``; z is 0.0 when fewer than 2 tokens).
    """
    scored = len(token_ids) - 1
    if scored < 1:
        return 0.0, 0, 0
    green = sum(int(green_mask(p, vocab_size, key)[t]) for p, t in zip(token_ids, token_ids[1:]))
    z = (green - GAMMA * scored) / math.sqrt(scored * GAMMA * (1 - GAMMA))
    return z, green, scored
