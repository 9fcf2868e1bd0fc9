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

The split. The paper seeds a random permutation of the vocabulary with a hash of the previous
token and calls its first γ|V| ids green. Here every token id ``t`` has a fixed 32-bit hash
``h(t)`` and every previous token ``prev`` a 32-bit hash ``s(prev)`` (both keyed by ``KEY``,
both the high half of splitmix64's finaliser), and

    t is green after prev  <=>  (h(t) + s(prev)) mod 2**32  <  GAMMA * 2**32.

Why: ``h`` is computed once per vocabulary size (a uint32 table, 1 MB for 262,144 ids), so
marking a row costs one uint32 add, one compare and a multiply-add of the mask over the
vocabulary -- no permutation, no per-step hashing of every id, nothing cached per previous
token.

What it gives: for a fixed previous token, ``h(t) + s(prev)`` is ``h(t)`` shifted by a
constant on the 32-bit circle, so each token is green with probability ``GAMMA`` (over the
hash), and about ``GAMMA * |V|`` tokens are green -- which is all the z-test above needs. What
it does not give: the green lists of different previous tokens are not independent as in the
paper. Each list is the arc ``[-s(prev), -s(prev) + GAMMA * 2**32)`` of the circle of token
hashes, so two lists overlap by about ``max(0, GAMMA - d)`` of the vocabulary, ``d`` the circular
distance of their shifts (``GAMMA ** 2`` on average over pairs of previous tokens, as for
independent lists, but 0 for some pairs and up to ``GAMMA`` for others; previous tokens whose
shifts are closer than the gaps between token hashes get the very same list), and tokens with
nearby hashes are green after the same previous tokens. The key is public anyway (it is in
this file), so the scheme is a detectable mark, not a secret one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

GAMMA = 0.25
DELTA = 2.0
KEY = 15485863          # the hash key (the paper's example key, the millionth prime)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_THRESHOLD = np.uint32(int(GAMMA * 2**32))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014): a bijective uint64 -> uint64 scramble."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _hash32(ids, salt: np.uint64) -> np.ndarray:
    """uint32 ``[n]``: the high 32 bits of ``_mix(id ^ salt)`` for int ``ids``."""
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64) ^ salt
    return (_mix(x) >> np.uint64(32)).astype(np.uint32)


@functools.lru_cache(maxsize=8)
def _salts(key: int) -> tuple[np.uint64, np.uint64]:
    """The two keyed salts: of the token hash ``h`` and of the previous-token hash ``s``."""
    k = _mix(np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        return k, _mix(np.array([k + _GOLDEN], dtype=np.uint64))[0]


@functools.lru_cache(maxsize=8)
def token_hashes(vocab_size: int, key: int = KEY) -> np.ndarray:
    """uint32 ``[vocab_size]``: ``h(t)`` for every token id (read-only, cached per vocab size)."""
    h = _hash32(np.arange(vocab_size), _salts(key)[0])
    h.flags.writeable = False
    return h


@functools.lru_cache(maxsize=4096)
def context_hash(prev_token: int, key: int = KEY) -> np.uint32:
    """``s(prev)``: the shift of the green arc after ``prev_token``."""
    return _hash32([prev_token], _salts(key)[1])[0]


def green_mask(prev_token: int, vocab_size: int, key: int = KEY, *,
               out: np.ndarray | None = None, work: np.ndarray | None = None) -> np.ndarray:
    """bool ``[vocab_size]``: which next tokens are green after ``prev_token``.

    ``out`` (bool ``[vocab_size]``) and ``work`` (uint32 ``[vocab_size]``) are optional scratch
    arrays, so a caller running every step allocates nothing.
    """
    shifted = np.add(token_hashes(vocab_size, key), context_hash(prev_token, key), out=work)
    return np.less(shifted, _THRESHOLD, out=out)          # the uint32 add wraps mod 2**32


def apply_watermark(logits: np.ndarray, prev_token: int, key: int = KEY, *, delta: float = DELTA,
                    mask: np.ndarray | None = None, work: np.ndarray | None = None,
                    bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``logits`` plus ``delta`` on the green ids, written to ``out`` (default: in place).

    Args:
        logits: float32 ``[vocab]``.
        prev_token: the token before the one being chosen.
        delta: the bias; ``DELTA / T`` on logits already divided by a temperature ``T``.
        mask, work: optional scratch arrays for :func:`green_mask`; bias: optional float32
            ``[vocab]`` scratch, left holding ``delta`` or 0 per token (a multiply and add
            over the vocabulary is cheaper than a masked ``np.add(where=)``).
        out: float32 ``[vocab]`` for the result (the add then doubles as a copy).

    Returns:
        ``out`` (or ``logits``).
    """
    green = green_mask(prev_token, logits.shape[0], key, out=mask, work=work)
    return np.add(logits, np.multiply(green.view(np.uint8), np.float32(delta), out=bias),
                  out=logits if out is None else out)


def z_score(token_ids: Sequence[int], vocab_size: int, key: int = KEY) -> tuple[float, int, int]:
    """Detect the watermark in ``token_ids`` (each token judged after its predecessor, by the
    same rule :func:`green_mask` applies).

    Args:
        token_ids: ids of the text, all ``< vocab_size``.
        vocab_size: the tokenizer's vocabulary size (checked against the ids).

    Returns:
        ``(z, green, scored)``: the z-score, the number of green tokens and of tokens scored
        (``len(token_ids) - 1``; z is 0.0 when fewer than 2 tokens).

    Raises:
        ValueError: an id outside ``0 .. vocab_size - 1``.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in 0..{vocab_size - 1}")
    scored = ids.shape[0] - 1
    if scored < 1:
        return 0.0, 0, 0
    salt_h, salt_s = _salts(key)
    shifted = _hash32(ids[1:], salt_h) + _hash32(ids[:-1], salt_s)      # wraps mod 2**32
    green = int(np.count_nonzero(shifted < _THRESHOLD))
    z = (green - GAMMA * scored) / math.sqrt(scored * GAMMA * (1 - GAMMA))
    return z, green, scored
