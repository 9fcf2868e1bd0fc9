"""The build choices of a decoder's ONNX graph (:class:`GraphOptions`, part of the graph cache's
key), with the row multiples each CPU's kernels need (:func:`default_row_multiples`); the
graphs themselves are built by :mod:`.graph` (contrib operators) and :mod:`.graph_standard`
(default-domain operators only)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from ..ort.providers import cpu_info

#: ``GraphOptions.verify_rows`` of a graph for speculative decoding: the last token and up to 4
#: proposed ones per verification run.
VERIFY_ROWS = 5

#: Bump whenever the standard graph (:mod:`.graph_standard`) changes: part of its cache key
#: (:meth:`GraphOptions.key`), so cached graphs of an older standard builder are rebuilt.
STANDARD_VERSION = 4


# ---- build options ---------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    return cpu_info()[1]


def default_row_multiples() -> tuple[tuple[int, int, int], ...]:
    """``((bits, block, multiple), ...)``: the rows a MatMulNBits call with weights of ``bits``
    bits in blocks of ``block`` (0: any block) is padded to a multiple of on this CPU (see
    :func:`.graph_nodes._pad_rows`); 1 where its kernels give a row the same arithmetic whatever
    the number of rows.

    x86-64 with AVX-512 VNNI: blocks of 32 (4- and 8-bit) 1, larger blocks 2 (rows are computed
    in pairs, an odd last row alone, otherwise). Other x86-64: 4-bit 2 (AVX2 and AVX-VNNI take
    a one-row kernel at M = 1); 8-bit 1, or 2 with AVX-512 (an odd last row is computed by
    another path there). Elsewhere (aarch64: NEON computes 4-bit rows in tiles of 4 and the rows
    left over otherwise): 4-bit 4, 8-bit 1. The start-up check
    (:meth:`.startup_checks.StartupChecks.check_batch_invariance`) holds the graph to this.
    """
    if platform.machine().lower() in ("x86_64", "amd64", "x64"):
        flags = cpu_flags()
        if {"avx512f", "avx512_vnni"} <= flags:
            return (4, 32, 1), (4, 0, 2), (8, 32, 1), (8, 0, 2)
        return (4, 0, 2), (8, 0, 2 if "avx512f" in flags else 1)
    return (4, 0, 4), (8, 0, 1)


@dataclass(frozen=True)
class GraphOptions:
    """Choices that change the built graph (part of the cache key).

    Attributes:
        accuracy_level: MatMulNBits ``accuracy_level`` of the layer matrices: 4 quantizes the
            activations to int8 per block inside the kernel (llama.cpp does the same; fastest on
            CPU), 0 computes in float32.
        lm_head_accuracy_level: the same for the LM head (8-bit weights).
        lm_head_block: an 8-bit LM head is requantized to blocks of this size when larger than
            its own (:func:`.weights.lm_head_weight`); 32 keeps a Q8_0 head exact.
        max_positions: rows of the rotary cos/sin caches (positions a sequence can reach);
            0: the model's ``context_length``.
        overrides: ``((kind, accuracy_level), ...)`` for single matrix kinds (see :meth:`level`),
            e.g. ``(("ffn_down", 0),)``.
        row_multiples: ``((bits, block, multiple), ...)``: a matrix product with weights of
            ``bits`` bits in blocks of ``block`` (0: any other block) runs on a multiple of
            ``multiple`` rows (:func:`.graph_nodes._pad_rows`), so a row's logits do not depend
            on its batch; 1, or weights not listed, runs the rows as they are.
            Default: :func:`default_row_multiples` (for this CPU).
        compact: 0 keeps the GGUF's weights (exact where :mod:`.weights` says so); a block size
            (64) requantizes every matrix, the LM head included, to 4-bit blocks of that size
            (:func:`.weights.quantize_4bit`): fewer bytes than the GGUF, not its values.
        flavour: ``"contrib"``: the graph above, onnxruntime's contrib operators doing the heavy
            work; ``"standard"``: default-domain operators only, weights of
            ``standard_dtype`` (:mod:`.graph_standard`; ``compact``, the accuracy levels, row
            multiples and ``verify_rows`` do not shape it).
        standard_dtype: the standard graph's weights, KV cache and products: ``"float16"``
            (the default) or ``"float32"`` (:data:`.graph_standard.DTYPES`).
        kernels: ``"onnxruntime"``: the matrix products are onnxruntime's ``MatMulNBits``;
            ``"custom"``: tiny_mindie's own ``MatMulGGUF`` (:mod:`tiny_mindie.kernels`) on the
            GGUF's blocks as they are, for every matrix of a type it reads (the LM head
            included), ``MatMulNBits`` for the others; the session must load the kernel
            library (``register_custom_ops_library``). Not with ``compact``.
        verify_rows: add the ``verify`` input and each layer's
            :func:`.graph_layers.verify_attention` for chunks of up to this many rows
            (speculative decoding, :data:`VERIFY_ROWS`; costs an ``If`` per layer in every run);
            0: neither.
    """

    accuracy_level: int = 4
    lm_head_accuracy_level: int = 4
    lm_head_block: int = 128
    max_positions: int = 0
    overrides: tuple[tuple[str, int], ...] = ()
    row_multiples: tuple[tuple[int, int, int], ...] = field(
        default_factory=default_row_multiples)
    verify_rows: int = 0
    compact: int = 0
    flavour: str = "contrib"
    kernels: str = "onnxruntime"
    standard_dtype: str = "float16"

    def level(self, kind: str) -> int:
        """accuracy_level of the matrices named ``kind`` (``attn_qkv``, ``attn_output``,
        ``ffn_gate_up``, ``ffn_down``, ``lm_head``)."""
        for k, v in self.overrides:
            if k == kind:
                return v
        return self.lm_head_accuracy_level if kind == "lm_head" else self.accuracy_level

    def key(self) -> str:
        """The options as a short string, part of the graph cache's entry names."""
        if self.flavour == "standard":
            return f"standard@{STANDARD_VERSION}-p{self.max_positions}-{self.standard_dtype}"
        extra = "".join(f"-{k}{v}" for k, v in self.overrides)
        rows = ".".join(f"{b}b{k}x{m}" for b, k, m in self.row_multiples)
        return (f"a{self.accuracy_level}-h{self.lm_head_accuracy_level}-l{self.lm_head_block}"
                f"-p{self.max_positions}-r{rows}-v{self.verify_rows}{extra}"
                + (f"-c{self.compact}" if self.compact else "")
                + (f"-k{self.kernels}" if self.kernels != "onnxruntime" else ""))

    def row_multiple(self, bits: int, block: int) -> int:
        """Rows a product with ``bits``-bit weights in blocks of ``block`` is padded to a
        multiple of (1: none)."""
        rules = {(b, k): m for b, k, m in self.row_multiples}
        return rules.get((bits, block), rules.get((bits, 0), 1))
