"""Build the ONNX graph of a GGUF decoder, node by node, with ``onnx.helper``.

Nothing is exported from a framework: every node below is written here from the model's
architecture parameters (:class:`~tiny_mindie.model.config.ModelConfig`) and its weights, packed
by :mod:`.weights`. The graph follows the numpy reference decoder (:mod:`.reference`) block for
block, with functions of the same names -- :func:`embed`, :func:`block`, :func:`attention`,
:func:`mlp`, :func:`linear`, :func:`rms_norm` and :func:`lm_head` (the reference's ``_logits``)
-- each adding its nodes to a :class:`_Builder` and returning the names of its outputs::

    h = embed(input_ids)                                       # [B, S] -> [T, D]
    for each layer:
        h = h + attention(rms_norm(h))
        h = h + mlp(rms_norm(h))
    logits = lm_head(rms_norm(h[logits_index]))                # [B, D] -> [B', V]

Each residual add is fused into the next norm (``SkipSimplifiedLayerNormalization``: ``h += y;
x = rms_norm(h)``), so a block hands its output on un-added (see :func:`block`).

It uses ONNX Runtime's contrib operators (domain ``com.microsoft``) where they are the fast path
on CPU: ``GroupQueryAttention`` (KV cache updated in place, rotary inside), ``MatMulNBits``
(block-quantized weights), ``SkipSimplifiedLayerNormalization`` and ``GatherBlockQuantized``;
``SimplifiedLayerNormalization`` is a default-domain op.

Graph inputs and outputs (``B`` rows, ``S`` tokens per row, ``L`` KV buffer length,
``Nkv`` = ``num_kv_heads``, ``H`` = ``head_dim``, ``V`` = ``vocab_size``; all dynamic except
``Nkv``, ``H``, ``V``)::

    input_ids              int64   [B, S]          token ids; rows shorter than S are right-padded
    seqlens_k              int32   [B]             per row: (tokens in the KV buffer after this
                                                   call, padding included) - 1
    total_sequence_length  int32   []              max over rows of seqlens_k + 1
    logits_index           int64   [B]             per row: b * S + (index of its last real token)
                                                   (a verification chunk: any rows of T)
    verify                 bool    []              (GraphOptions.verify_rows) True: a chunk of
                                                   one sequence, S <= verify_rows, whose rows'
                                                   attention is computed as decoding would
                                                   (:func:`verify_attention`)
    past_key.{i}           float32 [B, Nkv, L, H]  layer i's key cache (i = 0 .. num_layers-1)
    past_value.{i}         float32 [B, Nkv, L, H]  layer i's value cache

    logits                 float32 [B', V]         logits of the token at logits_index; B' is B
                                                   rounded up to a multiple of the metadata
                                                   entry ``tiny_mindie.logits_row_multiple``
                                                   (rows past B repeat row B - 1: ignore them)
    present_key.{i}        float32 [B, Nkv, L, H]  bind to the SAME buffer as past_key.{i}
    present_value.{i}      float32 [B, Nkv, L, H]  bind to the SAME buffer as past_value.{i}

Inside, activations are 2-D, ``[T, D]`` with ``T = B * S`` (``logits_index`` indexes ``T``);
a MatMulNBits whose kernels compute a row otherwise depending on the number of rows gets its
input padded to a multiple of rows and its output cut back (:func:`_pad_rows`, and
``GraphOptions.row_multiples`` for which).

Architectures: LLaMA (``llama``) as above, with a SiLU-gated MLP and rotary on adjacent pairs.
Qwen2 (``qwen2``) adds the q/k/v biases after the fused QKV projection and rotates in NEOX mode
(``rotary_interleaved=0``: llama.cpp's converter keeps Qwen2's Q/K rows in HF order). Qwen3
(``qwen3``): NEOX, q/k heads RMS-normalized as Gemma 3's (:func:`qk_norm`). Phi-3 (``phi3``):
NEOX, fused tensors split at load (:func:`.weights.load_layer`), ``local_window_size`` on every
layer. SmolLM3 (``smollm3``): ``do_rotary=0`` on every 4th layer. Rotary scaling lives in the
cos/sin caches (:func:`rope_caches`). Gemma 3
(``gemma3``) adds: the embedding times ``sqrt(D)`` (a float32 ``Mul``, as the reference); q and
k heads RMS-normalized over ``H`` before GroupQueryAttention; the attention and MLP outputs
RMS-normalized before each residual add; ``Gelu(approximate="tanh")`` instead of SiLU; NEOX
rope; and on local layers (``ModelConfig.is_local``) ``local_window_size = sliding_window`` (a
query at ``p`` then sees the keys ``p - w + 1 .. p``, the reference's ``p - key < window``) with
a second pair of cos/sin caches at the local rotary base. A power-of-two attention scale is
folded into the queries (:func:`attention`).

GroupQueryAttention semantics this graph relies on (CPU kernel of onnxruntime 1.24): with
``past_key`` and ``present_key`` sharing one buffer, row ``b`` writes its ``S`` new keys at
positions ``[seqlens_k[b] + 1 - S, seqlens_k[b] + 1)`` and its queries attend causally to
positions ``[0, own position]``; rotary positions are the same cache positions. ``S > 1`` with
past context (a prompt chunk after the first) is only accepted at ``B == 1``; ``S == 1`` (decode)
and ``S == total_sequence_length`` (first prompt chunks, all rows starting at 0) take any ``B``.
Right padding therefore writes junk keys *after* a row's real tokens, which no real token attends
to and the row's next chunk overwrites (see ``ort_backend.py``).

The built model is saved as ``model.onnx`` plus one external weight file ``model.onnx.data``
(tensors aligned to 4 KiB so ONNX Runtime can memory-map them); ONNX IR version 10,
default-domain opset 21, ``com.microsoft`` opset 1 (onnxruntime-cann 1.24.4 refuses IR 14,
which ``onnx`` writes unless told).
"""

