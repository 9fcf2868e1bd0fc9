"""Automatic prefix caching: which slot a request takes, how much of its prompt it reuses, and
that the answer is bit for bit the same with the cache on and off.

Unit tests drive :class:`SlotPool` and :func:`reusable_prefix`; model tests run the real
default model on the default (onnxruntime) backend in-process, with a small prefill piece
(``max_prefill_tokens=32``) so that prompts of 70-140 tokens cross several cuts.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tiny_mindie.engine.request import GenerationError
from tiny_mindie.engine.scheduler import SchedulerLimits, SlotPool, Taken, reusable_prefix

CHUNK = 32          # max_prefill_tokens of the model tests
SLOTS = 4


# ---- unit: slot choice and reusable length ---------------------------------------------------

def test_a_new_request_takes_the_slot_with_the_longest_shared_prefix():
    pool = SlotPool(3)
    slots = [pool.take().slot for _ in range(3)]
    assert slots == [0, 1, 2] and pool.take() is None
    pool.give_back(0, [1, 2, 3, 4, 5])
    pool.give_back(1, [1, 2, 9])
    pool.give_back(2, [7, 7])
    assert pool.cached_tokens(0) == 5
    every = lambda n: n                                          # noqa: E731
    assert pool.take([1, 2, 3, 4, 8, 8], every) == Taken(0, 4)        # partial hit
    assert pool.take([1, 2, 9, 9], every) == Taken(1, 3)              # whole cached prefix
    assert pool.take([5, 5], every) == Taken(2, 0)                    # miss: the only slot left
    assert pool.take([1], every) is None


def test_misses_and_ties_take_the_least_recently_used_slot_and_cache_never_blocks():
    pool = SlotPool(3)
    for _ in range(3):
        pool.take()
    for slot in (2, 0, 1):                      # given back in this order: 2 is the oldest
        pool.give_back(slot, [slot, 1, 2, 3])
    every = lambda n: n                                          # noqa: E731
    assert pool.take([9, 9], every) == Taken(2, 0)                    # miss: LRU, its cache dropped
    assert pool.cached_tokens(2) == 0
    pool.give_back(2, [0, 1, 2, 3])             # now slots 0 and 2 both hold [0, 1, 2, 3]
    assert pool.take([0, 1, 2, 3, 4], every) == Taken(0, 4)           # tie: the older of 0 and 2
    # a full pool of cached slots still admits unrelated prompts, one per slot
    assert pool.take([8], every).reused == 0 and pool.take([8], every).reused == 0
    assert pool.free == 0
    with pytest.raises(ValueError, match="freed twice"):
        pool.give_back(1, ())
        pool.give_back(1, ())


def test_a_prefix_is_copied_into_the_lru_slot_rather_than_cutting_another_cache():
    every = lambda n: n                                          # noqa: E731
    pool = SlotPool(3)
    for _ in range(3):
        pool.take()
    pool.give_back(2, [9])                      # the LRU slot
    pool.give_back(0, [1, 2, 3, 4, 5, 6])       # a conversation the user may come back to
    # reusing 3 of slot 0's 6 tokens would lose the rest: copy them into the LRU slot instead
    assert pool.take([1, 2, 3, 7], every, min_copy=1) == Taken(2, 3, copy_from=0)
    assert pool.cached_tokens(0) == 6
    # a running sequence (slot 1) holds no longer a prefix: slot 0 is taken as it is
    assert pool.take([1, 2, 3, 4, 5, 6, 7], every, running=[(1, [1, 2, 3, 4, 5, 6, 9])],
                     min_copy=1) == Taken(0, 6)
    pool.give_back(0, [1, 2])
    # ... a longer one: copied from it
    assert pool.take([1, 2, 3, 4, 5], every, running=[(1, [1, 2, 3, 4, 5, 6, 7, 8])],
                     min_copy=1) == Taken(0, 5, copy_from=1)
    pool.give_back(0, [1, 2])
    assert pool.take([1, 2, 3, 4, 5], every, running=[(1, [1, 2, 3, 4, 5])],
                     min_copy=4) == Taken(0, 2)         # 3 more tokens: not worth a copy


def test_reusable_prefix_keeps_the_prefill_pieces_a_cold_prompt_would_run():
    # any split: pieces of 4 cut at 4, 8; a prompt of 9 tokens runs [0,4) [4,8) [8,9)
    assert reusable_prefix(9, 9, 4, True) == 8       # the last token alone, as without cache
    assert reusable_prefix(8, 9, 4, True) == 8
    assert reusable_prefix(7, 9, 4, True) == 6       # [7,8) alone would use the decode kernels
    assert reusable_prefix(6, 9, 4, True) == 6
    assert reusable_prefix(20, 10, 4, True) == 8     # 10 tokens: [8,10); 9 would leave 1 token
    assert reusable_prefix(1, 10, 4, True) == 1
    assert reusable_prefix(0, 10, 4, True) == 0
    assert reusable_prefix(5, 5, 512, True) == 3     # one piece: at least two tokens prefilled
    # fixed cuts only: the prefix ends at a multiple of the piece
    assert reusable_prefix(7, 9, 4, False) == 4
    assert reusable_prefix(9, 9, 4, False) == 8
    assert reusable_prefix(3, 9, 4, False) == 0


# ---- model: the real engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(model_path):
    from tiny_mindie import LLM

    m = LLM(model_path, max_seq_len=512, max_input_len=500, num_slots=SLOTS,
            schedule=SchedulerLimits(max_batch_size=SLOTS, max_prefill_batch_size=SLOTS,
                                     max_prefill_tokens=CHUNK), log=None)
    yield m
    m.close()


SYSTEM = ("You are a careful assistant for a small bakery in the old town. You answer "
          "questions about bread, cakes, opening hours and prices in short, friendly sentences. "
          "You never invent products, and when you do not know an answer you say so and give "
          "the phone number of the shop instead. The shop opens at seven on weekdays. ")
QUESTIONS = ["What time do you open on Sunday?", "Do you sell rye bread?",
             "How much is a baguette?", "Can I order a cake for Friday?"]


def _set_cache(llm, on: bool) -> None:
    llm.engine.limits = dataclasses.replace(llm.engine.limits, prefix_cache=on)


def _run(llm, prompts: list[str], concurrent: bool, **params) -> list:
    """Completions of ``prompts``, one after the other or all at once."""
    reqs = [llm.make_request(p, max_new_tokens=12, **params) for p in prompts]
    if not concurrent:
        return [asyncio.run(llm.generate_async(r)) for r in reqs]

    async def all_at_once():
        return await asyncio.gather(*(llm.generate_async(r) for r in reqs))
    return asyncio.run(all_at_once())


def _answer(c) -> tuple:
    return c.token_ids, c.logprobs


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(temperature=0.9, seed=1234)],
                         ids=["greedy", "seeded"])
def test_the_same_answers_with_the_cache_on_and_off_at_batch_1_and_4(llm, sampling):
    """Prompts sharing a 60-token system prompt, and a second chat turn that extends the first,
    with the cache off (each prompt prefilled whole) and on (reused prefixes of every length:
    at a cut, inside a piece, a whole earlier prompt): identical tokens and logprobs."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    _set_cache(llm, False)
    try:
        llm.engine.forget_prefix_cache()
        off1 = _run(llm, prompts, False, **sampling)
        off4 = _run(llm, prompts, True, **sampling)
        turn2 = prompts[0] + llm.tokenizer.decode(off1[0].token_ids) + " And on Monday?"
        off_turn2 = _run(llm, [turn2], False, **sampling)
        assert all(c.cached_tokens == 0 for c in off1 + off4 + off_turn2)
    finally:
        _set_cache(llm, True)
    llm.engine.forget_prefix_cache()
    on1 = _run(llm, prompts, False, **sampling)    # the first misses; the rest copy its prefix
    on4 = _run(llm, prompts, True, **sampling)     # each finds its whole prompt in a slot
    on_turn2 = _run(llm, [turn2], False, **sampling)        # reuses the first prompt
    assert on1[0].cached_tokens == 0
    assert all(c.cached_tokens >= 30 for c in on1[1:])
    assert all(c.cached_tokens >= c.prompt_tokens - 2 for c in on4)
    assert on_turn2[0].cached_tokens >= on1[0].prompt_tokens - 2
    assert [_answer(c) for c in on1] == [_answer(c) for c in off1]
    assert [_answer(c) for c in on4] == [_answer(c) for c in off4]
    assert _answer(on_turn2[0]) == _answer(off_turn2[0])


