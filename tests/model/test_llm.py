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
    assert llm.engine.stats() == {"running": 0, "waiting": 0, "total_slots": 2, "free_slots": 2,
                                  "draft_seconds": 0.0}


def test_stop_string_ends_generation(llm):
    free = llm.generate("1, 2, 3, 4, 5,", max_new_tokens=30, do_sample=False)
    assert " 7" in free.text
    cut = llm.generate("1, 2, 3, 4, 5,", max_new_tokens=30, do_sample=False, stop=[" 7"])
    assert cut.finish_reason == "stop_sequence"
    assert cut.text == free.text[:free.text.index(" 7")]


def test_priority_one_overtakes_thirty_waiting_priority_five(llm):
    """Two slots busy, thirty priority-5 requests waiting, then one priority-1 request: the
    priority-1 request is admitted as soon as a slot frees, before every waiting one."""
    import asyncio

    async def run():
        order = []
        running = asyncio.Event()

        async def one(tag, priority, max_new_tokens=2):
            req = llm.make_request("Hello", max_new_tokens=max_new_tokens, do_sample=False,
                                   priority=priority, ignore_eos=True)
            async for ev in llm.stream_async(req):
                if ev.index == 0:
                    order.append(tag)
                    if tag.startswith("busy"):
                        running.set()

        blockers = [asyncio.ensure_future(one(f"busy{i}", 5, 12)) for i in range(2)]
        await running.wait()                 # both slots are taken now
        waiting = [asyncio.ensure_future(one(f"p5-{i}", 5)) for i in range(30)]
        await asyncio.sleep(0.05)
        urgent = asyncio.ensure_future(one("p1", 1))
        await asyncio.gather(*blockers, *waiting, urgent)
        return order

    order = asyncio.run(run())
    assert len(order) == 33
    later = order[order.index("p1") + 1:]
    assert len(later) == 30 and all(t.startswith("p5-") for t in later)   # p1 before every p5
    assert later == [f"p5-{i}" for i in range(30)]                       # FIFO within a priority


