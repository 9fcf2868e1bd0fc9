"""Each family's real chat template renders a 2-turn chat with a system message as the template
means it, and generation stops at the family's end-of-turn token without writing it as text.

Templates and vocabularies are llama.cpp's (``models/templates/*.jinja``, ``ggml-vocab-*.gguf``,
from the ``llama-cpp-python`` sdist, see tests/support/testdata.py); Gemma 3's vocabulary is the
cached gemma-3-270m GGUF's. Each family gets a tiny random model (:func:`write_tiny`) carrying
its real vocabulary and template, steered so that greedy decoding answers any prompt with one text
token and then the end-of-turn token: the stop comes from the tokenizer's end-of-generation set, the
one the engine uses, not from a stop string or a length limit.

Stand-ins, because the sdist lacks the real thing: Mistral's vocabulary is Llama 2's
SentencePiece one (same 32000 pieces frame, ``</s>`` = 2), with the Mistral-Nemo template;
SmolLM3's is Llama 3's with its two renamed reserved tokens (128011 ``<|im_start|>``, 128012
``<|im_end|>``, the end of sequence); Gemma 3 uses Gemma 2's template (same turn markers; it
refuses a system message, which Gemma 3's folds into the first user turn). Phi-4-mini (o200k
vocabulary) has neither template nor vocabulary there.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

pytestmark = pytest.mark.model

from tiny_arch import CASES, write_tiny  # noqa: E402
from tiny_chat import template_source, vocabulary  # noqa: E402

from tiny_mindie.api.chat.template import chatml_stops, encode_chat, render_chat  # noqa: E402
from tiny_mindie.api.errors import APIError  # noqa: E402
from tiny_mindie.llm import LLM  # noqa: E402
from tiny_mindie.model.gguf import GGUFFile  # noqa: E402

SYSTEM, U1, A1, U2 = "You are terse.", "Hi!", "Hello.", "Name a colour."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1},
        {"role": "assistant", "content": A1}, {"role": "user", "content": U2}]

_CHATML = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
           "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
           "<|im_start|>assistant\n")
_LLAMA3 = ("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
           "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
           "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
           "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
           "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
           "<|start_header_id|>assistant<|end_header_id|>\n\n")

# family: (tiny case, vocabulary, template, end-of-turn, expected render (BOS dropped: the
# tokenizer adds it), times the end-of-turn token is in the prompt, template kwargs)
FAMILIES = {
    "qwen2.5": ("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct", "<|im_end|>",
                _CHATML, 4, {}),
    "qwen3": ("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B", "<|im_end|>", _CHATML, 4, {}),
    # the 3.2 template reads today's date unless given date_string
    "llama3.1": ("llama3.2", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct",
                 "<|eot_id|>", _LLAMA3, 4, {"date_string": "26 Jul 2024"}),
    "llama3.2": ("llama3.2", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.2-3B-Instruct",
                 "<|eot_id|>", _LLAMA3, 4, {"date_string": "26 Jul 2024"}),
    "phi3.5": ("phi3-longrope", "ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct",
               "<|end|>", "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi!<|end|>\n"
               "<|assistant|>\nHello.<|end|>\n<|user|>\nName a colour.<|end|>\n<|assistant|>\n",
               4, {}),
    # the system message joins the last user turn; only assistant turns end with </s>
    "mistral": ("llama-linear-swa", "ggml-vocab-llama-spm.gguf",
                "mistralai-Mistral-Nemo-Instruct-2407", "</s>",
                "[INST]Hi![/INST]Hello.</s>[INST]You are terse.\n\nName a colour.[/INST]", 1, {}),
    "smollm3": ("smollm3", "ggml-vocab-llama-bpe.gguf", "HuggingFaceTB-SmolLM3-3B", "<|im_end|>",
                "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
                "Reasoning Mode: /think\n\n## Custom Instructions\n\nYou are terse.\n\n"
                "<|im_end|>\n" + _CHATML.split("<|im_end|>\n", 1)[1], 4, {}),
    # Gemma 2's template: no system turn (asserted below); the chat without it
    "gemma3": ("llama3.2", "gemma-3-270m", "google-gemma-2-2b-it", "<end_of_turn>",
               "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
               "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n", 3, {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, vocab_dir, tmp_path_factory):
    """(name, LLM on the family's tiny steered model, its text token, its end-of-turn id)."""
    name = request.param
    case, vocab, template, end, *_ = FAMILIES[name]
    vocab = vocabulary(name, vocab, vocab_dir, request.getfixturevalue("gemma_path")
                       if vocab == "gemma-3-270m" else None)
    source = template_source(vocab_dir, template)
    path = str(tmp_path_factory.mktemp(name) / f"{name}.gguf")
    tokens = (vocab["tokenizer.ggml.tokens"] if isinstance(vocab, dict)
              else GGUFFile(vocab).get("tokenizer.ggml.tokens"))
    end_id = tokens.index(end)
    text_id = next(i for i, t in enumerate(tokens) if t.lstrip("Ġ▁") == "Blue")
    write_tiny(path, CASES[case], vocab=vocab, steer=(text_id, end_id), template=source)
    llm = LLM(path, backend="numpy", max_seq_len=256, max_input_len=192, num_slots=1, log=None)
    yield name, llm, text_id, end_id
    llm.close()


def test_template_renders_the_chat(family):
    name, llm, _, end_id = family
    _, _, _, end, want, n_end, extra = FAMILIES[name]
    tok = llm.tokenizer
    chat = CHAT[1:] if name == "gemma3" else CHAT
    assert render_chat(llm, chat, dict(extra)) == want
    ids = encode_chat(llm, chat, dict(extra))
    # the markers are single control tokens, BOS comes once (from the tokenizer), and the ids
    # spell the expected text (SentencePiece with a space prefix starts each text after a
    # control token with one, as llama.cpp's tokenizer does: Phi-3, Mistral)
    assert ids.count(end_id) == n_end and tok.is_special(end_id)
    bos = [tok.bos_id] if tok.add_bos else []
    assert ids[:len(bos)] == bos and tok.bos_id not in ids[len(bos):]
    text = tok.decode(ids[len(bos):], skip_special=False)
    assert text == want if tok.kind == "gpt2" else \
        text.replace("> ", ">").replace("] ", "]") == want.replace("> ", ">")
    if name == "gemma3":
        with pytest.raises(APIError, match="System role not supported"):
            render_chat(llm, CHAT, {})


def test_generation_stops_at_end_of_turn(family):
    name, llm, text_id, end_id = family
    _, _, _, end, _, _, extra = FAMILIES[name]
    tok = llm.tokenizer
    assert end_id in tok.eog_ids
    assert chatml_stops(tok) == () or end != "<|im_end|>"
    chat = CHAT[1:] if name == "gemma3" else CHAT
    out = llm.generate(encode_chat(llm, chat, dict(extra)), max_new_tokens=8)
    assert out.token_ids == [text_id, end_id]
    assert out.finish_reason == "eos_token"
    assert out.text.strip() == "Blue" and end not in out.text
    # the same model run past its end-of-turn (ignore_eos) goes on: the stop above was the
    # end-of-turn token's doing
    more = llm.generate(encode_chat(llm, chat, dict(extra)), max_new_tokens=4, ignore_eos=True)
    assert more.token_ids[:2] == [text_id, end_id] and more.finish_reason == "length"
