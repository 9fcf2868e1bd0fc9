"""The numpy reference decoder for LLaMA-family and Gemma 3 architectures, with a slot-based KV
cache.

The whole forward pass, one small pure function per block (in the manner of picoGPT):

    x = embedding[token_ids]                                   # [B, n] -> [B, n, d]
    for each layer:
        x = x + attention(rope(q), rope(k), v)   of rms_norm(x)
        x = x + mlp(rms_norm(x))
    logits = rms_norm(x[:, -1]) @ lm_head                      # [B, d] -> [B, vocab]

``B`` is the number of sequences in the batch, ``n`` the tokens per sequence in this step, ``d``
the hidden size, ``T`` the key positions attended to. All activations are float32.

Two explicit entry points (in the manner of gpt-fast): :func:`prefill` runs a chunk of one
sequence with causal attention over the cached prefix and the chunk; :func:`decode` runs one
token for each of ``B`` sequences at once. Both share :func:`block`; they differ only in how
they write to and read from the :class:`KVCache`.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from .backend import Backend, SeqChunk, check_chunks
from .config import YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig
from .gguf import GGUFFile

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
# [in, out] weights a GEMM of a few rows costs several times one GEMV over the same weight, more
# than the extra passes over the weight; at about 8 rows they meet.
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


# ---- weights and cache ----------------------------------------------------------------------

@dataclass
class Weights:
    """All parameters, dequantized once to float32, plus the rotary tables."""

    cfg: ModelConfig
    embedding: np.ndarray  # [vocab, d]
    layers: list[LayerWeights]
    norm: np.ndarray       # [d]
    lm_head: np.ndarray    # [d, vocab] (a view of ``embedding`` when tied)
    cos: np.ndarray        # [max_seq_len, rope_dim/2]
    sin: np.ndarray        # [max_seq_len, rope_dim/2]
    cos_local: np.ndarray | None = None  # [max_seq_len, rope_dim/2], local layers' (Gemma 3)
    sin_local: np.ndarray | None = None


def load_weights(f: GGUFFile, cfg: ModelConfig, max_seq_len: int) -> Weights:
    """Dequantize every tensor of ``f`` to float32, once, and lay matrices out for ``x @ W``.

    GGUF stores a matrix as ``[out, in]`` rows; here each becomes a C-contiguous ``[in, out]``
    array (one transposing copy at load, never per step). Q and K keep the GGUF row order
    (adjacent rotary pairs), which :func:`rope` expects.

    Why ``[in, out]`` contiguous: on OpenBLAS a one-row product ``x @ W`` is fastest in this
    order, and so is decode's one-GEMV-per-row (:func:`linear`); only GEMMs of 8 rows or more
    would gain from the ``[out, in]`` rows.
    """
    def t(*names: str) -> np.ndarray:  # GGUF [out_i, in] -> [in, sum(out_i)], C-contiguous
        w = (np.concatenate([f.dequantize(n) for n in names]) if len(names) > 1
             else f.dequantize(names[0]))
        return np.ascontiguousarray(w.T)

    # The embedding first: its dequantization makes the largest temporaries, and the peak
    # resident memory stays lower while little else is held.
    embedding = f.dequantize("token_embd.weight")  # [vocab, d]
    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        extra = {}
        if cfg.qk_norm:
            extra.update(q_norm=f.dequantize(p + "attn_q_norm.weight"),
                         k_norm=f.dequantize(p + "attn_k_norm.weight"))
        if cfg.post_norms:
            extra.update(post_attn_norm=f.dequantize(p + "post_attention_norm.weight"),
                         post_ffn_norm=f.dequantize(p + "post_ffw_norm.weight"))
        if cfg.qkv_bias:
            extra.update(b_qkv=np.concatenate([f.dequantize(p + f"attn_{t}.bias").reshape(-1)
                                               for t in "qkv"]).astype(np.float32))
        fused_qkv = f.has_tensor(p + "attn_qkv.weight")   # Phi-3: [q; k; v] rows in one
        fused_up = not f.has_tensor(p + "ffn_gate.weight")  # Phi-3: ffn_up holds [gate; up]
        layers.append(LayerWeights(
            attn_norm=f.dequantize(p + "attn_norm.weight"),
            w_qkv=t(p + "attn_qkv.weight") if fused_qkv
            else t(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
            w_o=t(p + "attn_output.weight"),
            ffn_norm=f.dequantize(p + "ffn_norm.weight"),
            w_gate_up=t(p + "ffn_up.weight") if fused_up
            else t(p + "ffn_gate.weight", p + "ffn_up.weight"),
            w_down=t(p + "ffn_down.weight"),
            **extra,
        ))
    # Tied LM head (no output.weight): a transposed view of the embedding (BLAS reads it in
    # place), not a second 100+ MB copy.
    lm_head = t("output.weight") if f.has_tensor("output.weight") else embedding.T
    cos, sin = rope_table(max_seq_len, *rope_frequencies(cfg, max_seq_len))
    local = (rope_table(max_seq_len, *rope_frequencies(cfg, max_seq_len, local=True))
             if cfg.rope_theta_local else (None, None))
    return Weights(cfg, embedding, layers, f.dequantize("output_norm.weight"), lm_head, cos, sin,
                   *local)


class KVCache:
    """Keys and values of every slot, fixed shape, float32, updated in place.

    ``k`` and ``v`` are each ``[num_layers, num_slots, num_kv_heads, max_seq_len, head_dim]``;
    ``k[layer, slot, :, pos]`` holds the (rotated) key of the token at ``pos`` of that slot's
    sequence. Positions past a sequence's length hold stale data that the attention mask hides.
    Pages are allocated lazily by the OS, so untouched slots cost no resident memory.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_seq_len: int):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write_chunk(self, layer: int, slot: int, start: int, k: np.ndarray, v: np.ndarray):
        """Store ``n`` consecutive tokens of one sequence; return its keys/values ``[0, start+n)``.

        k, v: ``[1, n, n_kv, hd]``. Returns views ``[1, n_kv, start+n, hd]`` (no copy).
        """
        end = start + k.shape[1]
        self.k[layer, slot, :, start:end] = k[0].swapaxes(0, 1)  # [n, n_kv, hd] -> [n_kv, n, hd]
        self.v[layer, slot, :, start:end] = v[0].swapaxes(0, 1)
        return self.k[layer, slot:slot + 1, :, :end], self.v[layer, slot:slot + 1, :, :end]

    def write_tokens(self, layer: int, slots: np.ndarray, pos: np.ndarray, k: np.ndarray,
                     v: np.ndarray):
        """Store one token for each of ``B`` sequences; return their keys/values ``[0, T)``.

        slots, pos: int64 ``[B]``; k, v: ``[B, 1, n_kv, hd]``. ``T = max(pos) + 1``; rows of
        shorter sequences carry stale positions the mask hides. Returns ``[B, n_kv, T, hd]``:
        views when ``slots`` are consecutive and ascending, gathered copies otherwise.
        """
        self.k[layer, slots, :, pos] = k[:, 0]  # [B, n_kv, hd]
        self.v[layer, slots, :, pos] = v[:, 0]
        T = int(pos.max()) + 1
        s0 = int(slots[0])
        if np.array_equal(slots, np.arange(s0, s0 + len(slots))):
            rows = slice(s0, s0 + len(slots))
            return self.k[layer, rows, :, :T], self.v[layer, rows, :, :T]
        return self.k[layer, slots, :, :T], self.v[layer, slots, :, :T]  # gather: copies


