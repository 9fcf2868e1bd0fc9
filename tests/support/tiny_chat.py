"""Tiny random-weight GGUFs that carry a real vocabulary and a real chat template (llama.cpp's
``ggml-vocab-*.gguf`` and ``models/templates/*.jinja`` from the ``llama-cpp-python`` sdist, see
tests/support/testdata.py), for the chat tests: tests/model/test_chat_families.py (each family's
template and end of turn) and tests/e2e/test_chat_tools.py (tools, tool calls, reasoning).

Stand-ins where the sdist lacks the real thing: Mistral's vocabulary is Llama 2's SentencePiece
one; SmolLM3's is Llama 3's with its two renamed reserved tokens (128011 ``<|im_start|>``,
128012 ``<|im_end|>``, the end of sequence). With ``tool_tokens``, the vocabularies get the
tool-call tokens of the real models: Qwen's the added tokens of the Qwen2.5/Qwen3 GGUFs in place
of its padding (151657 ``<tool_call>``, 151658 ``</tool_call>``, 151667 ``<think>``, 151668
``</think>``, user-defined tokens: their text reaches the output), Llama 3's 128010
``<|python_tag|>`` (control), Llama 2's SentencePiece one Mistral's control tokens
``[TOOL_CALLS]`` and ``[ARGS]`` (appended): control tokens add no text to the output.
"""

from __future__ import annotations

import os

from tiny_arch import copy_tokenizer, tokenizer_meta, write_tiny

from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED
from tiny_mindie.model.tokenizer_load import load_tokenizer

QWEN_ADDED = {151657: "<tool_call>", 151658: "</tool_call>", 151667: "<think>",
              151668: "</think>"}


def template_source(vocab_dir: str, name: str) -> str:
    """The text of ``templates/<name>.jinja``."""
    with open(os.path.join(vocab_dir, "templates", name + ".jinja"), encoding="utf-8") as fh:
        return fh.read()


def vocabulary(family: str, name: str, vocab_dir: str, gemma_path: str | None = None, *,
               tool_tokens: bool = False) -> str | dict:
    """The vocabulary for :func:`write_tiny`: a vocab file, the Gemma 3 model file
    (``name == "gemma-3-270m"``), or tokenizer metadata (SmolLM3's; Qwen's with
    ``tool_tokens``)."""
    if name == "gemma-3-270m":
        assert gemma_path is not None
        return gemma_path
    path = os.path.join(vocab_dir, name)
    if family == "smollm3":
        meta = tokenizer_meta(path)
        tokens = list(meta["tokenizer.ggml.tokens"])
        tokens[128011], tokens[128012] = "<|im_start|>", "<|im_end|>"
        return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 128012,
                "tokenizer.ggml.add_bos_token": False}
    if not tool_tokens:
        return path
    meta = tokenizer_meta(path)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if name == "ggml-vocab-qwen2.gguf":
        for i, t in QWEN_ADDED.items():
            tokens[i], types[i] = t, TOKEN_USER_DEFINED
    elif name == "ggml-vocab-llama-bpe.gguf":       # Llama 3.1's, a control token
        tokens[128010] = "<|python_tag|>"
    elif name == "ggml-vocab-llama-spm.gguf":       # Mistral's v3 control tokens, appended
        tokens += ["[TOOL_CALLS]", "[ARGS]"]
        types += [TOKEN_CONTROL, TOKEN_CONTROL]
        meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0, 0.0]
    return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


def _vocab_file(path: str, meta: dict) -> str:
    """A GGUF next to ``path`` holding only the tokenizer metadata ``meta`` (to tokenize with)."""
    import gguf

    out = path + ".vocab"
    w = gguf.GGUFWriter(out, "llama")
    copy_tokenizer(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_scripted(path: str, case, vocab: str | dict, template: str, text: str,
                   end: str) -> list[int]:
    """Write a tiny model of ``case`` whose greedy answer to any prompt is ``text`` (tokenized
    by the vocabulary, control and user-defined tokens parsed) and then the token ``end``
    (:func:`write_tiny`'s ``script``); returns the script's ids. The text's tokens must all
    differ, and none may end a prompt."""
    tok = load_tokenizer(GGUFFile(vocab if isinstance(vocab, str) else _vocab_file(path, vocab)))
    ids = tok.encode(text, add_bos=False, parse_special=True)
    # (SentencePiece starts a text after a control token with a space, as llama.cpp does)
    assert tok.decode(ids, skip_special=False).replace(" ", "") == text.replace(" ", "")
    script = (*ids, tok.token_to_id(end))
    assert len(set(script)) == len(script), [tok.token_text(i) for i in ids]
    write_tiny(path, case, vocab=vocab, template=template, script=script)
    return list(script)


def start_scripted_qwen3(vocab_dir: str, home, script: str, model: str = "tiny-qwen3"):
    """A server (numpy backend) on a tiny Qwen3 -- its vocabulary with the tool tokens, its
    real chat template, which thinks -- whose greedy answer to any prompt is ``script`` and
    then ``<|im_end|>`` (:func:`write_scripted`), served as ``model``; the caller stops it."""
    import copy
    import dataclasses

    from helpers import TEST_CONFIG, start_server
    from tiny_arch import CASES

    path = str(home / f"{model}.gguf")
    vocab = vocabulary("qwen3", "ggml-vocab-qwen2.gguf", vocab_dir, tool_tokens=True)
    write_scripted(path, dataclasses.replace(CASES["qwen3"], ctx=1024), vocab,
                   template_source(vocab_dir, "Qwen-Qwen3-0.6B"), script, "<|im_end|>")
    config = copy.deepcopy(TEST_CONFIG)
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [
        {"modelName": model, "modelWeightPath": path}]
    return start_server(str(home), config, ["--backend", "numpy"])
