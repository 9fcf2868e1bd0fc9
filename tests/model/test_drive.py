"""The driver the API families share (``tiny_mindie.api.drive``) and its error taxonomy
(``tiny_mindie.api.errors``): the fan-out of ``n`` samples, the bounded merge of several engine
streams against a client that stops reading, every error kind's status and reason."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tiny_mindie.api.drive import merged
from tiny_mindie.api.errors import MINDIE, OPENAI, TGI, APIError, Kind, from_generation_error
from tiny_mindie.api.metrics import FAIL_REASONS
from tiny_mindie.engine.request import (
    ErrorKind,
    GenerationError,
    GenerationParams,
)
from tiny_mindie.llm import MAX_SEED


def test_n_samples_are_seeded_seed_plus_j_and_wrap():
    ids = [1, 2, 3]
    out = GenerationParams(do_sample=True, seed=MAX_SEED - 1, n=3).requests(ids)
    assert [r.sampling.seed for r in out] == [MAX_SEED - 1, MAX_SEED, 0]
    assert len({r.request_id for r in out}) == 3
    assert all(r.prompt_ids == [1, 2, 3] and r.prompt_ids is not ids for r in out)
    assert all(r.sampling.do_sample for r in out)


def test_every_engine_error_has_its_kind_status_and_reason():
    expected = {"too_long": (424, "too_long"), "empty": (422, "validation"),
                "timeout": (500, "timeout"), "cancelled": (500, "cancelled"),
                "stopped": (503, "stopped"), "internal": (500, "internal")}
    assert {k.value for k in ErrorKind} == set(expected)
    for kind in ErrorKind:
        err = from_generation_error(GenerationError(kind.value, "why"))
        assert (err.status, err.kind.reason) == expected[kind.value]
    assert all(k.reason in FAIL_REASONS for k in Kind)


def test_each_style_writes_the_same_error_its_own_way():
    err = APIError(Kind.TOO_LONG, "too long")
    assert (err.status, err.body()) == (
        424, {"error": "too long", "error_type": "Generation Error"})
    err.style = TGI
    assert (err.status, err.body()) == (424, {"error": "too long", "error_type": "generation"})
    err.style = OPENAI      # OpenAI's and vLLM's status: the openai SDK's BadRequestError
    assert (err.status, err.body()) == (400, {"error": {
        "message": "too long", "type": "invalid_request_error", "param": None,
        "code": "context_length_exceeded"}})
    deep = APIError(Kind.TOO_DEEP, "deep")
    assert deep.status == 422
    deep.style = OPENAI
    assert deep.status == 400 and deep.body()["error"]["type"] == "invalid_request_error"
    assert MINDIE.status(APIError(Kind.STOPPED, "s")) == 503


def test_merged_streams_hold_the_engine_back_and_a_reader_that_stops_is_cut_off(llm):
    """Two samples merged for a client that reads one event and then nothing: the bounded
    queue leaves the events in the engine, which cuts the requests off past its buffer (an
    unbounded queue would take all 2 x 40 tokens); closing the merge frees every slot."""
    from tiny_mindie.engine.engine import Engine

    engine = Engine(llm.backend, llm.tokenizer, replace(llm.engine.limits, max_buffered_events=4))
    driven = SimpleNamespace(stream_async=engine.generate)   # the LLM's one use in merged()

    async def run():
        samples = llm.make_requests("1, 2, 3, 4, 5,", GenerationParams(
            max_new_tokens=40, do_sample=True, seed=3, ignore_eos=True, n=2))
        items = merged(driven, samples)
        got = [await items.__anext__()]
        deadline = time.monotonic() + 60          # until both leave the batch, however slow
        while (engine.stats()["running"] or engine.stats()["waiting"]) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            with pytest.raises(GenerationError) as err:
                async for item in items:
                    got.append(item)
        finally:
            await items.aclose()
        return got, err.value

    try:
        got, err = asyncio.run(run())
        assert err.kind == "cancelled" and "too slow" in err.message
        assert len(got) < 40, len(got)
        assert engine.stats()["free_slots"] == engine.stats()["total_slots"]
    finally:
        engine.stop()


def test_a_merge_with_a_stop_event_cancelled_while_it_waits_leaves_no_task_behind(llm):
    """Triton's merge waits on its queue and its stopInfer event at once; a client that leaves
    meanwhile cancels it there: every task it started must end with it (a pending queue read
    left behind is logged as "Task was destroyed but it is pending" when collected)."""
    async def run():
        request = llm.make_request("1, 2, 3, 4, 5,", max_new_tokens=40, ignore_eos=True)

        async def consume():
            async for _ in merged(llm, [request], stop=asyncio.Event()):
                pass

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)                  # inside its wait for the next event
        assert not consumer.done()
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    left = asyncio.run(run())
    assert left == [], left
    deadline = time.monotonic() + 30           # the engine frees the slot at its next step
    while llm.engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.engine.stats()["free_slots"] == llm.engine.stats()["total_slots"]


@pytest.fixture(scope="module")
def llm(model_path):
    from tiny_mindie import LLM
    m = LLM(model_path, backend="numpy", max_seq_len=512, max_input_len=256, num_slots=2, log=None)
    yield m
    m.close()
