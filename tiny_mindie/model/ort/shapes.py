"""The shapes of the decoder's session runs, a policy :class:`.ort_backend.OrtBackend` is given
by its graph's flavour (:func:`shape_policy`): how a decode run over consecutive KV rows and a
prompt piece of one slot are bound and run.

Dynamic shapes (:class:`DynamicShapes`, the contrib graph): every run has the shape of its
rows and tokens, no padding. GroupQueryAttention places a row's new tokens at
``[seqlens_k + 1 - S, seqlens_k + 1)``; for a chunk ``(start, n)`` run alone that is
``seqlens_k = start + n - 1``, and in a decode batch each row has its own ``seqlens_k =
start``. Positions a chunk writes past ``start + n`` never exist (no padding); stale positions
from an older, longer sequence in the slot sit after the new sequence's end, where the causal
mask hides them until they are overwritten.

Static shapes (:class:`StaticShapes`, the standard graph, :mod:`.graph_standard`): a compiling
execution provider (CANN's graph mode) builds one graph per set of input shapes, so every run
has one of a few: a decode run's rows are padded up to a size of
:attr:`StaticShapes.decode_batches` (powers of two up to ``num_slots``, and ``num_slots``), a
prompt piece's tokens up to a length of :attr:`~StaticShapes.chunk_lengths` (8, 32, 128, ... up
to ``max_chunk_tokens``), and the key positions attended to up to a span of
:attr:`~StaticShapes.spans` (256, 512, ... and ``max_seq_len``). On a provider other than the
CPU's every shape is run once at start-up (:meth:`~StaticShapes.warm_up`), so none is compiled
while a request waits. The logits rows are the run's rows (decode), 1 (a prompt piece) or the
piece's length (a verification).

Padding never touches a real position: each KV buffer row has one position more than
``max_seq_len``, a scratch position no sequence reaches, where padding tokens and padding rows
write their keys and values; they attend to position 0 only, and their logits are dropped. A
decode run over ``Bp`` padded rows binds the ``Bp`` consecutive physical rows from the batch's
first (moved back so the window fits), so padding rows are other slots' rows, of which only the
scratch position is written.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..arch import ModelConfig
from ..onnx.graph import LOGITS_ROWS_KEY, VERIFY_ROWS_KEY
from ..onnx.graph_options import VERIFY_ROWS, GraphOptions
from ..onnx.graph_standard import DTYPES
from .kv_cache import KVCache
from .ort_session import describe_kernels

#: the shortest span of key positions a run attends to; spans double from it
MIN_SPAN = 256
#: the shortest prompt piece; lengths grow fourfold from it up to ``max_chunk_tokens``
MIN_CHUNK = 8
#: ``max_chunk_tokens`` as the loader builds the backend (:class:`.ort_backend.OrtBackend`'s
#: default): the longest prompt piece of a run
MAX_CHUNK_TOKENS = 256


def buckets(first: int, factor: int, last: int) -> tuple[int, ...]:
    """``first, first * factor, ...`` below ``last``, then ``last``: the sizes a value up to
    ``last`` is padded to (:func:`bucket`)."""
    out, b = [], first
    while b < last:
        out.append(b)
        b *= factor
    return (*out, last)


def bucket(value: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) that is at least ``value``.

    Raises:
        ValueError: ``value`` is larger than all of them.
    """
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} is more than the largest static size {sizes[-1]}")


def shape_policy(options: GraphOptions) -> type[DynamicShapes] | type[StaticShapes]:
    """The policy for a graph built with ``options``: static shapes for the standard graph,
    dynamic for the contrib graph."""
    return StaticShapes if options.flavour == "standard" else DynamicShapes


