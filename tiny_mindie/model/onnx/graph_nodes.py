"""The nodes of the decoder graph that hold its weights, and the collector they are added to.

:class:`GraphBuilder` collects the nodes and initializers of one graph (the initializers in one
external data file, or, for GGUF blocks read by tiny_mindie's own operators, the GGUF's own
bytes: :meth:`GraphBuilder.blocks`); :class:`Shared` is what every block of the graph uses
besides its weights.
The functions here add the nodes that read weights -- the embedding, the norms, the matrix
products (:func:`linear`, padded to a row multiple by :func:`_pad_rows`) and the rotary caches --
each returning the names of its outputs; :mod:`.graph_layers` assembles them into the decoder's
blocks and :mod:`.graph` into the model.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..arch import ModelConfig
from ..gguf import GGUFFile
from ..reference.layers import rope_frequencies, rope_table
from .graph_options import GraphOptions
from .weights import BLOCK, GGUFMatrix, NBitsWeight, concat_weights

MS_DOMAIN = "com.microsoft"
#: the domain of tiny_mindie's own operators (:mod:`tiny_mindie.kernels`)
TM_DOMAIN = "tiny_mindie"
#: ggml type ids, the ``type`` attribute of ``MatMulGGUF``
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
_ALIGN = 4096
#: The external-data ``location`` of an initializer holding bytes of the GGUF itself (its
#: ``offset`` and ``length`` are the bytes' place in the GGUF): no file of that name exists, the
#: session is handed those bytes mapped (:func:`.ort_session.gguf_initializers`).
GGUF_LOCATION = "@gguf"


# ---- the node collector ---------------------------------------------------------------------

class GraphBuilder:
    """Collects nodes and initializers; initializers go to one external data file, except GGUF
    blocks of ``source`` (:meth:`blocks`), which stay in the GGUF."""

    def __init__(self, data_path: str, source: GGUFFile | None = None):
        from onnx import TensorProto, helper

        self.helper = helper
        self.TensorProto = TensorProto
        self.nodes: list = []
        self.inits: list = []
        self._n = 0
        self._data_name = os.path.basename(data_path)
        self._data = open(data_path, "wb")
        self._consts: dict = {}
        self.source = source

    def close(self) -> None:
        self._data.close()

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, name: str, array: np.ndarray) -> str:
        """Add ``array`` as an initializer stored in the external data file."""
        array = np.ascontiguousarray(array)
        t = self.TensorProto()
        t.name = name
        t.data_type = self.helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        if array.nbytes < 256:                      # tiny constants stay inline
            t.raw_data = array.tobytes()
        else:
            pos = self._data.tell()
            pad = (-pos) % _ALIGN
            if pad:
                self._data.write(b"\0" * pad)
                pos += pad
            self._data.write(memoryview(array).cast("B"))
            t.data_location = self.TensorProto.EXTERNAL
            for key, value in (("location", self._data_name), ("offset", str(pos)),
                               ("length", str(array.nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        self.inits.append(t)
        return name

    def follows(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Whether ``b``'s bytes come right after ``a``'s in the GGUF ``source`` (both views of
        its memory map)."""
        at = self.source.file_offset(a) if self.source is not None else None
        bt = self.source.file_offset(b) if at is not None else None
        return bt is not None and bt == at + a.nbytes

    def blocks(self, name: str, parts: Sequence[np.ndarray]) -> str:
        """An initializer of GGUF blocks, uint8 ``[sum of rows, row bytes]``: the rows of
        ``parts`` (uint8 ``[rows, row bytes]`` each) one after another. Where they are views of
        the GGUF ``source``, back to back in it, the initializer is those bytes of the GGUF, not
        a copy (external data at :data:`GGUF_LOCATION`, with their offset in the file), and one
        range of the file is one initializer whatever its names (a tied LM head and the
        embedding share one); else the rows are copied to the data file (:meth:`init`)."""
        first = self.source.file_offset(parts[0]) if self.source is not None else None
        if first is None or any(not self.follows(a, b) for a, b in itertools.pairwise(parts)):
            return self.init(name, parts[0] if len(parts) == 1 else np.concatenate(parts))
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        length = sum(p.nbytes for p in parts)
        key = (GGUF_LOCATION, first, shape)
        if key not in self._consts:
            t = self.TensorProto()
            t.name = name
            t.data_type = self.TensorProto.UINT8
            t.dims.extend(shape)
            t.data_location = self.TensorProto.EXTERNAL
            for k, value in (("location", GGUF_LOCATION), ("offset", str(first)),
                             ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, value
            self.inits.append(t)
            self._consts[key] = name
        return self._consts[key]

    def const(self, values, dtype=np.int64) -> str:
        """A small shared constant (shapes, axes)."""
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.name("const"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, *, domain: str = "",
           name: str | None = None, outputs: Sequence[str] | None = None, **attrs) -> list[str]:
        name = name or self.name(op_type)
        outs = list(outputs) if outputs is not None else [f"{name}/out{i}" for i in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outs, name=name,
                                                domain=domain or None, **attrs))
        return outs

    def op1(self, op_type: str, inputs: Sequence[str], **kw) -> str:
        return self.op(op_type, inputs, 1, **kw)[0]

    def subgraph(self, name: str, build: Callable[[], str], shape: Sequence[int | str]):
        """A ``GraphProto`` for an ``If`` branch: the nodes ``build()`` adds (constants it
        makes go to the main graph, whose names it may read) and one float32 output, the name
        ``build()`` returns, declared with ``shape`` (ints and dimension names: onnxruntime
        checks a branch's output against it, formatting a warning at every run where its own
        shape inference left a wrong dimension, and allocates a static shape in advance)."""
        outer, self.nodes = self.nodes, []
        try:
            out = build()
            nodes = self.nodes
        finally:
            self.nodes = outer
        h = self.helper
        return h.make_graph(nodes, name, [],
                            [h.make_tensor_value_info(out, self.TensorProto.FLOAT, shape)])


