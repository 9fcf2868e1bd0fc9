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
token for each of ``B`` sequences at once. Both share :func:`.layers.block`; they
differ only in how they write to and read from the :class:`KVCache`.

The blocks, their rotary layouts and the architectures' differences are in
:mod:`.layers`; this module holds the weights, the KV cache and the model loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..arch import ModelConfig
from ..backend import Backend, SeqChunk, check_chunks
from ..gguf import GGUFFile
from .layers import BLOCKS, KVUpdate, LayerWeights, rms_norm, rope_frequencies, rope_table

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


def xw_matrix(f: GGUFFile, *names: str, dtype=np.float32) -> np.ndarray:
    """GGUF matrices ``[out_i, in]`` stacked and laid out for ``x @ W``: ``dtype`` (float32 or
    float16: each float32 value of ``GGUFFile.dequantize`` rounded to it) ``[in, sum(out_i)]``,
    C-contiguous. Dequantized a hundred rows or so at a time (:meth:`.GGUFFile.dequantize_rows`),
    so the float32 temporaries stay small."""
    shapes = [f.raw(n).shape for n in names]
    out = np.empty((shapes[0][1], sum(s[0] for s in shapes)), dtype)
    col = 0
    for name, (rows, _) in zip(names, shapes, strict=True):
        for r in range(0, rows, _ROWS):
            part = f.dequantize_rows(name, r, min(rows, r + _ROWS)).astype(dtype, copy=False)
            out[:, col + r:col + r + len(part)] = part.T
        col += rows
    return out


#: rows of a GGUF matrix dequantized at once by :func:`xw_matrix`
_ROWS = 128


def load_layer(f: GGUFFile, cfg: ModelConfig, i: int, dtype=np.float32) -> LayerWeights:
    """Decoder layer ``i`` (GGUF ``blk.{i}.*``) dequantized, matrices laid out for ``x @ W``
    (:func:`xw_matrix`) in ``dtype`` (float32, or float16 for the standard graph's weights),
    norms and biases float32: q/k/v and gate/up fused as
    :class:`.layers.LayerWeights` says (Phi-3's are fused in the file already)."""
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
    return LayerWeights(
        attn_norm=f.dequantize(p + "attn_norm.weight"),
        w_qkv=xw_matrix(f, p + "attn_qkv.weight", dtype=dtype) if fused_qkv
        else xw_matrix(f, *(p + f"attn_{t}.weight" for t in "qkv"), dtype=dtype),
        w_o=xw_matrix(f, p + "attn_output.weight", dtype=dtype),
        ffn_norm=f.dequantize(p + "ffn_norm.weight"),
        w_gate_up=xw_matrix(f, p + "ffn_up.weight", dtype=dtype) if fused_up
        else xw_matrix(f, p + "ffn_gate.weight", p + "ffn_up.weight", dtype=dtype),
        w_down=xw_matrix(f, p + "ffn_down.weight", dtype=dtype),
        **extra,
    )


def load_weights(f: GGUFFile, cfg: ModelConfig, max_seq_len: int) -> Weights:
    """Dequantize every tensor of ``f`` to float32, once, and lay matrices out for ``x @ W``.

    GGUF stores a matrix as ``[out, in]`` rows; here each becomes a C-contiguous ``[in, out]``
    array (one transposing copy at load, never per step). Q and K keep the GGUF row order
    (adjacent rotary pairs), which :func:`.layers.rope` expects.

    Why ``[in, out]`` contiguous: on OpenBLAS a one-row product ``x @ W`` is fastest in this
    order, and so is decode's one-GEMV-per-row (:func:`.layers.linear`); only GEMMs
    of many rows would gain from the ``[out, in]`` rows.
    """
    # The embedding first: its dequantization makes the largest temporaries, and the peak
    # resident memory stays lower while little else is held.
    embedding = f.dequantize("token_embd.weight")  # [vocab, d]
    layers = [load_layer(f, cfg, i) for i in range(cfg.num_layers)]
    # Tied LM head (no output.weight): a transposed view of the embedding (BLAS reads it in
    # place), not a second copy of the largest matrix.
    lm_head = xw_matrix(f, "output.weight") if f.has_tensor("output.weight") else embedding.T
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
    # (unlike the [in, out] weights of linear).
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
