"""The tiny random models of tests/model/test_architectures.py, also used by the chat-template and
tool-call tests: one :class:`Case` per architecture feature, written by :func:`write_tiny` as
llama.cpp's converter would (d=64, 4 query heads and 2 KV heads of 32, MLP 128, 300 tokens, Q8_0
matrices, F32 norms)."""

from __future__ import annotations

import dataclasses
import math

import gguf as gguf_pkg
import numpy as np
from tiny_qwen2 import byte_tokens

from tiny_mindie.model.gguf import GGUFFile

D, H, KV, HD, FFN, VOCAB = 64, 4, 2, 32, 128, 300
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    """One tiny model: its architecture and the features it carries."""

    name: str
    arch: str
    layers: int = 2
    theta: float = 10000.0
    ctx: int = 128
    neox: bool = True           # HF row order, NEOX rope (no Q/K permutation in the file)
    qk_norm: bool = False
    fused: bool = False         # Phi-3's attn_qkv and [gate; up] ffn_up
    rope_dim: int = HD
    window: int = 0             # sliding window on every layer
    nope_step: int = 0          # SmolLM3: layer i without rotary when (i + 1) % step == 0
    tied: bool = False
    scaling: dict = dataclasses.field(default_factory=dict)   # HF rope_scaling
    hidden: int = D             # llama.cpp's Phi-3 wants H * HD (128) here


CASES = {c.name: c for c in [
    Case("qwen3", "qwen3", theta=1_000_000.0, qk_norm=True),
    Case("qwen3-yarn", "qwen3", theta=1_000_000.0, qk_norm=True,
         scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    Case("llama3.2", "llama", theta=500_000.0, neox=False,
         scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=16)),
    Case("llama-linear-swa", "llama", neox=False, window=8,
         scaling=dict(rope_type="linear", factor=4.0)),
    Case("phi3-longrope", "phi3", fused=True, rope_dim=16, window=8,
         scaling=dict(rope_type="longrope", original_max_position_embeddings=32)),
    Case("smollm3", "smollm3", layers=4, neox=False, nope_step=4),
]}

# HF's LongRoPE factors for the tiny phi3 (rope_dim/2 = 8 pairs)
LONG_FACTORS = [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 9.0, 16.0]
SHORT_FACTORS = [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]


