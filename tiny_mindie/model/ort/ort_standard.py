"""The ONNX Runtime backend on the standard graph (:mod:`.graph_standard`): the same slots, KV
buffers, row layout, parallel runs and start-up checks as :class:`.ort_backend.OrtBackend`,
with session runs of a small fixed set of shapes.

Static shapes: a compiling execution provider (CANN's graph mode) builds one graph per set of
input shapes, so every run here has one of a few: a decode run's rows are padded up to a size
of :attr:`StandardOrtBackend.decode_batches` (powers of two up to ``num_slots``, and
``num_slots``), a prompt piece's tokens up to a length of :attr:`~StandardOrtBackend.
chunk_lengths` (8, 32, 128, ... up to ``max_chunk_tokens``), and the key positions attended to
up to a span of :attr:`~StandardOrtBackend.spans` (256, 512, ... and ``max_seq_len``). On a
provider other than the CPU's every shape is run once at start-up
(:meth:`~StandardOrtBackend.warm_up`), so none is compiled while a request waits. The
logits rows are the run's rows (decode), 1 (a prompt piece) or the piece's length (a
verification).

Padding never touches a real position: each KV buffer row has one position more than
``max_seq_len``, a scratch position no sequence reaches, where padding tokens and padding rows
write their keys and values; they attend to position 0 only, and their logits are dropped. A
decode run over ``Bp`` padded rows binds the ``Bp`` consecutive physical rows from the batch's
first (moved back so the window fits), so padding rows are other slots' rows, of which only the
scratch position is written.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..onnx.graph_options import VERIFY_ROWS
from ..onnx.graph_standard import DTYPES
from ..registry.progress import slow_step
from .ort_backend import OrtBackend
from .providers import CPU

log = logging.getLogger(f"{__package__}.ort_backend")

#: the shortest span of key positions a run attends to; spans double from it
MIN_SPAN = 256
#: the shortest prompt piece; lengths grow fourfold from it up to ``max_chunk_tokens``
MIN_CHUNK = 8
#: ``max_chunk_tokens`` as the loader builds the backend (:class:`~..options.SessionTuning`'s
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


class StandardOrtBackend(OrtBackend):
    """:class:`.ort_backend.OrtBackend` on the standard graph (``GraphOptions.flavour =
    "standard"``); arguments and attributes as there, plus the static sizes below.

    Attributes:
        standard_dtype: the graph's dtype (``GraphOptions.standard_dtype``); ``kv_dtype`` the
            KV buffers' numpy type.
        decode_batches: the rows a decode run is padded to.
        chunk_lengths: the tokens a prompt piece (or a verification) is padded to.
        spans: the key positions a run attends to.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.providers[0] != CPU:        # a compiling provider: every shape now, not later
            with slow_step(log, f"compiling the graph for {self.static_shapes()} input shapes"):
                t0 = time.perf_counter()
                n = self.warm_up()
            log.info("%d input shapes run once (%.1f s)", n, time.perf_counter() - t0)

    @property
    def cache_len(self) -> int:
        """Positions of each KV buffer row: ``max_seq_len`` and one scratch position."""
        return self.max_seq_len + 1

    def _read_session(self, device_id: int) -> None:
        super()._read_session(device_id)
        dtype = self.standard_dtype = self._graph_options.standard_dtype
        self.kv_dtype = DTYPES[dtype]
        self.kernels = f"onnxruntime MatMul ({dtype})"
        self.decode_batches = buckets(1, 2, self.num_slots)
        self.chunk_lengths = buckets(MIN_CHUNK, 4, self.max_chunk_tokens)
        self.spans = buckets(MIN_SPAN, 2, self.max_seq_len)     # the scratch: never seen
        # a verification is a prompt piece with every row's logits, checked at start-up
        self.max_verify_rows = VERIFY_ROWS if self._graph_options.verify_rows else 0
        self._verify_input = False
        self.fast_verify = self.max_verify_rows > 0
        self._bindings: dict[tuple[int, int], object] = {}

    def static_shapes(self) -> int:
        """How many sets of input shapes the runs use at most (graphs a compiling provider
        builds): decode runs, prompt pieces and verifications, each at every span."""
        verify = 1 if self.max_verify_rows else 0
        return (len(self.decode_batches) + len(self.chunk_lengths) + verify) * len(self.spans)

    # ---- runs (the hooks of OrtBackend's forward and verify) ---------------------------------
    def _decode_group(self, slots, starts, tokens, out_rows, out):
        """See :meth:`.ort_backend.OrtBackend._decode_group`: the rows padded to a size of
        :attr:`decode_batches`, the window of physical rows moved back to fit."""
        rows = [(self._phys[s], st, np.array([t], np.int64))
                for s, st, t in zip(slots, starts, tokens, strict=True)]
        padded = bucket(len(rows), self.decode_batches)
        w0 = min(rows[0][0], self.num_slots - padded)
        self._binding(w0, padded)                   # made here, not in a worker thread
        wanted = [r - w0 for r, _, _ in rows]
        wanted += [wanted[-1]] * (padded - len(wanted))

        def run() -> None:
            logits = self._run(w0, padded, 1, [(r - w0, st, t) for r, st, t in rows], wanted)
            out[out_rows] = logits[:len(rows)]
            for s, st in zip(slots, starts, strict=True):
                self._used[s] = st + 1
        return run

    def _prepare_chunks(self, slot: int) -> None:
        self._binding(self._phys[slot], 1)

    def _chunk_logits(self, slot, start, piece, rows, *, verify=False):
        """See :meth:`.ort_backend.OrtBackend._chunk_logits`: ``piece`` padded to a length of
        :attr:`chunk_lengths`; several ``rows`` (a verification: its rows are computed as
        decode's where the start-up check says so) padded to that length too. ``verify``
        changes nothing here: the graph has no verification path of its own."""
        length = bucket(len(piece), self.chunk_lengths)
        wanted = rows if len(rows) == 1 else rows + [rows[-1]] * (length - len(rows))
        logits = self._run(self._phys[slot], 1, length, [(0, start, piece)], wanted)
        self._used[slot] = start + len(piece)
        return logits[:len(rows)]

    def warm_up(self) -> int:
        """Run every static shape once (:meth:`static_shapes`), padding only, so that a
        compiling provider builds its graphs now rather than when a request first needs one;
        only scratch positions are written. Returns the number of runs."""
        runs = [(b, 1, b) for b in self.decode_batches] + [(1, n, 1) for n in self.chunk_lengths]
        if self.max_verify_rows:
            n = bucket(self.max_verify_rows, self.chunk_lengths)
            runs.append((1, n, n))
        with self._lock:
            for span in self.spans:
                for batch, length, rows in runs:
                    self._run(0, batch, length, [], [0] * rows, span=span)
        return len(runs) * len(self.spans)

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
        write = np.full((batch, length), self.cache_len - 1, np.int64)      # scratch
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
        self._session.run_with_iobinding(binding)
        return logits

    def _binding(self, w0: int, batch: int):
        """An I/O binding with the KV buffers of physical rows ``[w0, w0 + batch)`` bound in
        place (past and present the same memory); one per window, kept."""
        binding = self._bindings.get((w0, batch))
        if binding is None:
            binding = self._session.io_binding()
            self._bind_cache(binding, w0, batch)
            self._bindings[(w0, batch)] = binding
        return binding

    def close(self) -> None:
        self._bindings.clear()
        super().close()


def _bias(seen: np.ndarray) -> np.ndarray:
    """``seen`` bool ``[B, S, Lb]`` as the graph's attention bias, float32
    ``[B, 1, 1, S, 1, Lb]``: 0 where seen, -inf elsewhere."""
    return np.where(seen, np.float32(0), np.float32(-np.inf))[:, None, None, :, None]
