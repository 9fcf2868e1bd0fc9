"""Build the ONNX graph of a GGUF decoder, node by node, with ``onnx.helper``.

Nothing is exported from a framework: every node below is written here from the model's
architecture parameters (:class:`~tiny_mindie.model.config.ModelConfig`) and its weights, packed
by :mod:`.weights` and :mod:`.graph_weights`. The graph follows the numpy reference decoder
(:mod:`.reference`) block for block, with functions of the same names --
:func:`.graph_nodes.embed`, :func:`.graph_layers.block`, :func:`.graph_layers.attention`,
:func:`.graph_layers.mlp`, :func:`.graph_nodes.linear`, :func:`.graph_nodes.rms_norm` and
:func:`.graph_layers.lm_head` (the reference's ``_logits``) -- each adding its nodes to a
:class:`.graph_nodes.GraphBuilder` and returning the names of its outputs::

    h = embed(input_ids)                                       # [B, S] -> [T, D]
    for each layer:
        h = h + attention(rms_norm(h))
        h = h + mlp(rms_norm(h))
    logits = lm_head(rms_norm(h[logits_index]))                # [B, D] -> [B', V]

Each residual add is fused into the next norm (``SkipSimplifiedLayerNormalization``: ``h += y;
x = rms_norm(h)``), so a block hands its output on un-added (see :func:`.graph_layers.block`).
This module holds the graph's contract (below), the build choices (:class:`GraphOptions`, with
the row multiples each CPU needs) and :func:`build_model`, which assembles the graph.

It uses ONNX Runtime's contrib operators (domain ``com.microsoft``) where they are the fast path
on CPU: ``GroupQueryAttention`` (KV cache updated in place, rotary inside), ``MatMulNBits``
(block-quantized weights), ``SkipSimplifiedLayerNormalization`` and ``GatherBlockQuantized``;
``SimplifiedLayerNormalization`` is a default-domain op. ``GraphOptions.flavour = "standard"``
builds :mod:`.graph_standard` instead: default-domain operators only, for execution providers
without these (the CANN provider); its contract is in that module.

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
                                                   (:func:`.graph_layers.verify_attention`)
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
input padded to a multiple of rows and its output cut back (:func:`.graph_nodes._pad_rows`, and
``GraphOptions.row_multiples`` for which).

Architectures: LLaMA (``llama``) as above, with a SiLU-gated MLP and rotary on adjacent pairs.
Qwen2 (``qwen2``) adds the q/k/v biases after the fused QKV projection and rotates in NEOX mode
(``rotary_interleaved=0``: llama.cpp's converter keeps Qwen2's Q/K rows in HF order). Qwen3
(``qwen3``): NEOX, q/k heads RMS-normalized as Gemma 3's (:func:`.graph_layers.qk_norm`). Phi-3
(``phi3``): NEOX, fused tensors split at load (:func:`.graph_weights.load_layer`),
``local_window_size`` on every layer. SmolLM3 (``smollm3``): ``do_rotary=0`` on every 4th
layer. Rotary scaling lives in the cos/sin caches (:func:`.graph_nodes.rope_caches`). Gemma 3
(``gemma3``) adds: the embedding times ``sqrt(D)`` (a float32 ``Mul``, as the reference); q and
k heads RMS-normalized over ``H`` before GroupQueryAttention; the attention and MLP outputs
RMS-normalized before each residual add; ``Gelu(approximate="tanh")`` instead of SiLU; NEOX
rope; and on local layers (``ModelConfig.is_local``) ``local_window_size = sliding_window`` (a
query at ``p`` then sees the keys ``p - w + 1 .. p``, the reference's ``p - key < window``) with
a second pair of cos/sin caches at the local rotary base. A power-of-two attention scale is
folded into the queries (:func:`.graph_layers.attention`).

GroupQueryAttention semantics this graph relies on (CPU kernel of onnxruntime 1.24): with
``past_key`` and ``present_key`` sharing one buffer, row ``b`` writes its ``S`` new keys at
positions ``[seqlens_k[b] + 1 - S, seqlens_k[b] + 1)`` and its queries attend causally to
positions ``[0, own position]``; rotary positions are the same cache positions. ``S > 1`` with
past context (a prompt chunk after the first) is only accepted at ``B == 1``; ``S == 1`` (decode)
and ``S == total_sequence_length`` (first prompt chunks, all rows starting at 0) take any ``B``.
Right padding therefore writes junk keys *after* a row's real tokens, which no real token attends
to and the row's next chunk overwrites (see ``ort_backend.py``).

The built model is saved as ``model.onnx`` plus one external weight file ``model.onnx.data``
(tensors aligned to 4 KiB so ONNX Runtime can memory-map them), except, with the custom
kernels, the GGUF blocks ``MatMulGGUF`` and ``GatherGGUF`` read: those initializers name bytes
of the GGUF itself (:data:`.graph_nodes.GGUF_LOCATION`), which the session is handed mapped
(:func:`.ort_session.gguf_initializers`), so the weights are neither copied into the cache nor
into memory. ONNX IR version 10,
default-domain opset 21, ``com.microsoft`` opset 1 (onnxruntime-cann 1.24.4 refuses IR 14,
which ``onnx`` writes unless told).
"""

from __future__ import annotations

