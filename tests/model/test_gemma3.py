"""The numpy reference decoder on the real Gemma 3 270M (Q4_K_M GGUF, no mocks).

The independent check (:func:`hf_gemma3_logits`) recomputes the model in float64 the way Hugging
Face ``Gemma3ForCausalLM`` does, written from HF's modelling rather than from ``reference.py``:
heads looped one by one, ``rotate_half`` rotary embedding, norms ``x / rms(x) * (1 + w_hf)``,
the sliding window as an explicit ``i - j < window`` test, local/global layer pattern, rotary
bases and attention scale spelled out as constants of Gemma 3 (not read from ``ModelConfig``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_math import QUESTION, attention, greedy_tokens, mean_nll, paragraph_ids, rms_norm, weight64

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.reference.decoder import NumpyBackend, causal_mask, prefill
from tiny_mindie.model.tokenizer_load import load_tokenizer

MAX_SEQ_LEN = 1024
WINDOW = 512
# A prompt past the sliding window: positions >= 512 on local layers no longer see the start.
LONG = 600

# float32 (reference.py) vs float64 (hf_gemma3_logits), 18 layers, 600 positions: the measured
# max |diff| of the last logits is ~2.6e-5 (logits span about -26..+32); dropping the sliding
# window moves them by ~18, applying HF's "1 + w" to the stored norm weights breaks the model.
ATOL_VS_FLOAT64 = 5e-4
# Same float32 model, different chunking / batching: only summation order differs (measured ~2e-5).
ATOL_SAME_MODEL = 2e-4

PARAGRAPH = (
    "The river rises in the hills north of the town and runs south through farmland for "
    "about forty miles before it reaches the sea. In the eighteenth century mills were built "
    "along its banks, and the town grew around the trade in wool and grain. A canal was cut in "
    "1790 to carry coal from the mines to the port, and the railway followed sixty years later. "
)


@pytest.fixture(scope="module")
def gguf(gemma_path) -> GGUFFile:
    return GGUFFile(gemma_path)


@pytest.fixture(scope="module")
def tok(gguf):
    return load_tokenizer(gguf)


@pytest.fixture(scope="module")
def backend(gguf) -> NumpyBackend:
    """One backend for the module: 4 slots of 1024 positions."""
    return NumpyBackend(gguf, ModelConfig.from_gguf(gguf), num_slots=4, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def long_ids(tok) -> np.ndarray:
    ids = tok.encode(PARAGRAPH * 12)
    assert len(ids) > LONG
    return np.array(ids[:LONG], dtype=np.int64)


# ---- an independent float64 recomputation in Hugging Face's layout -------------------------

def hf_gemma3_logits(f: GGUFFile, ids: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Logits float64 ``[vocab]`` of the last position of ``ids`` (see the module doc)."""
    d, H, KV, hd, eps = 640, 4, 1, 256, 1e-6

    def W(name):
        return weight64(f, name)

    def norm(x, w_gguf):
        # HF Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w). llama.cpp's converter stores
        # 1 + w in the GGUF, so w_hf = stored - 1.
        w_hf = w_gguf - 1.0
        return rms_norm(x, 1.0 + w_hf, eps)

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))

    n = len(ids)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    full = np.where(j <= i, 0.0, -np.inf)
    sliding = np.where((j <= i) & (i - j < window), 0.0, -np.inf)

    def rotary(base):
        inv_freq = 1.0 / base ** (np.arange(0, hd, 2) / hd)
        emb = np.concatenate([np.outer(np.arange(n), inv_freq)] * 2, axis=-1)  # [n, hd]
        return np.cos(emb), np.sin(emb)

    local_rope, global_rope = rotary(10_000.0), rotary(1_000_000.0)
    embedding = W("token_embd.weight")
    x = embedding[ids] * np.sqrt(d)
    for layer in range(18):
        p = f"blk.{layer}."
        is_global = layer % 6 == 5  # HF: sliding_window_pattern 6, every 6th layer global
        cos, sin = global_rope if is_global else local_rope
        mask = full if is_global else sliding
        h = norm(x, W(p + "attn_norm.weight"))
        q = h @ W(p + "attn_q.weight").T
        k = h @ W(p + "attn_k.weight").T
        v = h @ W(p + "attn_v.weight").T
        qn, kn = W(p + "attn_q_norm.weight"), W(p + "attn_k_norm.weight")
        attn = attention(q, k, v, H, KV, cos, sin, mask, 256.0 ** -0.5,   # query_pre_attn_scalar
                         lambda t, w=qn: norm(t, w), lambda t, w=kn: norm(t, w))
        attn = attn @ W(p + "attn_output.weight").T
        x = x + norm(attn, W(p + "post_attention_norm.weight"))
        h = norm(x, W(p + "ffn_norm.weight"))
        m = ((gelu_tanh(h @ W(p + "ffn_gate.weight").T) * (h @ W(p + "ffn_up.weight").T))
             @ W(p + "ffn_down.weight").T)
        x = x + norm(m, W(p + "post_ffw_norm.weight"))
    return norm(x[-1], W("output_norm.weight")) @ embedding.T


