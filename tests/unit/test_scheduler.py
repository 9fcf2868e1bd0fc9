"""The prefill plan: where prompts are cut does not depend on the load."""

from __future__ import annotations

import random

from tiny_mindie.engine.scheduler import SchedulerLimits, plan_prefill


def _cuts(length: int, others: list[int], limits: SchedulerLimits, rng: random.Random) -> list[int]:
    """Positions where a prompt of ``length`` tokens is cut when it is prefilled beside prompts
    of ``others`` tokens, admitted before or after it at random, step by step."""
    pending = [[f"o{i}", 0, n] for i, n in enumerate(others)]
    mine = ["me", 0, length]
    pending.insert(rng.randrange(len(pending) + 1), mine)
    cuts = []
    while mine[1] < length:
        plan = plan_prefill([(p[0], p[1], p[2] - p[1]) for p in pending if p[1] < p[2]], limits)
        assert plan, "no progress"
        assert sum(n for _, n in plan) <= limits.max_prefill_tokens
        assert len(plan) <= limits.max_prefill_batch_size
        for name, n in plan:
            p = next(p for p in pending if p[0] == name)
            p[1] += n
            if name == "me":
                cuts.append(p[1])
    return cuts


def test_prompts_are_cut_at_multiples_of_the_budget_whatever_else_waits():
    limits = SchedulerLimits(max_batch_size=8, max_prefill_batch_size=4, max_prefill_tokens=64)
    rng = random.Random(7)
    for length in (1, 2, 63, 64, 65, 130, 300):
        alone = _cuts(length, [], limits, rng)
        assert alone == sorted({*range(64, length, 64), length})
        for _ in range(20):
            others = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 6))]
            assert _cuts(length, others, limits, rng) == alone, others


def test_the_first_prompt_always_progresses_and_small_pieces_fill_the_rest():
    limits = SchedulerLimits(max_batch_size=8, max_prefill_batch_size=8, max_prefill_tokens=64)
    # the first needs 40 (its piece up to 64 after 24 done), the second's piece of 64 does not
    # fit in the 24 left, the third's 10 does
    plan = plan_prefill([("a", 24, 100), ("b", 0, 200), ("c", 0, 10)], limits)
    assert plan == [("a", 40), ("c", 10)]
    assert plan_prefill([("b", 0, 200)], limits) == [("b", 64)]
