"""Incremental detokenization on the default model's real byte-level BPE vocabulary."""

from __future__ import annotations

import pytest

from tiny_mindie.engine.detok import IncrementalDetokenizer

TEXTS = ["Bonjour, ça va très bien à Zürich", "我爱北京天安门。你好，世界！",
         "emoji 🤗🎉👩‍👩‍👧 end", "mixed: naïve café, 東京, and 🚀 launch"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_text_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, parse_special=False)
    d = IncrementalDetokenizer(tokenizer.token_bytes)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.finish())
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text == d.text


def test_split_character_comes_whole_with_the_completing_token(tokenizer):
    ids = tokenizer.encode("🤗", parse_special=False)
    assert len(ids) > 1, "this emoji spans several byte-level tokens"
    d = IncrementalDetokenizer(tokenizer.token_bytes)
    deltas = [d.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🤗"


def test_stop_string_split_across_tokens(tokenizer):
    text = "The answer is forty-two. Next question"
    ids = tokenizer.encode(text, parse_special=False)
    d = IncrementalDetokenizer(tokenizer.token_bytes, stop_strings=["two. Ne"])
    out = ""
    for i in ids:
        out += d.add(i)
        if d.stopped:
            break
    assert d.stopped
    assert out == d.text == "The answer is forty-"


def test_stop_string_included_when_asked(tokenizer):
    ids = tokenizer.encode("one two three four", parse_special=False)
    d = IncrementalDetokenizer(tokenizer.token_bytes, stop_strings=["three"],
                               include_stop_string=True)
    out = "".join(d.add(i) for i in ids)
    assert out == d.text == "one two three"


def test_held_back_prefix_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("hello wor", parse_special=False)
    d = IncrementalDetokenizer(tokenizer.token_bytes, stop_strings=["world"])
    out = "".join(d.add(i) for i in ids)
    assert out == "hello "           # "wor" might begin "world"
    assert out + d.finish() == "hello wor" and not d.stopped


def test_special_tokens_add_no_text(tokenizer):
    d = IncrementalDetokenizer(tokenizer.token_bytes)
    (im_end,) = tokenizer.encode("<|im_end|>", parse_special=True)
    assert d.add(im_end) == ""


def test_stop_strings_count_only_from_the_text_after_min_tokens():
    """``add(stops=False)`` (``min_tokens`` not reached): the text goes out whole, unheld, and
    a stop string that starts in it is never matched later; one that starts after is."""
    pieces = {0: b"a stop", 1: b" here", 2: b" and stop", 3: b" again"}
    d = IncrementalDetokenizer(pieces.__getitem__, stop_strings=["stop"])
    assert d.add(0, stops=False) == "a stop"          # not held back, not matched
    assert d.add(1) == " here" and not d.stopped
    assert d.add(2) == " and " and d.stopped
    assert d.text == "a stop here and "
