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

The checks are a mixin of :class:`.ort_backend.OrtBackend`: they run its session and KV cache,
and they log through its logger, being part of its start.
"""

from __future__ import annotations

import json
import logging
import mmap
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
    """The start-up checks of :class:`.ort_backend.OrtBackend` (see the module docstring).

    They use the backend's session runs (``forward``, ``verify`` and the prefill runs), its KV
    buffers and slot layout, and set its ``rows_per_decode_run``, ``prefix_split_invariant``,
    ``fast_verify`` and ``load_seconds`` entries.
    """

    def _run_startup_checks(self, session_config: dict[str, str] | None,
                            check_batching: bool) -> None:
        """The checks after loading, each read from its record where there is one: the batch
        and prefix-split checks with ``check_batching``, the verification check where the graph
        verifies (and its rows are padded as decode's: ``check_batching`` too)."""
        if check_batching and self.num_slots > 1:       # one slot: never a batch
            self._start_batch_check(session_config)
        if check_batching:
            self._start_split_check(session_config)
        if self.fast_verify and not check_batching:
            self.fast_verify = False    # unpadded rows: a chunk's rows are not decode's
        if self.fast_verify:
            self._start_verify_check(session_config)

    def _start_batch_check(self, session_config: dict[str, str] | None) -> None:
        t0 = time.perf_counter()
        key = self._batch_check_key(session_config)
        if _recorded_check(self.graph_path, key):       # only passes are recorded
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
                self.rows_per_decode_run = 1
                log.warning("onnxruntime computes a decode row differently alone and in a "
                            "batch on this CPU: decode rows run one per session run, so "
                            "that every answer stays the same under any load (slower with "
                            "many streams)")
        self.load_seconds["batch check"] = time.perf_counter() - t0

    def _start_split_check(self, session_config: dict[str, str] | None) -> None:
        t0 = time.perf_counter()
        n, pieces = self._split_check_pieces()
        key = dict(self._batch_check_key(session_config), check="prefix split",
                   tokens=n, pieces=[list(p) for p in pieces])
        # both outcomes are recorded: a failure only means the safe, shorter reuse
        self.prefix_split_invariant = self._recorded_outcome(
            key, "checking that prompts get the same KV in any chunks",
            self.check_prefix_split_invariance)
        log.info("prefix cache: %s", "a prefix of any length is reused (prompt KV checked: "
                 "the same in any chunks of 2+ tokens)" if self.prefix_split_invariant else
                 "prompt KV depends on the chunks it is computed in on this CPU: only "
                 "prefixes ending at a prefill cut are reused")
        self.load_seconds["split check"] = time.perf_counter() - t0

    def _start_verify_check(self, session_config: dict[str, str] | None) -> None:
        t0 = time.perf_counter()
        key = dict(self._batch_check_key(session_config), check="verify",
                   lengths=self._verify_check_pasts())
        self.fast_verify = self._recorded_outcome(
            key, "checking that verification matches decoding",
            self.check_verify_matches_decode)
        log.info("speculative decoding: %s", "proposed tokens are verified in one run "
                 "(checked: the same logits and KV as decoding them)" if self.fast_verify
                 else "a chunk's rows are not computed as decoding computes them on this "
                 "CPU: no speculation")
        self.load_seconds["verify check"] = time.perf_counter() - t0

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

    def _batch_check_key(self, session_config: dict[str, str] | None) -> dict:
        """What the outcome of :meth:`check_batch_invariance` depends on besides the graph (whose
        entry keeps the record): onnxruntime's version and build (``onnxruntime`` and
        ``onnxruntime-cann`` share version numbers), the CPU (model and feature flags), the
        providers, intra-op threads, session config entries and the rows checked."""
        import onnxruntime as ort

        build = f"{ort.__version__} {ort.get_device()} {ort.get_build_info()}"
        return {"onnxruntime": build, "cpu": cpu_identity(),
                "providers": [str(p) for p in self.providers], "threads": self.threads,
                "session_config": {k: str(v) for k, v in sorted((session_config or {}).items())},
                "rows": self._batch_check_rows(), "positions": self._batch_check_positions()}

    # ---- batch invariance ---------------------------------------------------------------------
    def _batch_check_positions(self) -> list[int]:
        """The position each row of :meth:`check_batch_invariance` decodes at: ``3 + s`` for row
        ``s``, wrapped into ``[1, max_seq_len)`` where that is shorter."""
        return [1 + (2 + s) % max(1, self.max_seq_len - 1)
                for s in range(self._batch_check_rows())]

    def _batch_check_rows(self) -> int:
        tile = max(m for *_, m in (*self._graph_options.row_multiples,
                                   *default_row_multiples()))
        return min(self.num_slots, max(5, 2 * tile + 1))

    def check_batch_invariance(self) -> bool:
        """Whether a decode row gets bit for bit the same logits alone and in one session run
        of 2 .. ``n`` rows, ``n = min(num_slots, max(5, 2 m + 1))`` with ``m`` the largest row
        multiple of the graph or of this CPU's default (its kernels' row tile). One run of
        ``b`` rows is what :meth:`forward` makes of a decode batch beside a prompt; split over
        parallel runs, a batch is runs of fewer rows, each covered too. Row ``s`` sits at its
        own position (a prompt of ``3 + s`` fixed token ids, see
        :meth:`_batch_check_positions`). Afterwards the slots are forgotten
        (layout reset, KV pages given back).

        The graph is built so that this holds (see ``graph_nodes._pad_rows``); the check
        catches a CPU or an onnxruntime build whose kernels do otherwise. Costs about ``3 n``
        session runs.
        """
        n = self._batch_check_rows()
        if self.max_seq_len < 2:                        # no position to decode at
            return True
        vocab = self.config.vocab_size
        prompts = [np.arange(1, 1 + p, dtype=np.int64) % vocab
                   for p in self._batch_check_positions()]
        tokens = [np.array([(7 + 101 * s) % vocab]) for s in range(n)]

        def step(rows: range) -> np.ndarray:
            return self.forward([SeqChunk(s, len(prompts[s]), tokens[s]) for s in rows])

        lanes, self.parallel_runs = self.parallel_runs, 1       # one run per forward call
        try:
            self.forward([SeqChunk(s, 0, prompts[s]) for s in range(n)])
            alone = [step(range(s, s + 1))[0] for s in range(n)]
            return all(np.array_equal(row, alone[s])
                       for b in range(2, n + 1) for s, row in enumerate(step(range(b))))
        finally:
            self.parallel_runs = lanes
            self._phys = list(range(self.num_slots))
            self._slot_at = list(range(self.num_slots))
            self._used = [0] * self.num_slots
            self.swaps = 0
            if hasattr(mmap, "MADV_REMOVE"):            # shared anonymous: pages freed, zeros again
                self._kv_map.madvise(mmap.MADV_REMOVE)

    # ---- prefix-split invariance --------------------------------------------------------------
    #: The pieces ``[a, b)`` :meth:`check_prefix_split_invariance` recomputes of a prompt of
    #: :data:`SPLIT_CHECK_TOKENS` tokens prefilled whole: short pieces and long ones, at the
    #: start and after a past (kernels may pick their path by the number of rows; Gemma 3 270M
    #: on MLAS gives other KV in chunks of <= 64 tokens than in chunks of >= 100).
    SPLIT_CHECK_TOKENS = 160
    SPLIT_CHECK_PIECES = ((0, 2), (2, 160), (0, 17), (17, 81), (150, 160))
    #: positions of slot 0 that hold the KV of :meth:`_check_prompt` (left by the split check
    #: for the verification check, which needs such a past)
    _check_kv_len = 0

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
        runs (each lane's slot gets a copy of the whole prefill's KV). Slot 0 keeps the
        prompt's KV for :meth:`check_verify_matches_decode`; the other slots' is forgotten.
        Either outcome is recorded beside the batch check, keyed by what was checked.

        Fails where a kernel chooses its path by the number of rows: a position computed in a
        short chunk then gets other KV than in a long one.
        """
        n, pieces = self._split_check_pieces()
        prompt = self._check_prompt(n)
        lanes = min(self.parallel_runs, self.num_slots, max(1, len(pieces)))
        logits = np.empty((1 + len(pieces), self.config.vocab_size), np.float32)
        rows = [self._phys[slot] for slot in range(lanes)]
        same = [True] * len(pieces)

        def lane(slot: int) -> None:
            for i in range(slot, len(pieces), lanes):
                a, b = pieces[i]
                before = [buf[rows[slot], :, a:b].copy() for buf in self._k + self._v]
                self._prefill_run(slot, a, prompt[a:b], logits, 1 + i)()
                same[i] = (b < n or np.array_equal(logits[1 + i], logits[0])) and all(
                    np.array_equal(x, buf[rows[slot], :, a:b])
                    for x, buf in zip(before, self._k + self._v, strict=True))

        try:
            with self._lock:
                self._prefill_run(0, 0, prompt, logits, 0)()
                for buf in self._k + self._v:
                    for row in rows[1:]:
                        buf[row, :, :n] = buf[rows[0], :, :n]
                for slot in range(lanes):       # bindings made here, not in a worker thread
                    self._prepare_chunks(slot)
                self._run_lanes([[lambda s=slot: lane(s)] for slot in range(lanes)])
            self._check_kv_len = n
            return all(same)
        finally:
            for slot in range(lanes):
                self._used[slot] = 0

    def _check_prompt(self, n: int) -> np.ndarray:
        """int64 ``[n]``: the fixed token ids the prompt and verification checks prefill."""
        return (np.arange(n, dtype=np.int64) * 7919 + 11) % self.config.vocab_size

    def _split_check_pieces(self) -> tuple[int, list[tuple[int, int]]]:
        """``(n, pieces)`` of :meth:`check_prefix_split_invariance`: its prompt's length
        ``n = min(SPLIT_CHECK_TOKENS, max_seq_len)`` and :data:`SPLIT_CHECK_PIECES` cut to it,
        those left shorter than 2 tokens (what the check vouches for) or whole dropped -- part
        of its record's key."""
        n = min(self.SPLIT_CHECK_TOKENS, self.max_seq_len)
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
        w = self.config.sliding_window
        fit = [p for p in {*self.VERIFY_CHECK_LENGTHS, *([w + 7] if w else [])}
               if min(self.max_verify_rows, self.max_seq_len - p) >= 2]
        if not fit and self.max_seq_len >= 3:
            fit = [max(1, self.max_seq_len - self.max_verify_rows)]
        return sorted(fit, reverse=True)

    def check_verify_matches_decode(self) -> bool:
        """Whether :meth:`verify` gives bit for bit the logits and KV of decoding the same
        tokens one by one (:func:`.graph_layers.verify_attention`), for a chunk of
        :attr:`max_verify_rows` tokens after each of :data:`VERIFY_CHECK_LENGTHS` positions
        (and ``sliding_window + 7``). One prompt is prefilled once, up to the longest of those
        positions (on from the positions the split check left in slot 0); the chunks are then
        decoded and verified from the longest position down (each leaves the positions before
        it as they were). Uses slot 0, whose KV is forgotten afterwards.

        Would fail where the matrix products compute a chunk's few rows otherwise than decode
        rows, or where an onnxruntime version computes GroupQueryAttention otherwise than
        :func:`.graph_layers.verify_attention` assumes; speculation is then off.
        """
        row = self._phys[0]
        pasts = self._verify_check_pasts()
        if not pasts:                   # no room for a verification of 2+ tokens: none vouched
            return False
        ids = self._check_prompt(pasts[0] + self.max_verify_rows)
        have = min(self._check_kv_len, pasts[0])    # left by the split check: not again
        try:
            if have < pasts[0]:
                self.forward([SeqChunk(0, have, ids[have:pasts[0]])])
            for past in pasts:
                n = min(self.max_verify_rows, self.max_seq_len - past)
                steps = np.stack([self.forward([SeqChunk(0, past + k, ids[past + k:][:1])])[0]
                                  for k in range(n)])
                kv = [buf[row, :, :past + n].copy() for buf in self._k + self._v]
                rows = self.verify(0, past, ids[past:past + n])
                if not (np.array_equal(rows, steps) and all(
                        np.array_equal(a, buf[row, :, :past + n])
                        for a, buf in zip(kv, self._k + self._v, strict=True))):
                    return False
            return True
        finally:
            self._used[0] = 0
            self._check_kv_len = 0