# ---- what the blocks share, and the weight nodes ---------------------------------------------

@dataclass(frozen=True)
class VerifyRows:
    """The positions of a verification chunk's rows, computed once in the main graph for
    every layer's :func:`verify_attention` (int64 ``[1]`` tensors unless said).

    Attributes:
        base: the chunk's first position, ``total_sequence_length - S``.
        total: ``t = total_sequence_length``, the chunk's end.
        rows: per unrolled row ``j``: ``(row, end)``: ``row = min(j, S - 1)`` and its causal
            end ``e = base + j + 1`` (1 for a row past the chunk: computed, then dropped).
        windowed: ``{window: [(start, pads)]}`` for local layers: the first position a row
            sees (``max(0, e - window)``: onnxruntime 1.24's GroupQueryAttention lets a query
            see ``window`` keys, itself included) and int64 ``[10]`` Pad pads putting ``start``
            zeros before its probabilities.
    """

    base: str
    total: str
    zero: str
    rows: list[tuple[str, str]]
    windowed: dict[int, list[tuple[str, str]]]

    def rows_for(self, window: int) -> list[tuple[str, str, str, str | None]]:
        """``(row, start, end, pads)`` per unrolled row for a layer with ``window`` (0: none;
        ``start`` 0, ``pads`` ``None``)."""
        starts = self.windowed[window] if window else [(self.zero, None)] * len(self.rows)
        return [(row, start, end, pads)
                for (row, end), (start, pads) in zip(self.rows, starts, strict=True)]


@dataclass(frozen=True)
class Shared:
    """What every block of one graph uses besides its weights.

    Attributes:
        config: the model's parameters.
        options: the build choices.
        tokens: int64 ``[1]`` holding ``T = B * S``, the rows of the activations
            (for :func:`_pad_rows`).
        qkv_shape: int64 ``[3]`` holding ``[B, S, (Nq + 2 Nkv) H]``, the shape
            GroupQueryAttention takes its packed QKV in.
        rope: the ``(cos, sin)`` caches, float32 ``[max_positions, rope_dim / 2]``: global
            layers'; ``rope_local``: local layers' (Gemma 3), else ``None``.
        attn_scale: GroupQueryAttention's ``scale``: 1 when the model's scale is folded into
            the queries (:func:`.graph_layers.attention`), else ``config.attn_scale``.
        verify: where the graph has the ``verify`` input and
            :func:`.graph_layers.verify_attention` beside each layer's GroupQueryAttention, the
            positions of its rows; else ``None``.
    """

    config: ModelConfig
    options: GraphOptions
    tokens: str
    qkv_shape: str
    rope: tuple[str, str]
    rope_local: tuple[str, str] | None
    attn_scale: float
    verify: VerifyRows | None = None


