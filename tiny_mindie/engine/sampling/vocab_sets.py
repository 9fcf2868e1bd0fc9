"""Top-p (Holtzman et al. 2020) and typical-p (Meister et al. 2022) sets over the whole
vocabulary, without sorting it.

Both sets are a prefix of the ids in the order of a key -- ``-x`` for top-p, ``|x - E_p[x]|``
for typical-p -- up to the id where the running probability reaches the target mass. Instead
of sorting ``V`` logits: a bound on the key taken from a strided sample of about ``SAMPLE``
logits keeps about ``FIRST`` ids in one compare over ``V``, an exact check tells whether they
hold enough probability (else the bound is widened and the compare repeated), and only they are
sorted (:func:`prefix_by_key`). That first round is done for all the rows of a batch at once
(:func:`vocab_sets`); :func:`nucleus_prefix` and :func:`typical_prefix` are the rounds of one row.

The weights ``w`` are ``exp((x - c) / T)`` for a constant ``c``: the temperature enters only
there, the keys work on the logits as they are (dividing by ``T > 0`` keeps their order).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .candidates import sort_desc
from .row import SampleRow, samples
from .scratch import scratch

SAMPLE = 256     # about this many logits are sampled for top-p / typical-p thresholds
FIRST = 1024     # ids kept by the first such threshold (enough for most rows of a real model)


def _stride(v: int) -> int:
    """The stride of the sample of ``v`` logits the bounds are taken from."""
    return max(1, v // SAMPLE)


def _first_rank(n_sampled: int, stride: int) -> int:
    """The rank, in the descending sample, of the first top-p threshold: about ``FIRST`` ids of
    the vocabulary reach it."""
    return min(max(0, -(-FIRST // stride) - 1), n_sampled - 1)


def dot(a: np.ndarray, b: np.ndarray, width: int = 256) -> float:
    """``sum(a * b)`` of two float32 ``[V]`` arrays without a temporary: float32 dot products
    of ``width``-wide pieces (``einsum``; no BLAS threads), added in float64."""
    n = a.shape[0] // width * width
    total = np.einsum("ni,ni->n", a[:n].reshape(-1, width),
                      b[:n].reshape(-1, width)).sum(dtype=np.float64)
    return float(total + np.dot(a[n:].astype(np.float64), b[n:]) if n < a.shape[0] else total)


def mean_logit(w: np.ndarray, x: np.ndarray, z: float) -> float:
    """``E_p[x]`` for ``p = w / z`` (float32 ``[V]`` each): :func:`dot` over ``z``. Ids of
    weight 0 count for nothing, even at a logit of ``-inf`` (a grammar's mask), where the
    product alone would be NaN: such a row is summed again without them."""
    total = dot(w, x)
    if not np.isfinite(total):
        total = dot(w, np.where(w > 0, x, np.float32(0)))
    return total / z


def _weighted(cand: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cand`` without its ids of weight 0, and their weights ``w[cand]``."""
    wc = w[cand]
    if not wc.all():
        cand, wc = cand[wc > 0], wc[wc > 0]
    return cand, wc


def nucleus_prefix(x: np.ndarray, w: np.ndarray, target: float, start: int | None = None
                   ) -> np.ndarray:
    """The top-p set of one row: ids by logit descending (ties: lower id), up to and including
    the one where their running weight first reaches ``target``; ids of weight 0 are left out.
    x, w: float32 ``[V]`` (``w >= 0``).

    Rounds: the threshold is the sampled logit of rank ``start`` (default: the rank that keeps
    about ``FIRST`` ids, :func:`_first_rank`), then ``2 * rank + 1`` while the ids reaching it
    hold less than ``target``; past the last sampled logit, every id.
    """
    v = x.shape[0]
    ts = np.sort(x[::_stride(v)])[::-1]
    i = _first_rank(ts.shape[0], _stride(v)) if start is None else int(start)
    mask = scratch(1, v).mask
    while True:
        last = i >= ts.shape[0]
        cand = np.arange(v) if last else np.flatnonzero(np.greater_equal(x, ts[i], out=mask))
        cand, wc = _weighted(cand, w)
        if last or wc.sum(dtype=np.float64) >= target:
            return prefix_by_key(cand, wc, np.negative(x[cand]), target)
        i = 2 * i + 1


def typical_prefix(x: np.ndarray, w: np.ndarray, target: float, center: float,
                   start: float | None = None) -> np.ndarray:
    """The typical-p set of one row: ids by ``|x - center|`` ascending (ties: lower id), up to
    and including the one where their running weight first reaches ``target``; ids of weight 0
    are left out. x, w: float32 ``[V]`` (``w >= 0``); center: ``E_p[x]``.

    Rounds: the compare is one-sided, ``x >= center - r``, and the ids farther than ``r`` above
    ``center`` are then dropped; ``r`` starts at ``start`` (default: :func:`_first_radius`) and
    doubles while the ids kept hold less than ``target``.
    """
    v = x.shape[0]
    r = _first_radius(x, w, target, center) if start is None else start
    mask = scratch(1, v).mask
    while True:
        t = np.float32(center - r)
        cand = np.flatnonzero(np.greater_equal(x, t, out=mask))
        last = cand.shape[0] == v
        cand, wc = _weighted(cand, w)
        key = np.abs(x[cand].astype(np.float64) - center)
        if not last:                     # only these are sure to be all the ids this close
            sure = key <= center - float(t)
            cand, wc, key = cand[sure], wc[sure], key[sure]
        if last or wc.sum(dtype=np.float64) >= target:
            return prefix_by_key(cand, wc, key, target)
        r *= 2


def _first_radius(x: np.ndarray, w: np.ndarray, target: float, center: float) -> float:
    """The first ``r`` of :func:`typical_prefix`: down to the largest sampled logit (the heavy
    ids of a real model's row lie above it: about ``FIRST`` ids to check), or, when that logit
    is above the centre (a flat row), the ``r`` that holds ``target`` as the sampled ids nearest
    the centre, weighted by the stride, estimate it (with a margin; at most the ``r`` that keeps
    about ``FIRST`` ids)."""
    stride = _stride(x.shape[0])
    top = float(x[::stride].max())
    if top < center:
        return center - top
    ks = np.abs(x[::stride].astype(np.float64) - center)
    order = np.argsort(ks)
    est = np.cumsum(w[::stride][order], dtype=np.float64) * stride
    j = min(int(np.searchsorted(est, 1.5 * target)), -(-FIRST // stride), order.shape[0] - 1)
    return max(float(ks[order[j]]), 1e-3)


def prefix_by_key(cand: np.ndarray, wc: np.ndarray, key: np.ndarray, target: float) -> np.ndarray:
    """The ids ``cand`` (ascending; ``[n]``) in ``key`` order (ties: lower id), up to and
    including the one where their running weight ``wc`` (float32 ``[n]``) first reaches
    ``target``; all of them if it never does. Only a head of them is sorted when it is enough:
    the ``k`` smallest keys for ``k`` = 64, 256, 1024 (a partition) are tried first."""
    for k in (64, 256, 1024):
        if cand.shape[0] <= k:
            break
        head = key <= np.partition(key, k - 1)[k - 1]
        if wc[head].sum(dtype=np.float64) >= target:
            cand, wc, key = cand[head], wc[head], key[head]
            break
    order = np.argsort(key, kind="stable")          # cand is ascending: ties go to the lower id
    cum = np.cumsum(wc[order], dtype=np.float64)
    return cand[order[:min(int(np.searchsorted(cum, target)) + 1, cand.shape[0])]]


def vocab_sets(x: np.ndarray, w: np.ndarray, sel: np.ndarray, target: np.ndarray,
               center: np.ndarray) -> list[np.ndarray]:
    """The top-p (``center`` NaN) or typical-p (``center`` = the row's ``E_p[x]``) sets of
    several rows of a batch at once.

    Args:
        x, w: C-contiguous float32 ``[b, V]``, logits and their weights (``w >= 0``).
        sel: int ``[R]``, the rows to do; target, center: float64 ``[R]``.

    Returns:
        ``R`` int arrays, as :func:`nucleus_prefix` / :func:`typical_prefix` return them.

    The first round of those for all ``R`` rows together: its compare row by row into one
    ``[R, V]`` mask, then one ``nonzero``, one gather, one mass check (``bincount``) over all
    the candidates, instead of a dozen numpy calls per row -- short calls that hold the GIL, so
    a helper thread could not share them. Top-p rows start from the logit that
    :func:`nucleus_prefix` starts from; typical-p rows from the largest sampled logit, when it
    is below the centre. A row is still computed from its own data only (its candidates, its
    weights in id order), so its set is the same in any batch. Rows whose first round falls
    short go on alone in :func:`nucleus_prefix` / :func:`typical_prefix` with a wider bound.
    """
    v = x.shape[1]
    n = sel.shape[0]
    samp = x[sel, ::_stride(v)]                                 # float32 [R, S]
    i0 = _first_rank(samp.shape[1], _stride(v))
    typ = ~np.isnan(center)
    t = np.where(typ, samp.max(axis=1),
                 np.partition(samp, samp.shape[1] - 1 - i0, axis=1)[:, samp.shape[1] - 1 - i0])
    c = np.where(typ, center, 0.0)
    go = ~typ | (t < c)            # a typical-p row whose sample reaches above the centre: alone
    bound = np.where(typ, c - t, np.inf)        # a typical-p id with a key up to this is sure
    masks = scratch(n, v).masks[:n]
    for j in range(n):
        if go[j]:
            np.greater_equal(x[sel[j]], t[j], out=masks[j])
        else:
            masks[j].fill(False)
    rows, cand = np.divmod(np.flatnonzero(masks), v)     # (cheaper than a 2-D nonzero)
    flat = sel[rows] * v + cand
    wc = w.ravel()[flat]
    xc = x.ravel()[flat].astype(np.float64)
    key = np.where(typ[rows], np.abs(xc - c[rows]), -xc)
    keep = (wc > 0) & (key <= bound[rows])
    if not keep.all():
        rows, cand, wc, key = rows[keep], cand[keep], wc[keep], key[keep]
    mass = np.bincount(rows, weights=wc, minlength=n)
    edges = np.searchsorted(rows, np.arange(n + 1))
    out = []
    for j in range(n):
        if go[j] and mass[j] >= target[j]:
            a, b = edges[j], edges[j + 1]
            out.append(prefix_by_key(cand[a:b], wc[a:b], key[a:b], target[j]))
        elif typ[j]:
            out.append(typical_prefix(x[sel[j]], w[sel[j]], target[j], center[j],
                                      2 * bound[j] if go[j] else None))
        else:
            out.append(nucleus_prefix(x[sel[j]], w[sel[j]], target[j], start=2 * i0 + 1))
    return out


def row_sets(x: np.ndarray, w: np.ndarray, best: np.ndarray, z: np.ndarray,
             rows: Sequence[SampleRow]) -> dict[int, np.ndarray]:
    """``{row: ids}`` for the rows of a batch that draw from the whole vocabulary's distribution
    with top-p (:func:`nucleus_of_vocab`'s set) or else typical-p (:func:`typical_of_vocab`'s
    set, not yet sorted by logit), the rows needing a pass over ``V`` found together
    (:func:`vocab_sets`). x, w: C-contiguous float32 ``[b, V]``; best, z: ``[b]``."""
    out: dict[int, np.ndarray] = {}
    todo: list[tuple[int, float, float]] = []       # (row, target, centre or NaN for top-p)
    for i, row in enumerate(rows):
        p = row.params
        if not samples(p) or p.top_k > 0:
            continue
        if p.top_p < 1.0:
            if w[i, best[i]] >= p.top_p * z[i]:          # the most likely id alone is enough
                out[i] = np.array([best[i]])
            else:
                todo.append((i, p.top_p * z[i], np.nan))
        elif p.typical_p < 1.0:
            todo.append((i, p.typical_p * z[i], mean_logit(w[i], x[i], z[i])))
    if todo:
        sel, target, center = (np.array(a) for a in zip(*todo, strict=True))
        out.update(zip(sel.tolist(), vocab_sets(x, w, sel, target, center), strict=True))
    return out


def nucleus_of_vocab(logits: np.ndarray, w: np.ndarray, z: float, top_p: float,
                     best: int | None = None) -> np.ndarray:
    """Top-p over the whole vocabulary (Holtzman et al. 2020) without sorting it: the most likely
    ids, by logit descending (ties: lower id), until their probability reaches ``top_p``.

    Args:
        logits: float32 ``[V]``.
        w: float32 ``[V]``, ``exp((logits - c) / T)`` for a constant ``c`` (unnormalised
            probabilities at a temperature ``T > 0``, 1 by default; only the order of ``logits``
            is used).
        z: ``sum(w)``.
        best: ``argmax(logits)`` when known: when it alone reaches ``top_p`` (a peaked row, the
            common case) no further pass over the vocabulary is needed.
    """
    if best is not None and w[best] >= top_p * z:
        return np.array([best])
    return vocab_sets(np.ascontiguousarray(logits)[None], np.ascontiguousarray(w)[None],
                      np.zeros(1, np.intp), np.array([top_p * z]), np.array([np.nan]))[0]


def typical_of_vocab(logits: np.ndarray, w: np.ndarray, z: float, mass: float) -> np.ndarray:
    """Typical-p over the whole vocabulary (Meister et al. 2022) without sorting it: the ids
    whose surprisal is closest to the entropy, until their probability reaches ``mass``;
    sorted by logit descending. ``logits``, ``w``, ``z`` as in :func:`nucleus_of_vocab`.

    With ``p = w / z = exp((x - m) / T) / z``: ``-log p = log z + (m - x) / T`` and the entropy
    ``H = E_p[-log p] = log z + (m - E_p[x]) / T``, so ``|-log p - H| = |x - E_p[x]| / T``: the
    distance of the logit to its mean (the same order at any ``T``) -- one product-sum over the
    vocabulary, no logarithm.
    """
    x, w = np.ascontiguousarray(logits), np.ascontiguousarray(w)
    return sort_desc(x, vocab_sets(x[None], w[None], np.zeros(1, np.intp), np.array([mass * z]),
                                   np.array([mean_logit(w, x, z)]))[0])
