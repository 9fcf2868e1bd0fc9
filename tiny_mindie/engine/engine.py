"""The engine: one inference thread running continuous batching over a :class:`Backend`.

``Engine.generate(request)`` is called on the event loop and returns an async iterator of
:class:`TokenEvent`. The inference thread admits requests, runs ``backend.forward`` on the batch,
samples the rows in one :func:`~.sampling.sample_batch` call (each row with its request's own
RNG), detokenizes, and hands events back to the loop with ``call_soon_threadsafe``. numpy and
ONNX Runtime release the GIL, so the loop stays responsive.

Before sampling, each row's ``logit_bias`` is added to its logits, and a constrained row's
(``GenerationRequest.constraint``) disallowed tokens are set to ``-inf`` from its grammar's
token mask (:mod:`.constraint`), computed for the batch's constrained rows after the forward
pass. The sampled token advances the row's matcher; once the grammar is complete only the
end-of-generation tokens are allowed, so the request ends on the next one (``finish_reason``
``"eos_token"``, even with ``ignore_eos``). A request's own state is :mod:`.sequence`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..model.backend import Backend, SeqChunk
from ..model.tokenizer import Tokenizer
from .constraint import compile_constraint, fill_masks, forget
from .counters import EngineCounters
from .draft import DraftModel
from .request import ErrorKind, GenerationError, GenerationRequest, TokenEvent
from .sampling import SampleRow, sample_batch
from .scheduler import SchedulerLimits, SlotPool, WaitQueue, plan_prefill, reusable_prefix
from .sequence import Sequence, bias_and_mask
from .speculation import Speculator

log = logging.getLogger("tiny_mindie.engine")

#: A prefix is copied from another slot (``Backend.copy_kv``) when that spares at least this many
#: prefill tokens: a memory copy is far cheaper than computing a position, so any prefix is.
MIN_COPY_TOKENS = 1


@dataclass(frozen=True)
class EngineLimits:
    """Server-wide limits (MindIE ``ModelDeployConfig`` / ``ScheduleConfig`` / ``ServerConfig``).

    Attributes:
        max_seq_len: prompt + output tokens per sequence.
        max_input_len: prompt tokens at most (MindIE ``maxInputTokenLen``).
        max_iter_times: output tokens per request at most.
        token_timeout_s: seconds allowed between two tokens of one request.
        e2e_timeout_s: seconds allowed for a whole request.
        max_buffered_events: token events a request may have waiting for its client; a
            client that reads slower than that is cut off (the batch never waits for it).
        schedule: batch and prefill limits.
        prefix_cache: a finished request leaves its prompt's KV in its slot, and a new request
            whose prompt starts with the same tokens reuses it instead of prefilling them again
            (see :class:`~.scheduler.SlotPool`); the answer is the same either way.
        speculation: a sequence decoding alone verifies tokens proposed by prompt lookup (or
            the draft model, when the engine has one) several at a time when that pays
            (:mod:`.speculation`), on backends that verify in one run; the answer is the same
            either way.
    """

    max_seq_len: int = 2560
    max_input_len: int = 2048
    max_iter_times: int = 512
    token_timeout_s: float = 600.0
    e2e_timeout_s: float = 600.0
    max_buffered_events: int = 1024
    schedule: SchedulerLimits = field(default_factory=SchedulerLimits)
    prefix_cache: bool = True
    speculation: bool = True

    def __post_init__(self) -> None:
        """Raises ``ValueError`` for a length, count or timeout not above 0."""
        bad = [n for n in ("max_seq_len", "max_input_len", "max_iter_times", "token_timeout_s",
                           "e2e_timeout_s", "max_buffered_events") if not getattr(self, n) > 0]
        if bad:
            raise ValueError(f"{bad[0]} must be > 0, got {getattr(self, bad[0])}")


class Engine:
    """Continuous-batching generation over one backend and tokenizer.

    Args:
        backend: the model (its ``num_slots`` bounds the running batch).
        tokenizer: the model's tokenizer.
        limits: server-wide limits.
        draft: a draft model proposing tokens for speculative decoding (:mod:`.draft`; its
            vocabulary the target's), or ``None``.
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer,
                 limits: EngineLimits = EngineLimits(), draft: DraftModel | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_seq_len = min(limits.max_seq_len, backend.max_seq_len)
        self.max_input_len = min(limits.max_input_len, self.max_seq_len - 1)
        self._slots = SlotPool(backend.num_slots)
        self._can_copy = type(backend).copy_kv is not Backend.copy_kv
        self.speculation = limits.speculation and backend.fast_verify
        self._speculator = Speculator(max(0, backend.max_verify_rows - 1), draft)
        self._waiting: WaitQueue[Sequence] = WaitQueue()
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False    # drain(): no new requests; the admitted ones finish
        self.counters = EngineCounters()  # token counts and latencies
        self._thread = threading.Thread(target=self._run, name="tiny_mindie-inference", daemon=True)
        self._started = False

    # ---- event-loop side ----------------------------------------------------------------
    def start(self) -> None:
        """Start the inference thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self) -> None:
        """Cancel everything and stop the inference thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout=10)

    def drain(self) -> None:
        """Stop admitting requests (``/stopService``): ``generate()`` fails with
        ``GenerationError.stopped()`` (503) from now on, and so do at once the waiting requests
        no free slot takes; the running ones go on to their end. See :meth:`stats` for when
        the engine is idle."""
        with self._cond:
            self._draining = True
            self._cond.notify()

    def forget_prefix_cache(self) -> None:
        """Drop every cached prefix: later requests prefill their whole prompt (until they
        leave prefixes of their own)."""
        with self._cond:
            self._slots.forget()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Generate for ``req``; yields one :class:`TokenEvent` per token, the last one carrying
        ``finish_reason`` and ``generated_text``.

        Leaving the iteration early (client gone) cancels the request in the engine.
        ``req.prompt_ids`` must number 1 .. :attr:`max_input_len`: ``LLM.prompt_ids`` (the one
        check of a prompt's length, answering clients 424 or 422) builds every request's ids,
        and one built by hand past that is refused (``ValueError``), kept out of the KV cache.

        Raises:
            GenerationError: timeout, engine stopped or draining, or an internal error.
            ConstraintError: ``req.constraint`` cannot be compiled (a ``ValueError``; the
                API layers compile it while validating, so that it is a 400 there).
            ValueError: a ``logit_bias`` token id outside the vocabulary, or prompt ids no KV
                slot holds (none, or over :attr:`max_input_len`: a request built by hand).
        """
        if not 0 < len(req.prompt_ids) <= self.max_input_len:
            raise ValueError(f"a request holds 1 .. {self.max_input_len} prompt ids, not "
                             f"{len(req.prompt_ids)} (LLM.make_request checks a prompt)")
        for token_id, _ in req.sampling.logit_bias:
            if token_id >= self.tokenizer.vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary "
                                 f"(0..{self.tokenizer.vocab_size - 1})")
        matcher = (compile_constraint(self.tokenizer, req.constraint).matcher()
                   if req.constraint is not None else None)
        self.start()
        max_new = min(req.stop.max_new_tokens, self.limits.max_iter_times,
                      self.max_seq_len - len(req.prompt_ids))
        seq = Sequence(req, asyncio.get_running_loop(), self.tokenizer, max_new, time.monotonic(),
                       self.limits.max_buffered_events, matcher, self._speculator.policies())
        with self._cond:
            if self._stopping or self._draining:
                raise GenerationError.stopped()
            self._by_id[req.request_id] = seq
            self._waiting.push(req.priority, seq)
            self._cond.notify()
        done = False
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, GenerationError):
                    done = True
                    raise item
                done = item.is_last
                yield item
                if done:
                    return
        finally:
            if not done:
                self.cancel(req.request_id)

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request; its slot is freed within one step.
        Returns whether the request was known."""
        with self._cond:
            seq = self._by_id.get(request_id)
            if seq is None:
                return False
            seq.cancelled = True
            self._cond.notify()
            return True

    def stats(self) -> dict:
        """Counts for status routes: running, waiting, total and free KV slots, and the
        seconds the draft model has run (0 without one)."""
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "total_slots": self._slots.total, "free_slots": self._slots.free,
                    "draft_seconds": (self._speculator.draft.seconds
                                      if self._speculator.draft else 0.0)}

    @property
    def accepting(self) -> bool:
        """New requests are admitted: neither :meth:`drain` nor :meth:`stop` was called."""
        return not (self._stopping or self._draining)

    @property
    def alive(self) -> bool:
        """The inference thread runs (or has not been started yet)."""
        return self._thread.is_alive() or not self._started

    # ---- inference thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
                self._expire(time.monotonic())
                self._admit()
                if self._draining:      # what no slot took now waits for nothing: refused
                    for seq in self._waiting.remove_if(lambda _seq: True):
                        self._finish(seq, GenerationError.stopped())
                if not self._running:
                    self._cond.wait(timeout=0.5)
                    continue
                batch = self._plan()
                source, proposal = self._proposal(batch)
            try:
                if proposal:
                    self._verify_step(batch[0][0], source, proposal)
                else:
                    self._step(batch)
            except Exception:  # a bug or a backend failure: fail the batch, keep serving
                log.exception("forward pass failed")
                with self._cond:
                    for seq, _ in batch:
                        self._finish(seq, GenerationError(ErrorKind.INTERNAL,
                                                          "Internal error in generation."),
                                     keep_kv=False)
        with self._cond:
            for seq in list(self._running) + list(self._waiting):
                self._finish(seq, GenerationError.stopped())

    def _expire(self, now: float) -> None:
        """Drop cancelled and timed-out requests (waiting or running)."""
        e2e, token = self.limits.e2e_timeout_s, self.limits.token_timeout_s
        for seq in self._waiting.remove_if(
                lambda s: s.cancelled or s.timeout_error(now, e2e, token) is not None):
            self._finish(seq, seq.timeout_error(now, e2e, token))
        for seq in list(self._running):
            err = seq.timeout_error(now, e2e, token)
            if seq.cancelled or err is not None:
                self._finish(seq, err)

    def _admit(self) -> None:
        while (len(self._waiting) and len(self._running) < self.limits.schedule.max_batch_size
               and self._slots.free):
            seq = self._waiting.pop()
            running = [(s.slot, s.tokens[:s.n_exact]) for s in self._running
                       if s.n_exact] if self.limits.prefix_cache else []
            taken = self._slots.take(seq.tokens[:seq.n_prompt],
                                     partial(self._reusable, seq.n_prompt), running,
                                     MIN_COPY_TOKENS if self._can_copy else None)
            seq.slot, seq.n_reused = taken.slot, taken.reused
            if taken.copy_from is not None:
                self.backend.copy_kv(taken.copy_from, taken.slot, taken.reused)
            seq.n_cached = seq.n_exact = seq.n_reused
            self.counters.prefix_cache(hit_tokens=seq.n_reused,
                                      miss_tokens=seq.n_prompt - seq.n_reused)
            seq.started = time.monotonic()
            self._running.append(seq)

    def _reusable(self, n_prompt: int, common: int) -> int:
        """How many of ``common`` cached leading tokens a prompt of ``n_prompt`` reuses (see
        :func:`~.scheduler.reusable_prefix`); 0 with the prefix cache off."""
        if not self.limits.prefix_cache:
            return 0
        return reusable_prefix(common, n_prompt, self.limits.schedule.max_prefill_tokens,
                               self.backend.prefix_split_invariant)

    def _plan(self) -> list[tuple[Sequence, int]]:
        """This step's rows: ``(sequence, tokens to feed)``; decode rows feed 1 token."""
        decode = [(s, 1) for s in self._running
                  if s.n_cached == len(s.tokens) - 1 and s.n_generated]
        prefill = plan_prefill(((s, s.n_cached, s.n_prompt - s.n_cached) for s in self._running
                                if s.n_cached < s.n_prompt), self.limits.schedule)
        return decode + prefill

    def _proposal(self, batch: list[tuple[Sequence, int]]) -> tuple[str, list[int]]:
        """``(source, tokens)`` to verify instead of this step's decode row
        (:meth:`.speculation.Speculator.proposals`): only for an unconstrained sequence
        decoding alone; else ``("", [])``."""
        if not self.speculation or len(batch) != 1 or len(self._running) != 1:
            return "", []
        seq, n = batch[0]
        if n != 1 or seq.matcher is not None or seq.cancelled:
            return "", []
        room = min(seq.max_new_tokens - seq.n_generated,
                   self.max_seq_len - len(seq.tokens)) - 1
        return self._speculator.proposals(seq.tokens, seq.speculation, room)

    def _verify_step(self, seq: Sequence, source: str, proposal: list[int]) -> None:
        """Run ``seq``'s last token and the ``proposal`` as one chunk
        (:meth:`~tiny_mindie.model.backend.Backend.verify`), then sample its positions in
        order, as decode steps would, while the samples equal the proposal."""
        ids = np.asarray([seq.tokens[-1], *proposal], dtype=np.int64)
        t0 = time.perf_counter()
        logits = self.backend.verify(seq.slot, seq.n_cached, ids)
        self._speculator.cost_model.verify(len(ids), time.perf_counter() - t0)
        now = time.monotonic()
        accepted = 0
        for i in range(len(ids)):
            with self._cond:
                if seq.cancelled or seq.slot is None:
                    return
                seq.n_cached += 1                 # ids[i] is a token of the sequence
            row = logits[i:i + 1]
            bias_and_mask(row, [seq], [], None)
            result = self._sample(row, [seq.sample_row()])[0]
            with self._cond:
                if seq.cancelled or seq.slot is None:
                    return
                if result is None:
                    self._finish(seq, GenerationError(ErrorKind.INTERNAL,
                                                      "Internal error in generation."))
                    return
                self._next_token(seq, result, now)
                if seq.slot is None or i == len(proposal) or result[0] != proposal[i]:
                    break
            accepted += 1
        seq.proposed += len(proposal)   # (the events sent meanwhile count the verification
        seq.accepted += accepted        # before: a client sees it once the next token comes)
        self.counters.speculation(proposed=len(proposal), accepted=accepted, source=source)
        self._speculator.verified(seq.speculation, source, len(proposal), accepted)

    def _step(self, batch: list[tuple[Sequence, int]]) -> None:
        chunks = [SeqChunk(s.slot, s.n_cached,
                           np.asarray(s.tokens[s.n_cached:s.n_cached + n], dtype=np.int64))
                  for s, n in batch]
        t0 = time.perf_counter()
        logits = self.backend.forward(chunks)
        if len(batch) == 1 and batch[0][1] == 1:         # a lone decode step: the cost unit
            self._speculator.cost_model.decode(time.perf_counter() - t0)
        now = time.monotonic()
        with self._cond:
            ready = []                # (row, sequence) of the rows that produce a token now
            for row, (seq, n) in enumerate(batch):
                if n > 1 and seq.n_exact == seq.n_cached and seq.n_cached + n <= seq.n_prompt \
                        and self._exact_piece(seq.n_cached, n):
                    seq.n_exact += n              # prompt KV a later prefill would match
                seq.n_cached += n
                if seq.cancelled or seq.slot is None or seq.n_cached < len(seq.tokens):
                    continue  # cancelled meanwhile, or a prompt chunk with more to come
                ready.append((row, seq))
        if not ready:
            return
        # one sampler call for the batch, outside the lock (only this thread touches the
        # sequences' tokens and generators; a cancel() meanwhile is seen below)
        if len(ready) < logits.shape[0]:
            logits = logits[[row for row, _ in ready]]
        # the grammar masks of the constrained rows: after the forward pass, not beside it (a
        # helper thread computing them meanwhile takes CPU from the forward pass, which then
        # loses more time than the masks cost; docs/structured-outputs.md)
        constrained = [seq for _, seq in ready if seq.matcher is not None]
        bitmask = (fill_masks([seq.matcher for seq in constrained], self.tokenizer.vocab_size)
                   if constrained else None)
        bias_and_mask(logits, [seq for _, seq in ready], constrained, bitmask)
        sampled = self._sample(logits, [seq.sample_row() for _, seq in ready])
        with self._cond:
            for (_, seq), result in zip(ready, sampled, strict=True):
                if seq.cancelled or seq.slot is None:
                    continue
                if result is None:
                    self._finish(seq, GenerationError(ErrorKind.INTERNAL,
                                                      "Internal error in generation."))
                else:
                    self._next_token(seq, result, now)

    def _exact_piece(self, start: int, n: int) -> bool:
        """Whether the KV of a prompt chunk ``[start, start + n)`` (``n >= 2``) is what any
        later prefill computes for those positions: any such chunk on a backend that is
        :attr:`~tiny_mindie.model.backend.Backend.prefix_split_invariant`, else only a whole
        piece between two cuts of :func:`~.scheduler.plan_prefill`."""
        if self.backend.prefix_split_invariant:
            return True
        chunk = self.limits.schedule.max_prefill_tokens
        return start % chunk == 0 and n == chunk

    @staticmethod
    def _sample(logits: np.ndarray, rows: list[SampleRow]) -> list[tuple | None]:
        """:func:`sample_batch`; should it raise (a bug one request's parameters reach), each
        row is sampled again alone from its generator's state before the batch, and only the
        rows that fail alone get ``None``: one request never fails the others."""
        states = [row.rng.bit_generator.state for row in rows]
        try:
            return sample_batch(logits, rows, overwrite=True)   # restored if it raises
        except Exception:
            log.exception("sampling the batch failed; sampling its rows one by one")
        out: list[tuple | None] = []
        for i, (row, state) in enumerate(zip(rows, states, strict=True)):
            row.rng.bit_generator.state = state
            try:
                out.append(sample_batch(logits[i:i + 1], [row])[0])
            except Exception:
                log.exception("sampling failed for one request")
                out.append(None)
        return out

    def _next_token(self, seq: Sequence, sampled: tuple, now: float) -> None:
        """Append the sampled ``(token, logprob, top)`` to ``seq`` and tell its client."""
        tok, logprob, top = sampled
        seq.tokens.append(tok)
        first = seq.n_generated == 1
        prefill_ms = (now - seq.started) * 1000.0 if first else None
        decode_ms = None if first else (now - seq.last_token) * 1000.0
        seq.last_token = now
        self.counters.token(first=first, prompt_tokens=seq.n_prompt,
                           interval_s=now - seq.submitted if first else decode_ms / 1000.0)
        stop = seq.req.stop
        finish = None
        grammar_done = False
        constrained = seq.matcher is not None
        eog = tok in self.tokenizer.eog_ids
        # a matcher that failed while computing its mask (a lexer or parser limit reached
        # later in the output) allows only the end of text: never a silent, cut answer
        failed = constrained and seq.matcher.error is not None
        if constrained and not eog and not failed:  # the mask allowed tok: the matcher follows
            failed = not seq.matcher.consume(tok)
        if failed:
            log.error("constrained request %s: token %d, grammar failed (%s)",
                      seq.req.request_id, tok, seq.matcher.error)
            forget(self.tokenizer, seq.req.constraint)
            self._finish(seq, GenerationError(ErrorKind.INTERNAL,
                                              "Internal error in generation: the output's "
                                              "grammar could not be followed."))
            return
        if constrained and not eog:
            # complete: the next mask allows the end-of-generation tokens only, so the request
            # ends on one of them as any other does; a vocabulary without any ends it here
            grammar_done = seq.matcher.done and not self.tokenizer.eog_ids
        if (not stop.ignore_eos or constrained) and eog or tok in stop.stop_token_ids:
            finish = "eos_token"        # a stop token's text only with include_stop_string
            text = seq.detok.add(tok) if stop.include_stop_string and not eog else ""
        else:
            text = seq.detok.add(tok, stops=seq.n_generated >= stop.min_tokens)
            if seq.detok.stopped:
                finish = "stop_sequence"
            elif grammar_done:          # complete, and nothing may follow but end of text
                finish = "eos_token"
            elif seq.n_generated >= seq.max_new_tokens:
                finish = "length"
        if finish is not None:
            text += seq.detok.finish()
        seq.emit(TokenEvent(token_id=tok, text=text, index=seq.n_generated - 1, logprob=logprob,
                            prefill_time_ms=prefill_ms, decode_time_ms=decode_ms,
                            finish_reason=finish,
                            generated_text=seq.detok.text if finish else None,
                            prompt_tokens=seq.n_prompt, top_logprobs=top,
                            cached_tokens=seq.n_reused, proposed_tokens=seq.proposed,
                            accepted_tokens=seq.accepted))
        if finish is not None:
            self.counters.completed(now - seq.submitted)
            self._finish(seq, None)

    def _finish(self, seq: Sequence, error: GenerationError | None,
                keep_kv: bool = True) -> None:
        """Remove ``seq`` from the engine and free its slot; tell the client about ``error``.

        The slot keeps the KV of the prompt positions a later prefill would compute alike
        (``seq.n_exact``; also after a cancellation or a timeout, which only come between
        steps) for the prefix cache, unless ``keep_kv`` is false (a failed forward pass may
        have written part of it)."""
        if seq in self._running:
            self._running.remove(seq)
        if seq.slot is not None:
            keep = seq.n_exact if keep_kv and self.limits.prefix_cache else 0
            self._slots.give_back(seq.slot, seq.tokens[:keep])
            seq.slot = None
        self._by_id.pop(seq.req.request_id, None)
        seq.matcher = None                  # its grammar state is freed with the request
        if error is not None:
            seq.emit(error)
