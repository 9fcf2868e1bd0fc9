"""Constrained decoding and logit_bias in the engine, model tier: the real registry models
(SmolLM2-135M, Gemma 3 270M) in-process, many prompts per test submitted at once (they run as
one continuous batch)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tiny_mindie.api.chat.template import encode_chat
from tiny_mindie.engine.request import Constraint
from tiny_mindie.llm import LLM

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
CARD = {   # short answers: many of them stay cheap
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SUBJECTS = ["a nurse in Lyon", "a retired sailor", "a young painter", "a chess champion",
            "a baker from Naples", "a robotics student", "a jazz pianist", "a farmer in Kenya",
            "a mountain guide", "a software tester", "a librarian", "a marathon runner",
            "a beekeeper", "a taxi driver in Tokyo", "a violin teacher", "a firefighter",
            "an astronaut", "a street magician", "a wine maker", "a data analyst"]


def _chat(llm: LLM, text: str) -> list[int]:
    return encode_chat(llm, [{"role": "user", "content": text}], {})


async def _run(llm: LLM, requests) -> list:
    return await asyncio.gather(*[llm.generate_async(r) for r in requests])


@pytest.fixture(scope="module")
def llm(model_path):
    m = LLM(model_path, max_seq_len=512, max_input_len=384, num_slots=8, log=None)
    yield m
    m.close()


def test_json_schema_outputs_validate_for_many_prompts(llm):
    """16 prompts, greedy and sampled, two schemas, in one batch: every answer is complete,
    parses and validates; the request ends where the object closes. (The 50-prompt run is
    tests/e2e/test_api_structured.py's, over the real server.)"""
    card, person = Constraint("json_schema", json.dumps(CARD)), Constraint(
        "json_schema", json.dumps(PERSON))
    asks = ["Describe {} as a JSON object.", "Who is {}? Answer in JSON.",
            "Invent {} and give name, age and role."]
    reqs = [llm.make_request(_chat(llm, asks[i % 3].format(s)), max_new_tokens=60,
                             constraint=card, do_sample=i % 2 == 1, temperature=0.9, seed=i)
            for i, s in enumerate(SUBJECTS[:12])]
    reqs += [llm.make_request(_chat(llm, f"Describe {s} as a JSON object."), max_new_tokens=160,
                              constraint=person, do_sample=True, temperature=0.7, seed=i)
             for i, s in enumerate(SUBJECTS[12:16])]
    done = asyncio.run(_run(llm, reqs))
    for d, schema in zip(done, [CARD] * 12 + [PERSON] * 4, strict=True):
        assert d.finish_reason == "eos_token" and d.token_ids[-1] in llm.tokenizer.eog_ids, d
        jsonschema.validate(json.loads(d.text), schema)
        assert d.text.endswith("}")
    assert len({d.text for d in done}) > 8           # the prompts matter


def test_json_object_regex_and_length(llm):
    obj = Constraint("json_object")
    rx = r"(yes|no), [0-9]{1,3} (apples|pears)"
    reqs = [llm.make_request(_chat(llm, q), max_new_tokens=60, constraint=obj, seed=1,
                             temperature=0.7) for q in ("Give me JSON about cats.",
                                                        "Reply with a JSON object.")]
    reqs += [llm.make_request(_chat(llm, q), max_new_tokens=20, constraint=Constraint("regex", rx))
             for q in ("Do you like fruit?", "How many apples?")]
    reqs.append(llm.make_request(_chat(llm, "A person?"), max_new_tokens=4,
                                 constraint=Constraint("json_schema", json.dumps(PERSON))))
    reqs.append(llm.make_request(_chat(llm, "Yes?"), max_new_tokens=20, ignore_eos=True,
                                 constraint=Constraint("regex", "(yes|no)")))
    *objs, yes1, yes2, cut, short = asyncio.run(_run(llm, reqs))
    # a complete grammar ends the request on an end token, even with ignore_eos
    assert short.finish_reason == "eos_token" and short.text in ("yes", "no")
    assert short.token_ids[-1] in llm.tokenizer.eog_ids
    for d in objs:
        assert d.finish_reason in ("eos_token", "length")
        if d.finish_reason == "eos_token":
            assert isinstance(json.loads(d.text), dict)
        else:
            assert d.text.startswith("{")
    for d in (yes1, yes2):
        assert d.finish_reason == "eos_token" and re.fullmatch(rx, d.text), d
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    assert cut.text.startswith('{"name":"')


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = "The capital of France is"
    free = llm.generate(prompt, max_new_tokens=3)
    first = free.token_ids[0]
    banned = llm.generate(prompt, max_new_tokens=3, logit_bias={first: -100})
    assert banned.token_ids[0] != first and first not in banned.token_ids
    forced_id = llm.tokenizer.encode(" banana", add_bos=False)[0]
    forced = llm.generate(prompt, max_new_tokens=3, logit_bias={forced_id: 100}, temperature=0.8,
                          seed=3)
    assert forced.token_ids == [forced_id] * 3
    # a small bias moves the logprob the way it should, greedy or sampled alike
    nudged = llm.generate(prompt, max_new_tokens=1, logit_bias={first: 1.0})
    assert nudged.token_ids == [first] and nudged.logprobs[0] > free.logprobs[0]


def test_same_seed_same_constrained_text_alone_and_in_a_batch(llm):
    c = Constraint("json_schema", json.dumps(CARD))

    def req(subject, seed):
        return llm.make_request(_chat(llm, f"Describe {subject} as JSON."), max_new_tokens=50,
                                constraint=c, temperature=1.0, top_p=0.95, seed=seed,
                                logit_bias={llm.tokenizer.encode("true", add_bos=False)[0]: 2.0})

    alone = llm.generate_async(req(SUBJECTS[0], 77))
    alone = asyncio.run(alone)
    batch = asyncio.run(_run(llm, [req(s, 77 + i) for i, s in enumerate(SUBJECTS[:6])]))
    assert batch[0].token_ids == alone.token_ids and batch[0].text == alone.text
    # streamed: the same tokens, the text in pieces
    events = list(llm.stream(_chat(llm, f"Describe {SUBJECTS[0]} as JSON."), max_new_tokens=50,
                             constraint=c, temperature=1.0, top_p=0.95, seed=77,
                             logit_bias={llm.tokenizer.encode("true", add_bos=False)[0]: 2.0}))
    assert [e.token_id for e in events] == alone.token_ids
    assert "".join(e.text for e in events) == alone.text == events[-1].generated_text


def test_cancelled_constrained_stream_frees_its_slot(llm):
    c = Constraint("regex", "[a-z ]{200,}")
    stream = llm.stream(_chat(llm, "Write a long story."), max_new_tokens=200, constraint=c)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    for _ in range(100):
        if llm.engine.stats()["running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert llm.engine.stats() == {"running": 0, "waiting": 0, "total_slots": 8, "free_slots": 8,
                                  "draft_seconds": 0.0}
    timed = llm.make_request(_chat(llm, "Write a long story."), max_new_tokens=200,
                             constraint=c, timeout_s=0.3)
    with pytest.raises(Exception, match="timeout"):
        asyncio.run(llm.generate_async(timed))


def test_gemma3_json_schema_outputs_validate(gemma_path):
    """Gemma 3's 262,144-token vocabulary: 6 prompts in one batch validate."""
    with LLM(gemma_path, max_seq_len=512, max_input_len=384, num_slots=8, log=None) as gemma:
        c = Constraint("json_schema", json.dumps(CARD))
        reqs = [gemma.make_request(_chat(gemma, f"Describe {s} as a JSON object."),
                                   max_new_tokens=60, constraint=c,
                                   do_sample=i % 2 == 1, temperature=0.8, seed=i)
                for i, s in enumerate(SUBJECTS[:6])]
        done = asyncio.run(_run(gemma, reqs))
    for d in done:
        assert d.finish_reason == "eos_token", d
        jsonschema.validate(json.loads(d.text), CARD)
