"""In-process API: load a model and generate, plain or streaming, without the HTTP server.

    >>> from tiny_mindie import LLM
    >>> llm = LLM()                                   # the default model, pulled if missing
    >>> llm.generate("The capital of France is", max_new_tokens=8, do_sample=False).text
    ' Paris. ...'
    >>> for ev in llm.stream("Once upon a time", max_new_tokens=16, seed=7):
    ...     print(ev.text, end="", flush=True)

The HTTP server is built on this class: every route ends in :meth:`LLM.stream_async`.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .engine.draft_load import DRAFT_NEEDS, check_draft, load_draft
from .engine.engine import Engine, EngineLimits
from .engine.request import (
    MAX_SEED,
    ErrorKind,
    GenerationError,
    GenerationParams,
    GenerationRequest,
    TokenEvent,
)
from .model.loader import load_model
from .model.options import BackendOptions
from .model.registry.catalog import DEFAULT_MODEL, resolve

__all__ = ["LLM", "GenerationParams", "Completion", "MAX_SEED"]
#: Longest text (characters) :meth:`LLM.encode_tail` tokenizes whole (exactly): at most 1 MB of
#: UTF-8, so that the time and memory its tokenization takes stay bounded.
TAIL_LIMIT = 250_000
_WORD_START = re.compile(r"(?<=\S) (?=\S)")
#: :class:`LLM`'s keywords that are neither options nor limits, and their defaults.
OWN_KEYWORDS: dict[str, Any] = {"num_slots": None, "kv_cache_mb": 1024,
                                "parse_special_tokens": True, "model_name": None,
                                "draft_model": None}
#: The keywords :class:`LLM` takes besides ``model``, ``options``, ``limits`` and ``log``: the
#: fields of :class:`~.model.options.BackendOptions` and :class:`~.engine.engine.EngineLimits`
#: the configuration sets, and :data:`OWN_KEYWORDS`.
KEYWORDS = frozenset({"backend", "threads", "parallel_runs", "batch_invariant", "weights",
                      "device_id", "providers", "graph", "kernels", "standard_dtype",
                      "speculation", "max_seq_len", "max_input_len", "max_iter_times",
                      "token_timeout_s", "e2e_timeout_s", "schedule", "prefix_cache",
                      *OWN_KEYWORDS})


@dataclass(frozen=True)
class Completion:
    """A finished generation.

    Attributes:
        text: the generated text (prompt not included).
        token_ids: generated ids, EOS included when generation ended on it.
        finish_reason: ``"length"``, ``"eos_token"`` or ``"stop_sequence"``.
        seed: the seed used (drawn by the server when not given).
        prompt_tokens: prompt length in tokens.
        logprobs: natural-log probability of each generated token.
        prefill_time_ms: time from the start of prefill to the first token, ms.
        cached_tokens: prompt tokens whose KV came from the prefix cache (not prefilled).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    seed: int
    prompt_tokens: int
    logprobs: list[float]
    prefill_time_ms: float
    cached_tokens: int = 0


