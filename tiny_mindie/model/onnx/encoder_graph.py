"""The encoder as an ONNX graph of default-domain operators (opset 17): float32 weights,
bidirectional attention over a padded batch, no KV cache; what :mod:`.encoder_ort` runs.

Inputs: ``input_ids [B, T]`` int64, ``token_type_ids [B, T]`` int64, ``attention_mask [B, T]``
float32 (1 on a text's tokens, 0 on padding), ``pool [B, T]`` float32 (the pooling weights,
:func:`.encoder_pool.pool_weights`). Output: ``pooled [B, hidden]`` float32, not normalized.
The blocks are those of :mod:`.encoder_reference`; padding is kept out of every text's attention
by an additive mask, so it never reaches a text's vector.

``standard=True`` builds the graph for the CANN execution provider: only operators, at this
opset, that Ascend's ONNX pages document (:func:`.cann_ops.check_model` finds nothing): layer
norm spelled out (``ReduceSum``, ``Div``, ``Sqrt``, ``Reciprocal``), ``Sub`` as ``Add`` of a
negated term, ``Unsqueeze``/``Squeeze`` as ``Reshape``, and BERT's GELU in its tanh form
(``Erf`` is not on the list; the two differ by under 1e-3 at any input).
"""

from __future__ import annotations

import math

import numpy as np

from ..encoder_load import EncoderConfig, EncoderLayer, EncoderWeights

OPSET = 17
NEG = -1e30                                        # an attention score no softmax keeps


class _Nodes:
    """The graph under construction: nodes, initializers, unique names; ``standard``: the
    operators of :mod:`.cann_ops` only."""

    def __init__(self, standard: bool = False) -> None:
        self.standard = standard
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def init(self, hint: str, array: np.ndarray) -> str:
        from onnx import numpy_helper
        name = f"{hint}_{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.require(array, requirements="C"), name))
        return name

    def const(self, values, dtype=np.int64) -> str:
        return self.init("c", np.asarray(values, dtype=dtype))

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        from onnx import helper
        self.count += 1
        out = f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out


def _ln(g: _Nodes, x: str, w: np.ndarray, b: np.ndarray, eps: float) -> str:
    if g.standard:                          # x [B, T, d]: normalized over the last axis
        n = g.const(float(len(w)), np.float32)
        mean = g.op("Div", [g.op("ReduceSum", [x, g.const([2])], keepdims=1), n])
        d = g.op("Add", [x, g.op("Neg", [mean])])
        var = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [d, d]), g.const([2])], keepdims=1),
                           n])
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, g.const(eps, np.float32)])])])
        return g.op("Add", [g.op("Mul", [g.op("Mul", [d, inv]), g.init("ln_w", w)]),
                            g.init("ln_b", b)])
    return g.op("LayerNormalization", [x, g.init("ln_w", w), g.init("ln_b", b)], axis=-1,
                epsilon=eps)


def _linear(g: _Nodes, x: str, w: np.ndarray, b: np.ndarray | None) -> str:
    y = g.op("MatMul", [x, g.init("w", w)])
    return y if b is None or not b.any() else g.op("Add", [y, g.init("b", b)])


def _rotary(g: _Nodes, x: str, cos: str, sin: str, half: int) -> str:
    """``x [B, heads, T, dh]`` turned by the tables ``cos``/``sin [T, half]``."""
    a = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([3])])
    b = g.op("Slice", [x, g.const([half]), g.const([2 * half]), g.const([3])])
    first = g.op("Add", [g.op("Mul", [a, cos]), g.op("Neg", [g.op("Mul", [b, sin])])])
    second = g.op("Add", [g.op("Mul", [b, cos]), g.op("Mul", [a, sin])])
    return g.op("Concat", [first, second], axis=3)


def _attention(g: _Nodes, x: str, w: EncoderLayer, cfg: EncoderConfig, bias: str,
               rope: tuple[str, str] | None) -> str:
    h, dh = cfg.heads, cfg.head_dim
    qkv = _linear(g, x, w.qkv, w.qkv_b)                                  # [B, T, 3d]
    qkv = g.op("Reshape", [qkv, g.const([0, 0, 3, h, dh])])
    qkv = g.op("Transpose", [qkv], perm=[2, 0, 3, 1, 4])                 # [3, B, h, T, dh]
    q, k, v = (g.op("Gather", [qkv, g.const(i)], axis=0) for i in range(3))
    if rope is not None:
        q, k = (_rotary(g, t, rope[0], rope[1], dh // 2) for t in (q, k))
    q = g.op("Mul", [q, g.const(1.0 / math.sqrt(dh), np.float32)])
    s = g.op("Add", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), bias])
    ctx = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])            # [B, h, T, dh]
    ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]),
                           g.const([0, 0, cfg.hidden])])
    return _linear(g, ctx, w.out, w.out_b)


