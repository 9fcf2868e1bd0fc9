"""Qwen3, Llama 3.x rope scaling (llama3 ``rope_freqs``, linear, Mistral's sliding window), YaRN,
Phi-3 (fused tensors, LongRoPE, partial rotary, sliding window) and SmolLM3 (NoPE layers) on tiny
random GGUFs written with ``gguf``'s writer.

Each case writes one file (d=64, 4 query heads and 2 KV heads of 32, MLP 128, 300 tokens, Q8_0
matrices so both backends pack them exactly, F32 norms), then checks:

- the numpy reference against an independent float64 recomputation in Hugging Face's layout
  (:func:`hf_logits`: heads one by one, ``rotate_half``, Q/K rows un-permuted for the rope
  "normal" families, the rotary frequencies computed from the HF ``rope_scaling`` formulas --
  ``_compute_llama3_parameters``, ``_compute_yarn_parameters``, ``_compute_longrope_parameters``
  -- not from the GGUF's factor tensors);
- that the feature under test matters: the reference with it switched off misses the float64
  logits by far more than the tolerance;
- the ONNX Runtime graph (float compute) against the reference, logits and 16 greedy tokens at
  batch 1 and 3; the default int8-activation graph within test_ort_backend's bounds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

gguf_pkg = pytest.importorskip("gguf")

pytestmark = pytest.mark.model

from hf_math import attention, rms_norm, weight64  # noqa: E402
from tiny_arch import (  # noqa: E402
    CASES,
    EPS,
    HD,
    KV,
    LONG_FACTORS,
    SHORT_FACTORS,
    Case,
    H,
    write_tiny,
)
from tiny_qwen2 import greedy  # noqa: E402

from tiny_mindie.model.arch import ModelConfig  # noqa: E402
from tiny_mindie.model.backend import SeqChunk  # noqa: E402
from tiny_mindie.model.gguf import GGUFFile  # noqa: E402
from tiny_mindie.model.onnx.graph_options import GraphOptions  # noqa: E402
from tiny_mindie.model.reference import decoder as ref  # noqa: E402
from tiny_mindie.model.reference.decoder import NumpyBackend  # noqa: E402

MAX_SEQ_LEN, GREEDY_STEPS = 64, 16

# float32 reference vs float64 recomputation: only rounding differs (measured 3.5e-6 to 7.3e-6
# over the cases; logits span about -15..+11). A feature switched off moves them > 100x this.
ATOL_VS_FLOAT64 = 1e-4
# float-compute graph vs reference: exact packing, summation order only (measured ~3e-6).
ATOL_FLOAT = 1e-3
# default int8-activation graph vs reference (test_ort_backend's bounds).
MAX_ABS_INT8, REL_INT8 = 1.5, 0.25

PROMPTS = [np.array([5, 77, 263, 100, 42, 9, 256, 31, 200, 150, 3], dtype=np.int64),
           np.array([296, 12, 88, 260], dtype=np.int64),
           np.array([7, 8, 9, 10, 11, 12, 13], dtype=np.int64)]


# ---- the independent float64 recomputation (Hugging Face's layout and rope formulas) --------

def hf_inv_freq(case: Case, n_ctx: int) -> tuple[np.ndarray, float]:
    """HF ``ROPE_INIT_FUNCTIONS[rope_type](config)``: inverse frequencies ``[rope_dim/2]`` and the
    attention factor, written from transformers' modeling_rope_utils. LongRoPE picks its long
    factors for sequences of ``n_ctx`` > original positions (as llama.cpp does by context size)."""
    d, base, s = case.rope_dim, case.theta, case.scaling
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    kind = s.get("rope_type")
    if kind == "linear":
        return inv / s["factor"], 1.0
    if kind == "llama3":        # _compute_llama3_parameters
        old, lo_f, hi_f, f = (s["original_max_position_embeddings"], s["low_freq_factor"],
                              s["high_freq_factor"], s["factor"])
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo_f, inv / f, inv)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = (wavelen >= old / hi_f) & (wavelen <= old / lo_f)
        return np.where(medium, smoothed, out), 1.0
    if kind == "yarn":          # _compute_yarn_parameters (beta_fast 32, beta_slow 1, truncate)
        f, orig = s["factor"], s["original_max_position_embeddings"]

        def corr(rot):
            return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))
        low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
        ramp = np.clip((np.arange(d // 2) - low) / max(high - low, 0.001), 0, 1)
        extrapolation = 1 - ramp
        return (inv / f) * (1 - extrapolation) + inv * extrapolation, 0.1 * math.log(f) + 1.0
    if kind == "longrope":      # _compute_longrope_parameters
        orig = s["original_max_position_embeddings"]
        ext = np.array(LONG_FACTORS if n_ctx > orig else SHORT_FACTORS)
        factor = case.ctx / orig
        return inv / ext, math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv, 1.0


def hf_logits(f: GGUFFile, case: Case, ids: np.ndarray, n_ctx: int = MAX_SEQ_LEN) -> np.ndarray:
    """Logits float64 ``[n, vocab]`` of every position of ``ids``, the way HF computes."""
    def W(name):
        return weight64(f, name)

    def unpermute(w, n_head):
        return w.reshape(n_head, HD // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    n = len(ids)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = (j <= i) & ((i - j < case.window) if case.window else True)
    mask = np.where(allowed, 0.0, -np.inf)
    inv, factor = hf_inv_freq(case, n_ctx)
    emb = np.concatenate([np.outer(np.arange(n), inv)] * 2, axis=-1)  # [n, rope_dim]
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    embedding = W("token_embd.weight")
    x = embedding[ids]
    for layer in range(case.layers):
        p = f"blk.{layer}."
        h = rms_norm(x, W(p + "attn_norm.weight"), EPS)
        if case.fused:
            q, k, v = np.split(h @ W(p + "attn_qkv.weight").T, [H * HD, (H + KV) * HD], axis=-1)
        else:
            wq, wk = W(p + "attn_q.weight"), W(p + "attn_k.weight")
            if not case.neox:
                wq, wk = unpermute(wq, H), unpermute(wk, KV)
            q, k, v = h @ wq.T, h @ wk.T, h @ W(p + "attn_v.weight").T
        norms = {}
        if case.qk_norm:
            qn, kn = W(p + "attn_q_norm.weight"), W(p + "attn_k_norm.weight")
            norms = dict(q_norm=lambda t, w=qn: rms_norm(t, w, EPS),
                         k_norm=lambda t, w=kn: rms_norm(t, w, EPS))
        rotary = not case.nope_step or (layer + 1) % case.nope_step != 0
        a = attention(q, k, v, H, KV, cos if rotary else None, sin, mask, HD ** -0.5, **norms)
        x = x + a @ W(p + "attn_output.weight").T
        h = rms_norm(x, W(p + "ffn_norm.weight"), EPS)
        if case.fused:
            g, u = np.split(h @ W(p + "ffn_up.weight").T, 2, axis=-1)
        else:
            g, u = h @ W(p + "ffn_gate.weight").T, h @ W(p + "ffn_up.weight").T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
    head = embedding if case.tied else W("output.weight")
    return rms_norm(x, W("output_norm.weight"), EPS) @ head.T


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model(case, tmp_path_factory) -> GGUFFile:
    path = str(tmp_path_factory.mktemp(case.name) / f"tiny-{case.name}.gguf")
    write_tiny(path, case)
    return GGUFFile(path)


@pytest.fixture(scope="module")
def reference(model) -> NumpyBackend:
    return NumpyBackend(model, ModelConfig.from_gguf(model), num_slots=4, max_seq_len=MAX_SEQ_LEN)


def _ort(model, tmp_path_factory, **graph):
    pytest.importorskip("onnxruntime")
    from tiny_mindie.model.options import BackendOptions
    from tiny_mindie.model.ort.ort_backend import OrtBackend

    return OrtBackend(model, ModelConfig.from_gguf(model),
                      BackendOptions(threads=1, batch_invariant=False), num_slots=4,
                      max_seq_len=MAX_SEQ_LEN, cache_dir=str(tmp_path_factory.mktemp("onnx-cache")),
                      graph_options=GraphOptions(**graph))


@pytest.fixture(scope="module")
def ort_float(model, tmp_path_factory):
    be = _ort(model, tmp_path_factory, accuracy_level=0, lm_head_accuracy_level=0)
    yield be
    be.close()


# ---- tests ------------------------------------------------------------------------------------

def test_config_reads_the_features(case, model):
    c = ModelConfig.from_gguf(model)
    assert (c.architecture, c.num_layers, c.rope_dim, c.rope_neox) == (
        case.arch, case.layers, case.rope_dim, case.neox)
    assert c.qk_norm == case.qk_norm and c.sliding_window == case.window
    assert c.tied_embeddings == case.tied and not c.qkv_bias
    assert [c.uses_rope(i) for i in range(c.num_layers)] == [
        not case.nope_step or (i + 1) % case.nope_step != 0 for i in range(case.layers)]
    kind = case.scaling.get("rope_type")
    assert bool(c.rope_freq_factors) == (kind == "llama3")
    assert bool(c.rope_factors_long) == (kind == "longrope")
    assert c.rope_scaling == (kind if kind in ("linear", "yarn") else "none")


def test_reference_matches_float64(case, model, reference):
    ids = PROMPTS[0]
    want = hf_logits(model, case, ids)
    got = reference.forward([SeqChunk(0, 0, ids)])[0]
    assert np.abs(got - want[-1]).max() < ATOL_VS_FLOAT64
    reference.forward([SeqChunk(1, 0, ids[:3])])                  # then token by token
    for p in range(3, len(ids)):
        got = reference.forward([SeqChunk(1, p, ids[p:p + 1])])[0]
        assert np.abs(got - want[p]).max() < ATOL_VS_FLOAT64, p
    assert np.abs(want[-1]).max() > 1.0


def _without(cfg: ModelConfig, case: Case) -> list[ModelConfig]:
    """The configuration with the case's feature(s) switched off, one by one."""
    off = []
    if case.qk_norm:
        off.append(dataclasses.replace(cfg, qk_norm=False))
    if case.scaling:
        off.append(dataclasses.replace(cfg, rope_scaling="none", rope_freq_factors=(),
                                       rope_factors_long=(), rope_factors_short=(),
                                       rope_attn_factor=1.0))
    if case.window:
        off.append(dataclasses.replace(cfg, sliding_window=0))
    if case.nope_step:
        off.append(dataclasses.replace(cfg, no_rope_step=0))
    if case.scaling.get("rope_type") == "longrope":      # the other factor set
        off.append(dataclasses.replace(cfg, rope_factors_long=cfg.rope_factors_short))
    return off


