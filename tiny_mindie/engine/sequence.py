"""The engine thread's state of one request (:class:`Sequence`), what its deadlines are, and
what the sampler sees of it: its row (:meth:`Sequence.sample_row`) and its logits' bias and
grammar mask (:func:`bias_and_mask`).
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..model.tokenizer import Tokenizer
from .constraint import Matcher, apply_bitmask
from .detok import IncrementalDetokenizer
from .request import ErrorKind, GenerationError, GenerationRequest
from .sampling import SampleRow, make_rng
from .speculation import SpeculationPolicy


class Sequence:
    """Engine-thread state of one request. Its events (token events, then maybe a
    :class:`GenerationError`) reach the caller through :attr:`queue`, on ``loop``; more than
    ``max_buffered`` unread ends the request."""

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 tokenizer: Tokenizer, max_new_tokens: int, now: float, max_buffered: int,
                 matcher: Matcher | None = None,
                 policies: dict[str, SpeculationPolicy] | None = None):
        self.req = req
        self.matcher = matcher      # the request's place in its grammar (constraint), or None
        self.bias = (np.array([i for i, _ in req.sampling.logit_bias], np.intp),
                     np.array([b for _, b in req.sampling.logit_bias], np.float32))
        # the ids min_tokens holds back (end of generation, stop_token_ids), or None
        self.held = (np.array(sorted(set(tokenizer.eog_ids) | set(req.stop.stop_token_ids)),
                              np.intp) if req.stop.min_tokens else None)
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens: list[int] = list(req.prompt_ids)
        self.n_prompt = len(req.prompt_ids)
        self.n_cached = 0         # positions [0, n_cached) of the slot hold this sequence's KV
        self.n_reused = 0         # ... of which these came from the prefix cache
        self.n_exact = 0          # ... of which these a fresh prefill computes bit for bit alike
        self.max_new_tokens = max_new_tokens
        self.slot: int | None = None
        self.rng = make_rng(req.sampling.seed)
        self.detok = IncrementalDetokenizer(tokenizer.token_bytes, req.stop.stop_strings,
                                            req.stop.include_stop_string)
        self.submitted = now
        self.deadline = now + req.timeout_s if req.timeout_s else float("inf")
        self.started: float | None = None   # prefill began
        self.last_token: float | None = None
        self.cancelled = False
        self.max_buffered = max_buffered
        self.speculation = policies or {}    # speculation's policy per source
        self.proposed = self.accepted = 0    # speculated tokens verified / kept

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def holds_end(self) -> bool:
        """Whether ``min_tokens`` still keeps the next token from ending the output (a
        complete grammar aside: it allows only the end)."""
        return (self.held is not None and self.n_generated < self.req.stop.min_tokens
                and not (self.matcher is not None and self.matcher.done))

    def sample_row(self) -> SampleRow:
        """What the sampler needs of this sequence for its next token."""
        return SampleRow(self.req.sampling, np.asarray(self.tokens), self.rng,
                         self.req.top_logprobs, self.n_prompt)

    def emit(self, item) -> None:
        """Hand ``item`` to the request's event loop; a closed loop means the caller is gone."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:   # the loop was closed without cancelling: nobody is listening
            self.cancelled = True

    def _deliver(self, item) -> None:
        """On the event loop: queue ``item`` unless the client has fallen too far behind."""
        if self.cancelled and not isinstance(item, GenerationError):
            return
        if self.queue.qsize() >= self.max_buffered:
            self.cancelled = True      # the engine drops the request at its next step
            item = GenerationError(ErrorKind.CANCELLED, "Client too slow: "
                                   f"more than {self.max_buffered} events unread.")
        self.queue.put_nowait(item)

    def timeout_error(self, now: float, e2e_timeout_s: float,
                      token_timeout_s: float) -> GenerationError | None:
        """The error that ends this request at ``now`` (monotonic seconds) for a time limit:
        its own ``timeout_s``, the server's ``e2e_timeout_s`` for the whole request, or
        ``token_timeout_s`` between two tokens; ``None`` when none is over or it is cancelled."""
        if self.cancelled:
            return None
        if now > self.deadline:
            return GenerationError(ErrorKind.TIMEOUT, "Engine callback timeout: client timeout")
        if now - self.submitted > e2e_timeout_s:
            return GenerationError(ErrorKind.TIMEOUT, "Engine callback timeout: server e2eTimeout")
        last = self.last_token or self.started
        if last is not None and now - last > token_timeout_s:
            return GenerationError(ErrorKind.TIMEOUT,
                                   "Engine callback timeout: server tokenTimeout")
        return None


def bias_and_mask(logits: np.ndarray, seqs: list[Sequence], constrained: list[Sequence],
                  bitmask: np.ndarray | None) -> None:
    """Before sampling, in place on float32 ``[len(seqs), V]`` ``logits``: add each row's
    ``logit_bias``, set the tokens ``min_tokens`` holds back to ``-inf``
    (:attr:`Sequence.holds_end`), then the tokens its grammar does not allow
    (``bitmask``: :func:`~.constraint.fill_masks` of ``constrained``)."""
    for row, seq in enumerate(seqs):
        ids, bias = seq.bias
        if ids.size:
            logits[row, ids] += bias
        if seq.holds_end:
            logits[row, seq.held] = -np.inf
    if bitmask is None:
        return
    at = {id(seq): i for i, seq in enumerate(constrained)}
    rows = [(row, at[id(seq)]) for row, seq in enumerate(seqs) if id(seq) in at]
    if len(rows) == logits.shape[0] == bitmask.shape[0]:
        apply_bitmask(logits, bitmask)            # the usual case: every row constrained
        return
    for row, i in rows:
        apply_bitmask(logits[row:row + 1], bitmask[i:i + 1])