import os
import platform
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .backend import available_cpus
from .config import ModelConfig
from .gguf import GGUFFile, ModelFileError
from .graph_layers import block, lm_head, verify_rows
from .graph_nodes import MS_DOMAIN, TM_DOMAIN, GraphBuilder, Shared, embed, rope_caches, rows_of
from .graph_standard import STANDARD_VERSION, build_standard_model
from .graph_weights import load_embedding, load_layer, load_lm_head, power_of_two
from .providers import cpu_info
from .weights import GGUFMatrix, NBitsWeight

#: Bump whenever the graph or the weight layout changes: cached graphs from older builders are
#: then rebuilt instead of loaded.
BUILDER_VERSION = 12

#: ``model.onnx`` metadata entries: the graph options' key, the row multiple of the ``logits``
#: output (see the table above), and the rows a ``verify`` run takes at most.
GRAPH_OPTIONS_KEY = "tiny_mindie.graph_options"
LOGITS_ROWS_KEY = "tiny_mindie.logits_row_multiple"
VERIFY_ROWS_KEY = "tiny_mindie.verify_rows"
#: ``model.onnx`` metadata entry naming a graph of another flavour than ``contrib``
GRAPH_FLAVOUR_KEY = "tiny_mindie.graph"

#: ``GraphOptions.verify_rows`` of a graph for speculative decoding: the last token and up to 4
#: proposed ones per verification run.
VERIFY_ROWS = 5

IR_VERSION = 10
OPSET = 21


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


# ---- the model -----------------------------------------------------------------------------------

def build_model(f: GGUFFile, config: ModelConfig, out_dir: str,
                options: GraphOptions = GraphOptions()) -> str:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx.data``) for the decoder in ``f``.

    Returns:
        the path of ``model.onnx``.

    Raises:
        ModelFileError: the architecture or a tensor is not supported.
    """
    c = config
    _check_supported(c, options)
    if options.flavour == "standard":
        return build_standard_model(f, c, out_dir, options.max_positions or c.context_length,
                                    {GRAPH_OPTIONS_KEY: options.key(), GRAPH_FLAVOUR_KEY:
                                     "standard"}, options.standard_dtype)
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "model.onnx")
    gguf = options.kernels == "custom"
    g = GraphBuilder(model_path + ".data", f if gguf else None)
    pool = ThreadPoolExecutor(max(1, available_cpus()), thread_name_prefix="tiny_mindie-pack")
    try:
        emb = load_embedding(f, gguf)
        q_scale = power_of_two(c.attn_scale)
        # the weights are packed on other cores (numpy releases the GIL) one layer ahead of
        # the nodes written in order, the LM head beside them: the build's peak memory is
        # about two layers' packing plus the head's, not the whole model's
        head_job = pool.submit(load_lm_head, f, c, emb, options.lm_head_block, options.compact,
                               gguf)
        layers = _ahead(pool, lambda i: load_layer(f, c, i, q_scale, options.compact, gguf),
                        range(c.num_layers), depth=1)
        rope, rope_local = rope_caches(g, c, options.max_positions or c.context_length)
        h = embed(g, c, emb)                                                # [T, D]
        tokens = rows_of(g, h)
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
                                    LOGITS_ROWS_KEY: str(_head_rows(options, head)),
                                    VERIFY_ROWS_KEY: str(options.verify_rows)})
    finally:
        pool.shutdown(cancel_futures=True)
        g.close()
    with open(model_path, "wb") as out:
        out.write(model.SerializeToString())
    return model_path


def _head_rows(options: GraphOptions, head: NBitsWeight | GGUFMatrix) -> int:
    """The row multiple the LM head's product pads its rows to (1: none; MatMulGGUF needs
    none)."""
    if isinstance(head, GGUFMatrix):
        return 1
    return options.row_multiple(head.bits, head.block)


def _check_supported(c: ModelConfig, options: GraphOptions) -> None:
    """Raises ``ModelFileError`` for an architecture the graphs do not build, or (the contrib
    graph) a rotary dimension GroupQueryAttention cannot rotate."""
    if options.kernels not in ("onnxruntime", "custom") or (
            options.kernels == "custom" and options.compact):
        raise ValueError(f"kernels {options.kernels!r}: onnxruntime, or custom with the exact "
                         "weights")
    if c.architecture not in ("llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma3"):
        raise ModelFileError(f"the onnxruntime backend does not support architecture "
                             f"{c.architecture!r} yet; use --backend numpy")
    if options.flavour != "standard" and ((c.rope_dim // 2) % 8 or c.rope_dim > c.head_dim):
        raise ModelFileError(f"{c.architecture}.rope.dimension_count = {c.rope_dim}: onnxruntime's "
                             "GroupQueryAttention rotates a multiple of 16 dimensions only; "
                             "use --backend numpy")


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


def _model_proto(g: GraphBuilder, c: ModelConfig, verify: bool, metadata: dict[str, str]):
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
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    if any(n.domain == TM_DOMAIN for n in g.nodes):
        opsets.append(helper.make_opsetid(TM_DOMAIN, 1))
    model = helper.make_model(graph, ir_version=IR_VERSION, producer_name="tiny_mindie",
                              producer_version=str(BUILDER_VERSION), opset_imports=opsets)
    for key, value in metadata.items():
        meta = model.metadata_props.add()
        meta.key, meta.value = key, value
    return model