def rope_caches(g: GraphBuilder, config: ModelConfig, positions: int
                ) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """The rotary cos/sin caches as initializers, float32 ``[positions, rope_dim / 2]``
    (:func:`..reference.layers.rope_table`): the model's, scaled as
    :func:`..reference.layers.rope_frequencies` says for sequences of up to ``positions``
    (LongRoPE picks its factors by that), and for Gemma 3's local layers at
    ``rope_theta_local`` (else ``None``)."""
    c = config
    cos, sin = rope_table(positions, *rope_frequencies(c, positions))
    glob = g.init("rope.cos", cos), g.init("rope.sin", sin)
    if not c.rope_theta_local:
        return glob, None
    cos_l, sin_l = rope_table(positions, *rope_frequencies(c, positions, local=True))
    return glob, (g.init("rope_local.cos", cos_l), g.init("rope_local.sin", sin_l))


def embed(g: GraphBuilder, config: ModelConfig, emb: NBitsWeight | GGUFMatrix) -> str:
    """``input_ids`` int64 ``[B, S]`` -> float32 ``[T, D]``: the embedding's rows, by
    ``tiny_mindie::GatherGGUF`` on its GGUF blocks (a :class:`.GGUFMatrix`: exactly the GGUF's
    values) or ``GatherBlockQuantized`` on its 8-bit blocks
    (:func:`.graph_weights.load_embedding`), times ``embedding_scale`` (Gemma: ``sqrt(D)``, in
    float32 like the reference)."""
    if isinstance(emb, GGUFMatrix):
        e = g.op1("GatherGGUF", [g.blocks("token_embd.gguf", [emb.data]), "input_ids"],
                  domain=TM_DOMAIN, name="embed/GatherGGUF", type=GGML_TYPE_IDS[emb.qtype],
                  N=emb.n, K=emb.k)                                     # [B, S, D]
    else:
        nb = emb.k // BLOCK
        emb_data = g.init("token_embd.qweight", emb.data.reshape(emb.n, nb, BLOCK))
        emb_scales = g.init("token_embd.scales3", emb.scales.reshape(emb.n, nb, 1))
        e = g.op1("GatherBlockQuantized", [emb_data, "input_ids", emb_scales], domain=MS_DOMAIN,
                  name="embed/GatherBlockQuantized", bits=8, block_size=BLOCK,
                  gather_axis=0, quantize_axis=2)                       # [B, S, D/32, 32]
    h = g.op1("Reshape", [e, g.const([-1, config.hidden_size])])       # [T, D]
    if config.embedding_scale != 1.0:
        h = g.op1("Mul", [h, g.const(np.float32(config.embedding_scale), np.float32)],
                  name="embed/scale")
    return h


def rms_norm(g: GraphBuilder, x: str, w: np.ndarray, name: str, eps: float) -> str:
    """``x / rms(x) * w`` over the last axis (as :func:`..reference.layers.rms_norm`):
    ``SimplifiedLayerNormalization``. x: float32 ``[..., D]``; w: float32 ``[D]``. ``name`` is
    the node's (``blk.{i}/attn_norm``); ``w`` is stored as the initializer of that name with
    ``.`` for ``/`` (``blk.{i}.attn_norm``). Returns float32 ``[..., D]``."""
    return g.op1("SimplifiedLayerNormalization", [x, g.init(name.replace("/", "."), w)], name=name,
                 axis=-1, epsilon=eps)


