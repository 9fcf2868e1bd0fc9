"""One row of a batch to sample, and what kind of row it is."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..request import SamplingParams

MIN_TEMPERATURE = 1e-5   # a lower temperature is greedy decoding (see samples)


@dataclass(frozen=True)
class SampleRow:
    """One row of a batch to sample.

    Attributes:
        params: the request's sampling parameters.
        seen: int ``[n]`` prompt + generated ids, for the penalties and the watermark.
        rng: the request's generator; one ``random()`` draw per sampled token, none when greedy.
        top_n: how many alternatives to report (OpenAI's ``top_logprobs``); 0 = none, and then
            nothing extra is computed.
        n_prompt: how many ids at the start of ``seen`` are the prompt; the presence and
            frequency penalties count only the ids after them.
    """

    params: SamplingParams
    seen: np.ndarray
    rng: np.random.Generator
    top_n: int = 0
    n_prompt: int = 0


def samples(p: SamplingParams) -> bool:
    """Whether a row is sampled: ``do_sample`` and a temperature of at least
    :data:`MIN_TEMPERATURE` (below it the distribution is its argmax to float32 precision, and
    ``1 / T`` would overflow; vLLM draws the same line)."""
    return p.do_sample and p.temperature >= MIN_TEMPERATURE


def top_k_sampled(p: SamplingParams) -> bool:
    """Top-k rows only ever look at their k candidates, never at the whole distribution."""
    return samples(p) and p.top_k > 0