class DynamicShapes:
    """Runs of the contrib graph, each of its own shape (see the module docstring).

    The policies share this interface. The class methods give the KV cache's layout
    (:class:`.kv_cache.KVCache`); an instance runs ``session`` on ``kv``'s buffers. Not thread
    safe by itself: bindings are made by the caller's thread (:meth:`decode`,
    :meth:`prepare_piece`), the runs may then go to other threads, each on its own rows.

    Args:
        session: the decoder's ``InferenceSession``.
        kv: the KV cache its runs read and write.
        config: the model's parameters.
        options: the graph's build choices.
        max_chunk_tokens: the longest prompt piece of a run.

    Attributes:
        kernels: the matrix products' kernels, as the banner says them.
        max_verify_rows: tokens of one verification run (0: the graph verifies none).
        logits_row_multiple: the graph's logits rows are padded to a multiple of it (graph.py,
            output ``logits``).
        session: the session run.
    """

    @staticmethod
    def cache_len(max_seq_len: int) -> int:
        """Positions of each KV buffer row: ``max_seq_len``."""
        return max_seq_len

    @staticmethod
    def kv_dtype(options: GraphOptions) -> type:
        """The KV buffers' element type: float32."""
        return np.float32

    def __init__(self, session, kv: KVCache, config: ModelConfig, options: GraphOptions,
                 max_chunk_tokens: int):
        self.session, self.kv, self._vocab = session, kv, config.vocab_size
        meta = session.get_modelmeta().custom_metadata_map
        self.logits_row_multiple = int(meta.get(LOGITS_ROWS_KEY, "1"))
        self.max_verify_rows = int(meta.get(VERIFY_ROWS_KEY, "0"))
        self._verify_input = self.max_verify_rows > 0       # the graph has the verify input
        self.kernels = describe_kernels(options.kernels, options.flavour)
        self._decode_bindings: dict[tuple[int, int], tuple] = {}
        self._prefill_bindings: dict[int, tuple] = {}

    def static_shapes(self) -> int:
        """Sets of input shapes the runs use at most: 0, no fixed set."""
        return 0

    def warm_up(self) -> int:
        """Nothing to run ahead (no fixed shapes): 0 runs."""
        return 0

    def decode(self, r0: int, B: int) -> Callable[[list[int], list[int]], np.ndarray]:
        """The run giving one token to each of physical rows ``[r0, r0 + B)``, its binding made
        now: called with the rows' ``starts`` and ``tokens``, it returns their logits, float32
        ``[B, V]`` (a view of a bound buffer, valid until the rows' next run)."""
        binding, logits, ids, seqlens, total = self._decode_binding(r0, B)

        def run(starts: list[int], tokens: list[int]) -> np.ndarray:
            ids[:, 0] = tokens
            seqlens[:] = starts
            total[()] = max(starts) + 1
            self.session.run_with_iobinding(binding)
            return logits
        return run

    def prepare_piece(self, r0: int) -> None:
        """Make the binding :meth:`piece` uses for physical row ``r0`` (in this thread, not a
        worker's)."""
        self._prefill_binding(r0)

    def piece(self, r0: int, start: int, piece: np.ndarray, rows: list[int], *,
              verify: bool = False) -> np.ndarray:
        """One session run of ``piece`` (int64 ``[n]``) on physical row ``r0`` at ``start``
        (``B = 1``), with the graph's ``verify`` input set when ``verify``. Returns the logits
        of its ``rows`` (indexes into the piece), float32 ``[len(rows), V]``: a view of a bound
        buffer, valid until the row's next run."""
        if verify:
            binding = self.session.io_binding()
            logits = self._bind_kv(binding, r0, 1, rows=len(rows), verify=True)
        else:
            binding, logits = self._prefill_binding(r0)
        end = start + len(piece)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(piece[None, :]))
        binding.bind_cpu_input("seqlens_k", np.array([end - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(end, np.int32))
        binding.bind_cpu_input("logits_index", np.asarray(rows, np.int64))
        self.session.run_with_iobinding(binding)
        return logits

    def close(self) -> None:
        self._decode_bindings.clear()
        self._prefill_bindings.clear()
        self.session = None

    def _bind_kv(self, binding, r0: int, B: int, *, rows: int = 0, verify: bool = False
                 ) -> np.ndarray:
        """Bind the KV buffers of physical rows ``[r0, r0 + B)`` in place (past and present share
        memory), the ``verify`` input where the graph has one, and a logits buffer; returns the
        logits buffer's first ``rows`` (default ``B``) rows ``[rows, vocab]`` (the buffer has
        them rounded up to the graph's row multiple)."""
        self.kv.bind(binding, r0, B)
        if self._verify_input:
            binding.bind_cpu_input("verify", np.array(verify))
        rows, m = rows or B, self.logits_row_multiple
        logits = np.empty((-(-rows // m) * m, self._vocab), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        return logits[:rows]

    def _prefill_binding(self, r0: int):
        entry = self._prefill_bindings.get(r0)
        if entry is None:
            binding = self.session.io_binding()
            entry = self._prefill_bindings[r0] = (binding, self._bind_kv(binding, r0, 1))
        return entry

    def _decode_binding(self, r0: int, B: int):
        """Binding for ``B`` decode rows at ``r0`` with its small inputs bound to reusable
        buffers (filled in place before each run)."""
        entry = self._decode_bindings.get((r0, B))
        if entry is None:
            binding = self.session.io_binding()
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


class StaticShapes:
    """Runs of the standard graph, padded to a small fixed set of shapes (see the module
    docstring); the interface and arguments of :class:`DynamicShapes`.

    Attributes:
        dtype: the graph's dtype (``GraphOptions.standard_dtype``).
        decode_batches: the rows a decode run is padded to.
        chunk_lengths: the tokens a prompt piece (or a verification) is padded to.
        spans: the key positions a run attends to.
        kernels, max_verify_rows, session: as :class:`DynamicShapes`'.
    """

    #: no logits rows of padding beyond those asked for
    logits_row_multiple = 1

    @staticmethod
    def cache_len(max_seq_len: int) -> int:
        """Positions of each KV buffer row: ``max_seq_len`` and one scratch position."""
        return max_seq_len + 1

    @staticmethod
    def kv_dtype(options: GraphOptions) -> type:
        """The KV buffers' element type: the graph's dtype."""
        return DTYPES[options.standard_dtype]

    def __init__(self, session, kv: KVCache, config: ModelConfig, options: GraphOptions,
                 max_chunk_tokens: int):
        self.session, self.kv, self.config = session, kv, config
        self.dtype = options.standard_dtype
        self.kernels = f"onnxruntime MatMul ({self.dtype})"
        self._scratch = kv.cache_len - 1                # the last position: no sequence's
        self.decode_batches = buckets(1, 2, kv.num_slots)
        self.chunk_lengths = buckets(MIN_CHUNK, 4, max_chunk_tokens)
        self.spans = buckets(MIN_SPAN, 2, self._scratch)        # the scratch: never seen
        # a verification is a prompt piece with every row's logits, checked at start-up
        self.max_verify_rows = VERIFY_ROWS if options.verify_rows else 0
        self._bindings: dict[tuple[int, int], object] = {}

    def static_shapes(self) -> int:
        """How many sets of input shapes the runs use at most (graphs a compiling provider
        builds): decode runs, prompt pieces and verifications, each at every span."""
        verify = 1 if self.max_verify_rows else 0
        return (len(self.decode_batches) + len(self.chunk_lengths) + verify) * len(self.spans)

    def warm_up(self) -> int:
        """Run every static shape once (:meth:`static_shapes`), padding only, so that a
        compiling provider builds its graphs now rather than when a request first needs one;
        only scratch positions are written. Returns the number of runs."""
        runs = [(b, 1, b) for b in self.decode_batches] + [(1, n, 1) for n in self.chunk_lengths]
        if self.max_verify_rows:
            n = bucket(self.max_verify_rows, self.chunk_lengths)
            runs.append((1, n, n))
        for span in self.spans:
            for batch, length, rows in runs:
                self._run(0, batch, length, [], [0] * rows, span=span)
        return len(runs) * len(self.spans)

    def decode(self, r0: int, B: int) -> Callable[[list[int], list[int]], np.ndarray]:
        """See :meth:`DynamicShapes.decode`: the rows padded to a size of
        :attr:`decode_batches`, the window of physical rows moved back to fit."""
        padded = bucket(B, self.decode_batches)
        w0 = min(r0, self.kv.num_slots - padded)
        self._binding(w0, padded)                   # made here, not in a worker thread
        wanted = [r0 - w0 + j for j in range(B)]
        wanted += [wanted[-1]] * (padded - B)

        def run(starts: list[int], tokens: list[int]) -> np.ndarray:
            rows = [(r0 - w0 + j, st, np.array([t], np.int64))
                    for j, (st, t) in enumerate(zip(starts, tokens, strict=True))]
            return self._run(w0, padded, 1, rows, wanted)[:B]
        return run

    def prepare_piece(self, r0: int) -> None:
        """See :meth:`DynamicShapes.prepare_piece`."""
        self._binding(r0, 1)

    def piece(self, r0: int, start: int, piece: np.ndarray, rows: list[int], *,
              verify: bool = False) -> np.ndarray:
        """See :meth:`DynamicShapes.piece`: ``piece`` padded to a length of
        :attr:`chunk_lengths`; several ``rows`` (a verification: its rows are computed as
        decode's where the start-up check says so) padded to that length too. ``verify``
        changes nothing here: the graph has no verification path of its own."""
        length = bucket(len(piece), self.chunk_lengths)
        wanted = rows if len(rows) == 1 else rows + [rows[-1]] * (length - len(rows))
        return self._run(r0, 1, length, [(0, start, piece)], wanted)[:len(rows)]

    def close(self) -> None:
        self._bindings.clear()
        self.session = None

    def _run(self, w0: int, batch: int, length: int, rows, logits_rows: list[int], *,
             span: int = 0) -> np.ndarray:
        """One session run over physical rows ``[w0, w0 + batch)`` of ``length`` tokens each:
        ``rows`` are ``(row in the run, start, token ids)``, the other rows and tokens padding;
        the keys attended to span the smallest of :attr:`spans` that holds them (or ``span``).
        Returns float32 ``[len(logits_rows), V]``: the logits of the run's tokens
        ``logits_rows``, flat indexes ``row * length + token``."""
        c = self.config
        ids = np.zeros((batch, length), np.int64)
        pos = np.zeros((batch, length), np.int64)
        write = np.full((batch, length), self._scratch, np.int64)
        end = 1
        for r, start, tokens in rows:
            n = len(tokens)
            ids[r, :n] = tokens
            pos[r, :n] = write[r, :n] = np.arange(start, start + n)
            end = max(end, start + n)
        span = span or bucket(end, self.spans)
        index = np.empty((batch, c.num_kv_heads, length, 3), np.int64)
        index[..., 0] = np.arange(batch)[:, None, None]
        index[..., 1] = np.arange(c.num_kv_heads)[None, :, None]
        index[..., 2] = write[:, None, :]
        binding = self._binding(w0, batch)
        for name, value in (("input_ids", ids), ("positions", pos), ("kv_index", index),
                            ("logits_index", np.asarray(logits_rows, np.int64))):
            binding.bind_cpu_input(name, value)
        keys = np.arange(span)
        seen = keys <= pos[..., None]                                       # [B, S, Lb]
        binding.bind_cpu_input("attention_bias", _bias(seen))
        if c.sliding_window:
            binding.bind_cpu_input("local_attention_bias", _bias(
                seen & (keys > pos[..., None] - c.sliding_window)))
        logits = np.empty((len(logits_rows), c.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape),
                            logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits

    def _binding(self, w0: int, batch: int):
        """An I/O binding with the KV buffers of physical rows ``[w0, w0 + batch)`` bound in
        place (past and present the same memory); one per window, kept."""
        binding = self._bindings.get((w0, batch))
        if binding is None:
            binding = self.session.io_binding()
            self.kv.bind(binding, w0, batch)
            self._bindings[(w0, batch)] = binding
        return binding


def _bias(seen: np.ndarray) -> np.ndarray:
    """``seen`` bool ``[B, S, Lb]`` as the graph's attention bias, float32
    ``[B, 1, 1, S, 1, Lb]``: 0 where seen, -inf elsewhere."""
    return np.where(seen, np.float32(0), np.float32(-np.inf))[:, None, None, :, None]