def _ffn(g: _Nodes, x: str, w: EncoderLayer) -> str:
    if w.gate is not None:                                               # SwiGLU
        gate = _linear(g, x, w.gate, None)
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        y = g.op("Mul", [_linear(g, x, w.up, None), act])
    else:                                                                # exact GELU
        u = _linear(g, x, w.up, w.up_b)
        if g.standard:                                                   # tanh GELU
            cube = g.op("Mul", [g.op("Mul", [u, u]), u])
            inner = g.op("Add", [u, g.op("Mul", [cube, g.const(0.044715, np.float32)])])
            t = g.op("Tanh", [g.op("Mul", [inner, g.const(math.sqrt(2.0 / math.pi),
                                                                np.float32)])])
            y = g.op("Mul", [g.op("Mul", [u, g.const(0.5, np.float32)]),
                             g.op("Add", [t, g.const(1.0, np.float32)])])
            return _linear(g, y, w.down, w.down_b)
        erf = g.op("Erf", [g.op("Mul", [u, g.const(1.0 / math.sqrt(2.0), np.float32)])])
        y = g.op("Mul", [g.op("Mul", [u, g.const(0.5, np.float32)]),
                         g.op("Add", [erf, g.const(1.0, np.float32)])])
    return _linear(g, y, w.down, w.down_b)


def _rope_tables(g: _Nodes, cfg: EncoderConfig, seq: str) -> tuple[str, str]:
    """cos and sin ``[T, half]`` for positions ``0 .. T-1`` (sliced from the whole context)."""
    half = cfg.head_dim // 2
    inv = cfg.rope_base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / cfg.head_dim)
    ang = np.arange(cfg.context, dtype=np.float64)[:, None] * inv[None, :]
    tables = []
    for fn in (np.cos, np.sin):
        t = g.init("rope", fn(ang).astype(np.float32))
        tables.append(g.op("Slice", [t, g.const([0]), seq, g.const([0])]))
    return tables[0], tables[1]


def build_encoder(cfg: EncoderConfig, weights: EncoderWeights, standard: bool = False):
    """The encoder's ``onnx.ModelProto`` (float32 weights as initializers); ``standard``: the
    operators of :mod:`.cann_ops` only (module docstring)."""
    from onnx import TensorProto, helper

    g = _Nodes(standard)
    ids, types = "input_ids", "token_type_ids"
    seq = g.op("Slice", [g.op("Shape", [ids]), g.const([1]), g.const([2])])          # [1]: T
    x = g.op("Add", [g.op("Gather", [g.init("tok", weights.tokens), ids], axis=0),
                     g.op("Gather", [g.init("types", weights.types), types], axis=0)])
    rope = None
    if weights.positions is not None:
        pos = g.op("Slice", [g.init("pos", weights.positions), g.const([0]), seq,
                             g.const([0])])
        x = g.op("Add", [x, pos])
    else:
        rope = _rope_tables(g, cfg, seq)
    x = _ln(g, x, weights.norm_w, weights.norm_b, cfg.eps)
    keep = g.op("Reshape", ["attention_mask", g.const([0, 1, 1, -1])])           # [B,1,1,T]
    bias = g.op("Add", [g.op("Mul", [keep, g.const(-NEG, np.float32)]),          # 0 or NEG
                        g.const(NEG, np.float32)])
    for w in weights.layers:
        x = _ln(g, g.op("Add", [x, _attention(g, x, w, cfg, bias, rope)]), w.ln1_w, w.ln1_b,
                cfg.eps)
        x = _ln(g, g.op("Add", [x, _ffn(g, x, w)]), w.ln2_w, w.ln2_b, cfg.eps)
    pooled = g.op("MatMul", [g.op("Reshape", ["pool", g.const([0, 1, -1])]), x])  # [B,1,d]
    g.nodes.append(helper.make_node("Reshape", [pooled, g.const([0, cfg.hidden])], ["pooled"]))
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, t, ["B", "T"])
              for n, t in ((ids, i64), (types, i64), ("attention_mask", f32), ("pool", f32))]
    out = [helper.make_tensor_value_info("pooled", f32, ["B", cfg.hidden])]
    graph = helper.make_graph(g.nodes, "encoder", inputs, out, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                             producer_name="tiny_mindie", ir_version=8)
