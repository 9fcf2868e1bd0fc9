"""The numpy reference decoder's layers: one small pure function per block (in the manner of
picoGPT), float32 throughout.

``B`` is the number of sequences in the batch, ``n`` the tokens per sequence in this step, ``d``
the hidden size, ``T`` the key positions attended to. :mod:`.reference` runs them over the model
and its KV cache; :mod:`.graph_layers` builds the same blocks as ONNX nodes.

Rotary layout: llama.cpp's converter stores LLaMA's Q and K projection rows permuted so that
the rotary embedding turns *adjacent* pairs ``(x[2i], x[2i+1])`` (llama.cpp's "normal" rope
mode). Hugging Face checkpoints instead pair ``x[i]`` with ``x[i + d/2]`` (``rotate_half``).
This module reads GGUF, so :func:`rope` pairs adjacent elements -- except for Gemma 3 and Qwen2,
whose Q/K rows llama.cpp leaves in HF order and rotates in "NEOX" mode (:func:`rope_neox`).

Qwen2 is LLaMA's :func:`block` with a bias added to each of the q, k and v projections; Qwen3
instead normalizes each q and k head (RMSNorm over ``head_dim``) before the rotation; Phi-3 stores
Q/K/V and gate/up fused (split at load) and attends to a sliding window on every layer; SmolLM3
skips the rotation on every 4th layer. Rotary scaling (llama3 factors, linear, YaRN, LongRoPE)
only changes the cos/sin tables (:func:`rope_frequencies`).

Gemma 3 (:func:`gemma3_block`) differs from LLaMA in: embeddings scaled by ``sqrt(d)``; an
RMSNorm of every q and k head over ``head_dim`` before the rotation; RMSNorm of the attention and
MLP outputs before each residual add (four norms per layer); a GELU(tanh)-gated MLP; an attention
scale of ``query_pre_attn_scalar ** -0.5``; and five of every six layers ("local") attend only to
the last ``sliding_window`` positions, with rotary base 10000 instead of the global
``rope.freq_base``. The GGUF's norm weights already hold HF's ``1 + w`` (llama.cpp's converter
adds the 1), so :func:`rms_norm` multiplies by them as stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..arch import YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig

# (k, v) of the new tokens, each [B, n, n_kv, head_dim]
#   -> (K, V) to attend to, each [B, n_kv, T, head_dim]
KVUpdate = Callable[[np.ndarray, np.ndarray], "tuple[np.ndarray, np.ndarray]"]


# ---- the blocks ----------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Root-mean-square layer norm (Zhang & Sennrich 2019, eq. 4): ``x / rms(x) * w``.

    ``rms(x) = sqrt(mean(x**2) + eps)`` over the last axis; no mean subtraction, no bias.
    x: float32 ``[..., d]``; w: float32 ``[d]``. Returns float32 ``[..., d]``.
    """
    ms = np.mean(np.square(x), axis=-1, keepdims=True)  # [..., d] -> [..., 1]
    return x * (1.0 / np.sqrt(ms + eps)) * w