from __future__ import annotations

import os
import platform
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .backend import available_cpus
from .config import ModelConfig
from .gguf import GGUFFile, ModelFileError
from .providers import cpu_info
from .reference import rope_frequencies, rope_table
from .weights import (
    BLOCK,
    LayerWeights,
    NBitsWeight,
    concat_weights,
    load_embedding,
    load_layer,
    load_lm_head,
    power_of_two,
)

#: Bump whenever the graph or the weight layout changes: cached graphs from older builders are
#: then rebuilt instead of loaded.
BUILDER_VERSION = 11

#: ``model.onnx`` metadata entries: the graph options' key, the row multiple of the ``logits``
#: output (see the table above), and the rows a ``verify`` run takes at most.
GRAPH_OPTIONS_KEY = "tiny_mindie.graph_options"
LOGITS_ROWS_KEY = "tiny_mindie.logits_row_multiple"
VERIFY_ROWS_KEY = "tiny_mindie.verify_rows"

#: ``GraphOptions.verify_rows`` of a graph for speculative decoding: the last token and up to 4
#: proposed ones per verification run.
VERIFY_ROWS = 5

IR_VERSION = 10
OPSET = 21
MS_DOMAIN = "com.microsoft"
_ALIGN = 4096


# ---- the node collector ---------------------------------------------------------------------

class _Builder:
    """Collects nodes and initializers; initializers go to one external data file."""

    def __init__(self, data_path: str):
        from onnx import TensorProto, helper

        self.helper = helper
        self.TensorProto = TensorProto
        self.nodes: list = []
        self.inits: list = []
        self._n = 0
        self._data_name = os.path.basename(data_path)
        self._data = open(data_path, "wb")
        self._consts: dict = {}

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


# ---- build options ---------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    return cpu_info()[1]


def default_row_multiples() -> tuple[tuple[int, int, int], ...]:
    """``((bits, block, multiple), ...)``: the rows a MatMulNBits call with weights of ``bits``
    bits in blocks of ``block`` (0: any block) is padded to a multiple of on this CPU (see
    :func:`_pad_rows`); 1 where its kernels give a row the same arithmetic whatever the number
    of rows.

    x86-64 with AVX-512 VNNI: blocks of 32 (4- and 8-bit) 1, larger blocks 2 (rows are computed
    in pairs, an odd last row alone, otherwise). Other x86-64: 4-bit 2 (AVX2 and AVX-VNNI take
    a one-row kernel at M = 1); 8-bit 1, or 2 with AVX-512 (an odd last row was computed by
    another path there). Elsewhere (aarch64: NEON computes 4-bit rows in tiles of 4 and the rows
    left over otherwise): 4-bit 4, 8-bit 1. The start-up check
    (:meth:`.ort_backend.OrtBackend.check_batch_invariance`) holds the graph to this.
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
            ``multiple`` rows (:func:`_pad_rows`), so a row's logits do not depend on its batch;
            1, or weights not listed, runs the rows as they are.
            Default: :func:`default_row_multiples` (for this CPU).
        compact: 0 keeps the GGUF's weights (exact where :mod:`.weights` says so); a block size
            (64) requantizes every matrix, the LM head included, to 4-bit blocks of that size
            (:func:`.weights.quantize_4bit`): fewer bytes than the GGUF, not its values.
        verify_rows: add the ``verify`` input and each layer's :func:`verify_attention`
            for chunks of up to this many rows (speculative decoding, :data:`VERIFY_ROWS`;
            costs an ``If`` per layer in every run); 0: neither.
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

    def level(self, kind: str) -> int:
        """accuracy_level of the matrices named ``kind`` (``attn_qkv``, ``attn_output``,
        ``ffn_gate_up``, ``ffn_down``, ``lm_head``)."""
        for k, v in self.overrides:
            if k == kind:
                return v
        return self.lm_head_accuracy_level if kind == "lm_head" else self.accuracy_level

    def key(self) -> str:
        """The options as a short string, part of the graph cache's entry names."""
        extra = "".join(f"-{k}{v}" for k, v in self.overrides)
        rows = ".".join(f"{b}b{k}x{m}" for b, k, m in self.row_multiples)
        return (f"a{self.accuracy_level}-h{self.lm_head_accuracy_level}-l{self.lm_head_block}"
                f"-p{self.max_positions}-r{rows}-v{self.verify_rows}{extra}"
                + (f"-c{self.compact}" if self.compact else ""))

    def row_multiple(self, bits: int, block: int) -> int:
        """Rows a product with ``bits``-bit weights in blocks of ``block`` is padded to a
        multiple of (1: none)."""
        rules = {(b, k): m for b, k, m in self.row_multiples}
        return rules.get((bits, block), rules.get((bits, 0), 1))