def causal_mask(positions: np.ndarray, T: int, window: int = 0) -> np.ndarray:
    """Additive mask: query at position ``p`` sees keys ``0..p`` -- or, with a sliding
    ``window > 0``, only keys ``p - window + 1 .. p`` (``p - key < window``, as llama.cpp's
    standard SWA and HF's sliding-window mask).

    positions: int64 ``[B, n]``. Returns float32 ``[B, n, T]``, 0 where allowed, -inf elsewhere.
    """
    keys = np.arange(T)
    allowed = keys <= positions[..., None]  # [B, n] -> [B, n, T]
    if window > 0:
        allowed &= keys > positions[..., None] - window
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf))


def _run_layers(w: Weights, x: np.ndarray, positions: np.ndarray, T: int,
                update_kv: Callable[[int], KVUpdate]) -> np.ndarray:
    """All decoder layers on ``x`` ``[B, n, d]`` at ``positions`` ``[B, n]``, attending to ``T``
    key positions; ``update_kv(i)`` is layer ``i``'s cache update. Returns ``[B, n, d]``."""
    cfg = w.cfg
    run = BLOCKS[cfg.architecture]
    cos, sin = w.cos[positions][:, :, None], w.sin[positions][:, :, None]  # [B, n, 1, rope_dim/2]
    mask = causal_mask(positions, T)  # [B, n, T]
    if cfg.sliding_window:
        cos_l, sin_l = cos, sin
        if w.cos_local is not None:  # Gemma 3: the local layers' own rotary base
            cos_l, sin_l = w.cos_local[positions][:, :, None], w.sin_local[positions][:, :, None]
        mask_l = causal_mask(positions, T, cfg.sliding_window)  # [B, n, T]
    for i, layer in enumerate(w.layers):
        if cfg.is_local(i):
            x = run(x, layer, cfg, cos_l, sin_l, mask_l, update_kv(i))
        elif cfg.uses_rope(i):
            x = run(x, layer, cfg, cos, sin, mask, update_kv(i))
        else:  # SmolLM3's NoPE layers
            x = run(x, layer, cfg, None, None, mask, update_kv(i))
    return x


