"""The ONNX Runtime backend: the decoder graph of :mod:`.graph` in one ``InferenceSession``.

The graph comes from the cache of built graphs (:mod:`.graph_cache`); the session's providers,
threads and options from :mod:`.providers`; it is opened by :mod:`.ort_session`, and its resident
memory is kept low by :mod:`.memory`. The backend is one class made of parts, each with its own
state: the KV cache (:class:`.kv_cache.KVCache`), the shape policy of its graph's runs
(:mod:`.shapes`: dynamic for the contrib graph, static, padded, for the standard graph) and the
start-up checks (:class:`.startup_checks.StartupChecks`). This module schedules the session runs.

KV cache and continuous batching
--------------------------------
The KV cache (:class:`.kv_cache.KVCache`) is one buffer per layer for keys and one for
values, each ``float32 [P, Nkv, max_seq_len, H]`` with ``P = num_slots`` physical rows; pages
are allocated lazily by the OS, so unused positions cost no resident memory.
GroupQueryAttention reads and writes these buffers in place: for a session run over physical
rows ``[r, r + B)``, ``past_key.{i}`` and ``present_key.{i}`` are both bound (I/O binding) to
the view ``k[i][r:r+B]``. That view must be contiguous, so a batch must occupy *consecutive*
physical rows: the cache keeps a map slot -> physical row and, when the slots of a decode batch
are not consecutive, swaps rows (copying only the positions in use) to make them so. Engines
that hand out slots from a free list rarely trigger a swap.

One :meth:`OrtBackend.forward` call is split into session runs:

- the single-token chunks (decode), ``S = 1``, as one run over their rows, or split into up to
  ``parallel_runs`` runs over consecutive groups of rows (see below);
- each multi-token chunk (prefill) in its own run, ``B = 1``, ``S = n`` (no padding, so nothing
  can leak between rows); chunks longer than ``max_chunk_tokens`` are run in pieces (the
  attention scratch of a run is ``num_heads * S * max_seq_len`` floats).

Parallel runs: an ``InferenceSession`` may be run from several threads at once (onnxruntime
documents ``Run`` as thread-safe, and the Python binding releases the GIL during it), sharing
the prepacked weights. With ``parallel_runs = L > 1`` the runs of one ``forward`` are spread over
``L`` threads, each run on its own intra-op thread(s): a decode batch alone is split into ``L``
runs over consecutive groups of rows; with prefill chunks present the decode rows stay one run,
and it and the chunks go to the threads longest first, each to the least loaded one (costs in
prompt tokens, :data:`DECODE_RUN_COST`), so new prompts are prefilled *beside* the running
streams. Every run writes only its own KV rows and logits rows.
Why: a second intra-op thread splits every operator, so each one waits for the slower core
(a single stream slows down whenever another process keeps one core busy), while separate runs
leave a single stream on its one core -- what ``threads=1`` gives where other processes share
the CPUs. Default ``L = CPUs // threads``: 1 with the default threads (every CPU, so a lone
stream uses every core), the number of CPUs with ``threads=1``; 1 on other execution
providers. A second
session with more intra-op threads for a lone stream would hold its own copy of the prepacked
weights (the Python binding cannot share them between sessions), so there is none. The
intra-op thread count does not change a row's arithmetic (the kernels split output columns and
heads over threads, not sums).

Batch invariance: a decode row must get the same logits in a run of one row and in a run of
many (else a seeded or greedy answer would change with the load). The graph pads the matrix
products whose kernels need it (see ``graph_nodes._pad_rows``); after loading,
:meth:`.startup_checks.StartupChecks.check_batch_invariance` checks it on this CPU, and if a row
differs, decode rows run one per session run (``rows_per_decode_run = 1``): the same answers,
slower under load.

How a run is bound and what its tokens and rows are padded to is the shape policy's
(:mod:`.shapes`).

Prefix caching: a slot keeps its KV after its sequence ends (``KVCache.used`` still counts its
positions, so row swaps carry it along); the engine reuses it for a later prompt with the same
prefix, or copies it into another slot (:meth:`OrtBackend.copy_kv`). That keeps the answer
the same only if a prompt's KV does not depend on how it was chunked:
:meth:`.startup_checks.StartupChecks.check_prefix_split_invariance` checks that at start-up
(recorded beside the batch check); its outcome is ``prefix_split_invariant``.

Why prefill chunks run alone: onnxruntime's GroupQueryAttention rejects ``S > 1`` with past
context at ``B > 1``, and on CPU a prompt's matmuls are already wide (``M = n``), so batching
prompts would only add padding. Decode rows are where batching pays: one read of the weights
serves every row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..arch import ModelConfig
from ..backend import Backend, SeqChunk, available_cpus, check_chunks
from ..gguf import GGUFFile
from ..onnx.graph_cache import cached_graph
from ..onnx.graph_options import GraphOptions
from ..options import BackendOptions, SessionTuning
from ..registry.progress import slow_step
from .kv_cache import KVCache
from .ort_session import (
    HugePageMove,
    for_provider,
    gguf_initializers,
    kernel_library,
    open_session,
    with_rotary_table,
)
from .providers import (
    CPU,
    default_threads,
    device_name,
    node_placement,
    ops_by_provider,
    placement_summary,
    select_providers,
    session_options,
)
from .shapes import shape_policy
from .startup_checks import StartupChecks

log = logging.getLogger(__name__)

#: What a decode run costs beside prefill, in prompt tokens, on top of one per row: lanes are
#: balanced on ``tokens`` for a prefill run and ``DECODE_RUN_COST + rows`` for a decode run (a
#: decode run's fixed cost is about that of four prompt tokens).
DECODE_RUN_COST = 4


def _run_all(runs: Sequence[Callable[[], None]]) -> None:
    for run in runs:
        run()


# ---- the backend -----------------------------------------------------------------------------

class OrtBackend(Backend):
    """The decoder as an ONNX Runtime session with a slot-based, in-place KV cache.

    Args:
        f: the opened model file.
        config: its parameters (``ModelConfig.from_gguf(f)``).
        options: the backend's choices (:class:`~..options.BackendOptions`); read here:
            ``threads`` (0: :func:`.providers.default_threads`, every CPU), ``parallel_runs``
            (session runs executed at once by one :meth:`forward`; 0: CPUs // threads on the
            CPU provider, 1 elsewhere; at most ``num_slots``; see the module docstring),
            ``device_id`` (the NPU of the CANN execution provider), ``providers`` (see
            :func:`.providers.select_providers`; empty: chosen), ``spinning`` (idle intra-op
            threads spin: lower latency, CPU burnt between runs) and ``batch_invariant`` (run
            the batch check, :meth:`.startup_checks.StartupChecks.check_batch_invariance`,
            after loading, and if it fails run every decode row alone,
            ``rows_per_decode_run = 1``). The graph is ``graph_options``' (the loader makes it
            from the rest of ``options``, :func:`~..loader.load_model`).
        num_slots: sequences the KV cache holds at once.
        max_seq_len: positions per slot.
        graph_options: graph build choices (:class:`~.graph_options.GraphOptions`).
        cache_dir: where built graphs are cached (default: next to the GGUF; see
            :mod:`.graph_cache`).
        tuning: how the session is opened (:class:`~..options.SessionTuning`): the longest
            piece of a prefill chunk run at once, extra session config entries, the
            weight-file pages given back after loading (:func:`.memory.release_file_pages`)
            and the prepacked weights moved to huge pages (:func:`.memory.use_huge_pages`), in
            the background (:attr:`huge_page_bytes`).

    Raises:
        ValueError: ``num_slots`` or ``max_seq_len`` below 1, ``parallel_runs`` below 0.
        ImportError: onnxruntime does not import.

    Attributes:
        providers: the providers the session actually uses; ``device`` the first of them.
        node_placement: nodes of the optimized graph per provider, most first
            (:func:`.providers.node_placement`; empty where onnxruntime does not tell);
            ``placement_ops``: the same per operator type (:func:`.providers.ops_by_provider`).
        graph: the graph's flavour, ``"contrib"`` or ``"standard"`` (``GraphOptions.flavour``).
        kv: the KV cache (:class:`.kv_cache.KVCache`).
        shapes: the shape policy of the runs, chosen by the flavour
            (:func:`.shapes.shape_policy`): :class:`.shapes.StaticShapes` for the standard graph
            (its padding sizes ``decode_batches``, ``chunk_lengths``, ``spans``),
            :class:`.shapes.DynamicShapes` for the contrib graph.
        checks: the start-up checks (:class:`.startup_checks.StartupChecks`: their outcomes).
        graph_path: the ``model.onnx`` in use; ``built``: whether this start built it;
        load_seconds: start-up times in seconds, ``{"graph": ..., "session": ...}``, plus
            ``"batch check"``, ``"split check"``, ``"verify check"`` for the checks that ran.
        mapped_weight_bytes: bytes of the GGUF the session reads in place, mapped (the custom
            kernels' blocks, :func:`.ort_session.gguf_initializers`); 0 with onnxruntime's
            kernels. They count in resident memory as file-backed pages once touched.
    """

    name = "onnxruntime"

    def __init__(self, f: GGUFFile, config: ModelConfig,
                 options: BackendOptions = BackendOptions(), *, num_slots: int = 8,
                 max_seq_len: int = 2048, graph_options: GraphOptions = GraphOptions(),
                 cache_dir: str | None = None, tuning: SessionTuning = SessionTuning()):
        import onnxruntime  # noqa: F401  (missing: ImportError now, before a graph is built)

        parallel_runs, device_id = options.parallel_runs, options.device_id
        if num_slots < 1 or max_seq_len < 1 or parallel_runs < 0:
            raise ValueError(f"num_slots ({num_slots}) and max_seq_len ({max_seq_len}) must be "
                             f">= 1, parallel_runs ({parallel_runs}) >= 0")
        graph_options = with_rotary_table(graph_options, config, max_seq_len)
        self.config = config
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.max_chunk_tokens = max(1, tuning.max_chunk_tokens)

        chosen = select_providers(list(options.providers) or None, device_id)
        graph_options = for_provider(graph_options, chosen)
        self._graph_options = graph_options
        t0 = time.perf_counter()
        self.graph_path, self.built = cached_graph(f, config, graph_options, cache_dir)
        t1 = time.perf_counter()
        self.threads = int(options.threads) or default_threads()
        release = [self.graph_path + ".data"] if tuning.release_pages else []
        mapped = graph_options.kernels == "custom"      # the GGUF's pages are weights in use
        if tuning.release_pages and self.built and not mapped:  # building read all of it
            release.append(f.path)
        so = session_options(self.threads, spinning=options.spinning,
                             config=tuning.session_config,
                             custom_ops=kernel_library(graph_options.kernels))
        #: the OrtValues of the GGUF's blocks the session reads in place (kept as long as it)
        self._gguf_values = gguf_initializers(self.graph_path, f, so) if mapped else []
        self.mapped_weight_bytes = sum(int(np.prod(v.shape())) for v in self._gguf_values)
        self._session, before = open_session(self.graph_path, so, chosen, release=release,
                                             huge_pages=tuning.huge_pages)
        self._huge_pages = HugePageMove(before) if before is not None else None
        if self._huge_pages is not None:
            self._huge_pages.start()
        t2 = time.perf_counter()
        self.load_seconds = {"graph": t1 - t0, "session": t2 - t1}
        shapes = shape_policy(graph_options)
        self.kv = KVCache(config, num_slots, shapes.cache_len(max_seq_len),
                          shapes.kv_dtype(graph_options))
        self.shapes = shapes(self._session, self.kv, config, graph_options, self.max_chunk_tokens)
        self._read_session(device_id)
        self.parallel_runs = self._lanes(parallel_runs)
        self._pool = (ThreadPoolExecutor(self.parallel_runs - 1,
                                         thread_name_prefix="tiny_mindie-run")
                      if self.parallel_runs > 1 else None)
        log.info("onnxruntime session on %s (graph %s in %.2f s, session %.2f s)", self.device,
                 "built" if self.built else "cached", t1 - t0, t2 - t1)

        self._lock = threading.Lock()
        self.rows_per_decode_run = 0                    # 0: any; 1: each decode row alone
        check = self.batch_invariant = options.batch_invariant  # by the graph, or row by row
        self.checks = StartupChecks(self, tuning.session_config, graph_options.row_multiples)
        self._apply_checks(self.checks.run(batch=check, verify=self.fast_verify and check))
        self._compile_shapes()

    def _read_session(self, device_id: int) -> None:
        """What the session and its shape policy tell: the kernels, the verification rows, the
        providers in use, node placement."""
        self.kernels, self.max_verify_rows = self.shapes.kernels, self.shapes.max_verify_rows
        self.fast_verify = self.max_verify_rows > 0
        self.graph = self._graph_options.flavour
        self.providers = self._session.get_providers()
        self.device = device_name(self.providers[0], device_id)
        self.placement_ops = ops_by_provider(self._session)
        self.node_placement = node_placement(self._session)
        log.info("execution providers: %s", placement_summary(self.node_placement,
                                                               self.placement_ops))

    def _lanes(self, parallel_runs: int) -> int:
        """The session runs one :meth:`forward` executes at once, of ``parallel_runs`` asked
        (0: CPUs // threads on the CPU provider; 1 on others)."""
        if self.providers[0] != CPU:
            parallel_runs = 1
        elif parallel_runs * self.threads > available_cpus():
            log.warning("%d parallel runs x %d intra-op threads is more than the %d CPUs: the "
                        "runs will only take turns", parallel_runs, self.threads, available_cpus())
        # more runs than slots could never all be busy (a run has at least one row)
        return min(parallel_runs or max(1, available_cpus() // self.threads), self.num_slots)

    def _apply_checks(self, outcomes: dict[str, bool]) -> None:
        """The start-up checks' ``outcomes`` (:meth:`.startup_checks.StartupChecks.run`) as the
        backend's ways: decode rows one per run where the batch check failed, prefix reuse of
        any length where the split check passed, verification in one run where its check
        passed (and only then)."""
        self.rows_per_decode_run = 0 if outcomes.get("batch", True) else 1
        self.prefix_split_invariant = outcomes.get("prefix split", False)
        self.fast_verify = outcomes.get("verify", False)
        self.load_seconds.update(self.checks.seconds)

    def _compile_shapes(self) -> None:
        """On a provider other than the CPU's, run the shape policy's every static shape once
        (:meth:`warm_up`; none for dynamic shapes), so that none is compiled while a request
        waits."""
        n = self.static_shapes()
        if self.providers[0] == CPU or not n:
            return
        with slow_step(log, f"compiling the graph for {n} input shapes"):
            t0 = time.perf_counter()
            runs = self.warm_up()
        log.info("%d input shapes run once (%.1f s)", runs, time.perf_counter() - t0)

    def static_shapes(self) -> int:
        """How many sets of input shapes the runs use at most (graphs a compiling provider
        builds; :meth:`.shapes.StaticShapes.static_shapes`); 0 for dynamic shapes."""
        return self.shapes.static_shapes()

    def warm_up(self) -> int:
        """Run every static shape once, padding only, writing only scratch positions
        (:meth:`.shapes.StaticShapes.warm_up`); returns the number of runs (0 for dynamic
        shapes)."""
        with self._lock:
            return self.shapes.warm_up()

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the session's memory moved to huge pages after loading (0 without
        ``huge_pages``); waits for the move, which runs in the background."""
        if self._huge_pages is None:
            return 0
        self._huge_pages.join()
        return self._huge_pages.moved

    # ---- Backend interface ------------------------------------------------------------------
    def forward(self, chunks: Sequence[SeqChunk]) -> np.ndarray:
        """See :meth:`Backend.forward`. Decode rows run as one batch (or ``parallel_runs``
        groups of rows run at once), prefill chunks one by one beside them.

        Also raises ``ValueError`` for token ids outside ``[0, vocab_size)`` or not 1-D.
        """
        ids = check_chunks(chunks, self.num_slots, self.max_seq_len, self.config.vocab_size)
        out = np.empty((len(chunks), self.config.vocab_size), dtype=np.float32)
        with self._lock:
            decode = [i for i, a in enumerate(ids) if len(a) == 1]
            prefill = [i for i, a in enumerate(ids) if len(a) > 1]
            runs: list[tuple[int, Callable[[], None]]] = []     # (cost, run)
            if decode:      # split over the lanes when decoding alone; else prefill shares them
                runs += self._decode_runs([chunks[i].slot for i in decode],
                                          [chunks[i].start for i in decode],
                                          [ids[i][0] for i in decode], decode, out,
                                          1 if prefill else self.parallel_runs)
            runs += [(len(ids[i]),
                      self._prefill_run(chunks[i].slot, chunks[i].start, ids[i], out, i))
                     for i in prefill]
            lanes: list[list[Callable[[], None]]] = [[] for _ in range(self.parallel_runs)]
            load = [0] * self.parallel_runs
            for cost, run in sorted(runs, key=lambda r: -r[0]):   # longest first, to the
                k = load.index(min(load))                          # least loaded lane
                lanes[k].append(run)
                load[k] += cost
            self._run_lanes(lanes)
        return out

    def verify(self, slot: int, start: int, token_ids: np.ndarray) -> np.ndarray:
        """See :meth:`Backend.verify`: runs with the graph's ``verify`` input set
        (:func:`.graph_layers.verify_attention`) of up to :attr:`max_verify_rows` tokens each, where
        the graph has it."""
        if not self.fast_verify:
            return super().verify(slot, start, token_ids)
        ids = check_chunks([SeqChunk(slot, start, token_ids)], self.num_slots, self.max_seq_len,
                           self.config.vocab_size)[0]
        out = np.empty((len(ids), self.config.vocab_size), np.float32)
        with self._lock:
            self.kv.used[slot] = min(self.kv.used[slot], start)
            for j in range(0, len(ids), self.max_verify_rows):
                piece = ids[j:j + self.max_verify_rows]
                out[j:j + len(piece)] = self._piece(slot, start + j, piece,
                                                    list(range(len(piece))), verify=True)
        return out

    def copy_kv(self, src_slot: int, dst_slot: int, n: int) -> None:
        """See :meth:`.backend.Backend.copy_kv`: positions ``[0, n)`` of every layer's key and
        value buffer (:meth:`.kv_cache.KVCache.copy`)."""
        self._check_copy(src_slot, dst_slot, n)
        with self._lock:
            self.kv.copy(src_slot, dst_slot, n)

    def kv_cache_bytes(self) -> int:
        return self.kv.nbytes

    def close(self) -> None:
        if self._huge_pages is not None:
            self._huge_pages.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.shapes.close()
        self._session = None
        self._gguf_values = []
        self.kv.close()

    # ---- internals --------------------------------------------------------------------------
    def _run_lanes(self, lanes: list[list[Callable[[], None]]]) -> None:
        """Run each lane's runs in order, the lanes at once (the first in this thread)."""
        lanes = [lane for lane in lanes if lane]
        futures = [self._pool.submit(_run_all, lane) for lane in lanes[1:]] if self._pool else []
        try:
            for lane in lanes[:1] if self._pool else lanes:
                _run_all(lane)
        finally:
            for fut in futures:     # every run finishes before the buffers are touched again
                fut.result()

    def _decode_runs(self, slots: list[int], starts: list[int], tokens: list[int],
                     out_rows: list[int], out: np.ndarray, groups: int
                     ) -> list[tuple[int, Callable[[], None]]]:
        """Runs giving one token to each of ``B`` slots: the slots' physical rows are made
        consecutive, then split into up to ``groups`` runs of consecutive rows; each run writes
        its logits to ``out[out_rows[j]]`` for its chunks ``j``. Returns ``(cost, run)`` pairs,
        the cost in prompt-token equivalents (:data:`DECODE_RUN_COST` + rows)."""
        # positions >= start are about to be rewritten
        for s, st in zip(slots, starts, strict=True):
            self.kv.used[s] = min(self.kv.used[s], st)
        self.kv.arrange(slots)
        order = sorted(range(len(slots)), key=lambda j: self.kv.row(slots[j]))
        if self.rows_per_decode_run == 1:          # see check_batch_invariance
            groups = len(slots)
        return [(DECODE_RUN_COST + len(g), self._decode_group(
                    [slots[j] for j in g], [starts[j] for j in g], [tokens[j] for j in g],
                    [out_rows[j] for j in g], out))
                for g in np.array_split(np.array(order), min(groups, len(slots)))]

    def _decode_group(self, slots: list[int], starts: list[int], tokens: list[int],
                      out_rows: list[int], out: np.ndarray) -> Callable[[], None]:
        """The run giving one token to each of ``slots`` (on consecutive physical rows, in row
        order), its logits to ``out[out_rows]``; its binding is made now, not in a worker
        thread (:meth:`.shapes.DynamicShapes.decode`)."""
        decode = self.shapes.decode(self.kv.row(slots[0]), len(slots))

        def run() -> None:
            out[out_rows] = decode(starts, tokens)
            for s, st in zip(slots, starts, strict=True):
                self.kv.used[s] = st + 1
        return run

    def _prefill_run(self, slot: int, start: int, tokens: np.ndarray, out: np.ndarray,
                     out_row: int) -> Callable[[], None]:
        """The run(s) of one prompt chunk (``B = 1``), in pieces of ``max_chunk_tokens``; the
        last piece's logits go to ``out[out_row]``. Its binding is made now."""
        self.kv.used[slot] = min(self.kv.used[slot], start)
        self.shapes.prepare_piece(self.kv.row(slot))

        def run() -> None:
            for j in range(0, len(tokens), self.max_chunk_tokens):
                piece = tokens[j:j + self.max_chunk_tokens]
                logits = self._piece(slot, start + j, piece, [len(piece) - 1])
            out[out_row] = logits[0]
        return run

    def _piece(self, slot: int, start: int, piece: np.ndarray, rows: list[int], *,
               verify: bool = False) -> np.ndarray:
        """One session run of ``piece`` (int64 ``[n]``) of ``slot`` at ``start``
        (:meth:`.shapes.DynamicShapes.piece`); returns the logits of its ``rows``, float32
        ``[len(rows), V]``, valid until the slot's next run."""
        logits = self.shapes.piece(self.kv.row(slot), start, piece, rows, verify=verify)
        self.kv.used[slot] = start + len(piece)
        return logits