# ---- tests ----------------------------------------------------------------------------------

def test_config(backend):
    c = backend.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert c.sliding_window == WINDOW and c.rope_theta == 1e6 and c.rope_theta_local == 1e4
    assert [i for i in range(c.num_layers) if not c.is_local(i)] == [5, 11, 17]
    assert c.attn_scale == 1 / 16 and c.embedding_scale == pytest.approx(640 ** 0.5)
    assert (c.rope_neox and c.qk_norm and c.post_norms and c.mlp_act == "gelu_tanh"
            and c.tied_embeddings)


def test_sliding_window_mask():
    pos = np.array([[3, 511, 512, 600]])  # [1, 4]
    local, full = causal_mask(pos, 601, WINDOW), causal_mask(pos, 601)  # [1, 4, 601]
    allowed = np.isfinite(local[0])
    assert allowed[0].nonzero()[0].tolist() == [0, 1, 2, 3]
    assert allowed[1].nonzero()[0].tolist() == list(range(0, 512))     # 512 keys: all of 0..511
    assert allowed[2].nonzero()[0].tolist() == list(range(1, 513))     # key 0 left the window
    assert allowed[3].nonzero()[0].tolist() == list(range(89, 601))    # p - 511 .. p
    assert np.isfinite(full[0, 3]).all() and not np.isfinite(local[0, 3, 88])


def test_greedy_completion_names_paris(backend, tok):
    ids = np.array(tok.encode(QUESTION), dtype=np.int64)
    assert ids[0] == tok.bos_id
    out = greedy_tokens(backend, ids, 3)
    assert tok.decode(out).startswith(" Paris"), tok.decode(out)


def test_norm_weights_are_stored_as_one_plus_w(backend, tok):
    """llama.cpp's converter adds Gemma's ``1 +`` to every norm weight, so the reference uses the
    stored values as they are; adding 1 again (HF's formula on GGUF values) wrecks the model."""
    w = backend.weights
    plus1 = dataclasses.replace(w, norm=w.norm + 1, layers=[dataclasses.replace(
        lw, attn_norm=lw.attn_norm + 1, ffn_norm=lw.ffn_norm + 1, q_norm=lw.q_norm + 1,
        k_norm=lw.k_norm + 1, post_attn_norm=lw.post_attn_norm + 1,
        post_ffn_norm=lw.post_ffn_norm + 1) for lw in w.layers])
    ids = np.array(tok.encode(QUESTION), dtype=np.int64)
    paris = tok.encode(" Paris", add_bos=False)[0]
    assert prefill(w, backend.cache, 0, 0, ids).argmax() == paris
    assert prefill(plus1, backend.cache, 0, 0, ids).argmax() != paris


