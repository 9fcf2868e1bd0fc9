"""Logits processors that act before the temperature: the repetition penalty, OpenAI's presence
and frequency penalties, and (from :mod:`..watermark`) the green-list watermark.

Penalties change the seen ids only: :func:`penalised` computes their new values from the seen
ids' logits alone, with the same float32 operations as penalising the whole row.
"""

from __future__ import annotations

import numpy as np

from ..request import SamplingParams
from ..watermark import apply_watermark
from .row import SampleRow
from .scratch import Scratch

LOGIT_MAX = 1e30   # penalised logits are kept within +-this: times log2(e) / MIN_TEMPERATURE
                   # (1.4e5) they stay finite in float32


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL repetition penalty (Keskar et al. 2019, sec. 4.1), as in HF transformers.

    Args:
        logits: float32 ``[vocab]``, modified in place and returned.
        seen: int ``[n]`` ids already in prompt + output (duplicates allowed).
        penalty: > 0. A seen token's positive logit is divided by it, a negative one multiplied.
    """
    if penalty == 1.0 or seen.size == 0:
        return logits
    ids = np.unique(seen)
    ids = ids[ids < logits.shape[0]]
    logits[ids] = _ctrl(logits[ids], penalty)
    return logits


def _ctrl(vals: np.ndarray, penalty: float) -> np.ndarray:
    """The CTRL penalty of :func:`apply_repetition_penalty` on the values themselves, float32
    ``[n]``; computed in float64 and kept within ``+-LOGIT_MAX`` (any penalty > 0 is accepted,
    and 1e300 must not turn a logit into an overflow)."""
    v = vals.astype(np.float64)
    with np.errstate(over="ignore"):            # 1.7e308 or 5e-324 overflow float64 too: +-inf
        out = np.where(v > 0, v / penalty, v * penalty)
    return np.clip(out, -LOGIT_MAX, LOGIT_MAX).astype(np.float32)


def apply_presence_frequency(logits: np.ndarray, output: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties on the generated tokens (not the prompt):
    ``logit -= frequency * count + presence * (count > 0)``; ``logits`` is modified in place."""
    if (presence == 0.0 and frequency == 0.0) or output.size == 0:
        return logits
    ids, counts = np.unique(output[output < logits.shape[0]], return_counts=True)
    logits[ids] -= np.float32(frequency) * counts.astype(np.float32) + np.float32(presence)
    return logits


def adjusts(row: SampleRow) -> bool:
    """Whether a penalty or the watermark changes this row's logits."""
    p = row.params
    return row.seen.size > 0 and (p.watermark or _has_penalties(p))


def _has_penalties(p: SamplingParams) -> bool:
    """Whether the repetition, presence or frequency penalty is on."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def penalised(logits: np.ndarray, row: SampleRow) -> tuple[np.ndarray, np.ndarray] | None:
    """The seen ids of one row and their logits after the penalties, ``(ids, values)``
    (int ``[n]``, float32 ``[n]``), computed from ``logits`` (float32 ``[V]``) on those ids
    only: the same float32 operations as penalising the whole row. ``None`` without penalties."""
    p, v = row.params, logits.shape[0]
    if not _has_penalties(p):
        return None
    ids = np.unique(row.seen[row.seen < v])
    sub = logits[ids] if p.repetition_penalty == 1.0 else _ctrl(logits[ids], p.repetition_penalty)
    output = row.seen[row.n_prompt:]                     # sub is indexed 0..n-1 like ids
    apply_presence_frequency(sub, np.searchsorted(ids, output[output < v]),
                             p.presence_penalty, p.frequency_penalty)
    return ids, sub


def adjust(x: np.ndarray, logits: np.ndarray, row: SampleRow, s: Scratch) -> None:
    """Penalties, then the watermark, on one row (before its temperature).

    x: float32 ``[V]``, written: ``logits`` with the watermark's ``DELTA`` on the green ids
    (the add is the copy) and the penalised seen ids (:func:`penalised`); may be ``logits``
    itself. s: the thread's scratch arrays (the watermark's mask, hashes and bias).
    """
    pen = penalised(logits, row)
    if row.params.watermark:
        apply_watermark(logits, int(row.seen[-1]), mask=s.mask, work=s.u32, bias=s.tmp, out=x)
    else:
        np.copyto(x, logits)
    if pen is not None:
        ids, vals = pen
        x[ids] = vals + s.tmp[ids] if row.params.watermark else vals   # s.tmp: the bias
