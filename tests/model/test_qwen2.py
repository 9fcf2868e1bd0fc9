"""Qwen2 (``qwen2``: LLaMA's block plus q/k/v biases, NEOX rope) on a tiny random model.

The registry's smallest Qwen2 GGUF (Qwen2.5-Coder 0.5B, tests/model/test_qwen25_coder.py) is 491 MB,
so this test writes a tiny one with ``gguf``'s own writer (2 layers, d=64, 4 query heads and 2 KV
heads of 16, MLP 128, 300 tokens of a byte-level BPE vocabulary), random weights stored as Q8_0
and Q4_0 (the Q4_0 ones exercise 4-bit MatMulNBits, mixed with 8-bit inside the fused QKV
projection), F32 biases and norms, an untied LM head.

Checks: the numpy reference against an independent float64 recomputation written the way Hugging
Face ``Qwen2ForCausalLM`` computes (heads one by one, ``rotate_half``, biases added to the
projections), and the ONNX Runtime backend against the reference (logits and greedy tokens, batch
1 and 2 with different prompt lengths).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf_pkg = pytest.importorskip("gguf")

# A model test, though a tiny one (under a second): it writes a model file and runs inference.
pytestmark = pytest.mark.model

from hf_math import attention, rms_norm, weight64  # noqa: E402
from tiny_qwen2 import EPS, FFN, HD, KV, N_LAYERS, THETA, VOCAB, D, H, greedy, write_tiny_qwen2  # noqa: E402

from tiny_mindie.model.arch import ModelConfig  # noqa: E402
from tiny_mindie.model.backend import SeqChunk  # noqa: E402
from tiny_mindie.model.gguf import GGUFFile  # noqa: E402
from tiny_mindie.model.onnx.graph_options import GraphOptions  # noqa: E402
from tiny_mindie.model.reference.decoder import NumpyBackend  # noqa: E402

MAX_SEQ_LEN = 64
GREEDY_STEPS = 16

# float32 reference vs float64 recomputation: only rounding differs (measured 4e-6; logits
# span about -11..+13). Using adjacent-pair rope instead of NEOX moves them by ~5.7; dropping the
# biases moves them too (test_biases_and_neox_matter).
ATOL_VS_FLOAT64 = 1e-4
# float-compute ONNX graph (accuracy_level 0) vs reference: every weight here packs exactly, so
# only summation order differs (measured 3e-6).
ATOL_FLOAT = 1e-3
# default int8-activation graph vs reference (the same bounds as tests/model/test_ort_backend.py;
# measured here: max 0.14, relative 0.011).
MAX_ABS_INT8 = 1.5
REL_INT8 = 0.25

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> GGUFFile:
    path = str(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf")
    write_tiny_qwen2(path)
    return GGUFFile(path)


@pytest.fixture(scope="module")
def config(model) -> ModelConfig:
    return ModelConfig.from_gguf(model)


@pytest.fixture(scope="module")
def reference(model, config) -> NumpyBackend:
    return NumpyBackend(model, config, num_slots=4, max_seq_len=MAX_SEQ_LEN)


def _ort(model, config, tmp_path_factory, **graph):
    from tiny_mindie.model.options import BackendOptions
    from tiny_mindie.model.ort.ort_backend import OrtBackend

    be = OrtBackend(model, config, BackendOptions(threads=1), num_slots=4, max_seq_len=MAX_SEQ_LEN,
                    cache_dir=str(tmp_path_factory.mktemp("onnx-cache")),
                    graph_options=GraphOptions(**graph))
    return be


@pytest.fixture(scope="module")
def ort_float(model, config, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    be = _ort(model, config, tmp_path_factory, accuracy_level=0, lm_head_accuracy_level=0)
    yield be
    be.close()


@pytest.fixture(scope="module")
def ort_default(model, config, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    be = _ort(model, config, tmp_path_factory)
    yield be
    be.close()


PROMPTS = [np.array([5, 77, 263, 100, 42, 9, 256, 31, 200, 150, 3], dtype=np.int64),
           np.array([296, 12, 88, 260], dtype=np.int64)]


# ---- an independent float64 recomputation in Hugging Face's layout -------------------------

def hf_qwen2_logits(f: GGUFFile, ids: np.ndarray) -> np.ndarray:
    """Logits float64 ``[n, vocab]`` of every position of ``ids``, the way HF Qwen2 computes."""
    def W(name):
        return weight64(f, name)

    def norm(x, w):
        return rms_norm(x, w, EPS)

    n = len(ids)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = np.where(j <= i, 0.0, -np.inf)
    inv_freq = 1.0 / THETA ** (np.arange(0, HD, 2) / HD)
    emb = np.concatenate([np.outer(np.arange(n), inv_freq)] * 2, axis=-1)  # [n, HD]
    cos, sin = np.cos(emb), np.sin(emb)

    x = W("token_embd.weight")[ids]
    for layer in range(N_LAYERS):
        p = f"blk.{layer}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = h @ W(p + "attn_q.weight").T + W(p + "attn_q.bias")
        k = h @ W(p + "attn_k.weight").T + W(p + "attn_k.bias")
        v = h @ W(p + "attn_v.weight").T + W(p + "attn_v.bias")
        attn = attention(q, k, v, H, KV, cos, sin, mask, 1 / np.sqrt(HD))
        x = x + attn @ W(p + "attn_output.weight").T
        h = norm(x, W(p + "ffn_norm.weight"))
        g, u = h @ W(p + "ffn_gate.weight").T, h @ W(p + "ffn_up.weight").T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
    return norm(x, W("output_norm.weight")) @ W("output.weight").T


# ---- tests ----------------------------------------------------------------------------------

def test_config(config, model):
    assert config.architecture == "qwen2"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size,
            config.vocab_size) == (N_LAYERS, D, H, KV, HD, FFN, VOCAB)
    assert config.rope_neox and config.qkv_bias and not config.tied_embeddings
    assert config.rope_theta == THETA and config.rms_eps == pytest.approx(EPS)
    assert model.raw("blk.0.ffn_down.weight").qtype == "Q4_0"
    assert model.raw("blk.0.attn_q.weight").qtype == "Q8_0"


def test_tokenizer_loads(model):
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    tok = load_tokenizer(model)
    ids = tok.encode("the cat")
    assert all(0 <= t < VOCAB for t in ids)
    assert tok.decode(ids) == "the cat"


def test_reference_matches_float64(model, reference):
    ids = PROMPTS[0]
    want = hf_qwen2_logits(model, ids)
    # whole prompt at once, then the same positions one token at a time through the cache
    got = reference.forward([SeqChunk(0, 0, ids)])[0]
    assert np.abs(got - want[-1]).max() < ATOL_VS_FLOAT64
    reference.forward([SeqChunk(1, 0, ids[:3])])
    for p in range(3, len(ids)):
        got = reference.forward([SeqChunk(1, p, ids[p:p + 1])])[0]
        assert np.abs(got - want[p]).max() < ATOL_VS_FLOAT64, p
    assert np.abs(want[-1]).max() > 1.0            # the logits are not trivially small


def test_biases_and_neox_matter(model, reference):
    """Sanity of the float64 check itself: the tiny model is sensitive to what it tests."""
    from tiny_mindie.model.reference import decoder as ref

    ids = PROMPTS[0]
    want = hf_qwen2_logits(model, ids)[-1]
    w = reference.weights
    saved = [lw.b_qkv for lw in w.layers]
    try:
        for lw in w.layers:
            lw.b_qkv = None
        no_bias = ref.prefill(w, ref.KVCache(w.cfg, 1, MAX_SEQ_LEN), 0, 0, ids)
    finally:
        for lw, b in zip(w.layers, saved, strict=True):
            lw.b_qkv = b
    assert np.abs(no_bias - want).max() > 100 * ATOL_VS_FLOAT64
    adjacent = NumpyBackend(model, dataclasses.replace(w.cfg, rope_neox=False), num_slots=1,
                            max_seq_len=MAX_SEQ_LEN)
    assert np.abs(adjacent.forward([SeqChunk(0, 0, ids)])[0] - want).max() > 100 * ATOL_VS_FLOAT64


@pytest.mark.parametrize("batch", [1, 2])
def test_ort_float_matches_reference(reference, ort_float, batch):
    prompts = PROMPTS[:batch]
    slots = list(range(batch))
    want_tok, want_logits = greedy(reference, prompts, slots, GREEDY_STEPS)
    got_tok, got_logits = greedy(ort_float, prompts, slots, GREEDY_STEPS)
    for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert np.abs(a - b).max() < ATOL_FLOAT, step
    assert got_tok == want_tok
    assert len(set(want_tok[0])) > 1                   # not a degenerate constant stream


def test_ort_default_close_to_reference(reference, ort_default):
    """The default graph (int8 activations inside MatMulNBits) stays within test_ort_backend's
    bounds."""
    for slot, ids in enumerate(PROMPTS):
        want = reference.forward([SeqChunk(slot, 0, ids)])[0]
        got = ort_default.forward([SeqChunk(slot, 0, ids)])[0]
        diff = got - want
        assert np.abs(diff).max() < MAX_ABS_INT8
        assert np.linalg.norm(diff) / np.linalg.norm(want - want.mean()) < REL_INT8
