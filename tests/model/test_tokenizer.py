"""The tokenizer against llama.cpp's reference tokenizations and the default model's vocabulary.

Conformance vectors: llama.cpp's ``models/ggml-vocab-*.gguf`` and their ``.inp``/``.out``
reference tokenizations, taken from PyPI's ``llama-cpp-python==0.3.36`` sdist, fetched and cached
on first use by the ``vocab_dir`` fixture (tests/support/testdata.py; ``$TINY_MINDIE_TESTDATA`` may
name a local copy). Tests using them skip, with the reason, when they cannot be had. All five
vocabularies reproduce every reference tokenization: GPT-2, Qwen2 and LLaMA-3 byte-level BPE, and
the LLaMA-2 and Phi-3 SentencePiece vocabularies.
"""

from __future__ import annotations

import os
import time

import pytest

from tiny_mindie.model.gguf import GGUFFile, ModelFileError
from tiny_mindie.model.tokenizer import Tokenizer
from tiny_mindie.model.tokenizer_load import load_tokenizer

BYTE_LEVEL = ["ggml-vocab-gpt-2.gguf", "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf"]
SENTENCEPIECE = ["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"]

MIXED_TEXT = "Crème brûlée, naïve façade — 你好，世界！ 🤖🎉👍🏽 Ελληνικά Привет 12345\n\tend"


