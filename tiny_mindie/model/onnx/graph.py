"""Build the ONNX graph of a GGUF decoder, node by node, with ``onnx.helper``.

Nothing is exported from a framework: every node below is written here from the model's
architecture parameters (:class:`~tiny_mindie.model.arch.ModelConfig`) and its weights, packed
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
(``phi3``): NEOX, fused tensors split at load (:func:`.graph_weights.pack_layer`),
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
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ..arch import ModelConfig
from ..backend import available_cpus
from ..gguf import GGUFFile, ModelFileError
from .graph_layers import block, lm_head, verify_rows
from .graph_nodes import MS_DOMAIN, TM_DOMAIN, GraphBuilder, Shared, embed, rope_caches, rows_of
from .graph_options import GraphOptions
from .graph_standard import build_standard_model
from .graph_weights import load_embedding, load_lm_head, pack_layer, power_of_two
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

IR_VERSION = 10
OPSET = 21


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
        layers = _ahead(pool, lambda i: pack_layer(f, c, i, q_scale, options.compact, gguf),
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
