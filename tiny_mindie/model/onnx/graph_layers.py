"""The decoder's blocks as graph nodes: attention (and its verification path), the MLP, a layer,
the LM head.

Each function follows the numpy reference's function of the same name
(:mod:`..reference.layers`), adds its nodes to a :class:`.graph_nodes.GraphBuilder` and returns
the names of its outputs; :func:`.graph.build_model` calls them layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..arch import ModelConfig
from .graph_nodes import (
    MS_DOMAIN,
    GraphBuilder,
    Shared,
    VerifyRows,
    add_rms_norm,
    linear,
    rms_norm,
    rows_of,
)
from .graph_weights import PackedLayer
from .weights import NBitsWeight


def qk_norm(g: GraphBuilder, p: str, qkv: str, w: PackedLayer, c: ModelConfig) -> str:
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


def attention(g: GraphBuilder, i: int, x: str, w: PackedLayer, s: Shared) -> str:
    """Layer ``i``'s attention on the normalized ``x`` float32 ``[T, D]`` -> ``[T, D]``:
    the fused QKV projection (+ Qwen2's biases, Gemma 3's q/k norms), ``GroupQueryAttention``
    (rotary inside, on the in-place KV cache ``past/present_key.{i}``, ``past/present_value.{i}``;
    local layers with their window and rotary caches), then the output projection.

    A power-of-two attention scale is folded into the queries
    (:func:`.graph_weights.pack_layer`) and GroupQueryAttention then runs with ``scale=1``: its
    ``Q K^T`` is an sgemm with ``alpha = scale``, and MLAS takes its no-packing kernel for one
    query row only at ``alpha == 1``. Rotary embedding is linear, so scaling q before it is the
    same.
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
        # branch output of a dynamic shape costs onnxruntime an allocation per If and run (its
        # fetch allocator), in every layer of every decode step; Where then keeps GQA's rows.
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


def verify_attention(g: GraphBuilder, i: int, qkv: str, s: Shared, rope: tuple[str, str] | None,
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


def verify_rows(g: GraphBuilder, tokens: str, rows: int, windows: Sequence[int]) -> VerifyRows:
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


def mlp(g: GraphBuilder, i: int, x: str, w: PackedLayer, s: Shared) -> str:
    """Layer ``i``'s gated MLP on the normalized ``x`` float32 ``[T, D]`` -> ``[T, D]``:
    ``down(act(gate(x)) * up(x))`` with ``act`` SiLU (:func:`..reference.layers.mlp`) or, for Gemma,
    GELU(tanh) (:func:`..reference.layers.geglu_mlp`); gate and up are one fused projection."""
    p = f"blk.{i}"
    gu = linear(g, x, w.w_gate_up, p + ".ffn_gate_up", s, "ffn_gate_up")    # [T, 2I]
    gate, up = g.op("Split", [gu], 2, axis=-1, num_outputs=2)                # 2 x [T, I]
    if s.config.mlp_act == "gelu_tanh":
        act = g.op1("Mul", [g.op1("Gelu", [gate], approximate="tanh"), up])
    else:
        act = g.op1("Mul", [g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]), up])
    return linear(g, act, [w.w_down], p + ".ffn_down", s, "ffn_down")        # [T, D]


def block(g: GraphBuilder, i: int, h: str, pending: str | None, w: PackedLayer, s: Shared
          ) -> tuple[str, str]:
    """Decoder layer ``i`` (:func:`..reference.layers.block`, and
    :func:`..reference.layers.gemma3_block` with ``post_norms``).

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


def lm_head(g: GraphBuilder, h: str, pending: str, norm: np.ndarray, head: NBitsWeight,
            head_name: str, s: Shared) -> str:
    """The logits of the rows at ``logits_index``: ``rms_norm(h + pending)[logits_index] @ head.T``
    (the reference's ``_logits``). h, pending: float32 ``[T, D]``; norm: float32 ``[D]``;
    head: ``[V, D]``. Returns float32 ``[B', V]``: ``B`` padded to the head's row multiple, the
    padding rows kept."""
    last_h = g.op1("Gather", [h, "logits_index"], axis=0)                  # [B, D]
    last_p = g.op1("Gather", [pending, "logits_index"], axis=0)
    x = g.op("SkipSimplifiedLayerNormalization", [last_h, last_p, g.init("output_norm", norm)], 1,
             domain=MS_DOMAIN, name="output_norm", epsilon=float(s.config.rms_eps))[0]
    return linear(g, x, [head], head_name + ".lm_head", s, "lm_head", rows_of(g, x),
                  keep_padding=True)                                        # [B', V]
