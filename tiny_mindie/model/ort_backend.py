"""The ONNX Runtime backend: the decoder graph of :mod:`.graph` in one ``InferenceSession``.

Execution providers: ``CANNExecutionProvider`` (Ascend NPU) is asked for only when Ascend's
``libascendcl.so`` loads (asking without it makes onnxruntime print an error and a banner);
otherwise the session runs on ``CPUExecutionProvider`` without a word. Users who bring another
provider pass ``providers=[...]`` (names or ``(name, options)`` pairs, as onnxruntime takes them).

Graph cache: the built graph (``model.onnx`` + ``model.onnx.data``) is stored under
``<dir of the GGUF>/onnx-cache/<gguf stem>-<key>/`` (or ``cache_dir``; when that directory is
not writable, ``$TINY_MINDIE_CACHE/onnx`` or ``~/.cache/tiny_mindie/onnx``), ``key`` being the
GGUF's sha256, the builder version and the graph options; a warm start loads it. Building a
graph removes the model's graphs from older builder versions (so does loading a cached one).

KV cache and continuous batching
--------------------------------
The backend owns one buffer per layer for keys and one for values, each
``float32 [P, Nkv, max_seq_len, H]`` with ``P = num_slots`` physical rows; pages are allocated
lazily by the OS, so unused positions cost no resident memory. GroupQueryAttention reads and
writes these buffers in place: for a session run over physical rows ``[r, r + B)``,
``past_key.{i}`` and ``present_key.{i}`` are both bound (I/O binding) to the view
``k[i][r:r+B]``. That view must be contiguous, so a batch must occupy *consecutive* physical
rows: the backend keeps a map slot -> physical row and, when the slots of a decode batch are not
consecutive, swaps rows (copying only the positions in use) to make them so. Engines that hand
out slots from a free list rarely trigger a swap.

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
Why: with one intra-op thread, decode at batch 8 is compute-bound (measured on 2 cores,
SmolLM2-135M: batch 1 12.1 ms; batch 8 27.7 ms as one run, 18.5 ms as two runs of 4 at once).
A second intra-op thread would also help, but it splits every operator, so each one waits for
the slower core: with another process busy on one of the 2 cores, one stream fell from 78 to
45 tok/s that way, while separate runs leave a single stream on its one core. Default
``L = CPUs // threads`` (2 on a 2-core machine with the default single intra-op thread); 1 on
other execution providers.

Batch invariance: a decode row must get the same logits in a run of one row and in a run of
many (else a seeded or greedy answer would change with the load). The graph pads the matrix
products whose kernels need it (see ``graph._pad_rows``); after loading,
:meth:`OrtBackend.check_batch_invariance` checks it on this CPU, and if a row differs, decode
rows run one per session run (``rows_per_decode_run = 1``): the same answers, slower under load.

GroupQueryAttention places a row's new tokens at ``[seqlens_k + 1 - S, seqlens_k + 1)``; for a
chunk ``(start, n)`` run alone that is ``seqlens_k = start + n - 1``, and in a decode batch each
row has its own ``seqlens_k = start``. Positions a chunk writes past ``start + n`` never exist
(no padding); stale positions from an older, longer sequence in the slot sit after the new
sequence's end, where the causal mask hides them until they are overwritten.

Why prefill chunks run alone: onnxruntime's GroupQueryAttention rejects ``S > 1`` with past
context at ``B > 1``, and on CPU a prompt's matmuls are already wide (``M = n``), so batching
prompts would only add padding. Decode rows are where batching pays: one read of the weights
serves every row (measured on 2 cores: 115 tok/s at batch 1, 260 at 4, 320 at 8).

Memory: onnxruntime repacks the quantized weights into its own buffers at load (about 130 MB
for SmolLM2-135M Q4_1), memory-maps the weight file and keeps the mappings; see
:func:`release_file_pages` for the pages it no longer needs. The KV buffers live in one
anonymous mapping (untouched positions cost nothing); the heap is trimmed after prepacking, and
the memory the session wrote, its prepacked weights above all, is moved to 2 MiB huge pages
(:func:`use_huge_pages`: a decode step streams every weight, and with fewer TLB misses and
prefetcher stops it is 6-13 % faster).
Threads: ``threads`` intra-op threads run each operator (default: all CPUs but one, see
:func:`default_threads`); spinning (the default) keeps them hot between operators.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .backend import Backend, SeqChunk, available_cpus, check_chunks
from .config import ModelConfig
from .gguf import GGUFFile, ModelFileError
from .graph import (
    BUILDER_VERSION,
    LOGITS_ROWS_KEY,
    GraphOptions,
    build_model,
    default_row_multiples,
)
from .registry import cache_root, sha256_of

log = logging.getLogger(__name__)

CANN = "CANNExecutionProvider"
CPU = "CPUExecutionProvider"


# ---- execution providers ---------------------------------------------------------------------

def ascend_available() -> bool:
    """True when Ascend's runtime library ``libascendcl.so`` can be loaded."""
    try:
        ctypes.CDLL("libascendcl.so")
    except OSError:
        return False
    return True


