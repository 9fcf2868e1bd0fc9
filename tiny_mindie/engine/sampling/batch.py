"""Sampling a decode step's batch: :func:`sample_batch` and its one-row forms.

Per row, in order: the penalties and the watermark (:mod:`.penalties`), the temperature, the
candidate set (:mod:`.candidates` inside a top-k pool, :mod:`.vocab_sets` over the whole
vocabulary), the draw (:mod:`.draw`). A row's result depends only on its own logits and
parameters: every pass over the batch is elementwise or a per-row reduction, so a row gives
bit-identical results alone or beside others.

Cost -- the vocabulary is never sorted, and ``logits / T`` is never written out: ranking,
thresholds and the typical-p centre work on the logits as they are (dividing by ``T > 0``
keeps their order), the temperature enters once, in the unnormalised probabilities
``exp2(x * k - s)`` with ``k = log2(e) / T`` (numpy's ``exp2`` is cheaper than ``exp``)
and a shift ``s``: ``max * k``, as usual, or 0 when ``max * k`` is in [0, 64] already (then
nothing can overflow, and the pass that subtracts it is saved; only ratios of these weights
are ever used), and only small candidate pools are divided by ``T`` where their log-softmax
is needed. Over the whole ``[B, V]`` float32 array: the argmax and, for the rows that need the
whole distribution (all but top-k), that exponential and its per-block sums. Penalties change
the seen ids only, and the watermark's add the row (in place when the caller allows, else on a
copy). Large scratch arrays are reused (:mod:`.scratch`), and with two CPUs the rows that need
the whole distribution are shared with a helper thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from ...model.backend import available_cpus
from ..request import SamplingParams
from .candidates import nucleus_candidates, sort_desc, top_k_candidates, typical_candidates
from .draw import BLOCK, Top, block_sums, draw, inverse_cdf, top_of_vocab
from .penalties import adjust, adjusts, penalised
from .row import SampleRow, samples, top_k_sampled
from .scratch import scratch
from .vocab_sets import row_sets

_LOG2E = np.float32(np.log2(np.e))   # exp(d) = exp2(d * log2(e)): numpy's exp2 takes half the time
_F32_MAX = float(np.finfo(np.float32).max)
PARALLEL_MIN = 1 << 20   # dense logits in a batch from which a helper thread takes half
_CPUS = available_cpus()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def sample_batch(logits: np.ndarray, rows: Sequence[SampleRow], *, overwrite: bool = False
                 ) -> list[tuple[int, float, Top | None]]:
    """Choose the next token of every row of a batch.

    Args:
        logits: float32 ``[B, V]`` next-token logits (not modified unless ``overwrite``).
        rows: ``B`` rows, in the order of ``logits``' rows.
        overwrite: the penalties and the watermark may be applied to ``logits`` in place,
            which saves copying the batch (8 MB for 8 rows of a 262,144-token vocabulary);
            ``logits`` then holds them afterwards, and is restored if this raises. (The engine
            passes its own array.)

    Returns:
        One ``(token_id, logprob, top)`` per row. ``logprob`` is the natural log of the chosen
        token's probability in the final (processed, renormalised) distribution; for greedy,
        under the penalised distribution at temperature 1. ``top`` is ``None`` when the row's
        ``top_n == 0``, else up to ``top_n`` ``(id, logprob)`` pairs, most likely first, of the
        distribution ``logprob`` comes from (fewer when top-k / top-p / typical-p keep fewer).

    With two CPUs or more and at least ``PARALLEL_MIN`` logits in rows that need the whole
    distribution (all but the top-k sampled ones), the rows from about half of the work on
    (:func:`_split`) are sampled on a helper thread meanwhile: numpy releases the GIL in its
    long loops, and rows never share work, so the results are the same. (Top-k rows are mostly
    short Python steps: split between threads they only take turns for the GIL, which makes
    them slower, not faster.)

    Raises:
        ValueError: ``len(rows)`` is not ``B``.
    """
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    b, v = logits.shape
    if len(rows) != b:
        raise ValueError(f"{len(rows)} rows for {b} rows of logits")
    dense = [i for i, r in enumerate(rows) if not top_k_sampled(r.params)]
    saved: list = []                 # rows changed in place: (row, ids or slice, old values)
    try:
        if len(dense) < 2 or len(dense) * v < PARALLEL_MIN or _CPUS < 2:
            return _sample_rows(logits, rows, overwrite, saved)
        h = _split(rows)
        saved_there: list = []
        later = _helper().submit(_sample_rows, logits[h:], rows[h:], overwrite, saved_there)
        try:
            first = _sample_rows(logits[:h], rows[:h], overwrite, saved)
        finally:
            wait([later])               # the helper's rows are done before any restore
            saved += saved_there
        return first + later.result()
    except BaseException:
        for row, ids, old in saved:
            row[ids] = old
        raise


def _row_cost(row: SampleRow) -> int:
    """Relative CPU cost of one row of :func:`sample_batch`, by kind of row: what
    :func:`_split` balances (only the ratios matter)."""
    p = row.params
    cost = 100 if top_k_sampled(p) else 130 if not samples(p) else (
        250 if p.top_p < 1.0 else 350 if p.typical_p < 1.0 else 150)
    return cost + (250 if p.watermark and row.seen.size else 0)


def _split(rows: Sequence[SampleRow]) -> int:
    """Where :func:`sample_batch` splits a batch: rows ``[0, h)`` on this thread, ``[h, B)`` on
    the helper, ``h`` the point that balances their :func:`_row_cost` best. (Consecutive rows:
    each thread's share of the batch-wide passes is then one view, one numpy call per pass.)"""
    costs = np.cumsum([_row_cost(r) for r in rows])
    return int(np.argmin(np.maximum(costs[:-1], costs[-1] - costs[:-1]))) + 1


def _helper() -> ThreadPoolExecutor:
    """The helper thread of :func:`sample_batch` (started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="tiny_mindie-sampler")
        return _pool


def _sample_rows(logits: np.ndarray, rows: Sequence[SampleRow], overwrite: bool,
                 saved: list) -> list[tuple[int, float, Top | None]]:
    """:func:`sample_batch` on this thread; logits: C-contiguous float32 ``[len(rows), V]``.
    Appends to ``saved`` what it changes in place (``(row view, ids or slice, old values)``),
    for the caller to restore should anything raise."""
    b, v = logits.shape
    if b == 0:
        return []
    s = scratch(b, v)
    e = s.e[:b]
    temp = np.array([min(r.params.temperature, _F32_MAX) if samples(r.params) else 1.0
                     for r in rows], np.float32)
    adjusted = [i for i, row in enumerate(rows) if adjusts(row)]
    x = logits                                           # read only, unless changed in place
    if adjusted and overwrite:
        for i in adjusted:
            if rows[i].params.watermark:                 # the whole row changes
                saved.append((logits[i], slice(None), logits[i].copy()))
                adjust(logits[i], logits[i], rows[i], s)
                continue
            pen = penalised(logits[i], rows[i])
            if pen is not None:
                saved.append((logits[i], pen[0], logits[i, pen[0]]))
                logits[i, pen[0]] = pen[1]
    elif adjusted:          # a copy: the watermark's add writes one anyway
        x = s.x[:b]
        for i, row in enumerate(rows):
            if i in adjusted:
                adjust(x[i], logits[i], row, s)
            else:
                np.copyto(x[i], logits[i])
    # exp2(x * k - shift) and its block sums, for every row but the top-k sampled ones (which
    # only ever look at their k candidates): in one pass over the batch when that is all rows
    full = [i for i, r in enumerate(rows) if not top_k_sampled(r.params)]
    best = np.argmax(x, axis=1) if full else np.zeros(b, np.intp)
    k = (_LOG2E / temp)[:, None]                         # float32 [b, 1]
    top = x[np.arange(b), best][:, None]
    mk = top * k                                         # the same product the row's max gets
    # no shift (0: subtracting it is exact) while the largest weight 2**mk stays <= 2**64 and
    # the logits small enough that the typical-p product-sum w * x cannot overflow float32
    shift = np.where((mk >= 0) & (mk <= 64) & (np.abs(top) <= 2**32), np.float32(0), mk)
    sums = np.zeros((b, -(-v // BLOCK)))
    for g in [slice(0, b)] if len(full) == b else [slice(i, i + 1) for i in full]:
        np.multiply(x[g], k[g], out=e[g])
        if shift[g].any():
            np.subtract(e[g], shift[g], out=e[g])
        np.exp2(e[g], out=e[g])
        sums[g] = block_sums(e[g])
    for i in full:
        if rows[i].params.min_p > 0 and samples(rows[i].params):
            sums[i] = _min_p_weights(e[i:i + 1], int(best[i]), rows[i].params.min_p)
    z = sums.sum(axis=1)
    sets = row_sets(x, e, best, z, rows)
    return [_sample_row(x[i], temp[i], e[i], int(best[i]), sums[i], float(z[i]), row, sets.get(i))
            for i, row in enumerate(rows)]


def _min_p_weights(w: np.ndarray, best: int, min_p: float) -> np.ndarray:
    """Min-p on one row's weights ``w`` (float32 ``[1, V]``, in place): the weights below
    ``min_p`` times the largest (``w[0, best]``) set to 0; returns the row's new block sums.
    An elementwise compare on the row's own weights: the same in any batch."""
    row = w[0]
    np.putmask(row, row < np.float32(min_p) * row[best], np.float32(0))
    return block_sums(w)[0]


def _sample_row(x: np.ndarray, t: np.float32, w: np.ndarray, best: int, sums: np.ndarray,
                z: float, row: SampleRow, vocab_set: np.ndarray | None
                ) -> tuple[int, float, Top | None]:
    """One row of :func:`sample_batch`. x: float32 ``[V]`` its processed logits *before* the
    temperature ``t``; w: float32 ``[V]`` ``exp((x - c) / t)``, ``c`` the max or 0; sums, z:
    its block sums and total (``w``, ``sums``, ``z`` set only for rows that are not top-k
    sampled); best: the argmax of x; vocab_set: the row's set from :func:`.row_sets`, if it has
    one. Pools whose log-softmax is needed are divided by ``t`` here (``x[ids] / t``: the same
    float32 values as ``(x / t)[ids]``)."""
    p, n = row.params, row.top_n
    if not samples(p):
        return best, float(np.log(np.float64(w[best]) / z)), top_of_vocab(x, w, z, n)
    if p.top_k > 0:
        ids = top_k_candidates(x, p.top_k)
        pool = x[ids] / t                                # by logit descending, like ids
        if p.min_p > 0:                                  # a prefix of the pool: min-p first
            m = np.count_nonzero(np.exp(pool.astype(np.float64) - pool[0]) >= p.min_p)
            ids, pool = ids[:max(m, 1)], pool[:max(m, 1)]
        pos = typical_candidates(pool, nucleus_candidates(pool, np.arange(ids.shape[0]), p.top_p),
                                 p.typical_p)
        return draw(ids[pos], np.exp(pool[pos].astype(np.float64) - pool[pos[0]]),
                    row.rng.random(), n)
    if p.top_p < 1.0:
        ids = vocab_set
        if p.typical_p < 1.0:
            ids = ids[typical_candidates(x[ids] / t, np.arange(ids.shape[0]), p.typical_p)]
    elif p.typical_p < 1.0:
        ids = sort_desc(x, vocab_set)
    elif p.min_p > 0:       # min-p alone: its set (the weights left), drawn in logit order
        ids = sort_desc(x, np.flatnonzero(w))
    else:   # plain sampling from the whole distribution: inverse CDF in vocabulary order
        j = inverse_cdf(w, sums, row.rng.random())
        return j, float(np.log(np.float64(w[j]) / z)), top_of_vocab(x, w, z, n)
    return draw(ids, w[ids].astype(np.float64), row.rng.random(), n)


def sample_with_top(logits: np.ndarray, params: SamplingParams, seen: np.ndarray,
                    rng: np.random.Generator, top_n: int = 0, n_prompt: int = 0
                    ) -> tuple[int, float, Top | None]:
    """:func:`sample_batch` for one sequence: logits float32 ``[V]``; see :class:`SampleRow`
    for the other arguments. Returns ``(token_id, logprob, top)``."""
    row = SampleRow(params, np.asarray(seen), rng, top_n, n_prompt)
    return sample_batch(np.asarray(logits)[None, :], [row])[0]


def sample(logits: np.ndarray, params: SamplingParams, seen: np.ndarray,
           rng: np.random.Generator) -> tuple[int, float]:
    """Choose the next token of one sequence: ``(token_id, logprob)`` of
    :func:`sample_with_top` (logits float32 ``[V]``, not modified)."""
    tok, logprob, _ = sample_with_top(logits, params, seen, rng)
    return tok, logprob
