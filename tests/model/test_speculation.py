"""Speculative decoding by prompt lookup: proposals, the policy, and that it is lossless.

Unit tests drive :func:`propose`, :class:`SpeculationPolicy`, :class:`Speculator` and
:class:`CostModel`. Model
tests run the real models on the onnxruntime backend in-process: a verification's rows and KV
are bit for bit those of decoding the same tokens one by one (SmolLM2; Gemma 3 past its
sliding window), and the engine's outputs -- tokens and logprobs, greedy and seeded -- are the
same with speculation on and off, while proposals really were verified and kept.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tiny_mindie.engine.speculation import (
    DRAFT_RATIO,
    CostModel,
    Speculator,
    expected_tokens,
    propose,
)

# ---- unit ------------------------------------------------------------------------------------


def test_propose_follows_the_most_recent_occurrence_of_the_longest_ngram():
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # the 2-gram (6, 7) last occurred at 6..7 (not at 1..2): what followed it there
    assert propose(tokens, 3) == [3, 4, 8]
    assert propose(tokens, 1) == [3]
    # a 3-gram match wins over a more recent 2-gram one
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 1, 2, 3]
    assert propose(tokens, 2) == [10, 11]
    # near the end: fewer tokens than asked
    assert propose([4, 5, 6, 4, 5], 4) == [6, 4, 5]


def test_propose_needs_an_earlier_ngram_of_two_tokens():
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([1, 2, 3, 2], 4) == []          # a lone repeated token proposes nothing
    assert propose([7, 7], 4) == []
    assert propose([], 4) == [] and propose([1, 2, 1, 2], 0) == []


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_policy_proposes_while_it_pays_and_backs_off_when_it_does_not():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    sp = Speculator(max_proposals=4)
    sp.cost_model = _PriorCost()             # 1 + 0.3 k steps for k proposals (k + 1 rows)
    p = sp.policies()
    assert sp.proposals(tokens, p, room=10) == ("ngram", [3, 4, 5, 6])
    assert sp.proposals(tokens, p, room=2) == ("ngram", [3, 4])   # the request's room caps k
    assert sp.proposals(tokens, p, room=0) == ("", [])
    # nothing kept: the rate falls below break-even, so it pauses 4 steps ...
    sp.verified(p, "ngram", 4, 0)
    assert [sp.proposals(tokens, p, 10) for _ in range(4)] == [("", [])] * 4
    # ... then tries again (from a rate at which trying may pay) with fewer proposals
    source, again = sp.proposals(tokens, p, 10)
    assert source == "ngram" and 1 <= len(again) < 4 and again == [3, 4, 5, 6][:len(again)]
    sp.verified(p, "ngram", len(again), 0)          # failing again: a pause twice as long
    assert [sp.proposals(tokens, p, 10) for _ in range(8)] == [("", [])] * 8
    assert sp.proposals(tokens, p, 10)[1]
    # a verification that costs more than any yield never runs
    dear = Speculator(max_proposals=4)
    dear.cost = lambda source, k: 10.0
    assert dear.proposals(tokens, dear.policies(), 10) == ("", [])


def test_the_speculator_asks_prompt_lookup_and_prices_a_draft_by_its_steps():
    sp = Speculator(max_proposals=4)
    policies = sp.policies()
    assert set(policies) == {"ngram", "draft"}
    assert sp.proposals([1, 2, 3, 4, 5, 6, 1, 2], policies, room=10) == ("ngram", [3, 4, 5, 6])
    assert sp.proposals([1, 2, 3, 4, 5, 6, 1, 2], policies, room=2) == ("ngram", [3, 4])
    assert sp.proposals([1, 2, 3, 4], policies, room=10) == ("", [])     # no draft, no n-gram
    # a draft's k proposals cost k of its steps beside the verification's k + 1 rows
    assert sp.cost("ngram", 3) == pytest.approx(1.9)
    assert sp.cost("draft", 3) == pytest.approx(1.9 + 3 * DRAFT_RATIO)


def test_cost_model_is_measured_verification_time_over_decode_time():
    c = CostModel()
    assert c(5) == pytest.approx(2.2)           # the prior before measurements
    c.decode(0.020)
    c.verify(5, 0.050)
    assert c(5) == pytest.approx(2.2)           # one sample: the prior bounds it ...
    c.verify(4, 0.030)
    assert c(4) == pytest.approx(1.5)           # ... (unless it is cheaper)
    for _ in range(CostModel.MIN_SAMPLES - 1):
        c.verify(5, 0.060)
    assert c(5) == pytest.approx(2.5)           # enough samples: their shortest
    c.decode(0.030)                              # the shortest recent step
    assert c.decode_s == pytest.approx(0.020)
    assert c(3) == pytest.approx(1.6)            # no measurement for 3 rows yet


def test_cost_model_ignores_steps_slowed_by_another_process():
    """Steps timed while another process held a core (10x here, some of them) leave the cost
    alone; a lasting change is followed once the window holds only the new steps."""
    c = CostModel()
    for i in range(40):
        c.decode(0.200 if i % 3 == 0 else 0.020)
        c.verify(5, 0.500 if i % 4 == 0 else 0.050)
    assert c(5) == pytest.approx(2.5)
    for _ in range(CostModel.WINDOW):
        c.verify(5, 0.090)                       # verification became dearer for good
    assert c(5) == pytest.approx(4.5)


def test_a_loaded_host_cannot_switch_speculation_off_for_a_copy():
    """Verifications timed only while other processes held the cores (each slower than
    decoding its rows one by one) are priced at their rows' decode steps, no more: a sequence
    whose proposals are all kept goes on proposing; one whose proposals fail still pauses."""
    c = CostModel()
    for _ in range(CostModel.WINDOW):
        c.decode(0.020)
        for rows in range(2, 6):
            c.verify(rows, 0.020 * rows * 3)     # three times decoding the rows one by one
    assert [c(rows) for rows in range(2, 6)] == [2.0, 3.0, 4.0, 5.0]
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    sp = Speculator(max_proposals=4)
    sp.cost_model = c
    p = sp.policies()
    for _ in range(10):
        assert sp.proposals(tokens, p, room=10) == ("ngram", [3, 4, 5, 6])
        sp.verified(p, "ngram", 4, 4)
    sp.verified(p, "ngram", 4, 0)                # nothing kept: below break-even, it pauses
    assert [sp.proposals(tokens, p, 10) for _ in range(4)] == [("", [])] * 4


# ---- model: the backend --------------------------------------------------------------------

def _verify_equals_decode(backend, past: int, n: int, seed: int) -> None:
    from tiny_mindie.model.backend import SeqChunk

    V = backend.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, V - 100, past + n).astype(np.int64)
    backend.forward([SeqChunk(0, 0, ids[:past])])
    steps = np.stack([backend.forward([SeqChunk(0, past + k, ids[past + k:past + k + 1])])[0]
                      for k in range(n)])
    row0, row1 = backend.kv.row(0), backend.kv.row(1)
    backend.forward([SeqChunk(1, 0, ids[:past])])
    rows = backend.verify(1, past, ids[past:])
    assert rows.shape == (n, V)
    for k in range(n):
        assert np.array_equal(rows[k], steps[k]), f"row {k} of {n} after {past} positions"
    for a, b in zip(backend.kv.k + backend.kv.v, backend.kv.k + backend.kv.v, strict=True):
        assert np.array_equal(a[row0, :, :past + n], b[row1, :, :past + n])


class _PriorCost(CostModel):
    """The cost model before it has measured anything (``1 + 0.3 (n - 1)`` steps for ``n``
    rows), kept so: the tests below count proposals kept, and a cost measured in wall-clock
    time on a loaded or faster host would make those counts depend on the host."""

    def decode(self, seconds: float) -> None:
        pass

    def verify(self, rows: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def smollm(model_path):
    from tiny_mindie.llm import LLM

    m = LLM(model_path, max_seq_len=768, max_input_len=700, num_slots=4, speculation=True,
            threads=1, log=None)
    m.engine._speculator.cost_model = _PriorCost()
    yield m
    m.close()


def test_verification_rows_are_decode_steps_bit_for_bit(smollm):
    be = smollm.backend
    assert be.fast_verify and be.max_verify_rows == 5
    # a whole verification, a short one, and one longer than a run (two runs)
    for past, n, seed in ((37, 5, 0), (300, 2, 1), (500, 8, 2)):
        _verify_equals_decode(be, past, n, seed)


def test_the_start_up_check_catches_a_graph_whose_chunks_are_not_decode_rows(model_path):
    """Without row padding (``batchInvariant: false``) a 4-bit product of one decode row takes
    another kernel than the rows of a chunk on x86-64 and aarch64 (see ``graph_nodes._pad_rows``):
    the verification check must say so, as a direct comparison does, and speculation would
    stay off (the server never enables it on such a graph)."""
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.onnx.graph_options import cpu_flags
    from tiny_mindie.model.options import BackendOptions

    _, _, _, be = load_model(model_path, BackendOptions(speculation=True, batch_invariant=False,
                                                        kernels="onnxruntime"),
                             num_slots=2, max_seq_len=256)
    try:
        assert be.max_verify_rows == 5 and not be.fast_verify    # not checked: left off
        be.fast_verify = True               # let verify() use the chunk path, to compare
        ids = np.random.default_rng(4).integers(100, 40000, 42).astype(np.int64)
        be.forward([SeqChunk(0, 0, ids[:37])])
        steps = [be.forward([SeqChunk(0, 37 + k, ids[37 + k:38 + k])])[0] for k in range(5)]
        same = all(np.array_equal(a, b) for a, b in zip(be.verify(0, 37, ids[37:]), steps,
                                                       strict=True))
        if "avx2" in cpu_flags() and "avx512f" not in cpu_flags():
            assert not same                 # measured: the one-row kernel rounds otherwise
        assert be.checks.check_verify_matches_decode() is same
    finally:
        be.close()


def test_gemma3_verification_matches_decoding_past_its_sliding_window(gemma_path):
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.options import BackendOptions

    _, cfg, _, be = load_model(gemma_path, BackendOptions(speculation=True, kernels="onnxruntime"),
                               num_slots=2, max_seq_len=640)
    try:
        assert cfg.sliding_window == 512 and be.fast_verify
        _verify_equals_decode(be, 600, 5, 3)        # local layers see only their window
    finally:
        be.close()


# ---- model: the engine -----------------------------------------------------------------------

def _repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts in which a random phrase comes back, so that a model continuing them
    often repeats it: prompt lookup then has something to propose."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(200, vocab - 200, int(rng.integers(4, 9))).tolist()
        filler = rng.integers(200, vocab - 200, int(rng.integers(0, 6))).tolist()
        out.append(filler + phrase + filler[:2] + phrase + phrase[:int(rng.integers(1, 4))])
    return out


def _outputs(llm, prompts, speculation: bool, concurrent: bool, **params) -> list[tuple]:
    llm.engine.speculation = speculation

    async def one(p):
        c = await llm.generate_async(llm.make_request(p, **params))
        return tuple(c.token_ids), tuple(c.logprobs), c.finish_reason

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    if concurrent:      # batched: speculation never runs (a sequence decoding alone only)
        return asyncio.run(all_at_once())
    return [asyncio.run(one(p)) for p in prompts]


def test_seeded_sampling_is_the_same_with_and_without_speculation_for_200_prompts(smollm):
    prompts = _repetitive_prompts(200, smollm.config.vocab_size, seed=11)
    params = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_p=0.95, top_k=40,
                  seed=1234, ignore_eos=True)
    before = smollm.engine.counters.snapshot()
    on = _outputs(smollm, prompts, True, concurrent=False, **params)
    after = smollm.engine.counters.snapshot()
    off = _outputs(smollm, prompts, False, concurrent=True, **params)
    smollm.engine.speculation = True
    assert on == off
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert proposed > 60 and accepted > 20, (proposed, accepted)


def test_greedy_extractive_answers_are_the_same_and_mostly_speculated(smollm):
    text = ("Edge devices have little memory, so small quantized models are a good fit for "
            "them, and a server that speaks the same API as the big one saves rewriting "
            "every client.")
    prompts = [f"Text:\n{text}\n\nThe same text again:\n{text[:k]}" for k in (0, 20, 45)]
    before = smollm.engine.counters.snapshot()
    on = _outputs(smollm, prompts, True, concurrent=False, max_new_tokens=40)
    after = smollm.engine.counters.snapshot()
    off = _outputs(smollm, prompts, False, concurrent=False, max_new_tokens=40)
    smollm.engine.speculation = True
    assert on == off
    generated = sum(len(t) for t, _, _ in on)
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert accepted > generated // 2, (accepted, generated)


def test_a_cancelled_speculating_stream_frees_its_slot(smollm):
    text = "one two three four five six seven eight nine ten " * 4
    stream = smollm.stream(text, max_new_tokens=60, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    stream.close()                                     # the client goes away mid-answer
    assert len(got) == 3
    for _ in range(100):
        if smollm.engine.stats()["running"] == 0:
            break
        import time
        time.sleep(0.02)
    assert smollm.engine.stats() == {"running": 0, "waiting": 0, "total_slots": 4,
                                     "free_slots": 4, "draft_seconds": 0.0}
    assert len(smollm.generate(text, max_new_tokens=5).token_ids) == 5


def test_spec_counters_are_exposed(smollm):
    from tiny_mindie.api.metrics import render

    snap = smollm.engine.counters.snapshot()
    text = render(smollm.engine.counters, smollm.engine.stats(), "m")
    assert (f'tiny_mindie_spec_decode_num_draft_tokens_total{{model_name="m"}} '
            f'{snap["spec_proposed_tokens"]}') in text
    assert (f'tiny_mindie_spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{snap["spec_accepted_tokens"]}') in text


def test_an_npu_provider_gets_the_graph_without_the_verification_path(model_path, caplog,
                                                                     monkeypatch):
    """CANN would run the contrib graph's If per layer (untested there): that graph is built
    without them, and the log says why (onnxruntime without CANN then runs it on the CPU). The
    standard graph, which ``auto`` picks for CANN, verifies as a prompt piece and keeps it."""
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.options import BackendOptions

    cann = [("CANNExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    with caplog.at_level("INFO", logger="tiny_mindie.model.ort.ort_backend"):
        _, _, _, be = load_model(model_path, BackendOptions(
            speculation=True, providers=cann, graph="contrib", kernels="onnxruntime"),
            num_slots=1, max_seq_len=64)
    try:
        assert be.max_verify_rows == 0 and not be.fast_verify
        assert "off on CANNExecutionProvider" in caplog.text
    finally:
        be.close()
    from tiny_mindie.model.ort import providers

    monkeypatch.setattr(providers, "ascend_available", lambda: True)    # as if it loaded
    _, _, _, be = load_model(model_path, BackendOptions(
        speculation=True, providers=cann, kernels="onnxruntime"), num_slots=1, max_seq_len=64)
    try:
        assert be.graph == "standard" and be.max_verify_rows == 5
    finally:
        be.close()