def test_matches_independent_float64_past_the_window(backend, gguf, long_ids):
    got = backend.forward([SeqChunk(1, 0, long_ids)])[0]  # 600 positions, prefill
    want = hf_gemma3_logits(gguf, long_ids)
    assert np.abs(got - want).max() < ATOL_VS_FLOAT64
    assert got.argmax() == want.argmax()

    # The window matters at this length: the same weights with a window longer than the prompt
    # (full attention on every layer, local rope kept) give clearly different logits.
    w = backend.weights
    no_window = dataclasses.replace(w, cfg=dataclasses.replace(w.cfg, sliding_window=MAX_SEQ_LEN))
    unwindowed = prefill(no_window, backend.cache, 2, 0, long_ids)
    assert np.abs(unwindowed - got).max() > 1.0


def test_chunked_prefill_and_decode_equal_whole_prefill(backend, long_ids):
    n = len(long_ids)
    whole = backend.forward([SeqChunk(1, 0, long_ids)])[0]
    for lo, hi in [(0, 300), (300, 530), (530, n)]:  # chunks that straddle the window edge
        chunked = backend.forward([SeqChunk(2, lo, long_ids[lo:hi])])[0]
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=ATOL_SAME_MODEL)

    # decode the last token in a batch with another sequence at a different position
    short = long_ids[:20]
    backend.forward([SeqChunk(3, 0, long_ids[:-1])])
    backend.forward([SeqChunk(0, 0, short[:-1])])
    got = backend.forward([SeqChunk(3, n - 1, long_ids[-1:]), SeqChunk(0, 19, short[-1:])])
    np.testing.assert_allclose(got[0], whole, rtol=0, atol=ATOL_SAME_MODEL)
    np.testing.assert_allclose(got[1], backend.forward([SeqChunk(1, 0, short)])[0],
                               rtol=0, atol=ATOL_SAME_MODEL)


def _mean_nll(backend: NumpyBackend, ids: np.ndarray) -> float:
    """Average negative log-likelihood (nats per token) of ``ids[1:]`` given their prefixes."""
    logits = prefill(backend.weights, backend.cache, 0, 0, ids, all_logits=True)
    return mean_nll(logits[:-1], ids[1:])


def test_english_paragraph_likelihood(backend, tok):
    """Average NLL of a plain English paragraph (tests/support/data/english_paragraph.txt, 227
    tokens).

    Measured: 2.87 nats/token (perplexity 17.7). The bound, 3.5 nats (perplexity 33), sits well
    above that and well below what breaks: the same tokens in shuffled order score 6.6 (same
    unigram content, no sense), a uniform guess log(262144) = 12.5, and the architecture slips
    the other tests guard against (norm weights +1, wrong rope pairing, no window) wreck the
    predictions. Reported numbers are printed with ``-s``.
    """
    ids = paragraph_ids(tok)
    assert ids[0] == tok.bos_id and len(ids) > 200
    nll = _mean_nll(backend, ids)
    rng = np.random.default_rng(0)
    shuffled = ids.copy()
    shuffled[1:] = rng.permutation(ids[1:])
    nll_shuffled = _mean_nll(backend, shuffled)
    print(f"\nGemma 3 270M mean NLL {nll:.3f} nats/token (perplexity {np.exp(nll):.1f}); "
          f"shuffled {nll_shuffled:.3f}")
    assert nll < 3.5
    assert nll_shuffled > nll + 2.0


def test_chat_in_the_chatml_fallback_stops_at_im_end(tok, tokenizer):
    """Gemma 3 270M's GGUF has no chat template, so /v1/chat/completions prompts it in ChatML;
    its vocabulary has no ``<|im_end|>`` token, so the marker is a stop string there (else the
    model writes it out and goes on with the next turn). SmolLM2's ChatML tokens end generation
    by themselves."""
    from tiny_mindie.api.chat.template import chatml_stops

    assert tok.chat_template is None and chatml_stops(tok) == ("<|im_end|>",)
    assert chatml_stops(tokenizer) == ()                  # SmolLM2's, from conftest
