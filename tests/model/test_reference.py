"""The numpy reference decoder on the real SmolLM2-135M-Instruct weights (no mocks).

The independent check (:func:`hf_logits`) recomputes the model in float64 the way Hugging Face
``LlamaForCausalLM`` does it: Q/K weights un-permuted back to HF row order and ``rotate_half``
rotary embedding (pairs ``x[i], x[i + d/2]``), heads looped one by one, K/V heads repeated for
GQA, full causal attention without a cache. A rope-pairing bug in ``reference.py`` cannot cancel
out against it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_math import attention, rms_norm, weight64

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.reference.decoder import NumpyBackend

MAX_SEQ_LEN = 256

# float32 (reference.py) vs float64 (hf_logits) over 30 layers; the measured max |diff| of the
# logits is ~3e-5 (logits span about -25..+25); a wrong rope pairing, theta,
# eps or GQA head mapping moves them by whole units.
ATOL_VS_FLOAT64 = 5e-4
# Same float32 model, different batching / chunking: only matmul summation order differs.
ATOL_SAME_MODEL = 2e-4


@pytest.fixture(scope="module")
def gguf(model_path) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def backend(gguf) -> NumpyBackend:
    """One backend for the module: 8 slots of 256 positions."""
    return NumpyBackend(gguf, ModelConfig.from_gguf(gguf), num_slots=8, max_seq_len=MAX_SEQ_LEN)


def ids_of(gguf: GGUFFile, pieces: list[str]) -> np.ndarray:
    """Token ids of whole vocabulary pieces ("Ġ" marks a leading space in byte-level BPE).

    Each word below is a single piece of SmolLM2's vocabulary, so this equals what the BPE
    tokenizer produces (checked once with HF ``tokenizers`` built from the GGUF vocab and merges:
    "The capital of France is" -> [504, 3575, 282, 4649, 314]).
    """
    vocab = gguf.get("tokenizer.ggml.tokens")
    return np.array([vocab.index(p) for p in pieces], dtype=np.int64)


FRANCE = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
STORY = ["Once", "Ġupon", "Ġa", "Ġtime", ",", "Ġthere", "Ġwas", "Ġa", "Ġlittle", "Ġgirl",
         "Ġwho", "Ġlived", "Ġin", "Ġa", "Ġvillage", "Ġnear", "Ġthe", "Ġforest", "."]


# ---- an independent float64 recomputation in Hugging Face's layout -------------------------

def hf_logits(f: GGUFFile, cfg: ModelConfig, ids: np.ndarray) -> np.ndarray:
    """Logits float64 ``[n, vocab]`` of every position of ``ids``, HF-style (see module doc)."""
    H, KV, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps

    def unpermute(w, n_head):
        # llama.cpp's converter: w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2); undo it.
        return w.reshape(n_head, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    def W(name):
        return weight64(f, name)

    def norm(x, w):
        return rms_norm(x, w, eps)

    n = len(ids)
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(n), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)  # [n, hd], HF's cos/sin layout
    cos, sin = np.cos(emb), np.sin(emb)
    causal = np.triu(np.full((n, n), -np.inf), k=1)

    embedding = W("token_embd.weight")
    x = embedding[ids]
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = h @ unpermute(W(p + "attn_q.weight"), H).T
        k = h @ unpermute(W(p + "attn_k.weight"), KV).T
        v = h @ W(p + "attn_v.weight").T
        x = x + attention(q, k, v, H, KV, cos, sin, causal,
                          1 / np.sqrt(hd)) @ W(p + "attn_output.weight").T
        h = norm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        u = h @ W(p + "ffn_up.weight").T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
    head = W("output.weight") if f.has_tensor("output.weight") else embedding
    return norm(x, W("output_norm.weight")) @ head.T


def test_matches_independent_float64_hf_layout(backend, gguf):
    ids = ids_of(gguf, STORY[:12])
    want = hf_logits(gguf, backend.config, ids)  # [12, vocab]

    got = backend.forward([SeqChunk(slot=0, start=0, token_ids=ids[:11])])  # prefill 11
    assert got.dtype == np.float32 and got.shape == (1, backend.config.vocab_size)
    assert np.abs(got[0] - want[10]).max() < ATOL_VS_FLOAT64
    assert got[0].argmax() == want[10].argmax()

    got = backend.forward([SeqChunk(slot=0, start=11, token_ids=ids[11:])])  # decode the 12th
    assert np.abs(got[0] - want[11]).max() < ATOL_VS_FLOAT64
    assert got[0].argmax() == want[11].argmax()


def test_whole_prefill_equals_chunked_prefill_equals_prefill_then_decode(backend, gguf):
    ids = ids_of(gguf, STORY)  # 19 tokens
    n = len(ids)
    whole = backend.forward([SeqChunk(1, 0, ids)])[0]

    for lo, hi in [(0, 7), (7, 15), (15, n)]:  # three chunks
        chunked = backend.forward([SeqChunk(2, lo, ids[lo:hi])])[0]
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=ATOL_SAME_MODEL)

    backend.forward([SeqChunk(3, 0, ids[:-1])])
    decoded = backend.forward([SeqChunk(3, n - 1, ids[-1:])])[0]
    np.testing.assert_allclose(decoded, whole, rtol=0, atol=ATOL_SAME_MODEL)


def test_batched_rows_do_not_leak_and_start0_forgets(backend, gguf):
    story, france = ids_of(gguf, STORY), ids_of(gguf, FRANCE)
    prompts = [story, france, story[3:12]]  # 19, 5 and 9 tokens
    nxt = ids_of(gguf, ["Ġshe", "ĠParis", "Ġthe"])

    alone_prefill, alone_decode = [], []
    for p, t in zip(prompts, nxt, strict=True):
        alone_prefill.append(backend.forward([SeqChunk(0, 0, p)])[0])
        alone_decode.append(backend.forward([SeqChunk(0, len(p), t[None])])[0])

    def check(got, want):
        np.testing.assert_allclose(got, np.stack(want), rtol=0, atol=ATOL_SAME_MODEL)

    for slots in ([5, 1, 3], [4, 5, 6]):  # scattered slots (gathered K/V) and consecutive (views)
        check(backend.forward([SeqChunk(s, 0, p) for s, p in zip(slots, prompts, strict=True)]),
              alone_prefill)
        check(backend.forward([SeqChunk(s, len(p), t[None])
                               for s, p, t in zip(slots, prompts, nxt, strict=True)]),
              alone_decode)

    # Slot 4 now holds the 20-position story; start=0 there must forget it (here in a batch that
    # mixes a prefill row with a decode row), also when a longer row in the same decode batch
    # makes the attended length pass slot 4's new sequence (its stale positions 6..11).
    got = backend.forward([SeqChunk(4, 0, france), SeqChunk(6, len(prompts[2]) + 1, story[:1])])
    np.testing.assert_allclose(got[0], alone_prefill[1], rtol=0, atol=ATOL_SAME_MODEL)
    got = backend.forward([SeqChunk(4, len(france), nxt[1:2]),
                           SeqChunk(6, len(prompts[2]) + 2, story[:1])])
    np.testing.assert_allclose(got[0], alone_decode[1], rtol=0, atol=ATOL_SAME_MODEL)


def test_greedy_continuation_names_paris(backend, gguf):
    ids = ids_of(gguf, FRANCE)
    paris = ids_of(gguf, ["ĠParis"])[0]
    logits = backend.forward([SeqChunk(7, 0, ids)])[0]
    out = []
    for pos in range(len(ids), len(ids) + 5):
        out.append(int(logits.argmax()))
        logits = backend.forward([SeqChunk(7, pos, np.array(out[-1:]))])[0]
    assert paris in out, [gguf.get("tokenizer.ggml.tokens")[i] for i in out]


@pytest.mark.parametrize("chunks, message", [
    ([SeqChunk(0, 0, np.array([], dtype=np.int64))], "empty"),
    ([SeqChunk(8, 0, np.array([1]))], "out of range"),
    ([SeqChunk(-1, 0, np.array([1]))], "out of range"),
    ([SeqChunk(0, 0, np.array([1, 2])), SeqChunk(0, 2, np.array([3]))], "twice"),
    ([SeqChunk(0, MAX_SEQ_LEN - 1, np.array([1, 2]))], "max_seq_len"),
    ([SeqChunk(0, -1, np.array([1]))], "max_seq_len"),
    ([SeqChunk(0, 0, np.array([49152]))], "token id"),
    ([SeqChunk(0, 0, np.array([-1]))], "token id"),
    ([SeqChunk(0, 0, np.array([[1, 2]]))], "one-dimensional"),
])
def test_invalid_chunks_raise_value_error(backend, chunks, message):
    with pytest.raises(ValueError, match=message):
        backend.forward(chunks)


def test_last_position_of_a_slot_is_usable(backend, gguf):
    ids = ids_of(gguf, STORY)
    backend.forward([SeqChunk(6, 0, np.resize(ids, MAX_SEQ_LEN - 1))])
    out = backend.forward([SeqChunk(6, MAX_SEQ_LEN - 1, ids[:1])])
    assert out.shape == (1, backend.config.vocab_size) and np.isfinite(out).all()
    c = backend.config
    assert backend.kv_cache_bytes() == (2 * c.num_layers * 8 * c.num_kv_heads * MAX_SEQ_LEN
                                        * c.head_dim * 4)


def test_linear_gemv_and_gemm_paths_agree(backend):
    from tiny_mindie.model.reference.layers import GEMV_MAX_ROWS, linear

    w = backend.weights.layers[0].w_gate_up  # [576, 3072]
    x = np.random.default_rng(0).standard_normal(
        (1, GEMV_MAX_ROWS + 1, w.shape[0])).astype(np.float32)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):  # per-row GEMVs, then one GEMM
        got = linear(x[:, :rows], w)  # [1, rows, 576] -> [1, rows, 3072]
        want = x[:, :rows].astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
