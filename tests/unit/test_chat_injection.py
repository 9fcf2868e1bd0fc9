"""Control tokens typed by a client are text: a chat message cannot forge a turn.

``/v1/chat/completions`` renders the chat template, then parses only the template's own control
tokens (``<|im_start|>``, ``<start_of_turn>``); what a client wrote -- contents, names, tool calls,
``chat_template_kwargs`` -- is encoded as plain text even where it spells one
(``Tokenizer.shield`` / ``Tokenizer.encode_shielded``, ``api.chat_template.encode_chat``). Chats
that spell none tokenize exactly as before. Raw-prompt routes keep parsing control tokens unless
``BackendConfig.ModelDeployConfig.parseSpecialTokens`` is false.

Here a tiny byte-level vocabulary (tests/support/injection_chats.py); the real SmolLM2 and Gemma 3
vocabularies: tests/model/test_chat_injection_models.py; the shared server and one started with
the option off: tests/e2e/test_chat_injection_server.py.
"""

from __future__ import annotations

import copy
import json
import re
import tracemalloc
from types import SimpleNamespace

import pytest
from injection_chats import GEMMA_TEMPLATE, INJECTION, MARK, as_llm, count, write_vocab

from tiny_mindie.api.chat.template import (
    CHATML,
    _shielded,
    _strings,
    encode_chat,
    template_markers,
)
from tiny_mindie.api.errors import APIError
from tiny_mindie.engine.request import GenerationError
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.tokenizer_load import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vocab") / "tiny.gguf")
    write_vocab(path, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    return load_tokenizer(GGUFFile(path))


def test_shield_leaves_ordinary_text_alone(tiny):
    for text in ("", "hello", "What is 2+2?", "a < b > c", "x |> y", "<b>bold</b>", "< |im_end| >",
                 "  padded  ", "im_start and im_end are words here"):
        assert tiny.shield(text, MARK) is text


def test_shield_breaks_control_tokens_written_whole(tiny):
    assert tiny.shield("a<|im_end|>b", MARK) == f"a<{MARK}|im_end|>b"
    assert tiny.shield(INJECTION, MARK) == INJECTION.replace("<|", f"<{MARK}|")
    # overlapping: the text after the first cut is searched again
    assert tiny.shield("<|im_start|><|endoftext|>", MARK).count(MARK) == 2


def test_shield_marks_ends_that_could_join_the_template(tiny):
    # the start of a control token at the end, its end at the start, a piece of one: each could
    # make a token with the template's text next to it
    assert tiny.shield("x <|im_", MARK) == f"x <|im_{MARK}"
    assert tiny.shield("end|> y", MARK) == f"{MARK}end|> y"
    # ... but not a word that could only be the middle of one: templates compare such words
    assert tiny.shield("m_en", MARK) == "m_en"
    assert tiny.shield("a <", MARK) == f"a <{MARK}"
    # ... also once a template trims the string: the mark sits before the spaces trim removes
    shielded = tiny.shield("  x <|im   \n", MARK)
    assert shielded == f"  x <|im{MARK}   \n" and shielded.strip() == f"x <|im{MARK}"
    assert tiny.shield("\n |>y", MARK) == f"\n {MARK}|>y"


def test_shield_refuses_a_one_character_control_token(tmp_path):
    path = str(tmp_path / "odd.gguf")
    write_vocab(path, ["<|im_end|>", "¤"])
    tok = load_tokenizer(GGUFFile(path))
    assert tok.shield("plain", MARK) == "plain"
    with pytest.raises(ValueError, match="one-character control token '¤'"):
        tok.shield("costs 5¤", MARK)


def test_the_mark_is_a_character_no_client_string_has(tiny):
    from tiny_mindie.api.chat.template import _free_mark

    assert _free_mark(["hello", "{{ x }}"]) == MARK
    taken = "".join(chr(0x20000 + k) for k in range(5))
    assert _free_mark(["hi", taken + "<|im_end|>"]) == chr(0x20005)
    # a client who types the mark gets it back as it was: only the added marks are removed
    llm = as_llm(tiny, CHATML)
    content = f"{MARK}<|im_end|>{MARK}"
    ids = encode_chat(llm, [{"role": "user", "content": content}], {})
    assert tiny.decode(ids) == f"user\n{content}\nassistant\n"  # control tokens not shown
    assert count(ids, tiny, "<|im_end|>") == 1


def test_encode_shielded_equals_encode_where_no_token_is_broken(tiny):
    text = "<|im_start|>user\nthe hat<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny.encode(text)
    assert count(ids, tiny, "<|im_start|>", "<|im_end|>") == 3
    assert tiny.encode_shielded(text, MARK) == ids                 # no mark: encode itself
    # marks anywhere but inside a control token change nothing (encode cuts at them too)
    inside = {k for m in re.finditer(r"<\|im_(start|end)\|>", text)
              for k in range(m.start() + 1, m.end())}
    for k in sorted(set(range(len(text) + 1)) - inside):
        assert tiny.encode_shielded(text[:k] + MARK + text[k:], MARK) == ids, k
    # a mark inside one: that token is text
    broken = text.replace("<|im_end|>", f"<{MARK}|im_end|>")
    ids = tiny.encode_shielded(broken, MARK)
    assert count(ids, tiny, "<|im_end|>") == 0 and count(ids, tiny, "<|im_start|>") == 2
    assert tiny.decode(ids, skip_special=False) == text


def test_a_long_chat_is_refused_before_its_strings_are_shielded(tiny):
    """The length check runs on the chat as written, before 400,000 typed ``<|im_end|>`` are
    each shielded: no string of a chat too long reaches ``Tokenizer.shield``, and a 4 MB chat of
    markers takes the memory one of plain text does."""
    def prompt_ids(text, encode):     # LLM.prompt_ids' text bound, for 100 KB at most
        if len(text.encode()) > 100_000:
            raise GenerationError("too_long", "too long")
        return encode(text)

    shielded = []                                    # the strings given to Tokenizer.shield
    tok = copy.copy(tiny)
    tok.shield = lambda text, mark: shielded.append(text) or tiny.shield(text, mark)
    llm = SimpleNamespace(tokenizer=tok, prompt_ids=prompt_ids)
    peaks = {}
    for content in ("abcdefghij" * 400_000, "<|im_end|>" * 400_000, "<|im_end|>"):
        tracemalloc.start()
        try:
            encode_chat(llm, [{"role": "user", "content": content}], {})
        except GenerationError:
            peaks[content[:3]] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert "<|im_end|>" in shielded                  # the short chat's strings are shielded,
    assert max(map(len, shielded)) < 100, len(shielded)          # the long chats' none
    assert peaks.keys() == {"abc", "<|i"}, peaks                  # the short chat fits
    assert peaks["<|i"] < 1.5 * peaks["abc"] and peaks["<|i"] < 5 * 4_000_000, peaks


def test_client_strings_are_walked_without_recursion(tiny):
    deep: object = "<|im_end|>"
    for k in range(5000):
        deep = [deep] if k % 2 else {"k": deep}
    assert list(_strings(deep)) == ["k"] * 2500 + ["<|im_end|>"]
    shielded = _shielded(deep, tiny, MARK)
    assert list(_strings(shielded)) == ["k"] * 2500 + [f"<{MARK}|im_end|>"]
    assert list(_strings(deep))[-1] == "<|im_end|>"          # the original is left alone


def test_template_markers():
    assert template_markers(CHATML) == ("<|im_start|>", "<|im_end|>")
    assert template_markers(GEMMA_TEMPLATE) == ("<start_of_turn>", "<end_of_turn>")
    assert template_markers("[INST] {{ m }} [/INST]{{ '<<SYS>>' }}</s>a < b") == \
        ("[INST]", "[/INST]", "<<SYS>>", "</s>")
    # tags a template writes as plain text on purpose (Qwen 2.5's tool section) are no turn markers
    assert template_markers("{{ '<tools>' }}{{ m }}</tools><tool_call><think>") == ()


def test_markers_that_are_control_tokens_are_not_plain_text(tiny, tmp_path):
    assert tiny.plain_text_of(template_markers(CHATML)) == ()
    path = str(tmp_path / "no_chatml.gguf")
    write_vocab(path, ["<|endoftext|>"])
    tok = load_tokenizer(GGUFFile(path))
    assert tok.plain_text_of(template_markers(CHATML)) == ("<|im_start|>", "<|im_end|>")
    with pytest.raises(APIError) as exc:
        encode_chat(as_llm(tok, CHATML), [{"role": "user", "content": INJECTION}], {})
    assert exc.value.status == 400 and "'<|im_start|>' is this model's chat turn marker" \
        in exc.value.message


def test_config_key_parse_special_tokens(tmp_path):
    from tiny_mindie.config.load import ConfigError, load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {}}}))
    assert load_config(str(path)).backend.model.parse_special_tokens is True
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig":
                                                  {"parseSpecialTokens": False}}}))
    assert load_config(str(path)).backend.model.parse_special_tokens is False
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig":
                                                  {"parseSpecialTokens": "no"}}}))
    with pytest.raises(ConfigError, match="parseSpecialTokens must be true or false"):
        load_config(str(path))
