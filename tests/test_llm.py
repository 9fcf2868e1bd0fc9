"""The in-process API (no HTTP) on the real default model, on the numpy reference backend
(the end-to-end server tests run the default backend)."""

from __future__ import annotations

import pytest

from tiny_mindie import LLM


@pytest.fixture(scope="module")
def llm(model_path):
    m = LLM(model_path, backend="numpy", max_seq_len=512, max_input_len=256, num_slots=2, log=None)
    yield m
    m.close()


def test_generate_and_stream_agree_for_a_seed(llm):
    done = llm.generate("Once upon a time", max_new_tokens=12, temperature=0.8, seed=11)
    events = list(llm.stream("Once upon a time", max_new_tokens=12, temperature=0.8, seed=11))
    assert done.seed == 11 and done.finish_reason in ("length", "eos_token")
    assert [e.token_id for e in events] == done.token_ids
    assert "".join(e.text for e in events) == done.text == events[-1].generated_text
    assert events[0].prefill_time_ms > 0 and events[1].decode_time_ms > 0
    assert all(lp <= 0 for lp in done.logprobs)


def test_greedy_is_deterministic_and_on_topic(llm):
    a = llm.generate("The capital of France is", max_new_tokens=6, do_sample=False)
    b = llm.generate("The capital of France is", max_new_tokens=6, do_sample=False)
    assert a.text == b.text and "Paris" in a.text


def test_stopping_a_stream_early_frees_the_slot(llm):
    for _ in llm.stream("Count: one, two,", max_new_tokens=50):
        break
    import time
    deadline = time.monotonic() + 5
    while llm.engine.stats()["free_slots"] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.engine.stats() == {"running": 0, "waiting": 0, "total_slots": 2, "free_slots": 2}


def test_stop_string_ends_generation(llm):
    free = llm.generate("1, 2, 3, 4, 5,", max_new_tokens=30, do_sample=False)
    assert " 7" in free.text
    cut = llm.generate("1, 2, 3, 4, 5,", max_new_tokens=30, do_sample=False, stop=[" 7"])
    assert cut.finish_reason == "stop_sequence"
    assert cut.text == free.text[:free.text.index(" 7")]