def llama3_rope_freqs(case: Case) -> list[float]:
    """``rope_freqs.weight`` as llama.cpp's converter writes it (conversion/llama.py)."""
    s = case.scaling
    freqs = 1.0 / case.theta ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wl - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of HF Q/K rows (rope "normal" families)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny(path: str, case: Case, seed: int = 0, *, vocab: str | dict | None = None,
               steer: tuple[int, int] | None = None, template: str | None = None,
               f32: bool = False, script: tuple[int, ...] | None = None) -> None:
    """Write the tiny random model of ``case`` to ``path``, as llama.cpp's converter would.

    Args:
        vocab: a GGUF (``ggml-vocab-*.gguf``, a real model) whose ``tokenizer.*`` metadata the
            file gets instead of the 300-token byte vocabulary, or that metadata
            (:func:`tokenizer_meta`); the embedding and output matrices then have its rows.
        steer: ``(text_id, end_id)``: make greedy decoding answer any prompt with ``text_id``
            and then ``end_id``. Hidden dimension 0 of every token's embedding is +50, of
            ``text_id``'s -50, and dominates the residual stream; output rows ``text_id`` and
            ``end_id`` are +10 / -10 there, every other row 0.
        template: ``tokenizer.chat_template`` to write (replacing the vocabulary's).
        f32: write the matrices as F32 instead of Q8_0 (same random draws).
        script: token ids, all different, the last an end-of-generation token: make greedy
            decoding answer any prompt that does not end in one of them with exactly these
            (a bigram chain): hidden dimension 0 of every other token's embedding is +50, of
            ``script[k]``'s dimension ``k + 1`` is +50 (dimensions ``0..len(script)`` else 0),
            and output row ``script[k]`` reads +10 from dimension ``k``.
    """
    Q = gguf_pkg.GGMLQuantizationType
    d = case.hidden
    rng = np.random.default_rng(seed)
    w = gguf_pkg.GGUFWriter(path, case.arch)
    a = case.arch + "."
    w.add_context_length(case.ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(FFN)
    w.add_block_count(case.layers)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)                  # H * HD = 128 != D, as in Qwen3 (head_dim 128)
    w.add_value_length(HD)
    w.add_rope_freq_base(case.theta)
    w.add_layer_norm_rms_eps(EPS)
    if case.rope_dim != HD:
        w.add_rope_dimension_count(case.rope_dim)
    if case.window:
        w.add_sliding_window(case.window)
    s = case.scaling
    if s.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf_pkg.RopeScalingType(s["rope_type"]))
        w.add_rope_scaling_factor(s["factor"])
        if s["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
    if s.get("rope_type") == "longrope":   # conversion/phi.py
        orig = s["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_float32(a + "rope.scaling.attn_factor",
                      math.sqrt(1 + math.log(case.ctx / orig) / math.log(orig)))

    if vocab is None:
        n_vocab = VOCAB
        tokens = byte_tokens()
        merges = ["Ġ t", "h e", "Ġt he", "i n"]
        tokens += [m.replace(" ", "") for m in merges]
        while len(tokens) < VOCAB - 2:
            tokens.append(f"[PAD{len(tokens)}]")
        tokens += ["<|endoftext|>", "<|im_end|>"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (VOCAB - 2) + [3, 3])
        w.add_token_merges(merges)
        w.add_eos_token_id(VOCAB - 1)
    else:
        meta = tokenizer_meta(vocab) if isinstance(vocab, str) else vocab
        n_vocab = copy_tokenizer(w, meta, skip=() if template is None else
                                 ("tokenizer.chat_template",))
    if template is not None:
        w.add_chat_template(template)

    def mat(name: str, a: np.ndarray) -> None:
        if f32:
            w.add_tensor(name, a.astype(np.float32))
            return
        if vocab is not None and a.shape[0] == n_vocab:   # a real vocabulary's rows: F16, fast
            w.add_tensor(name, a.astype(np.float16))
            return
        w.add_tensor(name, gguf_pkg.quants.quantize(a.astype(np.float32), Q.Q8_0),
                     raw_dtype=Q.Q8_0)

    def rand(out: int, inp: int, scale: float) -> np.ndarray:
        return rng.standard_normal((out, inp)) * scale

    def vec(name: str, n: int, mean: float, scale: float) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n) * scale).astype(np.float32))

    embd = rand(n_vocab, d, 1.0)
    if steer is not None:
        embd[:, 0], embd[steer[0], 0] = 50.0, -50.0
    if script is not None:
        n = len(script)
        assert len(set(script)) == n < d, "a script needs distinct tokens, fewer than d"
        embd[:, :n + 1] = 0.0
        embd[:, 0] = 50.0
        for k, t in enumerate(script):
            embd[t, 0], embd[t, k + 1] = 0.0, 50.0
    mat("token_embd.weight", embd)
    if s.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(llama3_rope_freqs(case), np.float32))
    if s.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(LONG_FACTORS, np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(SHORT_FACTORS, np.float32))
    for i in range(case.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d, 1.0, 0.1)
        q, k, v = (rand(n * HD, d, d ** -0.5) for n in (H, KV, KV))
        if not case.neox:
            q, k = permute(q, H), permute(k, KV)
        if case.fused:
            mat(p + "attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            mat(p + "attn_q.weight", q)
            mat(p + "attn_k.weight", k)
            mat(p + "attn_v.weight", v)
        if case.qk_norm:
            vec(p + "attn_q_norm.weight", HD, 1.0, 0.3)
            vec(p + "attn_k_norm.weight", HD, 1.0, 0.3)
        mat(p + "attn_output.weight", rand(d, H * HD, (H * HD) ** -0.5))
        vec(p + "ffn_norm.weight", d, 1.0, 0.1)
        gate, up = rand(FFN, d, d ** -0.5), rand(FFN, d, d ** -0.5)
        if case.fused:
            mat(p + "ffn_up.weight", np.concatenate([gate, up]))
        else:
            mat(p + "ffn_gate.weight", gate)
            mat(p + "ffn_up.weight", up)
        mat(p + "ffn_down.weight", rand(d, FFN, FFN ** -0.5))
    vec("output_norm.weight", d, 1.0, 0.1)
    if not case.tied:
        head = rand(n_vocab, d, 0.5)
        if steer is not None:
            head[:, 0], head[steer[0], 0], head[steer[1], 0] = 0.0, 10.0, -10.0
        if script is not None:
            head[:, :len(script) + 1] = 0.0
            for k, t in enumerate(script):
                head[t, k] = 10.0
        mat("output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenizer_meta(path: str) -> dict:
    """The ``tokenizer.*`` metadata of the GGUF at ``path``."""
    f = GGUFFile(path)
    return {k: f.get(k) for k in f.keys() if k.startswith("tokenizer.")}


def copy_tokenizer(w, meta: dict, skip: tuple[str, ...] = ()) -> int:
    """Write the ``tokenizer.*`` metadata ``meta`` but ``skip`` with the writer ``w``, with the
    types llama.cpp's converter gives them; returns the vocabulary size."""
    for key, v in meta.items():
        if key in skip:
            continue
        if isinstance(v, (list, tuple, np.ndarray)):
            w.add_array(key, list(v))
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, (int, np.integer)):
            w.add_uint32(key, int(v))
        else:
            w.add_float32(key, float(v))
    return len(meta["tokenizer.ggml.tokens"])
