"""Incremental detokenization on the default model's real byte-level BPE vocabulary."""

from __future__ import annotations

import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _brute_force(pieces: list[str], stops: list[str], include: bool) -> str:
    """The text a stream of ``pieces`` leaves with ``stops``: cut at the earliest starting
    match (the first stop string given on a tie)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            at, n = min(hits, key=lambda h: h[0])
            return text[:at + (n if include else 0)]
    return text


@given(stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3),
       pieces=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=10),
       include=st.booleans())
@settings(derandomize=True, database=None, deadline=None, max_examples=400)
def test_stop_strings_match_as_a_search_of_the_whole_text_would(stops, pieces, include):
    table = {i: p.encode() for i, p in enumerate(pieces)}
    d = IncrementalDetokenizer(table.__getitem__, stops, include_stop_string=include)
    sent = ""
    for i in range(len(pieces)):
        sent += d.add(i)
        if not d.stopped:   # held back: the longest end of the text a stop string starts with
            held = max((k for s in stops for k in range(1, min(len(s), len(d.text) + 1))
                        if s.startswith(d.text[-k:])), default=0)
            assert sent == d.text[:len(d.text) - held]
    assert sent + d.finish() == d.text == _brute_force(pieces, stops, include)


def _cpu_per_token(stop_length: int, tokens: int = 400) -> float:
    """CPU seconds this thread spends per token of ``a`` runs against one long stop string that
    almost matches them (``a...ab a...a``: the worst case of a suffix-by-suffix search)."""
    stop = "a" * (stop_length // 2) + "b" + "a" * (stop_length // 2)
    d = IncrementalDetokenizer({0: b"aaaa"}.__getitem__, [stop])
    start = time.thread_time()
    for _ in range(tokens):
        d.add(0)
    return (time.thread_time() - start) / tokens


def test_a_long_stop_string_costs_no_more_per_token_than_a_short_one():
    """The work per token does not grow with the stop string's length: a suffix-by-suffix
    search would take about 256 times as long per token for a string 16 times longer."""
    short = statistics.median(_cpu_per_token(1000) for _ in range(3))
    long = statistics.median(_cpu_per_token(16000) for _ in range(3))
    assert long / max(short, 1e-6) < 8, (short, long)
