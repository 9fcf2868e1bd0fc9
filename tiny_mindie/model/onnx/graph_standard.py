"""The standard graph: the decoder from default-domain ONNX operators only, for execution
providers without onnxruntime's contrib operators (the CANN provider's graph mode above all).

:func:`build_standard_model` writes it from the same GGUF as :func:`.graph.build_model`, block for
block as the numpy reference (:mod:`..reference.layers`), with its weights: every matrix
dequantized by the reference's own loader (:func:`..reference.decoder.load_layer`) to float32
and, in the ``float16`` graph (the default, :data:`DTYPES`), rounded to float16 -- the value
nearest the reference's. Nothing in it is a ``com.microsoft`` operator:

- matrix products are ``MatMul`` on ``[in, out]`` weights (the tied LM head a ``Gemm`` with
  ``transB=1`` on the embedding, so the largest matrix is stored once);
- RMSNorm is ``Mul``/``ReduceSum``/``Div``/``Add``/``Sqrt``/``Reciprocal``/``Mul``; rotary
  is ``Gather`` of cos/sin tables at the tokens' positions, ``Slice``, ``Mul``, ``Add``,
  ``Concat``;
- attention writes the chunk's keys and values into the KV cache with ``ScatterND`` (bound to
  the same buffer as its input it writes only those positions: in place), then ``MatMul`` and
  ``Softmax`` over the first ``Lb`` positions, ``Lb`` the span the attention bias covers. Each
  query's products are their own (one row, ``M = 1``, a batch dimension apart), so a query in
  a chunk of many is computed as a lone decode query is: a verification's rows are decoding's
  where the matrix products' rows are too (the start-up checks say);
- each operator is one the CANN graph mode takes and Ascend's ONNX pages document at this
  opset, with positive axes and no 1-D ``Slice`` (:mod:`.cann_ops` checks the built graph).

Precision. ``float32``: every tensor float32 (the exact check on a CPU). ``float16``: the
weight matrices, the KV cache and every matrix product are float16 -- ``MatMul``'s Ascend page
lists float16 only, and the NPU computes products in float16 in either graph -- each product's
activation input cast to float16 and its output back to float32 (``Cast``); everything else
(the residual stream, RMSNorm, rotary, the attention bias and ``Softmax``, SiLU/GELU, the
logits) stays float32, whose pages list float32 too: a sum of squares or an exponent overflows
float16's 65504 long before float32's range. The embedding table is float16 (``Gather`` takes
any type), cast to float32 after the lookup; norm weights, biases and rotary tables stay
float32 (a few MB).

Graph inputs and outputs (``B`` rows, ``S`` tokens per row, ``Lb`` key positions attended to,
``Lc`` the KV cache's positions, ``Nkv`` KV heads, ``H`` head_dim, ``R`` logits rows, ``V``
vocabulary, ``kv`` the graph's dtype; ``B``, ``S``, ``Lb``, ``R`` are dimensions a caller keeps
to a small fixed set (:mod:`.shapes`), so a compiling provider builds a fixed number of
graphs)::

    input_ids              int64   [B, S]            token ids (padding: any valid id)
    positions              int64   [B, S]            each token's rotary position
    kv_index               int64   [B, Nkv, S, 3]    ScatterND index of each new key/value:
                                                     (row, head, cache position)
    attention_bias         float32 [B,1,1,S,1,Lb]    0 where the token sees the key, -inf where
                                                     not (each token sees at least one key)
    local_attention_bias   float32 [B,1,1,S,1,Lb]    the same for local layers' windows (models
                                                     with sliding-window layers only)
    logits_index           int64   [R]               rows of the ``B * S`` tokens whose logits
                                                     are wanted
    past_key.{i}           kv      [B, Nkv, Lc, H]   layer i's key cache
    past_value.{i}         kv      [B, Nkv, Lc, H]

    logits                 float32 [R, V]
    present_key.{i}        kv      [B, Nkv, Lc, H]   bind to the SAME buffer as past_key.{i}
    present_value.{i}      kv      [B, Nkv, Lc, H]   bind to the SAME buffer as past_value.{i}

ONNX IR version 8, opset 17: the versions Ascend's ONNX parser documents (:mod:`.cann_ops`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..arch import ModelConfig
from ..backend import available_cpus
from ..gguf import GGUFFile
from ..reference.decoder import load_layer, xw_matrix
from ..reference.layers import LayerWeights, rope_frequencies, rope_table
from .graph_nodes import GraphBuilder

IR_VERSION = 8
OPSET = 17

#: the graph's dtypes (``GraphOptions.standard_dtype``, ``--standard-dtype``): the weight
#: matrices', the KV cache's and the matrix products'; the default first
DTYPES = {"float16": np.float16, "float32": np.float32}

_NEG = float(-np.inf)


@dataclass(frozen=True)
class _Shared:
    """What every layer reads besides its weights: the rotary (cos, sin, -sin) at the tokens'
    positions (global and local layers'), float32 ``[B, S, 1, rope_dim/2]``, the names of
    the attention bias inputs, and ``half``: whether products, weights and KV are float16."""

    config: ModelConfig
    rope: tuple[str, str, str]
    rope_local: tuple[str, str, str]
    bias: str
    bias_local: str | None
    half: bool = False


def _cast(g: GraphBuilder, x: str, half: bool, to_half: bool) -> str:
    """``x`` cast to float16 (``to_half``) or float32, in the float16 graph (``half``); ``x``
    itself in the float32 graph."""
    if not half:
        return x
    return g.op1("Cast", [x], to=g.TensorProto.FLOAT16 if to_half else g.TensorProto.FLOAT)


def linear(g: GraphBuilder, x: str, w: str, s: _Shared) -> str:
    """``x @ w`` with ``x`` float32 ``[..., K]`` and the initializer ``w`` ``[K, N]`` of the
    graph's dtype: a float16 product between two ``Cast`` nodes in the float16 graph. Returns
    float32 ``[..., N]``."""
    return _cast(g, g.op1("MatMul", [_cast(g, x, s.half, True), w]), s.half, False)


def rms_norm(g: GraphBuilder, x: str, w: np.ndarray, name: str, eps: float, rank: int) -> str:
    """``x * (1 / sqrt(sum(x * x) / D + eps)) * w`` over the last axis, in the reference's
    order (:func:`..reference.layers.rms_norm`; ``ReduceSum`` and ``Div``, not ``ReduceMean``,
    whose Ascend page stops at opset 16). x: float32 of ``rank`` dimensions ``[..., D]``;
    w: float32 ``[D]``. Returns float32 ``[..., D]``."""
    ss = g.op1("ReduceSum", [g.op1("Mul", [x, x]), g.const([rank - 1])], keepdims=1)  # [..., 1]
    ms = g.op1("Div", [ss, _f32(g, len(w))])
    inv = g.op1("Reciprocal", [g.op1("Sqrt", [g.op1("Add", [ms, _f32(g, eps)])])])
    return g.op1("Mul", [g.op1("Mul", [x, inv]), g.init(name, w.astype(np.float32))],
                 name=name.replace(".", "/"))


def rotate(g: GraphBuilder, x: str, rope: tuple[str, str, str], c: ModelConfig) -> str:
    """Rotary embedding of ``x`` float32 ``[B, S, N, H]`` with ``rope`` = (cos, sin, -sin),
    float32 ``[B, S, 1, rope_dim/2]``: NEOX halves (:func:`..reference.layers.rope_neox`) or
    adjacent pairs (:func:`..reference.layers.rope`); the elements past ``rope_dim`` pass
    through. ``x1 cos - x2 sin`` is ``x1 cos + x2 (-sin)``, the same float32 result (``Sub``'s
    Ascend page stops at opset 15)."""
    cos, sin, nsin = rope
    h, hd = c.rope_dim // 2, c.head_dim
    rot = x if 2 * h == hd else _slice(g, x, 0, 2 * h, 3)
    if c.rope_neox:
        x1, x2 = _slice(g, rot, 0, h, 3), _slice(g, rot, h, 2 * h, 3)
        axis = 3
    else:               # [B, S, N, r] -> [B, S, N, r/2, 2]: the pairs on the last axis
        pairs = g.op1("Reshape", [rot, g.const([0, 0, 0, h, 2])])
        x1, x2 = _slice(g, pairs, 0, 1, 4), _slice(g, pairs, 1, 2, 4)
        cos, sin, nsin = (g.op1("Reshape", [t, g.const([0, 0, 1, h, 1])])
                          for t in (cos, sin, nsin))
        axis = 4
    a = g.op1("Add", [g.op1("Mul", [x1, cos]), g.op1("Mul", [x2, nsin])])
    b = g.op1("Add", [g.op1("Mul", [x1, sin]), g.op1("Mul", [x2, cos])])
    out = g.op1("Concat", [a, b], axis=axis)
    if not c.rope_neox:
        out = g.op1("Reshape", [out, g.const([0, 0, 0, 2 * h])])
    return out if 2 * h == hd else g.op1("Concat", [out, _slice(g, x, 2 * h, hd, 3)], axis=3)


def attention(g: GraphBuilder, i: int, x: str, w: LayerWeights, s: _Shared) -> str:
    """Layer ``i``'s attention on the normalized ``x`` float32 ``[B, S, D]`` -> ``[B, S, D]``
    (:func:`..reference.layers.block`'s, and Gemma 3's q/k norms): the new keys and values
    written into ``present_key/value.{i}`` (ScatterND at ``kv_index``), every query attending
    to the first ``Lb`` cached positions through the bias. In the float16 graph the keys and
    values are float16 from the cache on, and the two products take float16 operands; the
    scores are cast to float32 before the bias and ``Softmax``."""
    c, p = s.config, f"blk.{i}"
    nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    qkv = linear(g, x, g.init(p + ".attn_qkv", w.w_qkv), s)                 # [B, S, (Nq+2Nkv)H]
    if w.b_qkv is not None:                                                  # Qwen2
        qkv = g.op1("Add", [qkv, g.init(p + ".attn_qkv.bias", w.b_qkv)])
    q, k, v = g.op("Split", [qkv, g.const([nq * hd, nkv * hd, nkv * hd])], 3, axis=2)
    q = g.op1("Reshape", [q, g.const([0, 0, nq, hd])])                       # [B, S, Nq, H]
    k = g.op1("Reshape", [k, g.const([0, 0, nkv, hd])])                      # [B, S, Nkv, H]
    v = g.op1("Reshape", [v, g.const([0, 0, nkv, hd])])
    eps = float(c.rms_eps)
    if w.q_norm is not None:                                                 # Qwen3, Gemma 3
        q = rms_norm(g, q, w.q_norm, p + ".attn_q_norm", eps, 4)
        k = rms_norm(g, k, w.k_norm, p + ".attn_k_norm", eps, 4)
    local = c.is_local(i)
    if c.uses_rope(i):
        rope = s.rope_local if local else s.rope
        q, k = rotate(g, q, rope, c), rotate(g, k, rope, c)
    perm = {"perm": [0, 2, 1, 3]}                                             # -> [B, Nkv, S, H]
    keys, values = (g.op1("ScatterND", [f"past_{kind}.{i}", "kv_index",
                                        _cast(g, g.op1("Transpose", [t], **perm), s.half, True)],
                          outputs=[f"present_{kind}.{i}"])
                    for kind, t in (("key", k), ("value", v)))
    span = g.op1("Gather", [g.op1("Shape", ["attention_bias"]), g.const([5])], axis=0)  # [Lb]
    keys, values = (g.op1("Reshape", [_slice_to(g, t, span, 2),
                                      g.const([0, 0, 1, 1, -1, hd])])
                    for t in (keys, values))                               # [B, Nkv, 1, 1, Lb, H]
    group = nq // nkv
    q = g.op1("Transpose", [g.op1("Reshape", [q, g.const([0, 0, nkv, group, 1, hd])])],
              perm=[0, 2, 3, 1, 4, 5])                                     # [B, Nkv, G, S, 1, H]
    q = _cast(g, g.op1("Mul", [q, _f32(g, c.attn_scale)]), s.half, True)
    scores = g.op1("MatMul", [q, g.op1("Transpose", [keys], perm=[0, 1, 2, 3, 5, 4])])
    scores = g.op1("Add", [_cast(g, scores, s.half, False),
                           s.bias_local if local else s.bias])             # [B, Nkv, G, S, 1, Lb]
    probs = _cast(g, g.op1("Softmax", [scores], axis=5), s.half, True)
    out = g.op1("MatMul", [probs, values])                                 # [B, Nkv, G, S, 1, H]
    out = g.op1("Reshape", [g.op1("Transpose", [out], perm=[0, 3, 1, 2, 4, 5]),
                            g.const([0, 0, nq * hd])])                     # [B, S, Nq H]
    o = g.op1("MatMul", [out, g.init(p + ".attn_output", w.w_o)])            # [B, S, D]
    return _cast(g, o, s.half, False)


def mlp(g: GraphBuilder, i: int, x: str, w: LayerWeights, s: _Shared) -> str:
    """Layer ``i``'s gated MLP on ``x`` float32 ``[B, S, D]`` -> ``[B, S, D]``: SiLU
    (:func:`..reference.layers.mlp`) or GELU(tanh) (:func:`..reference.layers.geglu_mlp`), the
    activation in float32 between the two products (:func:`linear`)."""
    p = f"blk.{i}"
    gu = linear(g, x, g.init(p + ".ffn_gate_up", w.w_gate_up), s)          # [B, S, 2I]
    inner = w.w_gate_up.shape[1] // 2
    gate, up = g.op("Split", [gu, g.const([inner, inner])], 2, axis=2)
    if s.config.mlp_act == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = g.op1("Mul", [g.op1("Mul", [g.op1("Mul", [_f32(g, 0.044715), gate]), gate]),
                             gate])
        t = g.op1("Mul", [_f32(g, float(np.sqrt(2.0 / np.pi))), g.op1("Add", [gate, cube])])
        act = g.op1("Mul", [g.op1("Mul", [_f32(g, 0.5), gate]),
                            g.op1("Add", [_f32(g, 1.0), g.op1("Tanh", [t])])])
    else:
        act = g.op1("Mul", [gate, g.op1("Sigmoid", [gate])])
    return linear(g, g.op1("Mul", [act, up]), g.init(p + ".ffn_down", w.w_down), s)


def block(g: GraphBuilder, i: int, h: str, w: LayerWeights, s: _Shared) -> str:
    """Decoder layer ``i`` on the residual stream ``h`` float32 ``[B, S, D]`` -> ``[B, S, D]``
    (:func:`..reference.layers.block`; :func:`..reference.layers.gemma3_block` with post norms)."""
    p, eps = f"blk.{i}", float(s.config.rms_eps)
    o = attention(g, i, rms_norm(g, h, w.attn_norm, p + ".attn_norm", eps, 3), w, s)
    if w.post_attn_norm is not None:
        o = rms_norm(g, o, w.post_attn_norm, p + ".post_attention_norm", eps, 3)
    h = g.op1("Add", [h, o])
    m = mlp(g, i, rms_norm(g, h, w.ffn_norm, p + ".ffn_norm", eps, 3), w, s)
    if w.post_ffn_norm is not None:
        m = rms_norm(g, m, w.post_ffn_norm, p + ".post_ffw_norm", eps, 3)
    return g.op1("Add", [h, m])


def build_standard_model(f: GGUFFile, config: ModelConfig, out_dir: str, max_positions: int,
                         metadata: dict[str, str], dtype: str = "float16") -> str:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx.data``) of the standard graph for the
    decoder in ``f``, in ``dtype`` (a key of :data:`DTYPES`), with rotary tables of
    ``max_positions`` rows and ``metadata`` as the model's metadata entries. The weights are
    dequantized on every CPU (numpy releases the GIL), a few layers ahead of the nodes written
    in order. Returns the path of ``model.onnx``.

    Raises:
        ModelFileError: a tensor is missing or of an unknown type.
        KeyError: ``dtype`` is not one of :data:`DTYPES`.
    """
    from onnx import helper

    c, wtype = config, DTYPES[dtype]
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "model.onnx")
    g = GraphBuilder(model_path + ".data")
    workers = max(1, available_cpus())
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tiny_mindie-dequant")
    try:
        tied = not f.has_tensor("output.weight")
        head = None if tied else pool.submit(xw_matrix, f, "output.weight", dtype=wtype)  # [D, V]
        emb = g.init("token_embd", _rows(f, "token_embd.weight", wtype))      # [V, D]
        h = _cast(g, g.op1("Gather", [emb, "input_ids"], axis=0), wtype == np.float16, False)
        if c.embedding_scale != 1.0:
            h = g.op1("Mul", [h, _f32(g, c.embedding_scale)])
        s = _shared(g, c, max_positions, wtype == np.float16)
        for i, w in enumerate(_layers(f, c, wtype, pool, workers)):
            h = block(g, i, h, w, s)
        rows = g.op1("Gather", [g.op1("Reshape", [h, g.const([-1, c.hidden_size])]),
                                "logits_index"], axis=0)                     # [R, D]
        x = _cast(g, rms_norm(g, rows, f.dequantize("output_norm.weight"), "output_norm",
                              float(c.rms_eps), 2), s.half, True)
        out = ["logits_half" if s.half else "logits"]
        if tied:                                                              # [V, D]
            g.op("Gemm", [x, emb], outputs=out, transB=1)
        else:
            g.op("MatMul", [x, g.init("output", head.result())], outputs=out)
        if s.half:
            g.op("Cast", out, outputs=["logits"], to=g.TensorProto.FLOAT)
        graph = helper.make_graph(g.nodes, "tiny_mindie_decoder_standard", _inputs(c, wtype),
                                  _outputs(c, wtype), g.inits)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        g.close()
    model = helper.make_model(graph, ir_version=IR_VERSION, producer_name="tiny_mindie",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    for key, value in metadata.items():
        meta = model.metadata_props.add()
        meta.key, meta.value = key, value
    with open(model_path, "wb") as out:
        out.write(model.SerializeToString())
    return model_path


# ---- helpers ---------------------------------------------------------------------------------

def _layers(f: GGUFFile, c: ModelConfig, dtype, pool: ThreadPoolExecutor, workers: int
            ) -> Iterator[LayerWeights]:
    """The layers' weights (:func:`..reference.decoder.load_layer` in ``dtype``), in order, each
    dequantized on ``pool`` up to ``workers`` layers ahead (the memory of that many layers)."""
    ahead = deque()
    for i in range(c.num_layers):
        ahead.append(pool.submit(load_layer, f, c, i, dtype))
        if len(ahead) > workers:
            yield ahead.popleft().result()
    while ahead:
        yield ahead.popleft().result()


def _rows(f: GGUFFile, name: str, dtype) -> np.ndarray:
    """The matrix ``name`` ``[rows, columns]`` in ``dtype``, dequantized a hundred rows or so
    at a time (float32 temporaries of that size only)."""
    rows = f.raw(name).shape[0]
    out = np.empty(f.raw(name).shape, dtype)
    for r in range(0, rows, 128):
        out[r:r + 128] = f.dequantize_rows(name, r, min(rows, r + 128))
    return out


def _shared(g: GraphBuilder, c: ModelConfig, max_positions: int, half: bool) -> _Shared:
    """The rotary (cos, sin, -sin) at ``positions`` (float32 ``[B, S, 1, rope_dim/2]``: cos
    and sin tables ``[max_positions, 1, rope_dim/2]`` gathered, ``Neg`` of sin) for global and
    local layers, the bias inputs, and ``half`` (the float16 graph)."""
    def at_positions(name: str, local: bool) -> tuple[str, str, str]:
        cos, sin = rope_table(max_positions, *rope_frequencies(c, max_positions, local=local))
        cos, sin = (g.op1("Gather", [g.init(f"{name}.{k}", t[:, None]), "positions"], axis=0)
                    for k, t in (("cos", cos), ("sin", sin)))
        return cos, sin, g.op1("Neg", [sin])        # -sin of the rows gathered: exact

    rope = at_positions("rope", False)
    local = at_positions("rope_local", True) if c.rope_theta_local else rope
    return _Shared(c, rope, local, "attention_bias",
                   "local_attention_bias" if c.sliding_window else None, half)


def _inputs(c: ModelConfig, dtype) -> list:
    from onnx import TensorProto, helper

    F, I64, KV = TensorProto.FLOAT, TensorProto.INT64, helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype))
    kv = ["batch", c.num_kv_heads, "cache_len", c.head_dim]
    bias = ["batch", 1, 1, "seq", 1, "span"]
    out = [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
           helper.make_tensor_value_info("positions", I64, ["batch", "seq"]),
           helper.make_tensor_value_info("kv_index", I64, ["batch", c.num_kv_heads, "seq", 3]),
           helper.make_tensor_value_info("attention_bias", F, bias)]
    if c.sliding_window:
        out.append(helper.make_tensor_value_info("local_attention_bias", F, bias))
    out.append(helper.make_tensor_value_info("logits_index", I64, ["logits_rows"]))
    for i in range(c.num_layers):
        out += [helper.make_tensor_value_info(f"past_key.{i}", KV, kv),
                helper.make_tensor_value_info(f"past_value.{i}", KV, kv)]
    return out


def _outputs(c: ModelConfig, dtype) -> list:
    from onnx import TensorProto, helper

    KV = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    kv = ["batch", c.num_kv_heads, "cache_len", c.head_dim]
    out = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["logits_rows",
                                                                       c.vocab_size])]
    for i in range(c.num_layers):
        out += [helper.make_tensor_value_info(f"present_key.{i}", KV, kv),
                helper.make_tensor_value_info(f"present_value.{i}", KV, kv)]
    return out


def _f32(g: GraphBuilder, value: float) -> str:
    return g.const(np.float32(value), np.float32)


def _slice(g: GraphBuilder, x: str, start: int, end: int, axis: int) -> str:
    return g.op1("Slice", [x, g.const([start]), g.const([end]), g.const([axis])])


def _slice_to(g: GraphBuilder, x: str, end: str, axis: int) -> str:
    return g.op1("Slice", [x, g.const([0]), end, g.const([axis])])