def test_every_reuse_length_gives_the_cold_answer(llm):
    """One prompt after a cached one that shares its first ``k`` tokens, for ``k`` around the
    cuts (31..33, 63..65) and the end: the reused length follows :func:`reusable_prefix` and
    the greedy answer and logprobs are the cold ones."""
    ids = llm.encode(SYSTEM + QUESTIONS[2])
    n = len(ids)
    assert n > 66
    cold = llm.generate(ids, max_new_tokens=6, do_sample=False)
    for k in (31, 32, 33, 63, 64, 65, n - 2, n - 1, n):
        llm.engine.forget_prefix_cache()
        other = ids[:k] + [(t + 1) % 1000 + 10 for t in ids[k:]] if k < n else ids
        llm.generate(other, max_new_tokens=1, do_sample=False)
        hot = llm.generate(ids, max_new_tokens=6, do_sample=False)
        assert hot.cached_tokens == reusable_prefix(k, n, CHUNK, True), k
        assert _answer(hot) == _answer(cold), k


def test_least_recently_used_cache_is_evicted_first(llm):
    llm.engine.forget_prefix_cache()
    system = llm.encode(SYSTEM)
    prompts = [[100 + i] + system for i in range(SLOTS + 1)]     # nothing shared
    for p in prompts:                               # the fifth takes the first one's slot
        llm.generate(p, max_new_tokens=1, do_sample=False)
    assert llm.generate(prompts[1], max_new_tokens=1).cached_tokens > 30     # kept
    assert llm.generate(prompts[0], max_new_tokens=1).cached_tokens == 0     # evicted