def select_providers(providers: Sequence[Any] | None = None, device_id: int = 0) -> list:
    """The execution providers to ask onnxruntime for.

    Args:
        providers: explicit list (names or ``(name, options)``); ``None`` chooses: CANN on
            ``device_id`` when the build has it and ``libascendcl.so`` loads, then CPU.
        device_id: NPU for the CANN provider (MindIE's ``npuDeviceIds[0]``).
    """
    if providers is not None:
        return list(providers)
    import onnxruntime as ort

    chosen: list = []
    if CANN in ort.get_available_providers() and ascend_available():
        chosen.append((CANN, {"device_id": str(device_id)}))
    chosen.append(CPU)
    return chosen


# ---- graph cache -----------------------------------------------------------------------------



def cached_graph(f: GGUFFile, config: ModelConfig, options: GraphOptions = GraphOptions(),
                 cache_dir: str | None = None) -> tuple[str, bool]:
    """Path of the built graph for ``f``, building it on a miss.

    Returns:
        ``(path of model.onnx, True if it was built now)``.
    """
    digest = sha256_of(f.path)
    stem = os.path.splitext(os.path.basename(f.path))[0]
    entry = f"{stem}-{digest[:16]}-b{BUILDER_VERSION}-{options.key()}"
    roots = [cache_dir] if cache_dir else [os.path.join(os.path.dirname(os.path.abspath(f.path)),
                                                        "onnx-cache"), os.path.join(cache_root(), "onnx")]
    for root in roots:
        path = os.path.join(root, entry, "model.onnx")
        if os.path.isfile(os.path.join(root, entry, "complete")):
            _drop_outdated(root, f"{stem}-{digest[:16]}-b")     # left by an older version, if any
            return path, False
    last_error: Exception | None = None
    for root in roots:
        try:
            os.makedirs(root, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
        except OSError as exc:
            last_error = exc
            continue
        try:
            build_model(f, config, tmp, options)
            with open(os.path.join(tmp, "complete"), "w") as fh:
                fh.write(f"sha256 {digest}\nbuilder {BUILDER_VERSION}\noptions {options.key()}\n")
            final = os.path.join(root, entry)
            try:
                os.rename(tmp, final)
            except OSError:                     # another process built it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            _drop_outdated(root, f"{stem}-{digest[:16]}-b")
            return os.path.join(final, "model.onnx"), True
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    raise ModelFileError(f"no writable directory for the ONNX graph cache ({last_error})")


def _drop_outdated(root: str, prefix: str) -> None:
    """Remove this model's graphs (entries ``prefix + version + "-" + options``) built by an
    older builder, whatever their options: this code never loads them again (a builder version
    bump would leave ~1.5x the GGUF behind for each)."""
    for name in os.listdir(root):
        version = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if version.isdigit() and int(version) < BUILDER_VERSION:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log.info("removed the outdated graph %s", name)


# ---- resident memory -------------------------------------------------------------------------

_MADV_PAGEOUT = 21      # Linux >= 5.4: reclaim these pages now (content is kept: clean file pages
                        # are re-read on the next touch, dirty ones would go to swap)


def _mappings():
    """``(start, end, permissions, path)`` of each mapping of this process, from
    ``/proc/self/maps`` (``path`` empty for anonymous memory). Raises OSError without it."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            yield lo, hi, fields[1], fields[5].rstrip("\n") if len(fields) > 5 else ""


def _madvise():
    """libc's ``madvise(addr, length, advice) -> 0 or -1``, or None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


def release_file_pages(path: str) -> int:
    """Ask the kernel to reclaim the pages of ``path`` mapped in this process; returns bytes asked.

    onnxruntime memory-maps the external weight file, reads every tensor once to prepack it into
    its own buffers, and keeps the mappings: the pages it read then count as resident although
    the kernels use the packed copies. ``MADV_PAGEOUT`` gives them back; whatever is still used
    (the embedding rows looked up, norm weights, rotary tables) is faulted in again on demand.
    A no-op where the call is unavailable.
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    try:
        real = os.path.realpath(path)
        return sum(hi - lo for lo, hi, _, name in _mappings()
                   if name == real and madvise(lo, hi - lo, _MADV_PAGEOUT) == 0)
    except (OSError, ValueError):
        return 0


_MADV_COLLAPSE = 25     # Linux >= 6.1: collapse this range's present pages into huge pages now
_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20


def anonymous_regions() -> list[tuple[int, int]]:
    """``(start, end)`` addresses of this process's private anonymous mappings (heap included)
    of at least one huge page (2 MiB), from ``/proc/self/maps``; empty where it does not exist.
    Shared and non-read-write mappings (reservations) are left out."""
    try:
        return [(lo, hi) for lo, hi, perms, name in _mappings()
                if name in ("", "[heap]") and perms[:2] == "rw" and perms[3] == "p"
                and hi - lo >= _HUGE_PAGE]
    except OSError:
        return []


#: pagemap bits 63 (present) and 56 (mapped by this process alone): a page that was only read
#: is present too, but as the kernel's shared zero page, and collapsing it would allocate memory
_OWN_PAGE = np.uint64((1 << 63) | (1 << 56))


def own_huge_pieces(lo: int, hi: int) -> list[int]:
    """Start addresses of the aligned 2 MiB pieces of ``[lo, hi)`` whose every 4 KiB page is in
    memory and this process's own (written, not the shared zero page: bits 63 and 56 of
    ``/proc/self/pagemap``); empty where pagemap is unreadable."""
    lo = -(-lo // _HUGE_PAGE) * _HUGE_PAGE
    hi = hi // _HUGE_PAGE * _HUGE_PAGE
    per = _HUGE_PAGE // _PAGE                   # pages per huge page
    step = 128 * _HUGE_PAGE                     # read pagemap 256 MiB of addresses at a time
    out: list[int] = []
    try:
        with open("/proc/self/pagemap", "rb") as fh:
            for start in range(lo, hi, step):
                n = min(step, hi - start) // _PAGE
                fh.seek(start // _PAGE * 8)
                entries = np.frombuffer(fh.read(n * 8), "<u8")
                if len(entries) != n:
                    return out
                own = ((entries & _OWN_PAGE) == _OWN_PAGE).reshape(-1, per).all(axis=1)
                out += (start + np.flatnonzero(own) * _HUGE_PAGE).tolist()
    except (OSError, ValueError):
        pass
    return out


def populated_pieces() -> set[int]:
    """:func:`own_huge_pieces` of all :func:`anonymous_regions`."""
    return {a for region in anonymous_regions() for a in own_huge_pieces(*region)}


def use_huge_pages(before: set[int]) -> int:
    """Collapse into 2 MiB transparent huge pages the pieces of private anonymous memory that are
    fully populated now and were not in ``before`` (:func:`populated_pieces` taken before a load):
    the memory the load wrote, and nothing the embedding program wrote before (what its other
    threads write during the load is collapsed too: fully written, so it costs no memory).
    Returns the bytes collapsed; 0 where ``MADV_COLLAPSE`` is missing (Linux < 6.1, other
    systems).

    Only ``MADV_COLLAPSE``, no ``MADV_HUGEPAGE``: the pages are collapsed once, now, and nothing
    asks the kernel to fill the pieces' holes later (with ``MADV_HUGEPAGE`` a later fault in a
    piece the program had partly freed would bring back a whole 2 MiB). A piece with holes is
    never collapsed (that would fill them), so resident memory does not grow.

    Why: a decode step streams every weight once (Gemma 3 270M: ~290 MB, its LM head 173 MB in
    one piece), and on 4 KiB pages that is a TLB miss every 4 KiB and a hardware prefetcher
    that stops at every page boundary. onnxruntime's prepacked weights live in ordinary
    ``malloc`` memory, which gets huge pages only when asked
    (``/sys/kernel/mm/transparent_hugepage/enabled`` is usually ``madvise``; ``MADV_COLLAPSE``
    does not depend on that setting). Measured on Gemma 3 270M, 2 threads, one process, two
    sessions run in alternation: a batch-1 decode step 11.6 ms on 4 KiB pages, 9.4 ms on huge
    pages (faster in 30 of 30 rounds); the LM head alone 5.3 -> 4.2 ms.
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    ranges: list[list[int]] = []                # consecutive pieces: one call each run
    for a in sorted(populated_pieces() - before):
        if ranges and ranges[-1][1] == a:
            ranges[-1][1] = a + _HUGE_PAGE
        else:
            ranges.append([a, a + _HUGE_PAGE])
    return sum(hi - lo for lo, hi in ranges if madvise(lo, hi - lo, _MADV_COLLAPSE) == 0)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Prepacking ~250 weights leaves freed temporary buffers inside the heap; measured: -3.4 MiB
    resident after loading SmolLM2-135M."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_threads() -> int:
    """Intra-op threads when none are configured: all CPUs this process may run on but one,
    at least 1 -- the other core serves the event loop, the engine thread and the sampler.

    Measured on the 2-vCPU machine this was written on (HTTP server, greedy streams of 64
    tokens, 15 s per point, two rounds; other jobs were running on the machine too, load
    average 1.6-4):

        clients  threads=1: agg. tok/s  ms/token/stream  TTFT    threads=2: agg. tok/s  ms/token  TTFT
        1                    86 / 77     11.2 / 12.0      29-30 ms             71 / 45    9.7 / 20.8  33-60 ms
        4                   174 / 162    21.5 / 21.8      80-84 ms            165 / 99   16.2 / 36.1  70-141 ms
        8                   213 / 221    35.3 / 34.1     111 ms              111 / 109  66.4 / 68.6  240-260 ms

    Two spinning intra-op threads on two cores fight the server's own Python threads (and
    anyone else's work): one stream on an idle machine decodes ~15 % faster with 2, but
    every loaded point was as fast or much faster with 1, and far steadier. ``--threads 2``
    (or ``intraOpThreads``) still selects two, e.g. for the single-stream benchmark.
    """
    return max(1, available_cpus() - 1)


