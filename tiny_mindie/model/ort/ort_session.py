"""Opening the ONNX Runtime backend's session: the graph options its settings call for, the
GGUF's own blocks handed to it mapped (custom kernels), the session on the built graph with the
weight-file pages it read given back, and the move of its memory to huge pages in the
background.

Part of the backend's start: it logs through :mod:`.ort_backend`'s logger.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..arch import ModelConfig
from ..gguf import GGUFFile, ModelFileError
from ..onnx.graph_nodes import GGUF_LOCATION
from ..onnx.graph_options import GraphOptions
from ..registry.progress import slow_step
from .memory import populated_pieces, release_file_pages, trim_heap, use_huge_pages
from .providers import CPU, provider_name

log = logging.getLogger(f"{__package__}.ort_backend")


def with_rotary_table(options: GraphOptions, config: ModelConfig, max_seq_len: int
                      ) -> GraphOptions:
    """``options`` with the rotary table a LongRoPE model needs for ``max_seq_len``.

    Raises:
        ValueError: ``max_seq_len`` passes the graph's rotary table.
    """
    if config.rope_factors_long and not options.max_positions:
        # LongRoPE picks its factors by the positions a sequence can reach (llama.cpp:
        # n_ctx_seq), so the graph's rotary table is built for max_seq_len, as the reference
        options = dataclasses.replace(options, max_positions=max_seq_len)
    if max_seq_len > (options.max_positions or config.context_length):
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the graph's rotary table "
                         f"({options.max_positions or config.context_length})")
    return options


#: the kernel library's ISA paths, as the banner says them
_ISA_NAMES = {"avx512vnni": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2",
              "neon": "NEON dot product", "portable": "portable C"}


def resolve_kernels(kernels: str, flavour: str, compact: int) -> str:
    """The graph's kernels (``GraphOptions.kernels``) for the setting ``kernels``: ``auto`` is
    ``custom`` where the kernel library is built and loads, the graph is ``contrib`` and the
    weights exact (``compact`` 0), else ``onnxruntime``.

    Raises:
        ModelFileError: ``custom`` where the library is not built, does not load, refuses its
            ISA path (``TINY_MINDIE_KERNEL_ISA``), or the graph or weights cannot take it.
    """
    import tiny_mindie.kernels as lib

    if kernels == "onnxruntime":
        return kernels
    fits = flavour == "contrib" and not compact
    if kernels == "auto":
        if not fits:
            return "onnxruntime"
        try:
            reason = lib.unavailable_reason()
            if reason is None and lib.isa():
                return "custom"
        except lib.KernelError as exc:
            reason = str(exc)
        log.warning("kernels: onnxruntime MatMulNBits (the own kernels do not run: %s)", reason)
        return "onnxruntime"
    if not fits:
        raise ModelFileError("kernels custom need the contrib graph and the exact weights")
    try:
        lib.isa()
    except lib.KernelError as exc:
        raise ModelFileError(f"kernels custom: {exc}") from None
    return "custom"


def kernel_library(kernels: str) -> str | None:
    """The path of the kernel library the session registers for ``GraphOptions.kernels``
    (``None`` for onnxruntime's own)."""
    if kernels != "custom":
        return None
    import tiny_mindie.kernels as lib

    return lib.library_path()


def describe_kernels(kernels: str, flavour: str) -> str:
    """Which kernels run the matrix products, as the banner and ``/v1/config`` say it."""
    if flavour == "standard":
        return "onnxruntime MatMul (float32)"
    if kernels != "custom":
        return "onnxruntime MatMulNBits"
    import tiny_mindie.kernels as lib

    return f"custom op, {_ISA_NAMES.get(lib.isa(), lib.isa())}"


def for_provider(options: GraphOptions, chosen: list) -> GraphOptions:
    """``options`` without the contrib graph's verification path unless the first of the
    ``chosen`` providers is the CPU's (the standard graph verifies as a prompt piece, with no
    path of its own: the start-up check decides there as on the CPU)."""
    if options.verify_rows and options.flavour != "standard" and provider_name(chosen[0]) != CPU:
        # an If per layer would cut an NPU's graph into pieces (and is untested there)
        log.info("speculative decoding: for the CPU execution provider only; off on %s",
                 provider_name(chosen[0]))
        options = dataclasses.replace(options, verify_rows=0)
    return options


def gguf_initializers(path: str, f: GGUFFile, options) -> list:
    """Hand the session options ``options`` the initializers of the graph at ``path`` that name
    bytes of the GGUF (external data at :data:`.graph_nodes.GGUF_LOCATION`: the blocks of the
    custom kernels), each a read-only view of ``f``'s memory map
    (``SessionOptions.add_initializer``: onnxruntime's CPU provider reads such a buffer in
    place, so the weights are the GGUF's page-cache pages, shared with every process mapping
    the file, and nothing is copied).

    Returns:
        the ``onnxruntime.OrtValue`` of each (they hold the views: keep them as long as the
        session).

    Raises:
        ModelFileError: an initializer's bytes are not in ``f``, or not its shape's size.
    """
    import onnx
    import onnxruntime as ort

    model = onnx.load(path, load_external_data=False)
    values = []
    for t in model.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if t.data_location != onnx.TensorProto.EXTERNAL or ext.get("location") != GGUF_LOCATION:
            continue
        data = f.mapped_bytes(int(ext.get("offset", 0)), int(ext.get("length", -1)))
        if data.size != int(np.prod(t.dims, dtype=np.int64)):
            raise ModelFileError(f"{path}: initializer {t.name} {list(t.dims)} is not its "
                                 f"{data.size} bytes of {f.path}")
        value = ort.OrtValue.ortvalue_from_numpy(data.reshape(tuple(t.dims)))
        options.add_initializer(t.name, value)
        values.append(value)
    return values


def open_session(path: str, options, providers: list, *, release: Sequence[str],
                 huge_pages: bool):
    """An ``onnxruntime.InferenceSession`` on the graph at ``path``, and the pieces of memory
    populated before it (:func:`.memory.populated_pieces`; ``None`` without ``huge_pages``),
    for :class:`HugePageMove`.

    Afterwards the pages of the files in ``release`` that this process mapped are given back
    (:func:`.memory.release_file_pages`: onnxruntime read them to prepack the weights). Says so
    in the log when creating the session is slow (:func:`.progress.slow_step`).
    """
    import onnxruntime as ort

    if huge_pages:      # freed heap pages out first, so memory the session reuses is new
        trim_heap()
    before = populated_pieces() if huge_pages else None
    with slow_step(log, "creating the onnxruntime session (prepacking the weights)"):
        session = ort.InferenceSession(path, options, providers=providers)
    if release:
        for name in release:
            release_file_pages(name)
        trim_heap()
    return session, before


class HugePageMove(threading.Thread):
    """Moves the memory a session wrote (its prepacked weights above all) to huge pages
    (:func:`.memory.use_huge_pages` of the pieces not populated ``before``), in the background:
    the backend serves meanwhile, at full speed once it is done (moving hundreds of MB is a
    long step of a start, not worth waiting for). ``moved`` holds the bytes moved once
    :meth:`join` returns."""

    def __init__(self, before: set[int]):
        super().__init__(name="tiny_mindie-huge-pages", daemon=True)
        self.before = before
        self.moved = 0

    def run(self) -> None:
        t0 = time.perf_counter()
        self.moved = use_huge_pages(self.before)
        log.info("%d MB of the session's memory moved to huge pages (%.2f s, in the background)",
                 self.moved // 10**6, time.perf_counter() - t0)