def test_cancelled_and_timed_out_requests_leave_only_computed_kv(llm):
    """A stream stopped after its first token leaves its whole prompt; a request that times
    out mid-prefill leaves the pieces it finished; either way the next request with that prompt
    reuses them and gets the cold answer, and every slot is free again."""
    llm.engine.forget_prefix_cache()
    prompt = SYSTEM * 3 + QUESTIONS[3]                      # ~130 tokens: 5 pieces
    cold = llm.generate(prompt, max_new_tokens=6, do_sample=False)
    llm.engine.forget_prefix_cache()
    for _ in llm.stream(prompt, max_new_tokens=50, do_sample=False):
        break
    hot = llm.generate(prompt, max_new_tokens=6, do_sample=False)
    assert hot.cached_tokens >= cold.prompt_tokens - 2 and _answer(hot) == _answer(cold)

    llm.engine.forget_prefix_cache()
    with pytest.raises(GenerationError) as err:
        # 7 prefill pieces and 200 tokens never fit in 50 ms; the first piece always runs
        llm.generate(prompt, max_new_tokens=200, ignore_eos=True, timeout_s=0.05)
    assert err.value.kind == "timeout"
    hot = llm.generate(prompt, max_new_tokens=6, do_sample=False)
    # whole pieces (a cut is also where a prefix may end on any backend)
    assert hot.cached_tokens % CHUNK == 0 and hot.cached_tokens < cold.prompt_tokens
    assert _answer(hot) == _answer(cold)
    stats = llm.engine.stats()
    assert stats["running"] == 0 and stats["free_slots"] == SLOTS


def test_hit_and_miss_tokens_are_counted_and_exposed(llm):
    from tiny_mindie.api.metrics import render

    llm.engine.forget_prefix_cache()
    before = llm.engine.counters.snapshot()
    a = llm.generate(SYSTEM + QUESTIONS[0], max_new_tokens=1)
    b = llm.generate(SYSTEM + QUESTIONS[1], max_new_tokens=1)
    after = llm.engine.counters.snapshot()
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    misses = after["prefix_miss_tokens"] - before["prefix_miss_tokens"]
    assert a.cached_tokens == 0 and b.cached_tokens > 30
    assert hits == b.cached_tokens and misses == a.prompt_tokens + b.prompt_tokens - hits
    text = render(llm.engine.counters, llm.engine.stats(), "m")
    rate = after["prefix_hit_tokens"] / (after["prefix_hit_tokens"]
                                         + after["prefix_miss_tokens"])
    assert f'tiny_mindie_npu_prefix_cache_hit_rate{{model_name="m"}} {rate!r}' in text
    assert (f'tiny_mindie_prefix_cache_hit_tokens_total{{model_name="m"}} '
            f'{after["prefix_hit_tokens"]}') in text