def _zeroed_buffers(count: int, shape: tuple[int, ...]) -> tuple[mmap.mmap, list[np.ndarray]]:
    """``count`` float32 arrays of ``shape`` in one anonymous mapping: zero pages the OS only
    backs with memory when written (``np.zeros`` may instead get recycled heap memory and
    clear it: measured +7.9 MiB resident at load for 4 slots x 1024 positions)."""
    each = int(np.prod(shape)) * 4
    buf = mmap.mmap(-1, max(1, count * each))
    arrays = [np.frombuffer(buf, np.float32, int(np.prod(shape)), i * each).reshape(shape)
              for i in range(count)]
    return buf, arrays


#: What a decode run costs beside prefill, in prompt tokens, on top of one per row: measured on
#: one core (SmolLM2-135M) a decode run takes about 10 ms + 2.3 ms per row and a prompt chunk
#: 2.2 ms per token, so lanes are balanced on ``tokens`` for prefill and ``4 + rows`` for decode.
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
        num_slots: sequences the KV cache holds at once.
        max_seq_len: positions per slot.
        threads: intra-op threads (0: :func:`default_threads`, all CPUs but one).
        device_id: NPU for the CANN execution provider.
        providers: execution providers (see :func:`select_providers`); ``None`` chooses.
        cache_dir: where built graphs are cached (default: next to the GGUF).
        graph_options: graph build choices (:class:`~.graph.GraphOptions`).
        max_chunk_tokens: longest piece of a prefill chunk run at once.
        session_config: extra onnxruntime session config entries (``add_session_config_entry``).
        spinning: let idle intra-op threads spin (lower latency, burns CPU between runs).
        release_pages: after loading, give back the weight-file pages onnxruntime read while
            prepacking (see :func:`release_file_pages`).
        huge_pages: after loading, move the prepacked weights to huge pages
            (:func:`use_huge_pages`).
        parallel_runs: session runs executed at once by one :meth:`forward` (0: CPUs //
            threads on the CPU provider, 1 elsewhere; at most ``num_slots``); see the module
            docstring.
        check_batching: run :meth:`check_batch_invariance` after loading, and if it fails run
            every decode row alone (``rows_per_decode_run = 1``).

    Attributes:
        providers: the providers the session actually uses; ``device`` the first of them.
        graph_path: the ``model.onnx`` in use; ``built``: whether this start built it;
        load_seconds: ``{"graph": ..., "session": ...}`` start-up times.
    """

    name = "onnxruntime"

    def __init__(self, f: GGUFFile, config: ModelConfig, *, num_slots: int = 8,
                 max_seq_len: int = 2048, threads: int = 0, device_id: int = 0,
                 providers: Sequence[Any] | None = None, cache_dir: str | None = None,
                 graph_options: GraphOptions = GraphOptions(), max_chunk_tokens: int = 256,
                 session_config: dict[str, str] | None = None, spinning: bool = True,
                 release_pages: bool = True, parallel_runs: int = 0, huge_pages: bool = True,
                 check_batching: bool = True):
        import onnxruntime as ort

        if num_slots < 1 or max_seq_len < 1 or parallel_runs < 0:
            raise ValueError(f"num_slots ({num_slots}) and max_seq_len ({max_seq_len}) must be >= 1, "
                             f"parallel_runs ({parallel_runs}) >= 0")
        if max_seq_len > (graph_options.max_positions or config.context_length):
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the graph's rotary table "
                             f"({graph_options.max_positions or config.context_length})")
        self.config = config
        self._graph_options = graph_options
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.max_chunk_tokens = max(1, max_chunk_tokens)

        t0 = time.perf_counter()
        self.graph_path, self.built = cached_graph(f, config, graph_options, cache_dir)
        t1 = time.perf_counter()

        ort.set_default_logger_severity(3)              # errors only: no banners, no warnings
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.threads = int(threads) or default_threads()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        for key, value in (session_config or {}).items():
            so.add_session_config_entry(key, str(value))
        if huge_pages:      # freed heap pages out first, so memory the session reuses is new
            trim_heap()
        before = populated_pieces() if huge_pages else set()
        self._session = ort.InferenceSession(self.graph_path, so,
                                             providers=select_providers(providers, device_id))
        if release_pages:
            release_file_pages(self.graph_path + ".data")
            if self.built:                  # building read every tensor of the GGUF
                release_file_pages(f.path)
            trim_heap()
        # what the session wrote (its prepacked weights above all) goes to huge pages
        self.huge_page_bytes = use_huge_pages(before) if huge_pages else 0
        t2 = time.perf_counter()
        self.load_seconds = {"graph": t1 - t0, "session": t2 - t1}
        # the graph's logits may have padding rows (see graph.py, output ``logits``)
        self._logits_row_multiple = int(self._session.get_modelmeta().custom_metadata_map
                                        .get(LOGITS_ROWS_KEY, "1"))
        self.providers = self._session.get_providers()
        first = self.providers[0]
        self.device = "CPU" if first == CPU else (
            f"{first}:{device_id}" if first == CANN else first)
        if first != CPU:
            parallel_runs = 1
        elif parallel_runs * self.threads > available_cpus():
            log.warning("%d parallel runs x %d intra-op threads is more than the %d CPUs: the "
                        "runs will only take turns", parallel_runs, self.threads, available_cpus())
        # more runs than slots could never all be busy (a run has at least one row)
        self.parallel_runs = min(parallel_runs or max(1, available_cpus() // self.threads), num_slots)
        self._pool = (ThreadPoolExecutor(self.parallel_runs - 1, thread_name_prefix="tiny_mindie-run")
                      if self.parallel_runs > 1 else None)
        log.info("onnxruntime session on %s (graph %s in %.2f s, session %.2f s; %d MB of it moved "
                 "to huge pages)", self.device, "built" if self.built else "cached", t1 - t0,
                 t2 - t1, self.huge_page_bytes // 10**6)

        c = config
        shape = (num_slots, c.num_kv_heads, max_seq_len, c.head_dim)
        self._kv_map, kv = _zeroed_buffers(2 * c.num_layers, shape)
        self._k, self._v = kv[:c.num_layers], kv[c.num_layers:]
        self._row_bytes = c.num_kv_heads * max_seq_len * c.head_dim * 4
        self._phys = list(range(num_slots))             # slot -> physical row
        self._slot_at = list(range(num_slots))          # physical row -> slot
        self._used = [0] * num_slots                    # positions in use, per slot
        self._decode_bindings: dict[tuple[int, int], tuple] = {}
        self._prefill_bindings: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.swaps = 0                                  # row swaps done (for tests / metrics)
        self.rows_per_decode_run = 0                    # 0: any; 1: each decode row alone
        self.batch_invariant = check_batching           # by the graph, or row by row (below)
        if check_batching and num_slots > 1:            # one slot: never a batch
            t3 = time.perf_counter()
            if self.check_batch_invariance():
                log.info("decode rows checked: the same logits alone and in batches (%.2f s)",
                         time.perf_counter() - t3)
            else:
                self.rows_per_decode_run = 1
                log.warning("onnxruntime computes a decode row differently alone and in a batch "
                            "on this CPU: decode rows run one per session run, so that every "
                            "answer stays the same under any load (slower with many streams)")
            self.load_seconds["batch check"] = time.perf_counter() - t3

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
            runs += [(len(ids[i]), self._prefill_run(chunks[i].slot, chunks[i].start, ids[i], out, i))
                     for i in prefill]
            lanes: list[list[Callable[[], None]]] = [[] for _ in range(self.parallel_runs)]
            load = [0] * self.parallel_runs
            for cost, run in sorted(runs, key=lambda r: -r[0]):   # longest first, to the
                k = load.index(min(load))                          # least loaded lane
                lanes[k].append(run)
                load[k] += cost
            self._run_lanes(lanes)
        return out

    def kv_cache_bytes(self) -> int:
        return 2 * sum(k.nbytes for k in self._k)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._decode_bindings.clear()
        self._prefill_bindings.clear()
        self._session = None
        self._k = self._v = []
        self._kv_map = None             # unmapped once the last view is gone

    def check_batch_invariance(self) -> bool:
        """Whether a decode row gets bit for bit the same logits alone and in one session run
        of 2 .. ``n`` rows, ``n = min(num_slots, max(5, 2 m + 1))`` with ``m`` the largest row
        multiple of the graph or of this CPU's default (its kernels' row tile). One run of
        ``b`` rows is what :meth:`forward` makes of a decode batch beside a prompt; split over
        parallel runs, a batch is runs of fewer rows, each covered too. Row ``s`` sits at its
        own position (a prompt of ``3 + s`` fixed token ids). Afterwards the slots are forgotten
        (layout reset, KV pages given back).

        The graph is built so that this holds (see ``graph._pad_rows``); the check catches a
        CPU or an onnxruntime build whose kernels do otherwise. Costs about ``3 n`` session runs.
        """
        tile = max(m for _, m in (*self._graph_options.row_multiples, *default_row_multiples()))
        n = min(self.num_slots, max(5, 2 * tile + 1))
        vocab = self.config.vocab_size
        prompts = [np.arange(1, 4 + s, dtype=np.int64) % vocab for s in range(n)]
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
        for s, st in zip(slots, starts):            # positions >= start are about to be rewritten
            self._used[s] = min(self._used[s], st)
        self._arrange(slots)
        order = sorted(range(len(slots)), key=lambda j: self._phys[slots[j]])
        if self.rows_per_decode_run == 1:          # see check_batch_invariance
            groups = len(slots)
        runs = []
        for group in np.array_split(np.array(order), min(groups, len(slots))):
            r0 = self._phys[slots[group[0]]]
            entry = self._decode_binding(r0, len(group))   # made here, not in a worker thread
            runs.append((DECODE_RUN_COST + len(group), lambda g=group, e=entry: self._run_decode(
                e, [slots[j] for j in g], [starts[j] for j in g], [tokens[j] for j in g],
                [out_rows[j] for j in g], out)))
        return runs

    def _run_decode(self, entry: tuple, slots: list[int], starts: list[int], tokens: list[int],
                    out_rows: list[int], out: np.ndarray) -> None:
        """One decode run over the consecutive physical rows of ``slots`` (in row order)."""
        binding, logits, ids, seqlens, total = entry
        ids[:, 0] = tokens
        seqlens[:] = starts
        total[()] = max(starts) + 1
        self._session.run_with_iobinding(binding)
        out[out_rows] = logits
        for s, st in zip(slots, starts):
            self._used[s] = st + 1

    def _prefill_run(self, slot: int, start: int, tokens: np.ndarray, out: np.ndarray,
                     out_row: int) -> Callable[[], None]:
        """The run(s) of one prompt chunk (``B = 1``, no padding), in pieces of
        ``max_chunk_tokens``; the last piece's logits go to ``out[out_row]``."""
        self._used[slot] = min(self._used[slot], start)
        binding, logits = self._prefill_binding(self._phys[slot])

        def run() -> None:
            for j in range(0, len(tokens), self.max_chunk_tokens):
                piece = tokens[j:j + self.max_chunk_tokens]
                end = start + j + len(piece)
                binding.bind_cpu_input("input_ids", np.ascontiguousarray(piece[None, :]))
                binding.bind_cpu_input("seqlens_k", np.array([end - 1], np.int32))
                binding.bind_cpu_input("total_sequence_length", np.array(end, np.int32))
                binding.bind_cpu_input("logits_index", np.array([len(piece) - 1], np.int64))
                self._session.run_with_iobinding(binding)
                self._used[slot] = end
            out[out_row] = logits[0]
        return run

    def _arrange(self, slots: list[int]) -> int:
        """Make the physical rows of ``slots`` consecutive (swapping rows); return the first."""
        B, P = len(slots), self.num_slots
        rows = sorted(self._phys[s] for s in slots)
        if rows[-1] - rows[0] == B - 1:
            return rows[0]
        members = set(slots)
        best, best_cost = 0, None
        for w in range(P - B + 1):      # the window needing the least copying
            cost = 0
            for r in range(w, w + B):
                s = self._slot_at[r]
                if s not in members:
                    cost += self._used[s]
            for s in slots:
                if not w <= self._phys[s] < w + B:
                    cost += self._used[s]
            if best_cost is None or cost < best_cost:
                best, best_cost = w, cost
        outside = [s for s in slots if not best <= self._phys[s] < best + B]
        free = [r for r in range(best, best + B) if self._slot_at[r] not in members]
        for s, r in zip(outside, free):
            self._swap_rows(self._phys[s], r)
        return best

    def _swap_rows(self, a: int, b: int) -> None:
        sa, sb = self._slot_at[a], self._slot_at[b]
        na, nb = self._used[sa], self._used[sb]
        for buf in self._k + self._v:
            tmp = buf[a, :, :na].copy()
            buf[a, :, :nb] = buf[b, :, :nb]
            buf[b, :, :na] = tmp
        self._slot_at[a], self._slot_at[b] = sb, sa
        self._phys[sa], self._phys[sb] = b, a
        self.swaps += 1

    def _bind_kv(self, binding, r0: int, B: int) -> np.ndarray:
        """Bind the KV buffers of physical rows ``[r0, r0 + B)`` in place (past and present share
        memory) and a logits buffer; returns the logits buffer's first ``B`` rows ``[B, vocab]``
        (the buffer has ``B`` rounded up to the graph's row multiple)."""
        c = self.config
        shape = [B, c.num_kv_heads, self.max_seq_len, c.head_dim]
        off = r0 * self._row_bytes
        for i in range(c.num_layers):
            for kind, buf in (("key", self._k[i]), ("value", self._v[i])):
                ptr = buf.ctypes.data + off
                binding.bind_input(f"past_{kind}.{i}", "cpu", 0, np.float32, shape, ptr)
                binding.bind_output(f"present_{kind}.{i}", "cpu", 0, np.float32, shape, ptr)
        m = self._logits_row_multiple
        logits = np.empty((-(-B // m) * m, c.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        return logits[:B]

    def _prefill_binding(self, r0: int):
        entry = self._prefill_bindings.get(r0)
        if entry is None:
            binding = self._session.io_binding()
            entry = self._prefill_bindings[r0] = (binding, self._bind_kv(binding, r0, 1))
        return entry

    def _decode_binding(self, r0: int, B: int):
        """Binding for ``B`` decode rows at ``r0`` with its small inputs bound to reusable
        buffers (filled in place before each run)."""
        entry = self._decode_bindings.get((r0, B))
        if entry is None:
            binding = self._session.io_binding()
            logits = self._bind_kv(binding, r0, B)
            ids = np.zeros((B, 1), np.int64)
            seqlens = np.zeros(B, np.int32)
            total = np.zeros((), np.int32)
            last = np.arange(B, dtype=np.int64)
            for name, arr in (("input_ids", ids), ("seqlens_k", seqlens),
                              ("total_sequence_length", total), ("logits_index", last)):
                binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            entry = (binding, logits, ids, seqlens, total, last)
            self._decode_bindings[(r0, B)] = entry
        return entry[:5]