def _embed(w: Weights, token_ids: np.ndarray) -> np.ndarray:
    x = w.embedding[token_ids]  # [...] -> [..., d]
    if w.cfg.embedding_scale != 1.0:
        x *= np.float32(w.cfg.embedding_scale)  # Gemma: sqrt(d), in float32 as llama.cpp
    return x


def _logits(w: Weights, x: np.ndarray) -> np.ndarray:
    # A plain GEMM even for few rows: on the tied head's transposed view it beats per-row GEMVs
    # from 2 rows on.
    return rms_norm(x, w.norm, w.cfg.rms_eps) @ w.lm_head  # [B, d] -> [B, vocab]


# ---- the two entry points -------------------------------------------------------------------

def prefill(w: Weights, cache: KVCache, slot: int, start: int, token_ids: np.ndarray,
            all_logits: bool = False) -> np.ndarray:
    """Run a chunk of one sequence: tokens at positions ``[start, start + n)`` of ``slot``.

    Attends causally over the slot's cached positions ``[0, start)`` and the chunk itself, and
    writes the chunk's keys/values into the cache. token_ids: int64 ``[n]``.
    Returns float32 ``[vocab]``: logits of the chunk's last token; with ``all_logits``,
    ``[n, vocab]``: the next-token logits after every position (for likelihoods).
    """
    n = len(token_ids)
    positions = np.arange(start, start + n)[None]  # [1, n]
    x = _embed(w, token_ids)[None]  # [n] -> [1, n, d]
    x = _run_layers(w, x, positions, start + n,
                    lambda i: partial(cache.write_chunk, i, slot, start))
    if all_logits:
        return _logits(w, x[0])  # [n, d] -> [n, vocab]
    return _logits(w, x[:, -1])[0]  # [1, d] -> [vocab]


def decode(w: Weights, cache: KVCache, slots: np.ndarray, pos: np.ndarray,
           token_ids: np.ndarray) -> np.ndarray:
    """Run one token for each of ``B`` sequences, batched.

    slots, pos, token_ids: int64 ``[B]``: row ``b`` is token ``token_ids[b]`` at position
    ``pos[b]`` of slot ``slots[b]`` (distinct slots). Returns float32 ``[B, vocab]``.
    """
    positions = pos[:, None]  # [B] -> [B, 1]
    x = _embed(w, token_ids)[:, None]  # [B] -> [B, 1, d]
    x = _run_layers(w, x, positions, int(pos.max()) + 1,
                    lambda i: partial(cache.write_tokens, i, slots, pos))  # [B, 1, d]
    return _logits(w, x[:, 0])  # [B, d] -> [B, vocab]


# ---- the backend ----------------------------------------------------------------------------

class NumpyBackend(Backend):
    """The reference decoder behind the :class:`Backend` interface (float32, BLAS matmuls).

    Args:
        f: the opened model file (LLaMA or Gemma 3 architecture).
        config: its parameters (``ModelConfig.from_gguf(f)``).
        num_slots: sequences the KV cache holds at once.
        max_seq_len: positions per slot.
    """

    name = "numpy"
    device = "CPU"

    def __init__(self, f: GGUFFile, config: ModelConfig, *, num_slots: int = 8,
                 max_seq_len: int = 2048):
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"num_slots ({num_slots}) and max_seq_len ({max_seq_len}) "
                             "must be >= 1")
        self.config = config
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.weights = load_weights(f, config, max_seq_len)
        self.cache = KVCache(config, num_slots, max_seq_len)

    def forward(self, chunks: Sequence[SeqChunk]) -> np.ndarray:
        """Prefill each multi-token chunk on its own; decode all single-token chunks as one batch.

        See :meth:`Backend.forward`. Also raises ``ValueError`` for token ids outside
        ``[0, vocab_size)`` or not one-dimensional.
        """
        ids = check_chunks(chunks, self.num_slots, self.max_seq_len, self.config.vocab_size)
        out = np.empty((len(chunks), self.config.vocab_size), dtype=np.float32)
        rows = [i for i, a in enumerate(ids) if len(a) == 1]
        if rows:
            out[rows] = decode(self.weights, self.cache,
                               np.array([chunks[i].slot for i in rows], dtype=np.int64),
                               np.array([chunks[i].start for i in rows], dtype=np.int64),
                               np.concatenate([ids[i] for i in rows]))
        for i, a in enumerate(ids):
            if len(a) > 1:
                out[i] = prefill(self.weights, self.cache, chunks[i].slot, chunks[i].start, a)
        return out

    def copy_kv(self, src_slot: int, dst_slot: int, n: int) -> None:
        """See :meth:`Backend.copy_kv`."""
        self._check_copy(src_slot, dst_slot, n)
        self.cache.k[:, dst_slot, :, :n] = self.cache.k[:, src_slot, :, :n]
        self.cache.v[:, dst_slot, :, :n] = self.cache.v[:, src_slot, :, :n]

    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    def close(self) -> None:
        self.weights = None  # type: ignore[assignment]
        self.cache = None  # type: ignore[assignment]
