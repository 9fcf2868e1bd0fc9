"""The model's weights as the graph reads them: each layer's matrices packed by :mod:`.weights`
(fused where the GGUF fuses them, the attention scale folded into the queries), its norms and
biases as float32 vectors, the embedding and the LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..arch import ModelConfig
from ..gguf import GGUFFile
from .weights import (
    GGUF_KERNEL_TYPES,
    GGUFMatrix,
    NBitsWeight,
    lm_head_weight,
    pack_weight,
    quantize_8bit,
    row_slice,
)


def power_of_two(s: float) -> float | None:
    """``s`` when it is a power of two (so multiplying by it is exact in float32), else ``None``."""
    m, _ = math.frexp(s)
    return s if m == 0.5 else None


def _scaled(w: NBitsWeight | GGUFMatrix, factor: float) -> NBitsWeight | GGUFMatrix:
    """``w * factor`` for a power-of-two ``factor``: scales and residuals multiplied, which is
    exact in float32 (barring under/overflow), so the weight stays bit-exact up to that factor;
    a :class:`GGUFMatrix` keeps its blocks and the factor multiplies its product (as exact)."""
    if isinstance(w, GGUFMatrix):
        return GGUFMatrix(w.qtype, w.n, w.k, w.data, w.scale * factor)
    f = np.float32(factor)
    return NBitsWeight(w.bits, w.n, w.k, w.data, w.scales * f, w.zero_points,
                       None if w.mins is None else w.mins * f, w.exact, w.block)


@dataclass
class PackedLayer:
    """Decoder layer ``i``'s weights (GGUF ``blk.{i}.*``) packed for the graph; the field
    names are those of :class:`..reference.layers.LayerWeights`. Matrices keep GGUF's
    ``[out, in]`` rows; vectors are float32. ``D`` hidden size, ``H`` head_dim, ``Nq``/``Nkv``
    query/KV heads, ``I`` MLP width."""

    attn_norm: np.ndarray            # [D]
    # Wq [Nq H, D] (times the folded scale), Wk, Wv [Nkv H, D]
    w_qkv: list[NBitsWeight | GGUFMatrix]
    w_o: NBitsWeight | GGUFMatrix    # [D, Nq H]
    ffn_norm: np.ndarray             # [D]
    w_gate_up: list[NBitsWeight | GGUFMatrix]  # Wgate, Wup [I, D]
    w_down: NBitsWeight | GGUFMatrix  # [D, I]
    # Gemma 3 only (None otherwise):
    q_norm: np.ndarray | None = None          # [H], per query head (times the folded scale)
    k_norm: np.ndarray | None = None          # [H], per key head
    post_attn_norm: np.ndarray | None = None  # [D], on the attention output
    post_ffn_norm: np.ndarray | None = None   # [D], on the MLP output
    # Qwen2 only (None otherwise):
    b_qkv: np.ndarray | None = None           # [(Nq + 2 Nkv) H]: q (times the folded scale), k, v


def load_embedding(f: GGUFFile, gguf: bool = False) -> NBitsWeight | GGUFMatrix:
    """``token_embd.weight`` ``[V, D]``: with ``gguf``, where its type is one of
    :data:`.weights.GGUF_KERNEL_TYPES`, as the GGUF's blocks (a :class:`.GGUFMatrix`, what
    ``tiny_mindie::GatherGGUF`` reads); else as 8-bit blocks of 32 with the default zero point
    (what ``GatherBlockQuantized`` reads): Q8_0 and Q5_0 as packed, others requantized.

    Raises:
        ModelFileError: the tensor is missing or its type cannot be read.
    """
    qtype = f.raw("token_embd.weight").qtype
    if gguf and qtype in GGUF_KERNEL_TYPES:
        return pack_weight(f, "token_embd.weight", gguf=True)
    if qtype in ("Q8_0", "Q5_0"):
        return pack_weight(f, "token_embd.weight")
    return quantize_8bit(f.dequantize("token_embd.weight"))


def pack_layer(f: GGUFFile, config: ModelConfig, i: int, q_scale: float | None,
               compact: int = 0, gguf: bool = False) -> PackedLayer:
    """Layer ``i``'s weights packed for the graph; ``q_scale`` (a power of two, or ``None``)
    is folded into the queries, exactly: into Wq and the q bias, or, with q/k norms
    (Gemma 3), into the q norm's weights (a factor on Wq would be normalized away).
    ``compact``, ``gguf``: as for :func:`pack_weight`."""
    p = f"blk.{i}"

    def pack(name: str) -> NBitsWeight | GGUFMatrix:
        return pack_weight(f, name, compact, gguf)

    if f.has_tensor(p + ".attn_qkv.weight"):       # Phi-3: one [(Nq + 2 Nkv) H, D] matrix
        wqkv = pack(p + ".attn_qkv.weight")
        nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        wq, wk, wv = (row_slice(wqkv, a, b) for a, b in
                      ((0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)))
    else:
        wq, wk, wv = (pack(f"{p}.attn_{t}.weight") for t in "qkv")
    extra = {}
    if config.qk_norm:
        q_norm = f.dequantize(p + ".attn_q_norm.weight").astype(np.float32)
        if q_scale is not None:
            q_norm = q_norm * np.float32(q_scale)
        extra.update(q_norm=q_norm,
                     k_norm=f.dequantize(p + ".attn_k_norm.weight").astype(np.float32))
    elif q_scale is not None:
        wq = _scaled(wq, q_scale)
    if config.qkv_bias:
        bq, bk, bv = (f.dequantize(f"{p}.attn_{t}.bias").reshape(-1) for t in "qkv")
        if q_scale is not None:
            bq = bq * np.float32(q_scale)
        extra.update(b_qkv=np.concatenate([bq, bk, bv]).astype(np.float32))
    if config.post_norms:
        extra.update(post_attn_norm=f.dequantize(p + ".post_attention_norm.weight"),
                     post_ffn_norm=f.dequantize(p + ".post_ffw_norm.weight"))
    return PackedLayer(
        attn_norm=f.dequantize(p + ".attn_norm.weight"),
        w_qkv=[wq, wk, wv],
        w_o=pack(p + ".attn_output.weight"),
        ffn_norm=f.dequantize(p + ".ffn_norm.weight"),
        # Phi-3's ffn_up holds the gate rows, then the up rows: already the fused layout
        w_gate_up=[pack(p + ".ffn_up.weight")] if not f.has_tensor(p + ".ffn_gate.weight")
        else [pack(p + ".ffn_gate.weight"), pack(p + ".ffn_up.weight")],
        w_down=pack(p + ".ffn_down.weight"),
        **extra,
    )


def load_lm_head(f: GGUFFile, config: ModelConfig, embedding: NBitsWeight | GGUFMatrix,
                 block: int, compact: int = 0, gguf: bool = False) -> NBitsWeight | GGUFMatrix:
    """The LM head ``[V, D]``: ``output.weight``, or the packed ``embedding`` when tied, through
    :func:`lm_head_weight` with ``block``; with ``compact`` > 0, that GGUF matrix in 4-bit
    blocks (:func:`pack_weight`); with ``gguf``, that GGUF matrix as it is where its type is one
    of :data:`GGUF_KERNEL_TYPES`."""
    name = "token_embd.weight" if config.tied_embeddings else "output.weight"
    if gguf and not compact and f.raw(name).qtype in GGUF_KERNEL_TYPES:
        return pack_weight(f, name, gguf=True)
    if compact:
        return pack_weight(f, "token_embd.weight" if config.tied_embeddings else "output.weight",
                           compact)
    return lm_head_weight(embedding if config.tied_embeddings else pack_weight(f, "output.weight"),
                          block)
