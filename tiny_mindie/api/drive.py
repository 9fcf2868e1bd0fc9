"""The driver of every API family's generation routes: from validated parameters to the
engine and back to the wire. A family module keeps only its request parsing and the shapes of
its answers; what they share is here, once:

* :func:`route` and :func:`serve`: a family's route, and the one wrapper every route's handler
  runs in: the app's refusal while the model loads, the request counted in ``/metrics``, its
  errors answered in the family's style and their reason reported to the request's record;
* :func:`build`: a prompt's engine requests (tokenized off the event loop, its length checked
  once, ``LLM.make_requests``), its ``n`` samples seeded ``seed + j``;
* :func:`events`: one engine stream, whose events' counts and outcome it adds to the request's
  record (the router's :class:`~tiny_mindie.server.routing.RequestRecord`, which the handler
  gets as ``stream.record``); every generation of a route goes through it;
* :func:`merged` and :func:`collect`: several engine streams at once through one bounded queue
  (a slow client holds the engine back, and the engine cuts it off as it would a single
  stream), every stream closed on every way out;
* :func:`send_stream`: a streamed answer -- the first event awaited before the head (so an
  error before any token keeps its own HTTP status), each event in the family's shape, an
  engine error after the head written in the family's style, the engine streams closed; its
  framing on the wire (:class:`Framing`) one of :data:`SSE_EVENTS`, :data:`OPENAI_EVENTS`,
  :data:`NAMED_EVENTS`, :data:`NUL_JSON`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

from ..engine.request import GenerationError, GenerationParams, GenerationRequest, TokenEvent
from ..llm import LLM
from ..server.conn import Response, ResponseStream, json_text
from ..server.http import Request
from ..server.routing import CANCELLED, SUCCESS, RequestRecord, Route, RouteHandler
from ..server.sse import sse_event, utf8
from .errors import MINDIE, APIError, Style, from_generation_error
from .metrics import RequestCounters

SSE = "text/event-stream"
_END = object()


def route(method: str, path: str, plane: str, handler: RouteHandler, *, style: Style = MINDIE,
          generation: bool = False) -> Route:
    """A family's route: its errors are answered in ``style`` and ``generation`` routes are
    counted in ``/metrics``, once the app has put it in :func:`serve`."""
    return Route(method, path, plane, handler, generation=generation, style=style)


def serve(route: Route, refusal: Callable[[Route], APIError | None],
          requests: RequestCounters) -> Route:
    """``route`` with its handler in the one wrapper every route runs in. For each request:
    ``refusal(route)`` (the app's answer while the model loads, or on a route the models
    served lack) is raised instead of running the handler; a generation route's request is
    counted in ``requests`` (received now, its outcome once its access record is written);
    every :class:`APIError` -- the handler's own, the shared validators', the engine's, the
    refusal -- is answered in the route's style and its kind's reason reported to the
    request's record (``stream.record``: the routes must be served by a
    :class:`~tiny_mindie.server.routing.Router`)."""
    style, handler = route.style or MINDIE, route.handler

    async def served(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        record: RequestRecord = stream.record
        try:
            refused = refusal(route)
            if refused is not None:
                raise refused
            if route.generation:
                requests.request_received()
                record.ended.append(requests.request_done)
            return await handler(req, stream, params)
        except APIError as err:
            err.style = style
            record.report(err.kind.reason)
            raise
    return dataclasses.replace(route, handler=served)


# ---- requests ----------------------------------------------------------------------------
async def build(llm: LLM, prompt: str | Sequence[int],
                params: GenerationParams) -> list[GenerationRequest]:
    """``LLM.make_requests(prompt, params)`` in a worker thread (a long prompt must not stall
    the event loop): ``params.n`` requests, sample ``j`` seeded ``seed + j``.

    Raises:
        APIError: 424 when the prompt cannot fit (422 when it has no token).
    """
    try:
        return await asyncio.to_thread(llm.make_requests, prompt, params)
    except GenerationError as err:
        raise from_generation_error(err) from None


# ---- engine streams ----------------------------------------------------------------------
async def events(llm: LLM, request: GenerationRequest,
                 record: RequestRecord | None = None) -> AsyncIterator[TokenEvent]:
    """The token events of ``request`` (``LLM.stream_async``), each event's counts added to
    the request's ``record`` (``None``: none) -- the prompt and cached tokens and the first
    token's time with the first event, one generated token with each, the output with the
    last -- and its outcome reported there: success at the last event, the error's reason, or
    ``cancelled`` when closed before its end (which cancels it in the engine).

    Raises:
        GenerationError: from the engine.
    """
    source = llm.stream_async(request)
    tally = record if record is not None else RequestRecord("", 0.0)   # outside a request
    ended = False
    try:
        async for ev in source:
            if ev.index == 0:
                tally.first_token_out()
                tally.count("prompt_tokens", ev.prompt_tokens)
                tally.count("cached_tokens", ev.cached_tokens)
            tally.count("generated_tokens", 1)
            if ev.is_last:
                ended = True
                tally.report(SUCCESS)
                tally.keep_output(ev.generated_text or "")
            yield ev
    except GenerationError as err:
        ended = True
        tally.report(from_generation_error(err).kind.reason)
        raise
    finally:
        if not ended:
            tally.report(CANCELLED)
        await source.aclose()


async def merged(llm: LLM, requests: Sequence[GenerationRequest], *,
                 stop: asyncio.Event | None = None, record: RequestRecord | None = None
                 ) -> AsyncIterator[tuple[int, TokenEvent]]:
    """``(index in requests, event)`` of all ``requests`` as they come, until each has its
    last event or ``stop`` is set (Triton's stopInfer), counted in ``record`` (:func:`events`).
    The streams run concurrently into a queue of ``max(4, 2 * len(requests))`` events: a slow
    consumer holds them back (the engine cuts them off past ``max_buffered_events``). Closing
    this iterator, an error or a cancellation closes every stream (cancelling it in the engine).

    Raises:
        GenerationError: the first engine error.
    """
    if len(requests) == 1 and stop is None:     # one stream needs no queue
        async with contextlib.aclosing(events(llm, requests[0], record)) as source:
            async for ev in source:
                yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(4, 2 * len(requests)))

    async def pump(i: int, r: GenerationRequest) -> None:
        source = events(llm, r, record)
        try:
            async for ev in source:
                await queue.put((i, ev))
        except GenerationError as err:
            await queue.put((i, err))
        finally:
            await source.aclose()

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    stopped = None if stop is None else asyncio.ensure_future(stop.wait())
    get: asyncio.Future | None = None
    remaining = len(requests)
    try:
        while remaining:
            if stopped is None:
                i, item = await queue.get()
            else:
                if stop.is_set():
                    return
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():      # stop wins over an event that came at the same time
                    get.cancel()
                    return
                i, item = get.result()
            if isinstance(item, GenerationError):
                raise item
            if item.is_last:
                remaining -= 1
            yield i, item
    finally:
        for waiter in (stopped, get):       # a client gone while we wait: leave no task behind
            if waiter is not None:
                waiter.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_done_or_gone(work, stream: ResponseStream, poll_s: float = 0.2):
    """Await ``work`` (a coroutine), cancelling it -- and so its requests in the engine -- when
    the client disconnects meanwhile; returns ``None`` then.

    Raises:
        APIError: the engine's error (424, 500, 503, ...).
    """
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and stream.peer_gone():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
        return task.result()
    except GenerationError as err:
        raise from_generation_error(err) from None
    finally:
        if not task.done():   # we were cancelled ourselves
            task.cancel()


async def collect(llm: LLM, requests: Sequence[GenerationRequest], stream: ResponseStream, *,
                  stop: asyncio.Event | None = None) -> list[list[TokenEvent]] | None:
    """Every request's events (as :func:`merged` gives them, so up to ``stop``, their counts
    in ``stream.record``), one list per request; ``None`` when the client left meanwhile (the
    requests are then cancelled).

    Raises:
        APIError: the first engine error (the other requests are cancelled).
    """
    async def run() -> list[list[TokenEvent]]:
        got: list[list[TokenEvent]] = [[] for _ in requests]
        source = merged(llm, requests, stop=stop, record=stream.record)
        try:
            async for i, ev in source:
                got[i].append(ev)
        finally:
            await source.aclose()
        return got
    return await until_done_or_gone(run(), stream)


# ---- streamed answers --------------------------------------------------------------------
@dataclass(frozen=True)
class Framing:
    """How a streamed answer's objects go on the wire.

    Attributes:
        content_type: the answer's ``Content-Type``.
        nul_framed: each object as JSON followed by a NUL byte (vLLM 0.2), not an SSE event.
        named: each SSE event's ``event:`` field the object's ``type`` (Anthropic's and OpenAI
            Responses' streams).
        done: a last event sent in any case (OpenAI's ``[DONE]``); ``None``: none.
    """

    content_type: str = SSE
    nul_framed: bool = False
    named: bool = False
    done: str | None = None


SSE_EVENTS = Framing()
OPENAI_EVENTS = Framing(done="[DONE]")
NAMED_EVENTS = Framing(named=True)
NUL_JSON = Framing(content_type="application/json", nul_framed=True)


async def send_stream(stream: ResponseStream, items: AsyncIterator, style: Style,
                      render: Callable[[object], Iterable[dict]], *,
                      opening: Iterable[dict] = (),
                      closing: Callable[[], Iterable[dict]] = tuple,
                      framing: Framing = SSE_EVENTS) -> None:
    """Stream ``items`` (an iterator of :func:`merged`) as one answer.

    The first item is awaited before the head, so that an error before any token (prompt too
    long, service stopped, timeout in the queue) is answered with its own status. Then: the
    head (200, ``framing.content_type``); the ``opening`` objects; each item's
    ``render(item)`` objects; once ``items`` end, the ``closing()`` objects. An engine error
    after the head is sent as the last object, in ``style``; ``framing.done`` (OpenAI's
    ``[DONE]``) follows in any case. Each object goes as ``framing`` says (:class:`Framing`).
    ``items`` is closed on every way out.

    Raises:
        APIError: an engine error before the first item.
        ConnectionError: the client left (the requests are cancelled).
    """
    try:
        try:
            first = await anext(items, _END)
        except GenerationError as err:
            raise from_generation_error(err) from None
        out = await stream.start(200, framing.content_type)   # may be gone: ConnectionError

        async def send(obj) -> None:
            text = obj if isinstance(obj, str) else json_text(obj)
            if framing.nul_framed:
                await out.send(utf8(text) + b"\0")
            elif framing.named and isinstance(obj, dict) and isinstance(obj.get("type"), str):
                await out.send(utf8(f"event: {obj['type']}\n") + sse_event(text))
            else:
                await out.send_event(text)

        try:
            for obj in opening:
                await send(obj)
            item = first
            while item is not _END:
                for obj in render(item):
                    await send(obj)
                item = await anext(items, _END)
            for obj in closing():
                await send(obj)
        except GenerationError as err:
            await send(style.body(from_generation_error(err)))
        if framing.done is not None:
            await send(framing.done)
        await out.end()
    finally:
        await items.aclose()