# ---- the blocks ----------------------------------------------------------------------------------

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
            the queries (:func:`attention`), else ``config.attn_scale``.
        verify: where the graph has the ``verify`` input and :func:`verify_attention` beside
            each layer's GroupQueryAttention, the positions of its rows; else ``None``.
    """

    config: ModelConfig
    options: GraphOptions
    tokens: str
    qkv_shape: str
    rope: tuple[str, str]
    rope_local: tuple[str, str] | None
    attn_scale: float
    verify: VerifyRows | None = None


def rope_caches(g: _Builder, config: ModelConfig, positions: int
                ) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """The rotary cos/sin caches as initializers, float32 ``[positions, rope_dim / 2]``
    (:func:`.reference.rope_table`): the model's, scaled as :func:`.reference.rope_frequencies`
    says for sequences of up to ``positions`` (LongRoPE picks its factors by that), and for
    Gemma 3's local layers at ``rope_theta_local`` (else ``None``)."""
    c = config
    cos, sin = rope_table(positions, *rope_frequencies(c, positions))
    glob = g.init("rope.cos", cos), g.init("rope.sin", sin)
    if not c.rope_theta_local:
        return glob, None
    cos_l, sin_l = rope_table(positions, *rope_frequencies(c, positions, local=True))
    return glob, (g.init("rope_local.cos", cos_l), g.init("rope_local.sin", sin_l))


def embed(g: _Builder, config: ModelConfig, emb: NBitsWeight) -> str:
    """``input_ids`` int64 ``[B, S]`` -> float32 ``[T, D]``: ``GatherBlockQuantized`` on the
    embedding's 8-bit blocks (:func:`.weights.load_embedding`), times ``embedding_scale``
    (Gemma: ``sqrt(D)``, in float32 like the reference)."""
    nb = emb.k // BLOCK
    emb_data = g.init("token_embd.qweight", emb.data.reshape(emb.n, nb, BLOCK))
    emb_scales = g.init("token_embd.scales3", emb.scales.reshape(emb.n, nb, 1))
    e = g.op1("GatherBlockQuantized", [emb_data, "input_ids", emb_scales], domain=MS_DOMAIN,
              name="embed/GatherBlockQuantized", bits=8, block_size=BLOCK,
              gather_axis=0, quantize_axis=2)                           # [B, S, D/32, 32]
    h = g.op1("Reshape", [e, g.const([-1, config.hidden_size])])       # [T, D]
    if config.embedding_scale != 1.0:
        h = g.op1("Mul", [h, g.const(np.float32(config.embedding_scale), np.float32)],
                  name="embed/scale")
    return h


def rms_norm(g: _Builder, x: str, w: np.ndarray, name: str, eps: float) -> str:
    """``x / rms(x) * w`` over the last axis (as :func:`.reference.rms_norm`):
    ``SimplifiedLayerNormalization``. x: float32 ``[..., D]``; w: float32 ``[D]``. ``name`` is
    the node's (``blk.{i}/attn_norm``); ``w`` is stored as the initializer of that name with
    ``.`` for ``/`` (``blk.{i}.attn_norm``). Returns float32 ``[..., D]``."""
    return g.op1("SimplifiedLayerNormalization", [x, g.init(name.replace("/", "."), w)], name=name,
                 axis=-1, epsilon=eps)


def add_rms_norm(g: _Builder, h: str, y: str, w: np.ndarray, name: str, eps: float
                 ) -> tuple[str, str]:
    """The residual add fused into the next norm: ``h = h + y; x = rms_norm(h)``
    (``SkipSimplifiedLayerNormalization``). h, y: float32 ``[T, D]``; ``w`` and ``name`` as in
    :func:`rms_norm`. Returns ``(x, h)``, both float32 ``[T, D]``."""
    x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [h, y, g.init(name.replace("/", "."), w)],
                      4, domain=MS_DOMAIN, name=name, epsilon=eps)
    return x, h