def add_rms_norm(g: GraphBuilder, h: str, y: str, w: np.ndarray, name: str, eps: float
                 ) -> tuple[str, str]:
    """The residual add fused into the next norm: ``h = h + y; x = rms_norm(h)``
    (``SkipSimplifiedLayerNormalization``). h, y: float32 ``[T, D]``; ``w`` and ``name`` as in
    :func:`rms_norm`. Returns ``(x, h)``, both float32 ``[T, D]``."""
    x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [h, y, g.init(name.replace("/", "."), w)],
                      4, domain=MS_DOMAIN, name=name, epsilon=eps)
    return x, h


def linear(g: GraphBuilder, x: str, ws: Sequence[NBitsWeight | GGUFMatrix], prefix: str,
           s: Shared, kind: str, rows: str | None = None, *, keep_padding: bool = False) -> str:
    """``x @ [W_0; W_1; ...].T``: float32 ``x [T, K]`` -> ``[T, sum(N)]``, one node per run of
    matrices of the same form: ``tiny_mindie::MatMulGGUF`` on a run of :class:`.GGUFMatrix` of
    one type whose blocks lie back to back in the GGUF (:func:`_gguf_product`; the GGUF's bytes
    are not copied to join matrices), else MatMulNBits (:func:`_nbits_product`).

    ``rows`` holds ``T`` (default ``s.tokens``); MatMulNBits runs on ``x`` padded to the row
    multiple of its weights' bits (:func:`_pad_rows`), and its output is cut back to ``T`` rows
    unless ``keep_padding`` (then every weight must have the same multiple; MatMulGGUF needs
    none: a row's arithmetic is the same in any batch). ``kind`` names the matrices for
    ``GraphOptions.level``.
    """
    rows = s.tokens if rows is None else rows
    runs: list[list] = []
    for w in ws:
        if (runs and isinstance(w, GGUFMatrix) and isinstance(runs[-1][-1], GGUFMatrix)
                and runs[-1][-1].qtype == w.qtype and _joinable(g, runs[-1][-1], w)):
            runs[-1].append(w)
        elif runs and not isinstance(w, GGUFMatrix) and not isinstance(runs[-1][0], GGUFMatrix):
            runs[-1].append(w)
        else:
            runs.append([w])
    outs, j = [], 0
    for run in runs:
        if isinstance(run[0], GGUFMatrix):
            p = f"{prefix}.{j}" if len(ws) > 1 else prefix
            outs.append(_gguf_product(g, x, run, p))
            j += 1
        else:
            for w in concat_weights(run):
                p = f"{prefix}.{j}" if len(ws) > 1 else prefix
                outs.append(_nbits_product(g, x, w, p, s, kind, rows, keep_padding))
                j += 1
    if len(outs) == 1:
        return outs[0]
    return g.op1("Concat", outs, axis=-1)


def _joinable(g: GraphBuilder, a: GGUFMatrix, b: GGUFMatrix) -> bool:
    """Whether one product can read ``a`` and ``b`` (of one type): ``b``'s blocks follow
    ``a``'s in the GGUF the graph maps, or the graph maps none (they are then copied)."""
    return g.source is None or g.follows(a.data, b.data)


def _gguf_product(g: GraphBuilder, x: str, run: Sequence[GGUFMatrix], p: str) -> str:
    """``x [T, K] @ [W_0; W_1; ...].T`` -> ``[T, sum(N)]`` by ``tiny_mindie::MatMulGGUF`` on the
    matrices' GGUF blocks (one type; :meth:`GraphBuilder.blocks`), times their ``scale`` where
    one is not 1 (a power of two per output: exact)."""
    n, k = sum(w.n for w in run), run[0].k
    y = g.op1("MatMulGGUF", [x, g.blocks(p + ".gguf", [w.data for w in run])], domain=TM_DOMAIN,
              name=p + "/MatMulGGUF", type=GGML_TYPE_IDS[run[0].qtype], N=n, K=k)   # [T, N]
    if any(w.scale != 1.0 for w in run):
        scale = np.concatenate([np.full(w.n, w.scale, np.float32) for w in run])
        y = g.op1("Mul", [y, g.init(p + ".out_scale", scale)], name=p + "/scale")
    return y