def test_each_feature_matters(case, model, reference):
    """Ignoring what the case tests (rope_freqs, q/k norm, NoPE, the window, ...) misses the
    float64 logits: the check above would catch a backend that skipped it."""
    ids = np.concatenate([PROMPTS[0], PROMPTS[1], PROMPTS[2]])      # 22 > the window of 8
    want = hf_logits(model, case, ids)[-1]
    w = reference.weights
    assert np.abs(ref.prefill(w, ref.KVCache(w.cfg, 1, MAX_SEQ_LEN), 0, 0, ids) - want).max() \
        < ATOL_VS_FLOAT64
    offs = _without(w.cfg, case)
    assert offs
    for cfg in offs:
        if not cfg.qk_norm and w.cfg.qk_norm:
            saved = [(lw.q_norm, lw.k_norm) for lw in w.layers]
            for lw in w.layers:
                lw.q_norm = lw.k_norm = None
            try:
                got = ref.prefill(w, ref.KVCache(cfg, 1, MAX_SEQ_LEN), 0, 0, ids)
            finally:
                for lw, (qn, kn) in zip(w.layers, saved, strict=True):
                    lw.q_norm, lw.k_norm = qn, kn
        else:
            got = NumpyBackend(model, cfg, num_slots=1, max_seq_len=MAX_SEQ_LEN).forward(
                [SeqChunk(0, 0, ids)])[0]
        assert np.abs(got - want).max() > 100 * ATOL_VS_FLOAT64, cfg


@pytest.mark.parametrize("batch", [1, 3])
def test_ort_float_matches_reference(reference, ort_float, batch):
    prompts, slots = PROMPTS[:batch], list(range(batch))
    want_tok, want_logits = greedy(reference, prompts, slots, GREEDY_STEPS)
    got_tok, got_logits = greedy(ort_float, prompts, slots, GREEDY_STEPS)
    for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert np.abs(a - b).max() < ATOL_FLOAT, step
    assert got_tok == want_tok
    assert len(set(want_tok[0])) > 1


def test_ort_default_close_to_reference(model, reference, tmp_path_factory):
    be = _ort(model, tmp_path_factory)
    try:
        for slot, ids in enumerate(PROMPTS):
            want = reference.forward([SeqChunk(slot, 0, ids)])[0]
            diff = be.forward([SeqChunk(slot, 0, ids)])[0] - want
            assert np.abs(diff).max() < MAX_ABS_INT8
            assert np.linalg.norm(diff) / np.linalg.norm(want - want.mean()) < REL_INT8
    finally:
        be.close()