def linear(g: _Builder, x: str, ws: Sequence[NBitsWeight], prefix: str, s: Shared, kind: str,
           rows: str | None = None, *, keep_padding: bool = False) -> str:
    """``x @ [W_0; W_1; ...].T``: float32 ``x [T, K]`` -> ``[T, sum(N)]`` with MatMulNBits (one
    per run of matrices of the same form, :func:`.weights.concat_weights`), plus
    ``blocksum(x) @ mins.T`` for the residual of a ``w = d * q + m`` type (Q4_1, Q5_1, Q4_K,
    Q5_K: :func:`.weights._affine`).

    ``rows`` holds ``T`` (default ``s.tokens``); MatMulNBits runs on ``x`` padded to the row
    multiple of its weights' bits (:func:`_pad_rows`), and its output is cut back to ``T`` rows
    unless ``keep_padding`` (then every weight must have the same multiple). ``kind`` names the
    matrices for ``GraphOptions.level``. The block sums ``[T, K/32]`` are a ``ReduceSum`` over
    ``x`` viewed as ``[T, K/32, 32]`` (a Reshape: no copy); the correction and the addition are
    one Gemm (cheaper than a MatMul with a 0/1 block-indicator matrix).
    """
    rows = s.tokens if rows is None else rows
    outs = []
    for j, w in enumerate(concat_weights(ws)):
        p = f"{prefix}.{j}" if len(ws) > 1 else prefix
        m = s.options.row_multiple(w.bits, w.block)
        inputs = [_pad_rows(g, x, rows, m), g.init(p + ".qweight", w.data),
                  g.init(p + ".scales", w.scales.reshape(-1))]
        if w.zero_points is not None:
            inputs.append(g.init(p + ".qzeros", w.zero_points.reshape(-1)))
        y = g.op1("MatMulNBits", inputs, domain=MS_DOMAIN, name=p + "/MatMulNBits",
                  K=w.k, N=w.n, bits=w.bits, block_size=w.block,
                  accuracy_level=s.options.level(kind))                     # [T', N]
        if m > 1 and not keep_padding:
            y = g.op1("Slice", [y, g.const([0]), rows, g.const([0])])           # [T, N]
        if w.mins is not None:
            xb = g.op1("Reshape", [inputs[0] if keep_padding else x,
                                   g.const([-1, w.k // BLOCK, BLOCK])], name=p + "/blocks")
            bs = g.op1("ReduceSum", [xb, g.const([-1])], name=p + "/blocksum",
                       keepdims=0)                                              # [T, K/32]
            y = g.op1("Gemm", [bs, g.init(p + ".mins_t", np.ascontiguousarray(w.mins.T)), y],
                      name=p + "/add_mins")                                     # [T, N]
        outs.append(y)
    if len(outs) == 1:
        return outs[0]
    return g.op1("Concat", outs, axis=-1)


def _row_pads(g: _Builder, rows: str, multiple: int) -> str:
    """The ``Pad`` input that adds ``(-T) mod multiple`` rows at the end of a ``[T, D]`` tensor
    (``rows``: int64 ``[1]`` holding ``T``); made once per ``(rows, multiple)``."""
    key = ("row_pads", rows, multiple)
    if key not in g._consts:
        m = g.const([multiple])
        extra = g.op1("Mod", [g.op1("Sub", [m, g.op1("Mod", [rows, m])]), m])
        g._consts[key] = g.op1("Concat", [g.const([0, 0]), extra, g.const([0])], axis=0)
    return g._consts[key]


def _rows(g: _Builder, x: str) -> str:
    """int64 ``[1]``: the number of rows of ``x``."""
    return g.op1("Slice", [g.op1("Shape", [x]), g.const([0]), g.const([1])])


def _pad_rows(g: _Builder, x: str, rows: str, multiple: int) -> str:
    """``x [T, K] -> [T', K]``, ``T'`` the next multiple of ``multiple`` (the last row repeated
    into the new ones; ``rows`` holds ``T``).

    Why: onnxruntime's ``MatMulNBits`` kernels (MLAS, 1.24, int8 activations) compute a row by
    other arithmetic depending on how many rows share the call, and a row's logits would then
    depend on the batch it runs in (so would a seeded or greedy answer): on AVX2 a call of
    exactly one row of 4-bit weights takes a GEMV kernel (``CountM == 1``) that rounds otherwise
    than the kernel of every larger M; NEON computes 4-bit rows in tiles of 4 and the rows left
    over otherwise; on AVX-512 rows of blocks larger than 32 are computed in pairs and an odd
    last row alone (see :func:`default_row_multiples`, which also says where no padding is
    needed). MLAS quantizes the activations per row, so the repeated rows change nothing for
    the others; a single stream pays the slower multi-row kernel.
    """
    if multiple <= 1:
        return x
    return g.op1("Pad", [x, _row_pads(g, rows, multiple)], mode="edge")


def qk_norm(g: _Builder, p: str, qkv: str, w: LayerWeights, c: ModelConfig) -> str:
    """Gemma 3's q/k norm on the fused projection float32 ``[T, (Nq + 2 Nkv) H]``: each q and k
    head RMS-normalized over ``H`` (:func:`rms_norm` on ``[T, N, H]``), v untouched. Returns
    float32 ``[T, (Nq + 2 Nkv) H]``."""
    hd = c.head_dim
    q, k, v = g.op("Split", [qkv, g.const([c.num_heads * hd, c.num_kv_heads * hd,
                                          c.num_kv_heads * hd])], 3, axis=-1)
    outs = []
    for name, t, nw, n in (("q", q, w.q_norm, c.num_heads), ("k", k, w.k_norm, c.num_kv_heads)):
        t3 = g.op1("Reshape", [t, g.const([-1, n, hd])])                   # [T, N, H]
        t3 = rms_norm(g, t3, nw, f"{p}/attn_{name}_norm", float(c.rms_eps))
        outs.append(g.op1("Reshape", [t3, g.const([-1, n * hd])]))         # [T, N H]
    return g.op1("Concat", outs + [v], axis=-1)                              # [T, (Nq+2Nkv) H]


def attention(g: _Builder, i: int, x: str, w: LayerWeights, s: Shared) -> str:
    """Layer ``i``'s attention on the normalized ``x`` float32 ``[T, D]`` -> ``[T, D]``:
    the fused QKV projection (+ Qwen2's biases, Gemma 3's q/k norms), ``GroupQueryAttention``
    (rotary inside, on the in-place KV cache ``past/present_key.{i}``, ``past/present_value.{i}``;
    local layers with their window and rotary caches), then the output projection.

    A power-of-two attention scale is folded into the queries (:func:`.weights.load_layer`) and
    GroupQueryAttention then runs with ``scale=1``: its ``Q K^T`` is an sgemm with
    ``alpha = scale``, and MLAS takes its no-packing kernel for one query row only at
    ``alpha == 1``. Rotary embedding is linear, so scaling q before it is the same.
    """
    c, p = s.config, f"blk.{i}"
    qkv = linear(g, x, w.w_qkv, p + ".attn_qkv", s, "attn_qkv")              # [T, (Nq+2Nkv) H]
    if w.b_qkv is not None:                                                  # Qwen2
        qkv = g.op1("Add", [qkv, g.init(p + ".attn_qkv.bias", w.b_qkv)],
                    name=p + "/attn_qkv_bias")
    if w.q_norm is not None:                                                 # Gemma 3
        qkv = qk_norm(g, p, qkv, w, c)
    qkv = g.op1("Reshape", [qkv, s.qkv_shape])                               # [B, S, (Nq+2Nkv) H]
    local = c.is_local(i)
    cos, sin = s.rope_local if local and s.rope_local else s.rope
    window = {"local_window_size": c.sliding_window} if local else {}
    rotary = c.uses_rope(i)                                                  # SmolLM3: NoPE layers
    attn = g.op("GroupQueryAttention",
                [qkv, "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k",
                 "total_sequence_length"] + ([cos, sin] if rotary else []),
                domain=MS_DOMAIN, name=p + "/GroupQueryAttention",
                outputs=[p + "/attn_out", f"present_key.{i}", f"present_value.{i}"],
                num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, do_rotary=int(rotary),
                rotary_interleaved=0 if c.rope_neox else 1, scale=s.attn_scale,
                **window)[0]                                                 # [B, S, Nq H]
    if s.verify is not None:
        # The If's else branch (every plain run) yields a constant of a static shape: a
        # branch output of a dynamic shape costs onnxruntime ~30 us per If and run (its fetch
        # allocator), 5 % of a SmolLM2 decode step over 30 layers; Where then keeps GQA's rows.
        rows = g.subgraph(p + "/verify_rows", lambda: verify_attention(
            g, i, qkv, s, (cos, sin) if rotary else None, window.get("local_window_size", 0)),
            [1, "seq", c.num_heads * c.head_dim])
        unused = g.subgraph(p + "/decode_rows", lambda: g.op1(
            "Identity", [g.const(np.zeros((1, 1, 1)), np.float32)]), [1, 1, 1])
        rows = g.op1("If", ["verify"], name=p + "/verify", then_branch=rows,
                     else_branch=unused)                                     # [1, S, Nq H]
        attn = g.op1("Where", ["verify", rows, attn])                          # [B, S, Nq H]
    attn = g.op1("Reshape", [attn, g.const([-1, c.num_heads * c.head_dim])])  # [T, Nq H]
    return linear(g, attn, [w.w_o], p + ".attn_output", s, "attn_output")    # [T, D]


def verify_attention(g: _Builder, i: int, qkv: str, s: Shared, rope: tuple[str, str] | None,
                     window: int) -> str:
    """Layer ``i``'s attention for a chunk of one sequence (``B == 1``, ``S`` rows) computed the
    way decoding computes it: the output of ``S`` decode steps, bit for bit, where
    GroupQueryAttention's own chunk output rounds otherwise. For verifying proposed tokens in
    one run (speculative decoding), after GroupQueryAttention wrote the chunk's KV.

    qkv: float32 ``[1, S, (Nq + 2 Nkv) H]``, GroupQueryAttention's packed input; rope: the
    layer's ``(cos, sin)`` caches, ``None`` for a layer without rotary; window: its
    ``local_window_size`` (0: none). Reads ``present_key.{i}``/``present_value.{i}`` up to the
    chunk's end ``t``. Returns float32 ``[1, S, Nq H]``.

    Why it matches: for one query row (decode) GroupQueryAttention's ``Q K^T`` and ``probs V``
    per head are MLAS SGEMMs with ``M = 1``, which take MLAS's one-row kernels, over exactly the
    row's causal length ``e``, and its softmax spans those ``e`` scores (or the last ``window``,
    zeros before); for ``S > 1`` rows it takes the general kernel, which adds in another
    order. Here the heads of a KV group are a batch dimension, so ``FusedMatMul`` and ``MatMul``
    are again ``M = 1`` GEMMs, each row's over exactly its own ``e`` keys and values (the
    one-row kernels add the last few columns or terms otherwise depending on how many there
    are: neither longer products nor zero padding give the same bits), and each row's
    ``Softmax`` (MLAS's, as GroupQueryAttention's) spans exactly its own scores. Rows are
    unrolled up to ``GraphOptions.verify_rows`` (:class:`VerifyRows`); the rows past a shorter
    chunk attend to one position and are dropped.
    """
    c, p, vr = s.config, f"blk.{i}", s.verify
    nkv, hd, group = c.num_kv_heads, c.head_dim, c.num_heads // c.num_kv_heads
    nq = c.num_heads * hd
    q = g.op1("Slice", [qkv, g.const([0]), g.const([nq]), g.const([2])])    # [1, S, Nq H]
    if rope is not None:
        partial = {"rotary_embedding_dim": c.rope_dim} if c.rope_dim < hd else {}
        q = g.op1("RotaryEmbedding", [q, vr.base, *rope], domain=MS_DOMAIN,
                  name=p + "/verify_rotary", num_heads=c.num_heads,
                  interleaved=0 if c.rope_neox else 1, **partial)
    q = g.op1("Reshape", [q, g.const([-1, nkv, group, 1, hd])])            # [S, Nkv, G, 1, H]
    outs = []
    for row, start, end, pads in vr.rows_for(window):
        k, v = (g.op1("Reshape", [g.op1("Slice", [f"{kind}.{i}", g.const([0]), end,
                                                 g.const([2])]),
                                  g.const([1, nkv, 1, -1, hd])])           # [1, Nkv, 1, e, H]
                for kind in ("present_key", "present_value"))
        if nkv == 1:    # else MatMul folds the heads into the rows of one GEMM (M = G)
            k, v = (g.op1("Expand", [t, g.const([1, 1, group, 1, 1])]) for t in (k, v))
        sr = g.op1("FusedMatMul", [g.op1("Gather", [q, row], axis=0), k], domain=MS_DOMAIN,
                   transB=1, alpha=float(s.attn_scale))                    # [1, Nkv, G, 1, e]
        if window:
            sr = g.op1("Slice", [sr, start, end, g.const([4])])            # the window's keys
        probs = g.op1("Softmax", [sr], axis=-1)
        if window:
            probs = g.op1("Pad", [probs, pads])                            # zeros before
        outs.append(g.op1("MatMul", [probs, v]))                           # [1, Nkv, G, 1, H]
    out = g.op1("Slice", [g.op1("Concat", outs, axis=0), g.const([0]), s.tokens,
                          g.const([0])])                                   # [S, Nkv, G, 1, H]
    return g.op1("Reshape", [out, g.const([1, -1, nq])])                   # [1, S, Nq H]


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


def verify_rows(g: _Builder, tokens: str, rows: int, windows: Sequence[int]) -> VerifyRows:
    """The :class:`VerifyRows` of a graph with ``rows`` unrolled verification rows (``tokens``
    holds ``S``), for local layers of the ``windows`` sizes too."""
    total = g.op1("Reshape", [g.op1("Cast", ["total_sequence_length"], to=g.TensorProto.INT64),
                              g.const([1])])
    base = g.op1("Sub", [total, tokens])
    last = g.op1("Sub", [tokens, g.const([1])])
    out, windowed = [], {w: [] for w in windows}
    for j in range(rows):
        row = g.op1("Min", [g.const([j]), last])
        end = g.op1("Add", [base, g.const([j + 1])])
        if j:       # a row past the chunk's (dropped) looks at one position: next to no work
            end = g.op1("Where", [g.op1("Less", [g.const([j]), tokens]), end, g.const([1])])
        out.append((row, end))
        for w in windows:
            start = g.op1("Max", [g.op1("Sub", [end, g.const([w])]), g.const([0])])
            windowed[w].append((start, g.op1("Concat", [g.const([0] * 4), start,
                                                        g.const([0] * 5)], axis=0)))
    return VerifyRows(base, total, g.const([0]), out, windowed)


def mlp(g: _Builder, i: int, x: str, w: LayerWeights, s: Shared) -> str:
    """Layer ``i``'s gated MLP on the normalized ``x`` float32 ``[T, D]`` -> ``[T, D]``:
    ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (:func:`.reference.mlp`) or, for Gemma,
    GELU(tanh) (:func:`.reference.geglu_mlp`); gate and up are one fused projection."""
    p = f"blk.{i}"
    gu = linear(g, x, w.w_gate_up, p + ".ffn_gate_up", s, "ffn_gate_up")    # [T, 2I]
    gate, up = g.op("Split", [gu], 2, axis=-1, num_outputs=2)                # 2 x [T, I]
    if s.config.mlp_act == "gelu_tanh":
        act = g.op1("Mul", [g.op1("Gelu", [gate], approximate="tanh"), up])
    else:
        act = g.op1("Mul", [g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]), up])
    return linear(g, act, [w.w_down], p + ".ffn_down", s, "ffn_down")        # [T, D]


def block(g: _Builder, i: int, h: str, pending: str | None, w: LayerWeights, s: Shared
          ) -> tuple[str, str]:
    """Decoder layer ``i`` (:func:`.reference.block`, and :func:`.reference.gemma3_block` with
    ``post_norms``).

    h: the residual stream, float32 ``[T, D]``; pending: the previous layer's output, float32
    ``[T, D]``, not yet added to ``h`` (``None`` before the first layer): its add is fused into
    this layer's first norm, as this layer's attention output is into the second. Returns
    ``(h, out)``: the stream and this layer's output, still to be added.
    """
    p, eps = f"blk.{i}", float(s.config.rms_eps)
    if pending is None:
        x = rms_norm(g, h, w.attn_norm, p + "/attn_norm", eps)
    else:
        x, h = add_rms_norm(g, h, pending, w.attn_norm, p + "/attn_norm", eps)
    o = attention(g, i, x, w, s)
    if w.post_attn_norm is not None:                                         # Gemma 3
        o = rms_norm(g, o, w.post_attn_norm, p + "/post_attention_norm", eps)
    x, h = add_rms_norm(g, h, o, w.ffn_norm, p + "/ffn_norm", eps)
    out = mlp(g, i, x, w, s)
    if w.post_ffn_norm is not None:                                          # Gemma 3
        out = rms_norm(g, out, w.post_ffn_norm, p + "/post_ffw_norm", eps)
    return h, out


def lm_head(g: _Builder, h: str, pending: str, norm: np.ndarray, head: NBitsWeight,
            head_name: str, s: Shared) -> str:
    """The logits of the rows at ``logits_index``: ``rms_norm(h + pending)[logits_index] @ head.T``
    (the reference's ``_logits``). h, pending: float32 ``[T, D]``; norm: float32 ``[D]``;
    head: ``[V, D]``. Returns float32 ``[B', V]``: ``B`` padded to the head's row multiple, the
    padding rows kept."""
    last_h = g.op1("Gather", [h, "logits_index"], axis=0)                  # [B, D]
    last_p = g.op1("Gather", [pending, "logits_index"], axis=0)
    x = g.op("SkipSimplifiedLayerNormalization", [last_h, last_p, g.init("output_norm", norm)], 1,
             domain=MS_DOMAIN, name="output_norm", epsilon=float(s.config.rms_eps))[0]
    return linear(g, x, [head], head_name + ".lm_head", s, "lm_head", _rows(g, x),
                  keep_padding=True)                                        # [B', V]


# ---- the model -----------------------------------------------------------------------------------

def build_model(f: GGUFFile, config: ModelConfig, out_dir: str,
                options: GraphOptions = GraphOptions()) -> str:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx.data``) for the decoder in ``f``.

    Returns:
        the path of ``model.onnx``.

    Raises:
        ModelFileError: the architecture or a tensor is not supported.
    """
    if config.architecture not in ("llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma3"):
        raise ModelFileError(f"the onnxruntime backend does not support architecture "
                             f"{config.architecture!r} yet; use --backend numpy")
    c = config
    if (c.rope_dim // 2) % 8 or c.rope_dim > c.head_dim:
        raise ModelFileError(f"{c.architecture}.rope.dimension_count = {c.rope_dim}: onnxruntime's "
                             "GroupQueryAttention rotates a multiple of 16 dimensions only; "
                             "use --backend numpy")
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "model.onnx")
    g = _Builder(model_path + ".data")
    pool = ThreadPoolExecutor(max(1, available_cpus()), thread_name_prefix="tiny_mindie-pack")
    try:
        emb = load_embedding(f)
        q_scale = power_of_two(c.attn_scale)
        # the weights are packed on other cores (numpy releases the GIL) one layer ahead of
        # the nodes written in order, the LM head beside them: the build's peak memory is
        # about two layers' packing plus the head's, not the whole model's
        head_job = pool.submit(load_lm_head, f, c, emb, options.lm_head_block, options.compact)
        layers = _ahead(pool, lambda i: load_layer(f, c, i, q_scale, options.compact),
                        range(c.num_layers), depth=1)
        rope, rope_local = rope_caches(g, c, options.max_positions or c.context_length)
        h = embed(g, c, emb)                                                # [T, D]
        tokens = _rows(g, h)
        qkv_shape = g.op1("Concat", [g.op1("Shape", ["input_ids"]),
                                     g.const([(c.num_heads + 2 * c.num_kv_heads) * c.head_dim])],
                          axis=0)                                           # [B, S, (Nq+2Nkv) H]
        verify = None
        if options.verify_rows:
            windows = sorted({c.sliding_window for i in range(c.num_layers) if c.is_local(i)})
            verify = verify_rows(g, tokens, options.verify_rows, windows)
        s = Shared(c, options, tokens, qkv_shape, rope, rope_local,
                   1.0 if q_scale is not None else float(c.attn_scale), verify)
        pending = None
        for i, weights in enumerate(layers):
            h, pending = block(g, i, h, pending, weights, s)
        head = head_job.result()
        logits = lm_head(g, h, pending, f.dequantize("output_norm.weight"), head,
                         "token_embd" if c.tied_embeddings else "output", s)
        g.op("Identity", [logits], outputs=["logits"])                       # [B', V]
        model = _model_proto(g, c, options.verify_rows > 0, {GRAPH_OPTIONS_KEY: options.key(),
                                    LOGITS_ROWS_KEY: str(options.row_multiple(head.bits,
                                                                              head.block)),
                                    VERIFY_ROWS_KEY: str(options.verify_rows)})
    finally:
        pool.shutdown(cancel_futures=True)
        g.close()
    with open(model_path, "wb") as out:
        out.write(model.SerializeToString())
    return model_path


def _ahead(pool: ThreadPoolExecutor, fn: Callable, items, depth: int) -> Iterator:
    """``fn(item)`` for each of ``items``, in order, computed on ``pool`` at most ``depth``
    items ahead of the one yielded (so at most ``depth + 1`` results are held at once);
    an exception of ``fn`` is raised when its item's turn comes."""
    jobs: deque = deque()
    todo = iter(items)
    for item in todo:
        jobs.append(pool.submit(fn, item))
        if len(jobs) > depth:
            yield jobs.popleft().result()
    while jobs:
        yield jobs.popleft().result()


def _model_proto(g: _Builder, c: ModelConfig, verify: bool, metadata: dict[str, str]):
    """The ``onnx.ModelProto`` of the nodes and initializers in ``g``, with the graph inputs and
    outputs of the module docstring and ``metadata`` as its metadata entries."""
    from onnx import TensorProto, helper

    F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kv_shape = ["batch", c.num_kv_heads, "kv_len", c.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", I32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", I32, []),
              helper.make_tensor_value_info("logits_index", I64, ["batch"])]
    if verify:
        inputs.append(helper.make_tensor_value_info("verify", TensorProto.BOOL, []))
    outputs = [helper.make_tensor_value_info("logits", F, ["logits_rows", c.vocab_size])]
    for i in range(c.num_layers):
        inputs += [helper.make_tensor_value_info(f"past_key.{i}", F, kv_shape),
                   helper.make_tensor_value_info(f"past_value.{i}", F, kv_shape)]
        outputs += [helper.make_tensor_value_info(f"present_key.{i}", F, kv_shape),
                    helper.make_tensor_value_info(f"present_value.{i}", F, kv_shape)]
    graph = helper.make_graph(g.nodes, "tiny_mindie_decoder", inputs, outputs, g.inits)
    model = helper.make_model(
        graph, ir_version=IR_VERSION, producer_name="tiny_mindie",
        producer_version=str(BUILDER_VERSION),
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    for key, value in metadata.items():
        meta = model.metadata_props.add()
        meta.key, meta.value = key, value
    return model