def _vectors(vocab_dir: str, name: str) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) pairs of one vocabulary, as tests/support/testdata.py describes
    them."""
    with open(os.path.join(vocab_dir, name + ".inp"), encoding="utf-8", newline="") as fh:
        texts = fh.read().split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""
    texts = texts[:-1]
    with open(os.path.join(vocab_dir, name + ".out"), encoding="utf-8", newline="") as fh:
        lines = fh.read().split("\n")
    assert len(texts) == 46 and all(not line for line in lines[46:])
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=False)]


_cache: dict[str, Tokenizer] = {}


def _vocab(vocab_dir: str, name: str) -> Tokenizer:
    """The tokenizer of one test vocabulary, loaded once per session (opening a GGUF is slow)."""
    path = os.path.join(vocab_dir, name)
    if path not in _cache:
        _cache[path] = load_tokenizer(GGUFFile(path))
    return _cache[path]


# ---- conformance ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_reference_tokenizations(name, vocab_dir):
    tok = _vocab(vocab_dir, name)
    for text, expected in _vectors(vocab_dir, name):
        assert tok.encode(text, add_bos=False, parse_special=False) == expected, repr(text)


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_round_trip(name, vocab_dir):
    tok = _vocab(vocab_dir, name)
    for text, _ in _vectors(vocab_dir, name):
        ids = tok.encode(text, add_bos=False, parse_special=False)
        assert tok.decode(ids) == text, repr(text)
    ids = tok.encode(MIXED_TEXT, add_bos=False)
    assert tok.decode(ids) == MIXED_TEXT


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_token_bytes_match_text_byte_level(name, vocab_dir):
    tok = _vocab(vocab_dir, name)
    for text, expected in _vectors(vocab_dir, name):
        assert b"".join(tok.token_bytes(i) for i in expected) == text.encode("utf-8"), repr(text)


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_token_bytes_match_text_sentencepiece(name, vocab_dir):
    # token_bytes keeps the dummy-prefix space that decode() drops
    tok = _vocab(vocab_dir, name)
    for text, expected in _vectors(vocab_dir, name):
        want = (" " + text).encode("utf-8") if text else b""
        assert b"".join(tok.token_bytes(i) for i in expected) == want, repr(text)


# ---- special tokens and settings per vocabulary --------------------------------------------------
def test_gpt2_vocab_settings(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-gpt-2.gguf")
    assert tok.vocab_size == 50257 and tok.kind == "gpt2" and tok.pre == "gpt-2"
    assert tok.bos_id == tok.eos_id == 50256 and tok.add_bos is False
    assert tok.eog_ids == frozenset({50256})
    assert tok.encode("hi<|endoftext|>") == [5303, 50256]
    assert len(tok.encode("hi<|endoftext|>", parse_special=False)) > 2
    assert tok.encode("hi", add_bos=True) == [50256, 5303]


def test_qwen2_specials(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-qwen2.gguf")
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.is_special(im_start) and tok.token_bytes(im_end) == b""
    assert {im_end, tok.token_to_id("<|endoftext|>")} <= tok.eog_ids
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert im_start not in tok.encode("<|im_start|>", parse_special=False)
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    # user-defined tokens are parsed even without parse_special, and render as their text
    pad = tok.token_to_id("[PAD151646]")
    assert tok.encode("a[PAD151646]", parse_special=False)[-1] == pad
    assert not tok.is_special(pad) and tok.token_bytes(pad) == b"[PAD151646]"


def test_llama3_defaults_to_bos(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-llama-bpe.gguf")
    assert tok.add_bos is True and tok.bos_id == 128000
    assert tok.encode("Hello")[0] == 128000 and tok.encode("Hello", add_bos=False)[0] != 128000
    assert {128001, tok.token_to_id("<|eot_id|>")} <= tok.eog_ids


def test_llama_spm_specials(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-llama-spm.gguf")
    assert tok.kind == "llama" and tok.add_bos is True
    assert (tok.bos_id, tok.eos_id) == (1, 2) and 2 in tok.eog_ids
    # the ids the MindIE seed example uses (README)
    assert tok.encode("I am a French.\n", add_bos=False)[1:] == [626, 263, 5176, 29889, 13]
    ids = tok.encode("a</s>b")                       # a space prefix again after a special
    assert ids[:3] == [1, 263, 2] and [tok.token_text(i) for i in ids[3:]] == ["\u2581b"]
    assert 2 not in tok.encode("a</s>b", parse_special=False)
    assert tok.token_bytes(13) == b"\n" and tok.token_bytes(29871) == b" "
    assert tok.token_bytes(3 + 0xE4) == b"\xe4"       # byte piece <0xE4>: one raw byte
    assert tok.encode("") == [1] and tok.encode("", add_bos=False) == []


def test_phi3_eog(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-phi-3.gguf")
    assert {32000, tok.token_to_id("<|end|>")} <= tok.eog_ids
    assert tok.is_special(tok.token_to_id("<|end|>"))
    assert tok.encode("<|user|>\nhi<|end|>", add_bos=False)[0] == tok.token_to_id("<|user|>")


@pytest.mark.parametrize("name", ["ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"])
def test_lone_surrogate_encodes_as_replacement_char(name, vocab_dir):
    tok = _vocab(vocab_dir, name)
    assert tok.encode("a\ud800b", add_bos=False) == tok.encode("a\ufffdb", add_bos=False)


def test_out_of_range_ids(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-gpt-2.gguf")
    for bad in (-1, tok.vocab_size):
        with pytest.raises(IndexError):
            tok.token_bytes(bad)
        with pytest.raises(IndexError):
            tok.token_text(bad)
        with pytest.raises(IndexError):
            tok.is_special(bad)
        with pytest.raises(IndexError):
            tok.decode([1, bad])


def test_unsupported_tokenizer_model(tmp_path):
    import gguf

    path = tmp_path / "bert-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "[UNK]", "hello"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="unsupported tokenizer model 'bert'"):
        load_tokenizer(GGUFFile(path))


# ---- the default model (SmolLM2-135M-Instruct) --------------------------------------------------
@pytest.fixture(scope="module")
def smol_file(model_path) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def smol(smol_file) -> Tokenizer:
    return load_tokenizer(smol_file)


def test_default_model_tokenizer_loads(smol_file):
    tok = load_tokenizer(smol_file)
    assert tok.vocab_size == 49152 and tok.pre == "smollm"


def test_default_model_special_tokens(smol):
    im_start = smol.token_to_id("<|im_start|>")
    assert smol.encode("<|im_start|>") == [im_start]
    plain = smol.encode("<|im_start|>", parse_special=False)
    assert len(plain) > 1 and im_start not in plain
    assert smol.decode(plain) == "<|im_start|>"
    assert {smol.token_to_id("<|im_end|>"), smol.token_to_id("<|endoftext|>")} <= smol.eog_ids
    assert smol.eos_id in smol.eog_ids and smol.add_bos is False
    assert smol.is_special(im_start) and smol.token_bytes(im_start) == b""
    assert smol.token_text(im_start) == "<|im_start|>"
    assert "<|im_start|>" in (smol.chat_template or "")


def test_default_model_bytes_of_mixed_text(smol):
    ids = smol.encode(MIXED_TEXT)
    assert b"".join(smol.token_bytes(i) for i in ids) == MIXED_TEXT.encode("utf-8")
    assert smol.decode(ids) == MIXED_TEXT
    # an emoji spans several byte-level tokens: each alone is an incomplete UTF-8 sequence
    parts = [smol.token_bytes(i) for i in smol.encode("🤖")]
    assert len(parts) > 1 and b"".join(parts) == "🤖".encode()


def test_default_model_splits_digits(smol):
    ids = smol.encode("12345")
    assert len(ids) == 5
    assert [smol.token_text(i) for i in ids] == ["1", "2", "3", "4", "5"]


def test_llama2_ids_of_the_mindie_example_decode(vocab_dir):
    tok = _vocab(vocab_dir, "ggml-vocab-llama-spm.gguf")
    ids = [626, 263, 5176, 17739, 261, 2729, 297, 3681, 29889, 13]
    assert tok.decode(ids) == "am a French photographer based in Paris.\n"


@pytest.mark.parametrize("name", ["ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"])
def test_encoding_megabytes_leaves_other_threads_running(name, vocab_dir):
    """The server tokenizes off its event loop; that only helps if the tokenizer lets go of the
    GIL. A 5 MB text: the longest time another thread waits must be a small part of the whole
    (it was all of it: ``tokenizers``' ``encode`` kept the GIL once a regex had read the text)."""
    import threading

    tok = _vocab(vocab_dir, name)
    text = "word " * 1_000_000
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    start = last = time.perf_counter()
    worker.start()
    gaps = []
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    total = time.perf_counter() - start
    assert max(gaps) < 0.4 * total, (max(gaps), total)