def test_the_cache_off_reuses_nothing(llm):
    llm.engine.forget_prefix_cache()
    _set_cache(llm, False)
    try:
        llm.generate(SYSTEM + QUESTIONS[0], max_new_tokens=1)
        assert llm.generate(SYSTEM + QUESTIONS[0], max_new_tokens=1).cached_tokens == 0
        assert all(llm.engine._slots.cached_tokens(s) == 0 for s in range(SLOTS))
    finally:
        _set_cache(llm, True)


# ---- e2e: the real server --------------------------------------------------------------------

def test_cached_tokens_in_usage_metrics_and_access_log_over_the_server(server):
    """The same completion prompt twice: the second reports its reused tokens in
    ``usage.prompt_tokens_details.cached_tokens``, ``/metrics`` counts them, and its access
    log line shows ``cached_tokens=N``."""
    import json
    import time

    from helpers import request
    from prometheus_client.parser import text_string_to_metric_families

    def hit_tokens() -> float:
        _, _, body = request(server, "GET", "/metrics")
        return next(s.value for f in text_string_to_metric_families(body.decode())
                    for s in f.samples if s.name == "tiny_mindie_prefix_cache_hit_tokens_total")

    body = {"model": "smollm2-135m-instruct", "prompt": "A recipe for rye bread: " + SYSTEM,
            "max_tokens": 4, "temperature": 0}
    before = hit_tokens()
    answers = []
    for _ in range(2):
        status, _, raw = request(server, "POST", "/v1/completions", body)
        assert status == 200, raw
        answers.append(json.loads(raw))
    usage = [a["usage"] for a in answers]
    n = usage[0]["prompt_tokens"]
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage[1]["prompt_tokens_details"] == {"cached_tokens": n - 2}
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert hit_tokens() - before == n - 2
    deadline = time.monotonic() + 30
    while not any(f" cached_tokens={n - 2} " in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log[-10:])
        time.sleep(0.1)
    line = next(line for line in server.log if f" cached_tokens={n - 2} " in line)
    assert '"POST /v1/completions" 200' in line


def test_a_prefix_is_copied_from_a_running_request_and_gives_the_cold_answer(llm):
    """While one request with the system prompt still decodes, a second one sharing it copies
    the prefix from the running slot (no free slot holds it) and answers as without cache."""
    ids = llm.encode(SYSTEM + QUESTIONS[1])
    cold = llm.generate(ids, max_new_tokens=6, do_sample=False)

    async def run():
        llm.engine.forget_prefix_cache()
        first = llm.stream_async(llm.make_request(SYSTEM + QUESTIONS[0], max_new_tokens=200,
                                                  ignore_eos=True, do_sample=False))
        await first.__anext__()                 # its prompt is in its slot; it keeps decoding
        try:
            return await llm.generate_async(llm.make_request(ids, max_new_tokens=6,
                                                             do_sample=False))
        finally:
            await first.aclose()
    hot = asyncio.run(run())
    shared = len(llm.encode(SYSTEM))
    assert shared - 2 <= hot.cached_tokens < len(ids)
    assert _answer(hot) == _answer(cold)


@pytest.fixture(scope="module")
def numpy_llm(model_path):
    from tiny_mindie import LLM

    m = LLM(model_path, backend="numpy", max_seq_len=256, max_input_len=200, num_slots=2,
            schedule=SchedulerLimits(max_batch_size=2, max_prefill_batch_size=2,
                                     max_prefill_tokens=16), log=None)
    yield m
    m.close()


def test_without_split_invariance_only_prefixes_ending_at_a_cut_are_reused(numpy_llm):
    """The numpy backend rounds a position otherwise in chunks of other sizes: it reuses whole
    prefill pieces only (multiples of 16 here), and answers as without cache."""
    llm = numpy_llm
    assert not llm.backend.prefix_split_invariant
    a, b = (llm.encode(SYSTEM + q) for q in QUESTIONS[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    cold = llm.generate(b, max_new_tokens=4, do_sample=False)
    llm.engine.forget_prefix_cache()
    llm.generate(a, max_new_tokens=1, do_sample=False)
    hot = llm.generate(b, max_new_tokens=4, do_sample=False)
    assert hot.cached_tokens == shared - shared % 16 > 0
    assert _answer(hot) == _answer(cold)