def test_a_client_that_stops_reading_is_cut_off(llm):
    """Events are buffered up to a bound; past it the request is cancelled, never the batch
    slowed."""
    import asyncio
    import time
    from dataclasses import replace

    from tiny_mindie.engine.engine import Engine
    from tiny_mindie.engine.request import GenerationError

    engine = Engine(llm.backend, llm.tokenizer, replace(llm.engine.limits, max_buffered_events=4))

    async def run():
        req = llm.make_request("1, 2, 3, 4, 5,", max_new_tokens=40, do_sample=False)
        agen = engine.generate(req)
        first = await agen.__anext__()
        # a slow reader: the engine keeps generating until the request leaves the batch (cut
        # off past 4 unread events, or -- wrongly -- done with all 40 tokens); however slow the
        # machine is, wait for that rather than for a fixed time
        deadline = time.monotonic() + 60
        while engine.stats()["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        got = [first]
        with pytest.raises(GenerationError) as err:
            async for ev in agen:
                got.append(ev)
        return got, err.value

    try:
        got, err = asyncio.run(run())
        assert err.kind == "cancelled" and "too slow" in err.message
        assert len(got) <= 1 + 4
        assert engine.stats()["free_slots"] == engine.stats()["total_slots"]
    finally:
        engine.stop()


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(llm):
    """Chunked prefill: a 200-token prompt arriving while a stream runs is split into chunks of
    the prefill budget, and every step still decodes the running stream."""
    import asyncio
    from dataclasses import replace

    from tiny_mindie.engine.engine import Engine
    from tiny_mindie.engine.scheduler import SchedulerLimits
    from tiny_mindie.model.backend import Backend

    class Recording(Backend):
        """The real backend, with each forward call's row lengths written down."""
        def __init__(self, inner):
            self.inner, self.calls = inner, []
            self.name, self.device, self.config = inner.name, inner.device, inner.config
            self.num_slots, self.max_seq_len = inner.num_slots, inner.max_seq_len

        def forward(self, chunks):
            self.calls.append([len(c.token_ids) for c in chunks])
            return self.inner.forward(chunks)

    rec = Recording(llm.backend)
    limits = replace(llm.engine.limits, schedule=SchedulerLimits(max_batch_size=2,
                                                                 max_prefill_batch_size=2,
                                                                 max_prefill_tokens=32))
    engine = Engine(rec, llm.tokenizer, limits)

    async def run():
        running = llm.make_request("1, 2, 3,", max_new_tokens=40, do_sample=False, ignore_eos=True)
        long = llm.make_request(list(range(1000, 1200)), max_new_tokens=2, do_sample=False)
        first = asyncio.Event()

        async def consume(req, signal=None):
            out = []
            async for ev in engine.generate(req):
                out.append(ev)
                if signal is not None:
                    signal.set()
            return out

        a = asyncio.ensure_future(consume(running, first))
        await first.wait()
        b = asyncio.ensure_future(consume(long))
        return await asyncio.gather(a, b)

    try:
        stream, other = asyncio.run(run())
    finally:
        engine.stop()
    assert len(stream) == 40 and len(other) == 2
    prefill_steps = [c for c in rec.calls if any(n > 1 for n in c) and 1 in c]
    assert all(sum(n for n in c if n > 1) <= 32 for c in rec.calls)
    assert len(prefill_steps) >= 200 // 32       # the long prompt went in chunks ...
    assert all(1 in c for c in prefill_steps)    # ... each beside a decode row of the stream


def test_prompt_of_the_wrong_type_is_a_clear_type_error(llm):
    with pytest.raises(TypeError, match="prompt must be a str or a sequence of token ids"):
        llm.make_request(5)


def test_encode_tail_is_the_end_of_the_whole_encoding_without_tokenizing_it_all(llm):
    """TGI's ``truncate`` keeps a prompt's last tokens: exactly those of the whole text's
    encoding up to 250,000 characters (runs of one character included); past it only the end
    is tokenized, and for ordinary text the ids are still the whole encoding's."""
    words = " ".join(f"word{i % 97}, x{i}y." for i in range(6000))      # ~80 KB, ~50k tokens
    whole = llm.encode(words)
    for n in (1, 3, 100, 1000):
        assert llm.encode_tail(words, n) == whole[-n:]
    for run in ("-" * 100_003, "a" * 100_003, "." * 100_001, "\n" * 100_002, " " * 99_999,
                "ab" * 50_001, "=" * 100_003, "x " + "-" * 100_000,      # unbroken runs
                words + " " + "-" * 50_000 + " the end"):                 # one across the cuts
        whole = llm.encode(run)
        for n in (1, 5, 100):
            assert llm.encode_tail(run, n) == whole[-n:], (run[:3], len(run), n)
    big = " ".join(f"w{i % 1013} and {i}," for i in range(90_000))     # over TAIL_LIMIT: cut
    assert len(big) > 1_000_000 and llm.encode_tail(big, 50) == llm.encode(big)[-50:]
    run = "-" * 300_000                             # past the limit, no word to cut before:
    assert len(llm.encode_tail(run, 7)) == 7        # a valid tokenization of the end (not checked)
    short = "one two three"
    assert llm.encode_tail(short, 2) == llm.encode(short)[-2:]
    assert llm.encode_tail(short, 50) == llm.encode(short)             # BOS kept when all fits


def test_a_text_longer_than_any_prompt_is_refused_before_tokenizing(llm, monkeypatch):
    from tiny_mindie.engine.request import GenerationError

    def never(*a, **k):
        raise AssertionError("tokenized")
    monkeypatch.setattr(llm.tokenizer, "encode", never)
    with pytest.raises(GenerationError, match="is at least") as exc:
        llm.check_text_length("ab " * 5_000_000)                       # 15 MB
    assert exc.value.kind == "too_long"
    llm.check_text_length("ab " * 50)                                   # fits: no error


def test_a_request_built_by_hand_that_no_slot_holds_is_refused_and_the_engine_serves_on(llm):
    import asyncio

    from tiny_mindie.engine.request import GenerationParams
    params = GenerationParams(max_new_tokens=2, do_sample=False)
    for ids in ([1] * 300, []):                  # over max_input_len (256); no prompt at all
        with pytest.raises(ValueError, match=f"1 .. 256 prompt ids, not {len(ids)}"):
            asyncio.run(llm.generate_async(params.requests(ids)[0]))
    assert len(llm.generate("Hello", max_new_tokens=2, do_sample=False).token_ids) == 2
