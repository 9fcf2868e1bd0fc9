"""The start-up self-checks of the ONNX Runtime backend, and their records beside the graph.

After loading, :class:`.ort_backend.OrtBackend` checks three properties the engine relies on,
on this CPU with this onnxruntime build and thread count:

- batch invariance (:meth:`StartupChecks.check_batch_invariance`): a decode row gets the same
  logits alone and in a batch; where it does not, decode rows run one per session run
  (``rows_per_decode_run = 1``): the same answers, slower under load;
- prefix-split invariance (:meth:`StartupChecks.check_prefix_split_invariance`): a prompt's KV
  does not depend on the chunks it was prefilled in; where it does, the prefix cache reuses only
  prefixes that end at a prefill cut;
- verification (:meth:`StartupChecks.check_verify_matches_decode`): a verification run gives
  the logits and KV of decoding the same tokens one by one; where it does not, no speculation.

Each outcome is recorded in the graph entry's folder (:data:`BATCH_CHECKS`), keyed by what it
depends on besides the graph (:meth:`StartupChecks._batch_check_key`) and by what was checked,
so a later start with the same key reads it instead of checking again. The batch check records
passes only (a failure is checked again at the next start); the other two record either outcome
(a failure only means the safe, slower path).

:class:`StartupChecks` runs them on a backend through its interface (``forward``, ``verify``,
``copy_kv``) and its KV cache (``kv``); they log through the backend's logger, being part of its
start.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from ..backend import SeqChunk
from ..onnx.graph_cache import write_json_atomic
from ..onnx.graph_options import default_row_multiples
from ..registry.progress import slow_step
from .providers import cpu_identity

log = logging.getLogger(f"{__package__}.ort_backend")

#: a graph entry's record of the start-up checks it went through (see ``_batch_check_key``)
BATCH_CHECKS = "batch-checks.json"


def _batch_checks(graph_path: str) -> list:
    """The entries recorded for the checks of the graph at ``graph_path``: each a check's key
    and ``"passed"``."""
    try:
        with open(os.path.join(os.path.dirname(graph_path), BATCH_CHECKS)) as fh:
            keys = json.load(fh)
    except (OSError, ValueError):
        return []
    return keys if isinstance(keys, list) else []


#: Check outcomes kept with a graph, the newest: every CPU, thread count and slot layout that
#: ran it has its own key (an outcome pushed out is checked again at the next start).
RECORDED_CHECKS = 64


def _key_of(entry: dict) -> dict:
    return {n: v for n, v in entry.items() if n != "passed"}


def _recorded_check(graph_path: str, key: dict) -> bool | None:
    """The outcome recorded for the check ``key`` of the graph at ``graph_path``, ``None`` when
    there is none (an entry without ``"passed"`` counts as a pass)."""
    outcomes = [bool(e.get("passed", True)) for e in _batch_checks(graph_path)
                if isinstance(e, dict) and _key_of(e) == key]
    return outcomes[-1] if outcomes else None


def _record_batch_check(graph_path: str, key: dict, passed: bool = True) -> None:
    """Record the outcome of the check ``key`` with the graph entry (written to a temporary
    file and renamed; an entry that cannot be written is checked again at the next start)."""
    folder = os.path.dirname(graph_path)
    keys = [e for e in _batch_checks(graph_path)
            if not isinstance(e, dict) or _key_of(e) != key] + [dict(key, passed=passed)]
    try:
        write_json_atomic(os.path.join(folder, BATCH_CHECKS), keys[-RECORDED_CHECKS:])
    except OSError as exc:
        log.debug("cannot record the batch check in %s: %s", folder, exc)


class StartupChecks:
    """The start-up checks of a loaded :class:`.ort_backend.OrtBackend` (see the module
    docstring) and their records.

    Args:
        backend: runs the checks: its ``forward``, ``verify`` and ``copy_kv``, on its KV cache
            (``backend.kv``, left empty afterwards); its ``parallel_runs`` is 1 during the batch
            check. Read from it: ``config``, ``num_slots``, ``max_seq_len``, ``max_verify_rows``,
            ``graph_path``, ``providers``, ``threads``.
        session_config: the session's extra config entries (part of each record's key).
        row_multiples: the graph's row multiples (``GraphOptions.row_multiples``).

    Attributes:
        outcomes: each check's outcome by name (``"batch"``, ``"prefix split"``,
            ``"verify"``), of those :meth:`run` ran or read from their record.
        seconds: the time each took, checked or read, by ``load_seconds`` name (``"batch
            check"``, ``"split check"``, ``"verify check"``).
    """

    def __init__(self, backend, session_config: dict[str, str] | None,
                 row_multiples: tuple = ()):
        self.backend = backend
        self.graph_path: str = backend.graph_path
        self.outcomes: dict[str, bool] = {}
        self.seconds: dict[str, float] = {}
        self._session_config = session_config
        self._row_multiples = row_multiples
        #: positions of slot 0 that hold the KV of :meth:`_check_prompt` (left by the split
        #: check for the verification check, which needs such a past)
        self._check_kv_len = 0

    def run(self, batch: bool, verify: bool) -> dict[str, bool]:
        """The checks after loading, each read from its record where there is one: the batch
        check (with 2+ slots: else never a batch) and the prefix-split check with ``batch``, the
        verification check with ``verify``. Returns :attr:`outcomes`."""
        if batch and self.backend.num_slots > 1:
            self._start_batch_check()
        if batch:
            self._start_split_check()
        if verify:
            self._start_verify_check()
        return self.outcomes

    def _start_batch_check(self) -> None:
        t0 = time.perf_counter()
        key = self._batch_check_key()
        if _recorded_check(self.graph_path, key):       # only passes are recorded
            invariant = True
            log.info("decode rows: the same logits alone and in batches (checked at an "
                     "earlier start, with this onnxruntime, CPU and thread count)")
        else:
            with slow_step(log, "checking that decode rows get the same logits in batches"):
                invariant = self.check_batch_invariance()
            if invariant:
                _record_batch_check(self.graph_path, key)
                log.info("decode rows checked: the same logits alone and in batches "
                         "(%.2f s)", time.perf_counter() - t0)
            else:
                log.warning("onnxruntime computes a decode row differently alone and in a "
                            "batch on this CPU: decode rows run one per session run, so "
                            "that every answer stays the same under any load (slower with "
                            "many streams)")
        self.outcomes["batch"] = invariant
        self.seconds["batch check"] = time.perf_counter() - t0

    def _start_split_check(self) -> None:
        t0 = time.perf_counter()
        n, pieces = self._split_check_pieces()
        key = dict(self._batch_check_key(), check="prefix split",
                   tokens=n, pieces=[list(p) for p in pieces])
        # both outcomes are recorded: a failure only means the safe, shorter reuse
        same = self.outcomes["prefix split"] = self._recorded_outcome(
            key, "checking that prompts get the same KV in any chunks",
            self.check_prefix_split_invariance)
        log.info("prefix cache: %s", "a prefix of any length is reused (prompt KV checked: "
                 "the same in any chunks of 2+ tokens)" if same else
                 "prompt KV depends on the chunks it is computed in on this CPU: only "
                 "prefixes ending at a prefill cut are reused")
        self.seconds["split check"] = time.perf_counter() - t0

    def _start_verify_check(self) -> None:
        t0 = time.perf_counter()
        key = dict(self._batch_check_key(), check="verify",
                   lengths=self._verify_check_pasts())
        same = self.outcomes["verify"] = self._recorded_outcome(
            key, "checking that verification matches decoding",
            self.check_verify_matches_decode)
        log.info("speculative decoding: %s", "proposed tokens are verified in one run "
                 "(checked: the same logits and KV as decoding them)" if same
                 else "a chunk's rows are not computed as decoding computes them on this "
                 "CPU: no speculation")
        self.seconds["verify check"] = time.perf_counter() - t0

    def _recorded_outcome(self, key: dict, doing: str, check: Callable[[], bool]) -> bool:
        """The outcome of ``check`` recorded with the graph under ``key``; else ``check()``
        now (saying ``doing`` when it is slow), its outcome recorded, pass or fail."""
        recorded = _recorded_check(self.graph_path, key)
        if recorded is not None:
            return recorded
        with slow_step(log, doing):
            passed = check()
        _record_batch_check(self.graph_path, key, passed)
        return passed

    def _batch_check_key(self) -> dict:
        """What the outcome of :meth:`check_batch_invariance` depends on besides the graph (whose
        entry keeps the record): onnxruntime's version and build (``onnxruntime`` and
        ``onnxruntime-cann`` share version numbers), the CPU (model and feature flags), the
        providers, intra-op threads, session config entries and the rows checked."""
        import onnxruntime as ort

        be = self.backend
        build = f"{ort.__version__} {ort.get_device()} {ort.get_build_info()}"
        config = self._session_config or {}
        return {"onnxruntime": build, "cpu": cpu_identity(),
                "providers": [str(p) for p in be.providers], "threads": be.threads,
                "session_config": {k: str(v) for k, v in sorted(config.items())},
                "rows": self._batch_check_rows(), "positions": self._batch_check_positions()}

    # ---- batch invariance ---------------------------------------------------------------------
    def _batch_check_positions(self) -> list[int]:
        """The position each row of :meth:`check_batch_invariance` decodes at: ``3 + s`` for row
        ``s``, wrapped into ``[1, max_seq_len)`` where that is shorter."""
        return [1 + (2 + s) % max(1, self.backend.max_seq_len - 1)
                for s in range(self._batch_check_rows())]

    def _batch_check_rows(self) -> int:
        tile = max(m for *_, m in (*self._row_multiples, *default_row_multiples()))
        return min(self.backend.num_slots, max(5, 2 * tile + 1))

    def check_batch_invariance(self) -> bool:
        """Whether a decode row gets bit for bit the same logits alone and in one session run
        of 2 .. ``n`` rows, ``n = min(num_slots, max(5, 2 m + 1))`` with ``m`` the largest row
        multiple of the graph or of this CPU's default (its kernels' row tile). One run of
        ``b`` rows is what ``forward`` makes of a decode batch beside a prompt; split over
        parallel runs, a batch is runs of fewer rows, each covered too. Row ``s`` sits at its
        own position (a prompt of ``3 + s`` fixed token ids, see
        :meth:`_batch_check_positions`). Afterwards the KV cache is emptied
        (:meth:`.kv_cache.KVCache.forget`).

        The graph is built so that this holds (see ``graph_nodes._pad_rows``); the check
        catches a CPU or an onnxruntime build whose kernels do otherwise. Costs about ``3 n``
        session runs.
        """
        be = self.backend
        n = self._batch_check_rows()
        if be.max_seq_len < 2:                          # no position to decode at
            return True
        vocab = be.config.vocab_size
        prompts = [np.arange(1, 1 + p, dtype=np.int64) % vocab
                   for p in self._batch_check_positions()]
        tokens = [np.array([(7 + 101 * s) % vocab]) for s in range(n)]

        def step(rows: range) -> np.ndarray:
            return be.forward([SeqChunk(s, len(prompts[s]), tokens[s]) for s in rows])

        lanes, be.parallel_runs = be.parallel_runs, 1           # one run per forward call
        try:
            be.forward([SeqChunk(s, 0, prompts[s]) for s in range(n)])
            alone = [step(range(s, s + 1))[0] for s in range(n)]
            return all(np.array_equal(row, alone[s])
                       for b in range(2, n + 1) for s, row in enumerate(step(range(b))))
        finally:
            be.parallel_runs = lanes
            be.kv.forget()

    # ---- prefix-split invariance --------------------------------------------------------------
    #: The pieces ``[a, b)`` :meth:`check_prefix_split_invariance` recomputes of a prompt of
    #: :data:`SPLIT_CHECK_TOKENS` tokens prefilled whole: short pieces and long ones, at the
    #: start and after a past (kernels may pick their path by the number of rows; Gemma 3 270M
    #: on MLAS gives other KV in chunks of <= 64 tokens than in chunks of >= 100).
    SPLIT_CHECK_TOKENS = 160
    SPLIT_CHECK_PIECES = ((0, 2), (2, 160), (0, 17), (17, 81), (150, 160))

    def check_prefix_split_invariance(self) -> bool:
        """Whether a prompt's KV cache (every layer, every position) and last logits are bit for
        bit the same prefilled in one chunk and in any chunks of 2+ tokens (see
        :attr:`~.backend.Backend.prefix_split_invariant`), checked on the pieces of
        :meth:`_split_check_pieces`.

        The prompt is prefilled whole in slot 0; each piece ``[a, b)`` is then computed again on
        top of that KV (the positions before ``a`` as the whole prefill left them) and must
        reproduce the KV of its positions, and the last logits where it ends the prompt. By
        induction over the pieces of any chunking, that is the same outcome as prefilling the
        chunking from the start, for fewer positions computed: one prefill of
        :data:`SPLIT_CHECK_TOKENS` tokens and the pieces' tokens, spread over the parallel
        runs (a piece per lane's slot in each ``forward``; each of those slots gets a copy of
        the whole prefill's KV). Slot 0 keeps the prompt's KV for
        :meth:`check_verify_matches_decode`; the other slots' is forgotten. Either outcome is
        recorded beside the batch check, keyed by what was checked.

        Fails where a kernel chooses its path by the number of rows: a position computed in a
        short chunk then gets other KV than in a long one.
        """
        be, kv = self.backend, self.backend.kv
        n, pieces = self._split_check_pieces()
        prompt = self._check_prompt(n)
        lanes = min(be.parallel_runs, be.num_slots, max(1, len(pieces)))
        same: list[bool] = []
        try:
            whole = be.forward([SeqChunk(0, 0, prompt)])[0]
            for slot in range(1, lanes):
                be.copy_kv(0, slot, n)
            for first in range(0, len(pieces), lanes):
                run = list(enumerate(pieces[first:first + lanes]))     # (slot, piece)
                before = [kv.positions(slot, a, b) for slot, (a, b) in run]
                logits = be.forward([SeqChunk(slot, a, prompt[a:b]) for slot, (a, b) in run])
                same += [(b < n or np.array_equal(logits[slot], whole)) and all(
                    np.array_equal(x, y)
                    for x, y in zip(before[slot], kv.positions(slot, a, b), strict=True))
                    for slot, (a, b) in run]
            self._check_kv_len = n
            return all(same)
        finally:
            for slot in range(lanes):
                kv.used[slot] = 0

    def _check_prompt(self, n: int) -> np.ndarray:
        """int64 ``[n]``: the fixed token ids the prompt and verification checks prefill."""
        return (np.arange(n, dtype=np.int64) * 7919 + 11) % self.backend.config.vocab_size

    def _split_check_pieces(self) -> tuple[int, list[tuple[int, int]]]:
        """``(n, pieces)`` of :meth:`check_prefix_split_invariance`: its prompt's length
        ``n = min(SPLIT_CHECK_TOKENS, max_seq_len)`` and :data:`SPLIT_CHECK_PIECES` cut to it,
        those left shorter than 2 tokens (what the check vouches for) or whole dropped -- part
        of its record's key."""
        n = min(self.SPLIT_CHECK_TOKENS, self.backend.max_seq_len)
        pieces = [(a, min(b, n)) for a, b in self.SPLIT_CHECK_PIECES]
        return n, [(a, b) for a, b in pieces if b - a >= 2 and (a, b) != (0, n)]

    # ---- verification -------------------------------------------------------------------------
    #: past lengths at which :meth:`check_verify_matches_decode` verifies a chunk (and one past
    #: the sliding window, for models with local layers).
    VERIFY_CHECK_LENGTHS = (21, 150)

    def _verify_check_pasts(self) -> list[int]:
        """The positions :meth:`check_verify_matches_decode` verifies a chunk of 2 or more
        tokens after, longest first: those of :data:`VERIFY_CHECK_LENGTHS` and
        ``sliding_window + 7`` that ``max_seq_len`` leaves room for, else the last that does
        (none below 3 positions) -- part of its record's key."""
        be = self.backend
        w, rows, size = be.config.sliding_window, be.max_verify_rows, be.max_seq_len
        fit = [p for p in {*self.VERIFY_CHECK_LENGTHS, *([w + 7] if w else [])}
               if min(rows, size - p) >= 2]
        if not fit and size >= 3:
            fit = [max(1, size - rows)]
        return sorted(fit, reverse=True)

    def check_verify_matches_decode(self) -> bool:
        """Whether the backend's ``verify`` gives bit for bit the logits and KV of decoding the
        same tokens one by one (:func:`.graph_layers.verify_attention`), for a chunk of
        ``max_verify_rows`` tokens after each of :data:`VERIFY_CHECK_LENGTHS` positions
        (and ``sliding_window + 7``). One prompt is prefilled once, up to the longest of those
        positions (on from the positions the split check left in slot 0); the chunks are then
        decoded and verified from the longest position down (each leaves the positions before
        it as they were). Uses slot 0, whose KV is forgotten afterwards.

        Would fail where the matrix products compute a chunk's few rows otherwise than decode
        rows, or where an onnxruntime version computes GroupQueryAttention otherwise than
        :func:`.graph_layers.verify_attention` assumes; speculation is then off.
        """
        be, kv = self.backend, self.backend.kv
        pasts = self._verify_check_pasts()
        if not pasts:                   # no room for a verification of 2+ tokens: none vouched
            return False
        ids = self._check_prompt(pasts[0] + be.max_verify_rows)
        have = min(self._check_kv_len, pasts[0])    # left by the split check: not again
        try:
            if have < pasts[0]:
                be.forward([SeqChunk(0, have, ids[have:pasts[0]])])
            for past in pasts:
                n = min(be.max_verify_rows, be.max_seq_len - past)
                steps = np.stack([be.forward([SeqChunk(0, past + k, ids[past + k:][:1])])[0]
                                  for k in range(n)])
                decoded = kv.positions(0, 0, past + n)
                rows = be.verify(0, past, ids[past:past + n])
                if not (np.array_equal(rows, steps) and all(
                        np.array_equal(a, b)
                        for a, b in zip(decoded, kv.positions(0, 0, past + n), strict=True))):
                    return False
            return True
        finally:
            kv.used[0] = 0
            self._check_kv_len = 0
