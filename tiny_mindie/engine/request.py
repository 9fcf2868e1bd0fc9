"""The engine's request and event types: what the API adapters hand in and get back.

Nothing here knows about HTTP or numpy; the API families translate their JSON into a
:class:`GenerationParams` (once, complete), whose :meth:`~GenerationParams.requests` are the
engine's requests (:class:`GenerationRequest`), and each :class:`TokenEvent` back into their
own JSON.
"""

from __future__ import annotations

import enum
import itertools
import numbers
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_ids = itertools.count(1)
#: The largest seed: seeds are 0 .. 2**63-1.
MAX_SEED = 2**63 - 1


def next_request_id() -> str:
    """A process-unique request id (``"1"``, ``"2"``, ...)."""
    return str(next(_ids))


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits (see :mod:`tiny_mindie.engine.sampling`).

    Attributes:
        do_sample: ``False`` -> greedy (argmax after the repetition penalty).
        temperature: > 0; logits are divided by it.
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus mass in (0, 1]; 1.0 = off (Holtzman et al. 2020).
        typical_p: locally typical mass in (0, 1]; 1.0 = off (Meister et al. 2022).
        repetition_penalty: > 0; 1.0 = off (Keskar et al. 2019, CTRL, sec. 4.1).
        seed: seed of this request's own random generator, 0 .. 2**63-1.
        watermark: apply the green-list watermark (Kirchenbauer et al. 2023).
        presence_penalty, frequency_penalty: OpenAI's penalties in [-2, 2] on tokens already
            generated (not the prompt): ``logit -= frequency * count + presence``; 0 = off.
        logit_bias: OpenAI's ``logit_bias``: ``(token id, bias)`` pairs, bias in [-100, 100]
            added to that token's logit before sampling (greedy or not); ``()`` = none.
        min_p: in [0, 1]; after the temperature, tokens whose probability is below ``min_p``
            times the most likely token's are dropped, before top-k / top-p / typical-p
            (vLLM's order; Nguyen et al. 2024); 0 = off.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    watermark: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        """Raises ``ValueError`` for a value outside the ranges above."""
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")


@dataclass(frozen=True)
class Constraint:
    """Grammar the output must follow (constrained decoding, :mod:`tiny_mindie.engine.constraint`).

    Attributes:
        kind: ``"json_schema"`` | ``"json_object"`` | ``"regex"`` | ``"lark"``.
        spec: the schema as a JSON string (json_schema), ``""`` (json_object), the regex, or
            the grammar text (lark).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        """Raises ``ValueError`` for an unknown ``kind``."""
        if self.kind not in ("json_schema", "json_object", "regex", "lark"):
            raise ValueError(f"unknown constraint kind {self.kind!r}")


@dataclass(frozen=True)
class StopCriteria:
    """When generation ends (besides the server's length limits).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        stop_strings: text that ends generation (``finish_reason == "stop_sequence"``).
        include_stop_string: keep the matched stop string in the output.
        stop_token_ids: token ids that end generation like EOS does (even with
            ``ignore_eos``); the token's text is left out of the output unless
            ``include_stop_string`` (vLLM's rule).
        ignore_eos: keep going past end-of-generation tokens.
        min_tokens: the end-of-generation tokens and ``stop_token_ids`` cannot be sampled,
            and stop strings are not looked for, until this many tokens are generated
            (vLLM's ``min_tokens``); a complete grammar still ends the output; 0 = off.
    """

    max_new_tokens: int = 20
    stop_strings: tuple[str, ...] = ()
    include_stop_string: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        """Raises ``ValueError`` when ``max_new_tokens < 1`` or ``min_tokens < 0``."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation job (built by :meth:`GenerationParams.requests`, never changed after).

    Attributes:
        prompt_ids: token ids of the prompt (BOS already added when the model wants it).
        sampling, stop: see their classes.
        priority: 1 (most urgent) .. 5.
        timeout_s: seconds from submission after which the request is cancelled; None = none.
        request_id: unique id, used for cancellation and logs.
        top_logprobs: report this many most likely alternatives with each token
            (``TokenEvent.top_logprobs``; OpenAI's ``top_logprobs``); 0 = none, no extra cost.
        constraint: grammar the output must follow (see :class:`Constraint`); None = free.
            When the grammar is complete the request ends with ``finish_reason ==
            "eos_token"``; ``"length"`` means max tokens cut it (output not complete).
    """

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopCriteria = field(default_factory=StopCriteria)
    priority: int = 5
    timeout_s: float | None = None
    request_id: str = field(default_factory=next_request_id)
    top_logprobs: int = 0
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        """Raises ``ValueError`` for a priority outside 1..5, a non-positive timeout or a
        negative ``top_logprobs``."""
        if not 1 <= self.priority <= 5:
            raise ValueError(f"priority must be in 1..5, got {self.priority}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")


@dataclass(frozen=True)
class GenerationParams:
    """Everything a request asks besides its prompt, in one immutable value: what each API
    family's parser builds once from a body, and :meth:`requests` turns into the engine's
    requests (``LLM.make_requests``). Its fields are the keyword arguments of
    ``LLM.generate`` / ``LLM.stream``.

    Attributes:
        max_new_tokens, include_stop_string, stop_token_ids, ignore_eos, min_tokens: see
            :class:`StopCriteria`; ``stop``: its ``stop_strings``.
        do_sample: ``None`` samples when any of temperature, top_k, top_p, typical_p, min_p is
            set away from its neutral value (TGI's rule), else decodes greedily.
        temperature, top_k, top_p, typical_p, min_p, repetition_penalty, presence_penalty,
            frequency_penalty, watermark: see :class:`SamplingParams`.
        logit_bias: token id -> bias in [-100, 100] added to its logit (a mapping, or
            ``(id, bias)`` pairs; kept as sorted pairs).
        seed: the first sample's seed, 0 .. 2**63-1; ``None``: one drawn by :meth:`requests`.
        priority, timeout_s, top_logprobs, constraint: see :class:`GenerationRequest`.
        n: samples of the prompt (>= 1), sample ``j`` seeded ``seed + j`` (mod 2**63), so a
            given seed reproduces all ``n``.

    A value out of range raises ``ValueError`` when the requests are built (:meth:`requests`:
    the ranges of :class:`SamplingParams`, :class:`StopCriteria`, :class:`GenerationRequest`).
    """

    max_new_tokens: int = 20
    do_sample: bool | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    watermark: bool = False
    stop: Sequence[str] = ()
    include_stop_string: bool = False
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 5
    timeout_s: float | None = None
    top_logprobs: int = 0
    constraint: Constraint | None = None
    n: int = 1

    def __post_init__(self) -> None:
        """Sequences kept as tuples (a ``stop`` given as one string is that one stop string),
        ``logit_bias`` as sorted pairs (the value stays immutable and hashable).

        Raises:
            TypeError: a field of the wrong type (an int, a number, a flag, strings), named.
        """
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                           else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_types(self)

    def requests(self, prompt_ids: Sequence[int]) -> list[GenerationRequest]:
        """The :attr:`n` engine requests of ``prompt_ids`` (whose length ``LLM.prompt_ids``
        checked), each with its own copy of the ids and its own request id, sample ``j``
        seeded ``seed + j`` (mod 2**63; the seed drawn here when :attr:`seed` is ``None``).

        Raises:
            ValueError: a field out of range, or ``n < 1``.
        """
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        seed = secrets.randbelow(MAX_SEED + 1) if self.seed is None else self.seed
        stop = StopCriteria(max_new_tokens=self.max_new_tokens, stop_strings=self.stop,
                            include_stop_string=self.include_stop_string,
                            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                            min_tokens=self.min_tokens)
        return [GenerationRequest(prompt_ids=list(prompt_ids),
                                  sampling=self._sampling(seed if j == 0
                                                          else (seed + j) % (MAX_SEED + 1)),
                                  stop=stop, priority=self.priority, timeout_s=self.timeout_s,
                                  top_logprobs=self.top_logprobs, constraint=self.constraint)
                for j in range(self.n)]

    def _sampling(self, seed: int) -> SamplingParams:
        do_sample = self.do_sample
        if do_sample is None:
            do_sample = (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0
                         or self.typical_p < 1.0 or self.min_p > 0)
        return SamplingParams(
            do_sample=do_sample, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, typical_p=self.typical_p,
            repetition_penalty=self.repetition_penalty, seed=seed, watermark=self.watermark,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, min_p=self.min_p)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the engine reports it.

    Attributes:
        token_id: the sampled token.
        text: the new text this token completes (``""`` while a UTF-8 character or a possible
            stop string is still incomplete; held-back text comes with a later token).
        index: 0-based position in the output.
        logprob: natural log of the token's probability under the processed distribution.
        prefill_time_ms: on the first token: ms from the start of prefill to this token.
        decode_time_ms: on later tokens: ms since the previous token.
        finish_reason: on the last event only: ``"length"``, ``"eos_token"``, ``"stop_sequence"``.
        generated_text: on the last event only: the whole output text.
        prompt_tokens: number of prompt tokens (all events).
        cached_tokens: how many of them were not prefilled: their KV came from the prefix
            cache (all events; 0 on a miss or with the cache off).
        top_logprobs: when the request asked for ``top_logprobs > 0``: the most likely
            ``(token_id, logprob)`` pairs of the distribution ``logprob`` comes from, most
            likely first; else ``None``.
        proposed_tokens, accepted_tokens: tokens speculative decoding has proposed for this
            request so far and verified, and those of them kept (all events).
    """

    token_id: int
    text: str
    index: int
    logprob: float
    prefill_time_ms: float | None = None
    decode_time_ms: float | None = None
    finish_reason: str | None = None
    generated_text: str | None = None
    prompt_tokens: int = 0
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


class ErrorKind(enum.StrEnum):
    """Why the engine could not complete a request (the API answers each with its status:
    :class:`tiny_mindie.api.errors.Kind` has a member of the same name for each)."""

    TOO_LONG = "too_long"      # the prompt has more tokens than maxInputTokenLen
    EMPTY = "empty"            # the prompt has no token
    TIMEOUT = "timeout"        # a client, token or end-to-end time limit passed
    CANCELLED = "cancelled"    # the caller left, or read its events too slowly
    STOPPED = "stopped"        # the engine is stopping or draining
    INTERNAL = "internal"      # a bug in generation


class GenerationError(Exception):
    """A request could not be completed.

    Attributes:
        kind: an :class:`ErrorKind` (its value may be given, e.g. ``"timeout"``).
        message: text for the client, in MindIE's wording where MindIE has one.
        limit, length: for a prompt too long (:meth:`too_long`), the most tokens a prompt may
            have and the prompt's token count (``None`` for other errors).
        at_least: ``length`` is a lower bound of the prompt's token count (the text was
            refused by its size, not tokenized).

    Raises:
        ValueError: ``kind`` is no :class:`ErrorKind`.
    """

    def __init__(self, kind: ErrorKind | str, message: str, *, limit: int | None = None,
                 length: int | None = None, at_least: bool = False):
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.limit = limit
        self.length = length
        self.at_least = at_least

    @classmethod
    def stopped(cls) -> GenerationError:
        """:attr:`ErrorKind.STOPPED`: the engine is stopping or draining (MindIE's words)."""
        return cls(ErrorKind.STOPPED, "The service has been stopped.")

    @classmethod
    def too_long(cls, limit: int, length: int, *, at_least: bool = False) -> GenerationError:
        """A prompt of ``length`` tokens (``at_least``: a lower bound) over ``limit``
        (``maxInputTokenLen``): :attr:`ErrorKind.TOO_LONG` in MindIE's words."""
        return cls(ErrorKind.TOO_LONG,
                   "Failed to enqueue inferRequest. This model's maximum input ids length cannot "
                   f"be greater than {limit},the input ids length is "
                   f"{'at least ' if at_least else ''}{length}",
                   limit=limit, length=length, at_least=at_least)


_INTS = ("max_new_tokens", "top_k", "min_tokens", "priority", "top_logprobs", "n")
_NUMBERS = ("temperature", "top_p", "typical_p", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty")
_FLAGS = ("watermark", "include_stop_string", "ignore_eos")


def _check_types(p: GenerationParams) -> None:
    """Raises ``TypeError`` naming the first field of ``p`` of the wrong type (a bool is no
    int or number here, as JSON tells them apart)."""
    def is_int(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    def is_number(v) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    wrong = [(n, "an int") for n in _INTS if not is_int(getattr(p, n))]
    wrong += [(n, "a number") for n in _NUMBERS if not is_number(getattr(p, n))]
    wrong += [(n, "True or False") for n in _FLAGS if not isinstance(getattr(p, n), bool)]
    wrong += [(n, f"{what} or None") for n, what, ok in (
        ("do_sample", "True, False", isinstance(p.do_sample, bool)),
        ("seed", "an int", is_int(p.seed)), ("timeout_s", "a number", is_number(p.timeout_s)))
        if getattr(p, n) is not None and not ok]
    if not all(isinstance(s, str) for s in p.stop):
        wrong.append(("stop", "a string or a list of strings"))
    if not all(is_int(i) for i in p.stop_token_ids):
        wrong.append(("stop_token_ids", "a list of ints"))
    if wrong:
        name, what = wrong[0]
        raise TypeError(f"{name} must be {what}, got {repr(getattr(p, name))[:80]}")
