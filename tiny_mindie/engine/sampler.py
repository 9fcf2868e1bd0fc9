"""Next-token selection for a batch: logits processors and sampling, in numpy.

Order of the processors is Hugging Face's / TGI's: repetition penalty (then OpenAI's presence
and frequency penalties), the watermark bias when asked (:mod:`.watermark`), then temperature,
top-k, top-p (Holtzman et al. 2020), typical-p (Meister et al. 2022), each working on the
distribution the previous one left.

One implementation, batch first: :func:`sample_batch` takes a decode step's ``[B, V]`` logits
and one :class:`SampleRow` per row; :func:`sample` and :func:`sample_with_top` are the same call
with ``B = 1``. A row's result depends only on its own logits and parameters: every pass over
the batch is elementwise or a per-row reduction, so a row gives bit-identical results alone or
beside others.

Cost -- the vocabulary is never sorted, and ``logits / T`` is never written out: ranking,
thresholds and the typical-p centre work on the logits as they are (dividing by ``T > 0``
keeps their order), the temperature enters once, in the unnormalised probabilities
``exp2(x * k - s)`` with ``k = log2(e) / T`` (numpy's ``exp2`` takes half the time of ``exp``)
and a shift ``s``: ``max * k``, as usual, or 0 when ``max * k`` is in [0, 64] already (then
nothing can overflow, and the pass that subtracts it is saved; only ratios of these weights
are ever used), and only small candidate pools are divided by ``T`` where their log-softmax
is needed. Over the whole ``[B, V]`` float32 array: the argmax and, for the rows that need the
whole distribution (all but top-k), that exponential and its per-block sums. Penalties change
the seen ids only, and the watermark's add the row (in place when the caller allows, else on a
copy). Per row, one or two more passes over ``V`` at most (a compare; the product-sum
typical-p needs); the rest works on small candidate sets: a threshold from a strided sample of
the row's logits keeps about a thousand ids, an exact check tells whether they hold enough
probability (else the threshold is widened), and only they are sorted (top-p skips even that
when the most likely token alone reaches ``top_p``); that first round is done for all the
top-p and typical-p rows of a batch at once (:func:`_vocab_sets`). Large scratch arrays are
kept per thread and reused from step to step (on a VM a fresh 8 MB array costs more in page
faults than the arithmetic done in it), and with two CPUs the rows that need the whole
distribution are shared with a helper thread. ``scripts/bench.py --sampler`` measures the
share of a decode step (Gemma 3 270M: V = 262,144, batch 8; 4-10 % depending on the
parameters, typical-p alone and a mixed batch the most).

Every request has its own ``numpy.random.Generator`` (PCG64) seeded from its ``seed``, and draws
exactly one uniform number per sampled token (none when greedy), so a seed fixes the output
whatever else is in the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ..model.backend import available_cpus
from .request import SamplingParams
from .watermark import apply_watermark

_BLOCK = 1024     # block width of the per-row block sums (two-level inverse CDF)
_SAMPLE = 256     # about this many logits are sampled for top-p / typical-p thresholds
_FIRST = 1024     # ids kept by the first such threshold (enough for most rows of a real model)
_LOG2E = np.float32(np.log2(np.e))   # exp(d) = exp2(d * log2(e)): numpy's exp2 takes half the time
MIN_TEMPERATURE = 1e-5   # a lower temperature is greedy decoding (see _samples)
PARALLEL_MIN = 1 << 20   # dense logits in a batch from which a helper thread takes half
_CPUS = available_cpus()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

Top = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampleRow:
    """One row of a batch to sample.

    Attributes:
        params: the request's sampling parameters.
        seen: int ``[n]`` prompt + generated ids, for the penalties and the watermark.
        rng: the request's generator; one ``random()`` draw per sampled token, none when greedy.
        top_n: how many alternatives to report (OpenAI's ``top_logprobs``); 0 = none, and then
            nothing extra is computed.
        n_prompt: how many ids at the start of ``seen`` are the prompt; the presence and
            frequency penalties count only the ids after them.
    """

    params: SamplingParams
    seen: np.ndarray
    rng: np.random.Generator
    top_n: int = 0
    n_prompt: int = 0


def _samples(p: SamplingParams) -> bool:
    """Whether a row is sampled: ``do_sample`` and a temperature of at least
    :data:`MIN_TEMPERATURE` (below it the distribution is its argmax to float32 precision, and
    ``1 / T`` would overflow; vLLM draws the same line)."""
    return p.do_sample and p.temperature >= MIN_TEMPERATURE


def _top_k_sampled(p: SamplingParams) -> bool:
    """Top-k rows only ever look at their k candidates, never at the whole distribution."""
    return _samples(p) and p.top_k > 0


def make_rng(seed: int) -> np.random.Generator:
    """The per-request generator for ``seed`` (0 .. 2**63-1)."""
    return np.random.Generator(np.random.PCG64(seed))


class _Scratch:
    """Arrays reused from call to call: ``x``, ``e`` float32, ``masks`` bool, each ``[rows, V]``;
    ``tmp`` float32, ``mask`` bool (the first row of ``masks``), ``u32`` uint32, each ``[V]``."""

    def __init__(self, rows: int, vocab: int):
        self.x = np.empty((rows, vocab), np.float32)
        self.e = np.empty((rows, vocab), np.float32)
        self.tmp = np.empty(vocab, np.float32)
        self.masks = np.empty((rows, vocab), np.bool_)
        self.mask = self.masks[0]
        self.u32 = np.empty(vocab, np.uint32)


_local = threading.local()


def _scratch(rows: int, vocab: int) -> _Scratch:
    """This thread's scratch arrays for at least ``rows`` rows of ``vocab`` logits."""
    s = getattr(_local, "scratch", None)
    if s is None or s.x.shape[1] != vocab or s.x.shape[0] < rows:
        keep = s.x.shape[0] if s is not None and s.x.shape[1] == vocab else 1
        s = _local.scratch = _Scratch(max(rows, keep), vocab)
    return s


# ---- logits processors -----------------------------------------------------------------------

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


_F32_MAX = float(np.finfo(np.float32).max)
_LOGIT_MAX = 1e30   # penalised logits are kept within +-this: times log2(e) / MIN_TEMPERATURE
                    # (1.4e5) they stay finite in float32


def _ctrl(vals: np.ndarray, penalty: float) -> np.ndarray:
    """The CTRL penalty of :func:`apply_repetition_penalty` on the values themselves, float32
    ``[n]``; computed in float64 and kept within ``+-_LOGIT_MAX`` (any penalty > 0 is accepted,
    and 1e300 must not turn a logit into an overflow)."""
    v = vals.astype(np.float64)
    with np.errstate(over="ignore"):            # 1.7e308 or 5e-324 overflow float64 too: +-inf
        out = np.where(v > 0, v / penalty, v * penalty)
    return np.clip(out, -_LOGIT_MAX, _LOGIT_MAX).astype(np.float32)


def apply_presence_frequency(logits: np.ndarray, output: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties on the generated tokens (not the prompt):
    ``logit -= frequency * count + presence * (count > 0)``; ``logits`` is modified in place."""
    if (presence == 0.0 and frequency == 0.0) or output.size == 0:
        return logits
    ids, counts = np.unique(output[output < logits.shape[0]], return_counts=True)
    logits[ids] -= np.float32(frequency) * counts.astype(np.float32) + np.float32(presence)
    return logits


def _adjusts(row: SampleRow) -> bool:
    """Whether a penalty or the watermark changes this row's logits."""
    p = row.params
    return row.seen.size > 0 and (p.watermark or _has_penalties(p))


def _has_penalties(p: SamplingParams) -> bool:
    """Whether the repetition, presence or frequency penalty is on."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _penalised(logits: np.ndarray, row: SampleRow) -> tuple[np.ndarray, np.ndarray] | None:
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


def _adjust(x: np.ndarray, logits: np.ndarray, row: SampleRow, s: _Scratch) -> None:
    """Penalties, then the watermark, on one row (before its temperature).

    x: float32 ``[V]``, written: ``logits`` with the watermark's ``DELTA`` on the green ids
    (the add is the copy) and the penalised seen ids (:func:`_penalised`); may be ``logits``
    itself.
    """
    pen = _penalised(logits, row)
    if row.params.watermark:
        apply_watermark(logits, int(row.seen[-1]), mask=s.mask, work=s.u32, bias=s.tmp, out=x)
    else:
        np.copyto(x, logits)
    if pen is not None:
        ids, vals = pen
        x[ids] = vals + s.tmp[ids] if row.params.watermark else vals   # s.tmp: the bias


# ---- candidate sets --------------------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a small 1-D array (a candidate pool)."""
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def _sort_desc(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` ordered by logit descending, ties by id (so the order never depends on how
    a partition happened to return them)."""
    ids = np.sort(ids)
    return ids[np.argsort(-logits[ids], kind="stable")]


def largest_ids(a: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of float32 ``a``, by value descending (ties: lower id).

    Exact, and cheaper than ``argpartition`` on a large array: a threshold taken from a strided
    sample keeps only a few hundred candidates in one compare; if fewer than ``k`` values reach
    it, ``argpartition`` runs instead.
    """
    v = a.shape[0]
    if k >= v:
        return _sort_desc(a, np.arange(v))
    stride = 64
    if v >= 16 * stride and k * stride * 4 < v:
        sample = a[::stride]
        q = sample.shape[0] - 1 - min(2 * (k // stride + 1), sample.shape[0] - 1)
        t = np.partition(sample, q)[q]
        cand = np.flatnonzero(np.greater_equal(a, t, out=_scratch(1, v).mask))
        if cand.shape[0] >= k:     # the k largest are all >= t, so all are in cand
            return cand[np.lexsort((cand, -a[cand]))[:k]]
    ids = np.argpartition(-a, k - 1)[:k]
    edge = a[ids].min()             # settle ties at the edge by the lower id
    tied = np.flatnonzero(a == edge)
    if tied.shape[0] > np.count_nonzero(a[ids] == edge):
        above = ids[a[ids] > edge]
        ids = np.concatenate([above, tied[:k - above.shape[0]]])
    return _sort_desc(a, ids)


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits (float32 ``[V]``; all when ``k <= 0``), by logit
    descending (ties: lower id); O(V + k log k)."""
    return largest_ids(logits, logits.shape[0] if k <= 0 else k)


def _prefix_reaching(mass: np.ndarray, target: float) -> int:
    """Length of the shortest prefix whose cumulative mass reaches ``target`` (at least 1)."""
    return max(1, min(int(np.searchsorted(np.cumsum(mass), target, side="left")) + 1, mass.shape[0]))


def nucleus_candidates(logits: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p filter (Holtzman et al. 2020) inside a pool: the shortest prefix of ``ids`` (sorted
    by logit descending) whose mass, renormalised over the pool, reaches ``top_p``."""
    if top_p >= 1.0:
        return ids
    return ids[:_prefix_reaching(np.exp(_log_softmax(logits[ids])), top_p)]


def typical_candidates(logits: np.ndarray, ids: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical filter (Meister et al. 2022, sec. 4; HF ``TypicalLogitsWarper``) inside a
    pool: keep the ids whose surprisal ``-log p`` is closest to the entropy ``H`` of the pool's
    distribution, fewest first, until their mass reaches ``mass``. Sorted by logit descending."""
    if mass >= 1.0:
        return ids
    logp = _log_softmax(logits[ids])
    p = np.exp(logp)
    entropy = -np.sum(np.where(p > 0, p * logp, 0.0))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    kept = ids[order[:int(np.sum(np.cumsum(p[order]) < mass)) + 1]]
    return _sort_desc(logits, kept)


def _head_prefix(x: np.ndarray, w: np.ndarray, target: float, center: float | None = None,
                 start: float | None = None) -> np.ndarray:
    """Ids in order of a key (ties: lower id first), up to and including the one where their
    running weight ``w`` first reaches ``target``; ids of weight 0 are left out. The key is
    ``-x`` (top-p), or ``|x - center|`` when ``center`` is given (typical-p).
    x, w: float32 ``[V]`` (``w >= 0``).

    Without sorting ``V`` logits: a strided sample (about ``_SAMPLE`` ids) proposes a bound
    ``r`` on the key, one compare over ``V`` collects every id with key ``<= r``, and an exact
    check tells whether their weight reaches ``target``: then the answer is a prefix of them in
    key order, and only they are sorted; else ``r`` is widened. Top-p: ``r`` keeps about
    ``_FIRST``, then twice, four times ... as many ids (``x >= t`` for sampled logits ``t``).
    Typical-p: the compare is one-sided, ``x >= center - r``, and the ids above ``center + r``
    are then dropped; the first ``r`` reaches down to the largest sampled logit (the heavy ids
    of a real model's row lie above it: about ``_FIRST`` ids to check), or, when that logit is
    above the centre (a flat row), the sampled ids nearest the centre, weighted by ``stride``,
    estimate the ``r`` that holds ``target`` (with a margin; at most the ``r`` that keeps about
    ``_FIRST`` ids). ``r`` doubles when the check fails. ``start``: the first sample index
    (top-p) or ``r`` (typical-p) to try instead, when :func:`_vocab_sets` tried a smaller one.
    """
    v = x.shape[0]
    stride = max(1, v // _SAMPLE)
    mask = _scratch(1, v).mask
    if center is None:
        ts = np.sort(x[::stride])[::-1]
        i = min(max(0, -(-_FIRST // stride) - 1), ts.shape[0] - 1) if start is None else int(start)
    elif start is not None:
        r = start
    else:
        top = float(x[::stride].max())
        if top < center:
            r = center - top
        else:
            ks = np.abs(x[::stride].astype(np.float64) - center)
            order = np.argsort(ks)
            est = np.cumsum(w[::stride][order], dtype=np.float64) * stride
            j = min(int(np.searchsorted(est, 1.5 * target)), -(-_FIRST // stride), order.shape[0] - 1)
            r = max(float(ks[order[j]]), 1e-3)
    while True:
        if center is None:
            last = i >= ts.shape[0]
            cand = np.arange(v) if last else np.flatnonzero(np.greater_equal(x, ts[i], out=mask))
        else:
            t = np.float32(center - r)
            cand = np.flatnonzero(np.greater_equal(x, t, out=mask))
            last = cand.shape[0] == v
        wc = w[cand]
        if not wc.all():
            cand, wc = cand[wc > 0], wc[wc > 0]
        if center is None:
            key = np.negative(x[cand])
        else:
            key = np.abs(x[cand].astype(np.float64) - center)
            if not last:                     # only these are sure to be all the ids this close
                sure = key <= center - float(t)
                cand, wc, key = cand[sure], wc[sure], key[sure]
        if last or wc.sum(dtype=np.float64) >= target:
            break
        if center is None:
            i = 2 * i + 1
        else:
            r *= 2
    return _prefix_by_key(cand, wc, key, target)


def _prefix_by_key(cand: np.ndarray, wc: np.ndarray, key: np.ndarray, target: float) -> np.ndarray:
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


def _vocab_sets(x: np.ndarray, w: np.ndarray, sel: np.ndarray, target: np.ndarray,
                center: np.ndarray) -> list[np.ndarray]:
    """:func:`_head_prefix` for several rows of a batch at once: their top-p (``center`` NaN)
    or typical-p (``center`` = the row's ``E_p[x]``) sets over the whole vocabulary.

    Args:
        x, w: C-contiguous float32 ``[b, V]``, logits and their weights (``w >= 0``).
        sel: int ``[R]``, the rows to do; target, center: float64 ``[R]``.

    Returns:
        ``R`` int arrays, as :func:`_head_prefix` returns them.

    The first round of :func:`_head_prefix` for all ``R`` rows together: its compare row by row
    into one ``[R, V]`` mask, then one ``nonzero``, one gather, one mass check (``bincount``)
    over all the candidates, instead of a dozen numpy calls per row -- short calls that hold
    the GIL, so a helper thread could not share them. Top-p rows start from the logit that
    :func:`_head_prefix` starts from; typical-p rows from the largest sampled logit, when it is
    below the centre. A row is still computed from its own data only (its candidates, its
    weights in id order), so its set is the same in any batch. Rows whose first round falls
    short go on alone in :func:`_head_prefix` with a wider bound.
    """
    v = x.shape[1]
    n = sel.shape[0]
    stride = max(1, v // _SAMPLE)
    samp = x[sel, ::stride]                                     # float32 [R, S]
    i0 = min(max(0, -(-_FIRST // stride) - 1), samp.shape[1] - 1)
    typ = ~np.isnan(center)
    t = np.where(typ, samp.max(axis=1),
                 np.partition(samp, samp.shape[1] - 1 - i0, axis=1)[:, samp.shape[1] - 1 - i0])
    c = np.where(typ, center, 0.0)
    go = ~typ | (t < c)            # a typical-p row whose sample reaches above the centre: alone
    bound = np.where(typ, c - t, np.inf)        # a typical-p id with a key up to this is sure
    masks = _scratch(n, v).masks[:n]
    for j in range(n):
        if go[j]:
            np.greater_equal(x[sel[j]], t[j], out=masks[j])
        else:
            masks[j].fill(False)
    rows, cand = np.divmod(np.flatnonzero(masks), v)     # (2-D nonzero is 10x slower)
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
            out.append(_prefix_by_key(cand[a:b], wc[a:b], key[a:b], target[j]))
        elif typ[j]:
            out.append(_head_prefix(x[sel[j]], w[sel[j]], target[j], center[j],
                                    2 * bound[j] if go[j] else None))
        else:
            out.append(_head_prefix(x[sel[j]], w[sel[j]], target[j], start=2 * i0 + 1))
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
    return _vocab_sets(np.ascontiguousarray(logits)[None], np.ascontiguousarray(w)[None],
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
    return _sort_desc(x, _vocab_sets(x[None], w[None], np.zeros(1, np.intp), np.array([mass * z]),
                                     np.array([_dot(w, x) / z]))[0])


# ---- drawing ---------------------------------------------------------------------------------

def _blocks(a: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of float32 ``a`` ``[rows, V]``: ``[rows, V // width, width]`` and the rest
    ``[rows, V % width]``."""
    rows, v = a.shape
    n = v // width
    if n * width == v:              # a plain view (as_strided alone costs ~20 us of Python)
        return a.reshape(rows, n, width), a[:, v:]
    full = np.lib.stride_tricks.as_strided(a, (rows, n, width),
                                           (a.strides[0], width * a.strides[1], a.strides[1]),
                                           writeable=False)
    return full, a[:, n * width:]


def _block_sums(w: np.ndarray) -> np.ndarray:
    """float64 ``[rows, ceil(V / _BLOCK)]``: sums of consecutive ``_BLOCK``-wide pieces of each
    row of float32 ``w`` ``[rows, V]``: ``einsum``'s vectorised float32 sums (relative error
    a few 1e-7 on real rows; numpy's pairwise ``sum`` along the last axis takes 3-4x longer)."""
    full, rest = _blocks(w, _BLOCK)
    sums = np.einsum("rbi->rb", full)
    if rest.shape[1]:
        sums = np.concatenate([sums, rest.sum(axis=1)[:, None]], axis=1)
    return sums.astype(np.float64)


def _dot(a: np.ndarray, b: np.ndarray, width: int = 256) -> float:
    """``sum(a * b)`` of two float32 ``[V]`` arrays without a temporary: float32 dot products
    of ``width``-wide pieces (``einsum``; no BLAS threads), added in float64."""
    n = a.shape[0] // width * width
    total = np.einsum("ni,ni->n", a[:n].reshape(-1, width), b[:n].reshape(-1, width)).sum(dtype=np.float64)
    return float(total + np.dot(a[n:].astype(np.float64), b[n:]) if n < a.shape[0] else total)


def _inverse_cdf(w: np.ndarray, sums: np.ndarray, u: float) -> int:
    """Index where the running sum of ``w`` (float32 ``[V]``, ``>= 0``) first passes
    ``u * sum(w)``, ``0 <= u < 1``: a block from ``sums`` (:func:`_block_sums` of ``w``), then
    a running sum inside that block only. Never an index of weight 0."""
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = int(np.searchsorted(cum, target, side="right"))
    if b >= sums.shape[0]:                 # u * total rounded up to the total
        b = int(np.flatnonzero(sums)[-1])
    block = w[b * _BLOCK:(b + 1) * _BLOCK]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64),
                            target - (cum[b - 1] if b else 0.0), side="right"))
    if j >= block.shape[0]:                # rounding: the block's own sum falls short
        j = int(np.flatnonzero(block)[-1])
    return b * _BLOCK + j


def _top(ids: np.ndarray, logp: np.ndarray, n: int) -> Top:
    return tuple((int(i), float(lp)) for i, lp in zip(ids[:n], logp[:n]))


def _top_of_vocab(x: np.ndarray, w: np.ndarray, z: float, n: int) -> Top | None:
    """The ``n`` most likely ids of the whole distribution ``w / z`` with their logprobs."""
    if n <= 0:
        return None
    ids = top_k_candidates(x, n)
    with np.errstate(divide="ignore"):
        return _top(ids, np.log(w[ids].astype(np.float64) / z), n)


def _draw(ids: np.ndarray, weights: np.ndarray, u: float, n: int) -> tuple[int, float, Top | None]:
    """Inverse CDF over a candidate pool, in its order (by logit descending).

    Args:
        ids: int ``[k]`` the pool; weights: float64 ``[k]`` their unnormalised probabilities.
        u: uniform in [0, 1); n: how many ``(id, logprob)`` of the pool to report (its first).
    """
    cum = np.cumsum(weights)
    total = cum[-1]
    j = min(int(np.searchsorted(cum, u * total, side="right")), ids.shape[0] - 1)
    with np.errstate(divide="ignore"):
        top = _top(ids, np.log(weights[:n] / total), n) if n > 0 else None
        return int(ids[j]), float(np.log(weights[j] / total)), top


def _sample_row(x: np.ndarray, t: np.float32, w: np.ndarray, best: int, sums: np.ndarray,
                z: float, row: SampleRow, vocab_set: np.ndarray | None
                ) -> tuple[int, float, Top | None]:
    """One row of :func:`sample_batch`. x: float32 ``[V]`` its processed logits *before* the
    temperature ``t``; w: float32 ``[V]`` ``exp((x - c) / t)``, ``c`` the max or 0; sums, z:
    its block sums and total (``w``, ``sums``, ``z`` set only for rows that are not top-k
    sampled); best: the argmax of x; vocab_set: the row's set from :func:`_whole_vocab_sets`, if it has one.
    Pools whose log-softmax is needed are divided by ``t`` here (``x[ids] / t``: the same
    float32 values as ``(x / t)[ids]``)."""
    p, n = row.params, row.top_n
    if not _samples(p):
        return best, float(np.log(np.float64(w[best]) / z)), _top_of_vocab(x, w, z, n)
    if p.top_k > 0:
        ids = top_k_candidates(x, p.top_k)
        pool = x[ids] / t                                # by logit descending, like ids
        pos = typical_candidates(pool, nucleus_candidates(pool, np.arange(ids.shape[0]), p.top_p),
                                 p.typical_p)
        return _draw(ids[pos], np.exp(pool[pos].astype(np.float64) - pool[pos[0]]),
                     row.rng.random(), n)
    if p.top_p < 1.0:
        ids = vocab_set
        if p.typical_p < 1.0:
            ids = ids[typical_candidates(x[ids] / t, np.arange(ids.shape[0]), p.typical_p)]
    elif p.typical_p < 1.0:
        ids = _sort_desc(x, vocab_set)
    else:   # plain sampling from the whole distribution: inverse CDF in vocabulary order
        j = _inverse_cdf(w, sums, row.rng.random())
        return j, float(np.log(np.float64(w[j]) / z)), _top_of_vocab(x, w, z, n)
    return _draw(ids, w[ids].astype(np.float64), row.rng.random(), n)


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
    short Python steps: split between threads they only take turns for the GIL, measured
    1.8 -> 2.7 ms for eight.)

    Raises:
        ValueError: ``len(rows)`` is not ``B``.
    """
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    b, v = logits.shape
    if len(rows) != b:
        raise ValueError(f"{len(rows)} rows for {b} rows of logits")
    dense = [i for i, r in enumerate(rows) if not _top_k_sampled(r.params)]
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
    """Rough CPU time of one row of :func:`sample_batch` in microseconds (Gemma 3's 262,144
    logits, measured per kind of row): what :func:`_split` balances."""
    p = row.params
    cost = 100 if _top_k_sampled(p) else 130 if not _samples(p) else (
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
    s = _scratch(b, v)
    e = s.e[:b]
    temp = np.array([min(r.params.temperature, _F32_MAX) if _samples(r.params) else 1.0
                     for r in rows], np.float32)
    adjusted = [i for i, row in enumerate(rows) if _adjusts(row)]
    x = logits                                           # read only, unless changed in place
    if adjusted and overwrite:
        for i in adjusted:
            if rows[i].params.watermark:                 # the whole row changes
                saved.append((logits[i], slice(None), logits[i].copy()))
                _adjust(logits[i], logits[i], rows[i], s)
                continue
            pen = _penalised(logits[i], rows[i])
            if pen is not None:
                saved.append((logits[i], pen[0], logits[i, pen[0]]))
                logits[i, pen[0]] = pen[1]
    elif adjusted:          # a copy: the watermark's add writes one anyway
        x = s.x[:b]
        for i, row in enumerate(rows):
            if i in adjusted:
                _adjust(x[i], logits[i], row, s)
            else:
                np.copyto(x[i], logits[i])
    # exp2(x * k - shift) and its block sums, for every row but the top-k sampled ones (which
    # only ever look at their k candidates): in one pass over the batch when that is all rows
    full = [i for i, r in enumerate(rows) if not _top_k_sampled(r.params)]
    best = np.argmax(x, axis=1) if full else np.zeros(b, np.intp)
    k = (_LOG2E / temp)[:, None]                         # float32 [b, 1]
    top = x[np.arange(b), best][:, None]
    mk = top * k                                         # the same product the row's max gets
    # no shift (0: subtracting it is exact) while the largest weight 2**mk stays <= 2**64 and
    # the logits small enough that the typical-p product-sum w * x cannot overflow float32
    shift = np.where((mk >= 0) & (mk <= 64) & (np.abs(top) <= 2**32), np.float32(0), mk)
    sums = np.zeros((b, -(-v // _BLOCK)))
    for g in [slice(0, b)] if len(full) == b else [slice(i, i + 1) for i in full]:
        np.multiply(x[g], k[g], out=e[g])
        if shift[g].any():
            np.subtract(e[g], shift[g], out=e[g])
        np.exp2(e[g], out=e[g])
        sums[g] = _block_sums(e[g])
    z = sums.sum(axis=1)
    sets = _whole_vocab_sets(x, e, best, z, rows)
    return [_sample_row(x[i], temp[i], e[i], int(best[i]), sums[i], float(z[i]), row, sets.get(i))
            for i, row in enumerate(rows)]


def _whole_vocab_sets(x: np.ndarray, w: np.ndarray, best: np.ndarray, z: np.ndarray,
                      rows: Sequence[SampleRow]) -> dict[int, np.ndarray]:
    """``{row: ids}`` for the rows that draw from the whole vocabulary's distribution with
    top-p (:func:`nucleus_of_vocab`'s set) or else typical-p (:func:`typical_of_vocab`'s set,
    not yet sorted by logit), the rows needing a pass over ``V`` found together
    (:func:`_vocab_sets`). x, w: C-contiguous float32 ``[b, V]``; best, z: ``[b]``."""
    out: dict[int, np.ndarray] = {}
    todo: list[tuple[int, float, float]] = []       # (row, target, centre or NaN for top-p)
    for i, row in enumerate(rows):
        p = row.params
        if not _samples(p) or p.top_k > 0:
            continue
        if p.top_p < 1.0:
            if w[i, best[i]] >= p.top_p * z[i]:          # the most likely id alone is enough
                out[i] = np.array([best[i]])
            else:
                todo.append((i, p.top_p * z[i], np.nan))
        elif p.typical_p < 1.0:
            todo.append((i, p.typical_p * z[i], _dot(w[i], x[i]) / z[i]))
    if todo:
        sel, target, center = (np.array(a) for a in zip(*todo))
        out.update(zip(sel.tolist(), _vocab_sets(x, w, sel, target, center)))
    return out


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