def rope_frequencies(cfg: ModelConfig, n_ctx: int, local: bool = False
                     ) -> tuple[np.ndarray, float]:
    """The rotary angle per position of each pair, and the magnitude cos and sin are scaled by.

    Pair ``i`` turns by ``p * inv_freq[i]`` at position ``p`` (RoFormer, Su et al. 2021,
    eq. 15: ``theta ** (-2i / rope_dim)``), as llama.cpp's ``ggml_rope_cache_init`` and
    ``rope_yarn`` (ggml-cpu/ops.cpp) compute it:

    - frequency factors (``rope_freqs`` of Llama 3.1+, Phi-3's LongRoPE long/short factors
      for sequences of up to ``n_ctx`` positions, :meth:`ModelConfig.freq_factors`) divide
      the frequencies;
    - ``linear`` scaling divides them by ``rope.scaling.factor`` (positions / factor);
    - ``yarn`` (Peng et al. 2023, "YaRN", eq. 17-19) interpolates by the factor only the pairs
      whose wavelength is long against the original context: with llama.cpp's
      ``ggml_rope_yarn_corr_dims`` ends ``lo, hi`` (beta_fast 32, beta_slow 1) and
      ``ramp = 1 - clip((i - lo) / max(0.001, hi - lo), 0, 1)``, the frequency is
      ``inv * (ramp + (1 - ramp) / factor)``, and the magnitude ``1 + 0.1 ln(factor)``;
    - ``rope.scaling.attn_factor`` multiplies the magnitude (Phi-3 LongRoPE).

    ``local``: Gemma 3's local layers: base ``rope_theta_local``, unscaled.
    Returns (inv_freq float64 ``[rope_dim / 2]``, magnitude).
    """
    d = cfg.rope_dim
    i = np.arange(d // 2, dtype=np.float64)
    if local:
        return cfg.rope_theta_local ** (-2.0 * i / d), 1.0
    inv = cfg.rope_theta ** (-2.0 * i / d)
    factors = cfg.freq_factors(n_ctx)
    if factors:
        inv = inv / np.asarray(factors, dtype=np.float64)
    mscale = cfg.rope_attn_factor
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_scaling == "yarn":
        def corr_dim(n_rot: float) -> float:  # ggml_rope_yarn_corr_dim
            return (d * np.log(cfg.rope_orig_context / (n_rot * 2 * np.pi))
                    / (2 * np.log(cfg.rope_theta)))
        lo = max(0.0, np.floor(corr_dim(YARN_BETA_FAST)))
        hi = min(d - 1.0, np.ceil(corr_dim(YARN_BETA_SLOW)))
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
        inv = inv * (ramp + (1.0 - ramp) / cfg.rope_factor)
        mscale *= 1.0 + 0.1 * np.log(cfg.rope_factor)
    return inv, float(mscale)


def rope_table(n_pos: int, inv_freq: np.ndarray, mscale: float = 1.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """Cosines and sines of the rotary angles ``p * inv_freq[i]`` for ``p < n_pos``, times
    ``mscale`` (see :func:`rope_frequencies`).

    Returns (cos, sin), each float32 ``[n_pos, len(inv_freq)]``.
    """
    angles = np.outer(np.arange(n_pos, dtype=np.float64), inv_freq)  # -> [n_pos, rope_dim/2]
    return ((np.cos(angles) * mscale).astype(np.float32),
            (np.sin(angles) * mscale).astype(np.float32))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary position embedding on adjacent pairs (Su et al. 2021, eq. 34; llama.cpp "normal").

    Each pair ``(x[2i], x[2i+1])`` of the leading ``rope_dim = 2 * cos.shape[-1]`` elements is
    rotated by its angle; the remaining elements of the head pass through.
    x: float32 ``[B, n, heads, head_dim]``; cos, sin: float32 ``[B, n, 1, rope_dim/2]``.
    Returns float32 ``[B, n, heads, head_dim]``.
    """
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., 0:r:2], x[..., 1:r:2]  # [B, n, heads, head_dim] -> 2 x [B, n, heads, r/2]
    out = np.empty_like(x)
    out[..., 0:r:2] = x1 * cos - x2 * sin
    out[..., 1:r:2] = x1 * sin + x2 * cos
    out[..., r:] = x[..., r:]
    return out


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary position embedding on split halves (HF ``rotate_half``; llama.cpp "NEOX" mode).

    Pair ``i`` is ``(x[i], x[i + r/2])`` with ``r = rope_dim = 2 * cos.shape[-1]``; the elements
    past ``r`` pass through. Shapes as in :func:`rope`.
    """
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]  # [B, n, heads, head_dim] -> 2 x [B, n, heads, r/2]
    out = np.empty_like(x)
    out[..., :h] = x1 * cos - x2 * sin
    out[..., h:2 * h] = x1 * sin + x2 * cos
    out[..., 2 * h:] = x[..., 2 * h:]
    return out


# Up to this many rows, :func:`linear` does one matrix-vector product per row: on OpenBLAS with
# [in, out] weights a GEMM of a few rows costs more than one GEMV per row over the same weight,
# the extra passes over the weight included; with more rows the GEMM wins.
GEMV_MAX_ROWS = 6


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w``: x float32 ``[..., in]``, w ``[in, out]``. Returns float32 ``[..., out]``.

    The leading axes are folded into ``m`` rows, multiplied as one GEMM -- or, for few rows
    (decode), as ``m`` GEMVs (see :data:`GEMV_MAX_ROWS`).
    """
    rows = x.reshape(-1, x.shape[-1])  # [..., in] -> [m, in]
    if len(rows) <= GEMV_MAX_ROWS:
        y = rows[:, None, :] @ w  # numpy runs one GEMV per row: -> [m, 1, out]
    else:
        y = rows @ w  # one GEMM: -> [m, out]
    return y.reshape(*x.shape[:-1], w.shape[-1])  # -> [..., out]


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; rows must hold at least one finite value."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
              scale: float | None = None) -> np.ndarray:
    """Grouped-query attention (Ainslie et al. 2023): each K/V head serves ``g`` query heads.

    ``softmax(q k^T / sqrt(head_dim) + mask) v`` (Vaswani et al. 2017, eq. 1). The ``g`` query
    heads of a group and the ``n`` query tokens are stacked as the rows of one matmul per
    (sequence, K/V head), so there is no loop over heads or positions.
    q: float32 ``[B, n, n_head, hd]`` (query head ``h`` uses K/V head ``h // g``);
    k, v: float32 ``[B, n_kv, T, hd]``;
    mask: float32 ``[B, n, T]``, 0 where allowed, -inf where not;
    scale: multiplier of ``q k^T`` (default ``1 / sqrt(hd)``).
    Returns float32 ``[B, n, n_head * hd]``.
    """
    B, n, n_head, hd = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    g = n_head // n_kv
    q = q.reshape(B, n, n_kv, g, hd).transpose(0, 2, 3, 1, 4)  # -> [B, n_kv, g, n, hd]
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    q = q.reshape(B, n_kv, g * n, hd) * np.float32(scale)  # -> [B, n_kv, g*n, hd]
    s = q @ k.swapaxes(-1, -2)  # -> [B, n_kv, g*n, T]
    s = s.reshape(B, n_kv, g, n, T) + mask[:, None, None]  # -> [B, n_kv, g, n, T]
    p = softmax(s).reshape(B, n_kv, g * n, T)  # -> [B, n_kv, g*n, T]
    o = p @ v  # -> [B, n_kv, g*n, hd]
    o = o.reshape(B, n_kv, g, n, hd).transpose(0, 3, 1, 2, 4)  # -> [B, n, n_kv, g, hd]
    return o.reshape(B, n, n_head * hd)  # -> [B, n, n_head*hd]


def mlp(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU feed-forward (Shazeer 2020, eq. 6): ``(silu(x W_gate) * (x W_up)) W_down``.

    x: float32 ``[..., d]``; w_gate_up: ``[d, 2 * ffn]`` (gate columns, then up columns);
    w_down: ``[ffn, d]``. Returns float32 ``[..., d]``.
    """
    gate, up = np.split(linear(x, w_gate_up), 2, axis=-1)  # [..., d] -> 2 x [..., ffn]
    return linear(gate / (1.0 + np.exp(-gate)) * up, w_down)  # [..., ffn] -> [..., d]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016, sec. 2; PyTorch
    ``approximate="tanh"``)."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi))
                                    * (x + np.float32(0.044715) * x * x * x)))