class LLM:
    """A loaded model with its continuous-batching engine.

    Args:
        model: a ``.gguf`` path or a registry name (pulled on first use).
        options: the backend's choices (:class:`~tiny_mindie.model.options.BackendOptions`);
            ``None``: its defaults.
        limits: the engine's limits (:class:`~tiny_mindie.engine.engine.EngineLimits`);
            ``None``: its defaults. Its ``schedule.max_batch_size`` is capped by the KV slots.
        log: where progress lines go (``print`` by default; ``None`` for silence).
        settings: keywords of :data:`KEYWORDS`, each overriding the same-named field of
            ``options`` and of ``limits`` (``speculation`` is a field of both):

            - of the options: ``backend`` (``"onnxruntime"``, the default, or ``"numpy"``, the
              reference decoder), ``threads``, ``parallel_runs``, ``batch_invariant``,
              ``weights`` (``exact`` or ``compact``), ``device_id``, ``providers``, ``graph``
              (``auto``, ``contrib`` or ``standard``), ``kernels``, ``standard_dtype``,
              ``speculation``;
            - of the limits: ``max_seq_len`` (prompt + output tokens per sequence),
              ``max_input_len`` (prompt tokens at most), ``max_iter_times``,
              ``token_timeout_s``, ``e2e_timeout_s``, ``schedule`` (batching limits),
              ``prefix_cache`` (reuse the KV of prompt prefixes seen before),
              ``speculation`` (speculative decoding by prompt lookup);
            - the model's own (:data:`OWN_KEYWORDS`): ``num_slots`` (sequences decoded
              together; default from ``kv_cache_mb``), ``kv_cache_mb`` (the KV-cache budget
              in MB used to size ``num_slots``), ``parse_special_tokens`` (whether control
              tokens written in a text prompt, ``<|im_start|>``, become their ids,
              :meth:`encode`; False keeps them plain text), ``model_name`` (the name clients
              use; default the file's ``general.name``) and ``draft_model`` (a ``.gguf`` path
              or registry name of a smaller model with the same vocabulary, loaded beside this
              one to propose tokens for speculative decoding, :mod:`tiny_mindie.engine.draft`;
              needs ``speculation`` and the onnxruntime backend; ``None``: prompt lookup
              alone).

    Attributes:
        model_meta: what the model file says of the model, in llama-server's ``meta`` terms
            (:func:`model_meta`).
        options: the backend's choices it was loaded with.

    Raises:
        TypeError: a keyword not in :data:`KEYWORDS`.
        ModelFileError: the model file (or the draft's) is missing, a directory, unreadable or
            unsupported, or the draft's vocabulary is not the model's (both found before
            anything is built: :func:`~.engine.draft_load.check_draft`).
        ValueError: an unknown backend, a weight mode the backend does not take, or a draft
            model without speculation on the onnxruntime backend.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, options: BackendOptions | None = None,
                 limits: EngineLimits | None = None, log=print, **settings):
        say = log or (lambda _msg: None)
        # the options are checked when made (BackendOptions): before a pull
        options, limits, own = resolve_settings(settings, options, limits)
        if own["draft_model"] and (options.backend != "onnxruntime" or not options.speculation):
            raise ValueError(DRAFT_NEEDS)
        self.options = options
        self.parse_special_tokens = own["parse_special_tokens"]
        self.model_path = resolve(model, log=say)
        # the draft's file and vocabulary, from both headers: before either graph is built
        draft_path = (check_draft(self.model_path, own["draft_model"], say)
                      if own["draft_model"] else None)
        t0 = time.monotonic()
        say(f"loading {self.model_path} on the {options.backend} backend ...")
        gguf_file, self.config, self.tokenizer, self.backend = load_model(
            self.model_path, options, num_slots=own["num_slots"], kv_cache_mb=own["kv_cache_mb"],
            max_batch=limits.schedule.max_batch_size, max_seq_len=limits.max_seq_len)
        num_slots = self.backend.num_slots
        if self.backend.max_seq_len < limits.max_seq_len:
            say(f"maxSeqLen {limits.max_seq_len} is more than the model's trained context; "
                f"using {self.backend.max_seq_len}")
        self.model_name = own["model_name"] or gguf_file.get("general.name") or model
        self.model_meta = model_meta(gguf_file, self.config)
        # The reader's parsed metadata (~160 MB for a 49k vocabulary) is not needed any more.
        del gguf_file
        gc.collect()
        self.load_time_s = time.monotonic() - t0
        say(f"loaded {self.config.architecture} model ({self.config.num_layers} layers, "
            f"vocab {self.config.vocab_size}) in {self.load_time_s:.1f} s; "
            f"{num_slots} KV slots x {self.backend.max_seq_len} tokens on {self.backend.device}"
            + _mapped_note(self.backend))
        try:
            self.draft = load_draft(draft_path, self.backend, self.tokenizer, options, say,
                                    limits.schedule.max_prefill_tokens) if draft_path else None
        except BaseException:
            self.backend.close()
            raise
        schedule = replace(limits.schedule,
                           max_batch_size=min(limits.schedule.max_batch_size, num_slots))
        self.engine = Engine(self.backend, self.tokenizer,
                             replace(limits, schedule=schedule,
                                     speculation=limits.speculation and options.speculation),
                             draft=self.draft)
        self.engine.start()
        self._longest_token = max(1, max(len(self.tokenizer.token_bytes(i))
                                         for i in range(self.tokenizer.vocab_size)))

    # ---- requests -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Prompt ids for ``text``, BOS added when the model wants it: control tokens written in
        it are parsed when :attr:`parse_special_tokens` (the default), else plain text. (Chat
        prompts are encoded otherwise: :func:`tiny_mindie.api.chat_template.encode_chat`.)"""
        return self.tokenizer.encode(text, parse_special=self.parse_special_tokens)

    def encode_tail(self, text: str, n: int) -> list[int]:
        """The last ``n`` ids of :meth:`encode` (TGI's ``truncate``).

        A text of up to :data:`TAIL_LIMIT` characters (or ``5 L``, below) is tokenized whole:
        exact. Only the end of a longer one is (tokenizing a text of many megabytes whole
        takes long and much memory): it is cut just before a word (a single space between two
        non-space characters) at least
        ``L = (n + 64) * longest_token`` characters from its end (so at least ``n + 64`` tokens
        follow), and again about ``3 L`` further back; when both tails end in the same ``n``
        ids those are the answer (ordinary text: the whole text's ids, tested), else the longer
        tail's. That is a valid tokenization of the same characters, but behind a long unbroken
        run (or, for SentencePiece vocabularies, pieces that span a space) its last ids can
        differ from what tokenizing the whole text would give.
        """
        keep = (n + 64) * self._longest_token
        if len(text) <= max(TAIL_LIMIT, 5 * keep):
            return self.encode(text)[-n:]

        def tail(start: int) -> list[int]:
            return self.tokenizer.encode(text[start:], add_bos=False,
                                         parse_special=self.parse_special_tokens)[-n:]

        cuts = []
        for back in (keep, 4 * keep):           # a word start in [end - back - keep, end - back]
            m = _WORD_START.search(text, len(text) - back - keep, len(text) - back)
            cuts.append(None if m is None else m.start())
        if None not in cuts:
            near, far = tail(cuts[0]), tail(cuts[1])
            if near == far:
                return near
        return tail(len(text) - 5 * keep if cuts[1] is None else cuts[1])

    def check_text_length(self, text: str) -> None:
        """The first step of :meth:`prompt_ids` for a text: refuse one that holds more tokens
        than any prompt may, without tokenizing it: every token covers at most
        ``longest_token`` bytes, so ``bytes // longest_token`` is a lower bound of its token
        count (a huge text is refused before tokenizing it would cost time and memory in
        proportion to its size).

        Raises:
            GenerationError: ``"too_long"`` (HTTP 424) with MindIE's message.
        """
        at_least = len(text.encode("utf-8", "surrogatepass")) // self._longest_token
        if at_least > self.engine.max_input_len:
            raise GenerationError.too_long(self.engine.max_input_len, at_least, at_least=True)

    def prompt_ids(self, prompt: str | Sequence[int],
                   encode: Callable[[str], list[int]] | None = None) -> list[int]:
        """The token ids of a prompt that fits: the one check of a prompt's length, which
        every route's prompt goes through once (the engine trusts it). A text is first refused
        by its length alone (:meth:`check_text_length`), then tokenized by ``encode``
        (:meth:`encode` by default; the chat's encoder shields the client's strings); the ids
        must number 1 .. ``maxInputTokenLen``.

        Raises:
            TypeError: ``prompt`` is neither a text nor a sequence of token ids.
            GenerationError: ``"too_long"`` (HTTP 424), ``"empty"`` (HTTP 422).
        """
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            ids = (encode or self.encode)(prompt)
        elif isinstance(prompt, Sequence) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
        else:
            raise TypeError("prompt must be a str or a sequence of token ids, "
                            f"got {type(prompt).__name__}")
        limit = self.engine.max_input_len
        if len(ids) > limit:
            raise GenerationError.too_long(limit, len(ids))
        if not ids:
            raise GenerationError(ErrorKind.EMPTY, "Inputs must not be empty.")
        return ids

    def make_requests(self, prompt: str | Sequence[int],
                      params: GenerationParams) -> list[GenerationRequest]:
        """The ``params.n`` requests of ``prompt``: its ids checked once (:meth:`prompt_ids`),
        sample ``j`` seeded ``seed + j`` (:meth:`GenerationParams.requests`).

        Raises:
            ValueError: a parameter out of range.
            TypeError, GenerationError: as :meth:`prompt_ids`.
        """
        return params.requests(self.prompt_ids(prompt))

    def make_request(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                     **fields) -> GenerationRequest:
        """One :class:`GenerationRequest` for ``prompt``: from ``params``, or from the
        keyword ``fields`` of a :class:`~tiny_mindie.engine.request.GenerationParams`
        (``max_new_tokens``, ``do_sample``, ``temperature``, ``seed``, ``stop``, ...).
        ``do_sample=None`` samples when any of temperature, top_k, top_p, typical_p, min_p
        is set away from its neutral value (TGI's rule), else decodes greedily;
        ``seed=None`` draws one.

        Raises:
            TypeError: both ``params`` and ``fields``, an unknown field, or a prompt of
                another type.
            ValueError: a parameter out of range, or ``n`` other than 1
                (:meth:`make_requests` builds ``n``).
            GenerationError: ``"too_long"`` when the prompt cannot fit, ``"empty"`` when it has
                no token (:meth:`prompt_ids`).
        """
        if params is None:
            params = GenerationParams(**fields)
        elif fields:
            raise TypeError("make_request takes a GenerationParams or keyword fields, not both")
        if params.n != 1:
            raise ValueError(f"make_request builds one request, n is {params.n}: use "
                             "make_requests")
        return self.make_requests(prompt, params)[0]

    def stream_async(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Token events of ``request`` (see :meth:`Engine.generate`); raises ``GenerationError``.
        Closing the iterator early (``aclose()``) cancels the request."""
        return self.engine.generate(request)

    async def generate_async(self, request: GenerationRequest) -> Completion:
        """Run ``request`` to the end; raises ``GenerationError``."""
        events = [ev async for ev in self.engine.generate(request)]
        last = events[-1]
        return Completion(text=last.generated_text or "", token_ids=[e.token_id for e in events],
                          finish_reason=last.finish_reason or "length",
                          seed=request.sampling.seed, prompt_tokens=last.prompt_tokens,
                          logprobs=[e.logprob for e in events],
                          prefill_time_ms=events[0].prefill_time_ms or 0.0,
                          cached_tokens=last.cached_tokens)

    # ---- synchronous conveniences (each call runs its own event loop) ------------------------
    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                 **fields) -> Completion:
        """Generate for ``prompt`` and wait for the end. ``params`` or ``fields``: see
        :meth:`make_request`."""
        return asyncio.run(self.generate_async(self.make_request(prompt, params, **fields)))

    def stream(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
               **fields) -> Iterator[TokenEvent]:
        """Yield token events for ``prompt`` as they are generated (``params`` or ``fields``:
        see :meth:`make_request`); stopping early cancels."""
        loop = asyncio.new_event_loop()
        agen = self.stream_async(self.make_request(prompt, params, **fields))
        try:
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(agen.aclose())
            loop.close()

    def close(self) -> None:
        """Stop the engine and release the backend."""
        self.engine.stop()
        self.backend.close()
        if self.draft is not None:
            self.draft.backend.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_settings(settings: Mapping[str, Any], options: BackendOptions | None = None,
                     limits: EngineLimits | None = None
                     ) -> tuple[BackendOptions, EngineLimits, dict[str, Any]]:
    """``(options, limits, own)``: ``options`` and ``limits`` (their defaults for ``None``)
    with the same-named fields of ``settings`` (keywords of :data:`KEYWORDS`) put in, and the
    other keywords (:data:`OWN_KEYWORDS`, their defaults where not given). ``schedule=None``
    and ``providers=None`` stand for the defaults.

    Raises:
        TypeError: a keyword not in :data:`KEYWORDS` (named, as Python names one).
        ValueError: options that do not go together (:class:`BackendOptions`).
    """
    unknown = sorted(set(settings) - KEYWORDS)
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}"
                        if len(unknown) == 1 else "LLM() got unexpected keyword arguments "
                        + ", ".join(map(repr, unknown)))
    settings = {k: v for k, v in settings.items() if not (k == "schedule" and v is None)}
    backend = {k: v for k, v in settings.items() if k in BackendOptions.names()}
    if options is None:
        options = BackendOptions(**backend)
    elif backend:
        options = replace(options, **backend)
    engine = {f.name for f in fields(EngineLimits)}
    limits = replace(limits or EngineLimits(), **{k: v for k, v in settings.items()
                                                   if k in engine})
    return options, limits, {k: settings.get(k, v) for k, v in OWN_KEYWORDS.items()}


#: llama.cpp's ``llama_vocab_type`` of each GGUF ``tokenizer.ggml.model``.
VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


def model_meta(f, config) -> dict[str, int | None]:
    """The model's figures as llama-server's ``/v1/models`` ``meta`` gives them: ``vocab_type``
    (llama.cpp's enum: 1 SentencePiece, 2 byte-level BPE, ...; ``None`` for a tokenizer it does
    not name), ``n_vocab`` (tokens), ``n_ctx_train`` (the trained context, tokens), ``n_embd``
    (the hidden size), ``n_params`` (parameters) and ``size`` (bytes of the weights as stored).

    Args:
        f: the model's :class:`~tiny_mindie.model.gguf.GGUFFile`.
        config: its :class:`~tiny_mindie.model.arch.ModelConfig`.
    """
    n_params, size = f.tensor_totals()
    tokens = f.get("tokenizer.ggml.tokens")
    return {"vocab_type": VOCAB_TYPES.get(str(f.get("tokenizer.ggml.model", ""))),
            "n_vocab": len(tokens) if tokens is not None else config.vocab_size,
            "n_ctx_train": config.context_length,
            "n_embd": config.hidden_size, "n_params": n_params, "size": size}


def _mapped_note(backend) -> str:
    """The load line's note on weights read in place from the GGUF's pages (none without)."""
    mapped = getattr(backend, "mapped_weight_bytes", 0)
    return (f"; {mapped / 1e6:.0f} MB of weights read in place from the GGUF (its file pages: "
            "shared with other processes mapping it, reclaimable)") if mapped else ""
