"""Next-token selection for a batch: logits processors and sampling, in numpy.

Order of the processors is Hugging Face's / TGI's: repetition penalty (then OpenAI's presence
and frequency penalties), the watermark bias when asked (:mod:`..watermark`), then temperature,
min-p (in vLLM's place: the ids below ``min_p`` times the largest probability dropped), top-k,
top-p (Holtzman et al. 2020), typical-p (Meister et al. 2022), each working on the distribution
the previous one left.

One implementation, batch first: :func:`sample_batch` takes a decode step's ``[B, V]`` logits
and one :class:`SampleRow` per row; :func:`sample` and :func:`sample_with_top` are the same call
with ``B = 1``. The modules, each with one job:

- :mod:`.row`         :class:`SampleRow`, and whether a row is sampled at all (greedy below
                      ``MIN_TEMPERATURE``)
- :mod:`.penalties`   repetition, presence and frequency penalties, and the watermark's bias
- :mod:`.candidates`  top-k, and top-p / typical-p inside a small pool
- :mod:`.vocab_sets`  top-p / typical-p over the whole vocabulary without sorting it
- :mod:`.draw`        the per-request generator, the inverse-CDF draw, logprobs
- :mod:`.batch`       :func:`sample_batch`: the batch's passes, the helper thread, one-row forms
- :mod:`.scratch`     the per-thread work arrays reused from step to step
- :mod:`.reference`   a short, plain definition of the same choice, one row at a time, that the
                      tests hold the fast path to (same uniform number -> same token)
"""

from .batch import sample, sample_batch, sample_with_top
from .draw import Top, make_rng
from .row import MIN_TEMPERATURE, SampleRow

__all__ = ["MIN_TEMPERATURE", "SampleRow", "Top", "make_rng", "sample", "sample_batch",
           "sample_with_top"]