def geglu_mlp(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """GELU-gated feed-forward (Shazeer 2020, eq. 5; Gemma):
    ``(gelu_tanh(x W_gate) * (x W_up)) W_down``.

    Shapes as in :func:`mlp`.
    """
    gate, up = np.split(linear(x, w_gate_up), 2, axis=-1)  # [..., d] -> 2 x [..., ffn]
    return linear(gelu_tanh(gate) * up, w_down)  # [..., ffn] -> [..., d]


@dataclass
class LayerWeights:
    """One decoder layer, float32; matrices have shape ``[in, out]`` for ``x @ W``."""

    attn_norm: np.ndarray  # [d]
    w_qkv: np.ndarray      # [d, (n_head + 2 * n_kv) * hd]: Q columns (GGUF rope layout), K, V
    w_o: np.ndarray        # [n_head * hd, d]
    ffn_norm: np.ndarray   # [d]
    w_gate_up: np.ndarray  # [d, 2 * ffn]
    w_down: np.ndarray     # [ffn, d]
    # Gemma 3 only (None for LLaMA):
    q_norm: np.ndarray | None = None          # [hd], per query head
    k_norm: np.ndarray | None = None          # [hd], per key head
    post_attn_norm: np.ndarray | None = None  # [d], on the attention output
    post_ffn_norm: np.ndarray | None = None   # [d], on the MLP output
    # Qwen2 only (None otherwise):
    b_qkv: np.ndarray | None = None           # [(n_head + 2 * n_kv) * hd]: q, k, v biases


def block(x: np.ndarray, w: LayerWeights, cfg: ModelConfig, cos: np.ndarray | None,
          sin: np.ndarray | None, mask: np.ndarray, update_kv: KVUpdate) -> np.ndarray:
    """One pre-norm LLaMA decoder layer; also Qwen2 (q/k/v biases, NEOX rope), Qwen3 (NEOX
    rope, RMSNorm of each q and k head over ``head_dim`` before it), Phi-3 (NEOX rope) and
    SmolLM3 (no rotary on every 4th layer: ``cos is None``).

    x: float32 ``[B, n, d]``; cos, sin: ``[B, n, 1, rope_dim/2]`` at the tokens' positions, or
    ``None`` for a layer without rotary;
    mask: ``[B, n, T]``; ``update_kv(k, v)`` stores the new keys/values in the cache and returns
    everything to attend to (see :data:`KVUpdate`). Returns float32 ``[B, n, d]``.
    """
    B, n, _ = x.shape
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # [B, n, d] -> [B, n, (H + 2 KV) hd]
    qkv = linear(rms_norm(x, w.attn_norm, cfg.rms_eps), w.w_qkv)
    if w.b_qkv is not None:
        qkv = qkv + w.b_qkv  # Qwen2
    q, k, v = np.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
    q, k = q.reshape(B, n, H, hd), k.reshape(B, n, KV, hd)
    if w.q_norm is not None:  # Qwen3
        q, k = rms_norm(q, w.q_norm, cfg.rms_eps), rms_norm(k, w.k_norm, cfg.rms_eps)
    if cos is not None:
        rot = rope_neox if cfg.rope_neox else rope
        q, k = rot(q, cos, sin), rot(k, cos, sin)  # -> [B, n, H, hd], [B, n, KV, hd]
    k_all, v_all = update_kv(k, v.reshape(B, n, KV, hd))  # -> 2 x [B, KV, T, hd]
    a = attention(q, k_all, v_all, mask, cfg.attn_scale)  # -> [B, n, H*hd]
    x = x + linear(a, w.w_o)  # [B, n, H*hd] -> [B, n, d]
    return x + mlp(rms_norm(x, w.ffn_norm, cfg.rms_eps), w.w_gate_up, w.w_down)  # [B, n, d]


def gemma3_block(x: np.ndarray, w: LayerWeights, cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray,
                 mask: np.ndarray, update_kv: KVUpdate) -> np.ndarray:
    """One Gemma 3 decoder layer (sandwich norms, q/k norm, NEOX rope, GeGLU).

    Arguments as in :func:`block`; ``cos``/``sin`` carry this layer's rotary base and ``mask``
    its sliding window (local layers) or plain causal mask (global layers).
    """
    B, n, _ = x.shape
    H, KV, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
    qkv = linear(rms_norm(x, w.attn_norm, eps), w.w_qkv)  # [B, n, d] -> [B, n, (H + 2 KV) hd]
    q, k, v = np.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
    q = rope_neox(rms_norm(q.reshape(B, n, H, hd), w.q_norm, eps), cos, sin)  # -> [B, n, H, hd]
    k = rope_neox(rms_norm(k.reshape(B, n, KV, hd), w.k_norm, eps), cos, sin)  # -> [B, n, KV, hd]
    k_all, v_all = update_kv(k, v.reshape(B, n, KV, hd))  # -> 2 x [B, KV, T, hd]
    a = linear(attention(q, k_all, v_all, mask, cfg.attn_scale), w.w_o)  # [B, n, H*hd] -> [B, n, d]
    x = x + rms_norm(a, w.post_attn_norm, eps)  # [B, n, d]
    m = geglu_mlp(rms_norm(x, w.ffn_norm, eps), w.w_gate_up, w.w_down)  # [B, n, d]
    return x + rms_norm(m, w.post_ffn_norm, eps)  # [B, n, d]


BLOCKS = {"llama": block, "gemma3": gemma3_block, "qwen2": block, "qwen3": block,
          "phi3": block, "smollm3": block}