def _nbits_product(g: GraphBuilder, x: str, w: NBitsWeight, p: str, s: Shared, kind: str,
                   rows: str, keep_padding: bool) -> str:
    """``x @ w.T`` by MatMulNBits, plus ``blocksum(x) @ mins.T`` for the residual of a
    ``w = d * q + m`` type (Q4_1, Q5_1, Q4_K, Q5_K: :func:`.weights._affine`). The block sums
    ``[T, K/32]`` are a ``ReduceSum`` over ``x`` viewed as ``[T, K/32, 32]`` (a Reshape: no
    copy); the correction and the addition are one Gemm (cheaper than a MatMul with a 0/1
    block-indicator matrix)."""
    m = s.options.row_multiple(w.bits, w.block)
    inputs = [_pad_rows(g, x, rows, m), g.init(p + ".qweight", w.data),
              g.init(p + ".scales", w.scales.reshape(-1))]
    if w.zero_points is not None:
        inputs.append(g.init(p + ".qzeros", w.zero_points.reshape(-1)))
    y = g.op1("MatMulNBits", inputs, domain=MS_DOMAIN, name=p + "/MatMulNBits",
              K=w.k, N=w.n, bits=w.bits, block_size=w.block,
              accuracy_level=s.options.level(kind))                             # [T', N]
    if m > 1 and not keep_padding:
        y = g.op1("Slice", [y, g.const([0]), rows, g.const([0])])               # [T, N]
    if w.mins is not None:
        xb = g.op1("Reshape", [inputs[0] if keep_padding else x,
                               g.const([-1, w.k // BLOCK, BLOCK])], name=p + "/blocks")
        bs = g.op1("ReduceSum", [xb, g.const([-1])], name=p + "/blocksum",
                   keepdims=0)                                                  # [T, K/32]
        y = g.op1("Gemm", [bs, g.init(p + ".mins_t", np.ascontiguousarray(w.mins.T)), y],
                  name=p + "/add_mins")                                         # [T, N]
    return y


def _row_pads(g: GraphBuilder, rows: str, multiple: int) -> str:
    """The ``Pad`` input that adds ``(-T) mod multiple`` rows at the end of a ``[T, D]`` tensor
    (``rows``: int64 ``[1]`` holding ``T``); made once per ``(rows, multiple)``."""
    key = ("row_pads", rows, multiple)
    if key not in g._consts:
        m = g.const([multiple])
        extra = g.op1("Mod", [g.op1("Sub", [m, g.op1("Mod", [rows, m])]), m])
        g._consts[key] = g.op1("Concat", [g.const([0, 0]), extra, g.const([0])], axis=0)
    return g._consts[key]


def rows_of(g: GraphBuilder, x: str) -> str:
    """int64 ``[1]``: the number of rows of ``x``."""
    return g.op1("Slice", [g.op1("Shape", [x]), g.const([0]), g.const([1])])


def _pad_rows(g: GraphBuilder, x: str, rows: str, multiple: int) -> str:
    """``x [T, K] -> [T', K]``, ``T'`` the next multiple of ``multiple`` (the last row repeated
    into the new ones; ``rows`` holds ``T``).

    Why: onnxruntime's ``MatMulNBits`` kernels (MLAS, 1.24, int8 activations) compute a row by
    other arithmetic depending on how many rows share the call, and a row's logits would then
    depend on the batch it runs in (so would a seeded or greedy answer): on AVX2 a call of
    exactly one row of 4-bit weights takes a GEMV kernel (``CountM == 1``) that rounds otherwise
    than the kernel of every larger M; NEON computes 4-bit rows in tiles of 4 and the rows left
    over otherwise; on AVX-512 rows of blocks larger than 32 are computed in pairs and an odd
    last row alone (see :func:`.graph_options.default_row_multiples`, which also says where no
    padding is needed). MLAS quantizes the activations per row, so the repeated rows change
    nothing for the others; a single stream pays the slower multi-row kernel.
    """
    if multiple <= 1:
        return x
    return g.op1("Pad", [x, _row_pads(g, rows, multiple)], mode="edge")
