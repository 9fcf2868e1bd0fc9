"""The two ways ``python -m tiny_mindie chat`` talks to a model, behind one interface
(:class:`Answerer`): a conversation (OpenAI-style messages) and sampling options in, the answer's
pieces out as they come, then its :class:`Stats`.

* :class:`LocalChat`: the model loaded in this process; each turn goes through the pipeline of
  ``POST /v1/chat/completions`` (:func:`~.api.openai_request.parse_chat`,
  :func:`~.api.openai_chat.prepare_chat` -- the model's chat template --,
  :func:`~.api.openai_answer.make_requests` and :class:`~.api.openai_answer.Split`, which keeps
  the reasoning apart), without HTTP.
* :class:`RemoteChat`: a running server's ``/v1/chat/completions`` (``--url``), streamed as SSE,
  over mutual TLS with the configuration's client certificate (plain HTTP for ``http://``).

A piece is ``(kind, text)``: ``kind`` is ``"content"`` or ``"reasoning"``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

#: What the terminal is given: ``on_piece(kind, text)``.
OnPiece = Callable[[str, str], None]


class ChatError(Exception):
    """A turn the model could not answer: the server's or the pipeline's message (one line)."""


@dataclass
class Stats:
    """One answer's counts: prompt tokens, those served from the prefix cache, generated
    tokens, the time to the first token and the whole answer's time (seconds)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second after the first one (0.0 below two tokens)."""
        span = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 \
            else 0.0

    def line(self) -> str:
        """``prompt P tokens (C cached), N tokens, TTFT T ms, R tokens/s``."""
        return (f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
                f"{self.completion_tokens} tokens, TTFT {self.ttft_s * 1000:.0f} ms, "
                f"{self.tokens_per_s:.1f} tokens/s")


def request_body(model: str, messages: list[dict], options: dict) -> dict:
    """The ``/v1/chat/completions`` body of one streamed turn; ``options``: ``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``max_tokens`` (those not set are left out)."""
    return {"model": model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True},
            **{k: v for k, v in options.items() if v is not None}}


class Answerer:
    """What the chat needs of a model: its name and one streamed answer per turn."""

    model: str

    def answer(self, messages: list[dict], options: dict, on_piece: OnPiece) -> Stats:
        """Stream the answer to ``messages``; raises :class:`ChatError`, or
        ``KeyboardInterrupt`` (the answer is then stopped, in the engine or the server)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the model or the connection."""


class LocalChat(Answerer):
    """The in-process model (an :class:`~.llm.LLM`) through the OpenAI chat pipeline."""

    def __init__(self, llm):
        self.llm = llm
        self.model = llm.model_name

    def answer(self, messages: list[dict], options: dict, on_piece: OnPiece) -> Stats:
        body = json.dumps(request_body(self.model, messages, options)).encode()
        # asyncio.run turns Ctrl-C into a cancellation of _answer (its streams are closed,
        # which cancels the request in the engine), then raises KeyboardInterrupt here.
        return asyncio.run(self._answer(body, on_piece))

    async def _answer(self, body: bytes, on_piece: OnPiece) -> Stats:
        from ..api.drive import merged
        from ..api.errors import APIError
        from ..api.openai.answer import Split, counted, make_requests
        from ..api.openai.chat import prepare_chat
        from ..api.openai.request import parse_chat
        from ..engine.request import GenerationError

        llm, stats, t0 = self.llm, Stats(), time.monotonic()
        try:
            chat, messages, extra, tools = parse_chat(SimpleNamespace(llm=llm), body)
            p = await prepare_chat(llm, chat, messages, extra, tools)
            requests = (await make_requests(llm, p))[0]
            split = Split(p.answer) if p.answer is not None else None
            async for _, ev in merged(llm, requests):
                if not stats.completion_tokens:
                    stats.ttft_s = time.monotonic() - t0
                stats.prompt_tokens, stats.cached_tokens = ev.prompt_tokens, ev.cached_tokens
                stats.completion_tokens += counted(ev)
                deltas = split.feed(ev) if split is not None else [{"content": ev.text}]
                _pieces(deltas, on_piece)
        except APIError as err:
            raise ChatError(err.message) from None
        except GenerationError as err:
            raise ChatError(str(err)) from None
        stats.total_s = time.monotonic() - t0
        return stats

    def close(self) -> None:
        self.llm.close()


def _pieces(deltas: list[dict], on_piece: OnPiece) -> None:
    """The ``content`` and ``reasoning_content`` of OpenAI chat deltas, to ``on_piece``."""
    for delta in deltas:
        if delta.get("reasoning_content"):
            on_piece("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            on_piece("content", delta["content"])


class RemoteChat(Answerer):
    """A running server at ``url`` (``https://HOST:PORT`` or ``http://HOST:PORT``).

    Args:
        url: the server's business address.
        ssl_context: the client context (trusting the CA, presenting the client certificate)
            for ``https``; ignored for ``http``.
        timeout: seconds a connection or a read may wait.

    Raises:
        ChatError: the URL is not ``http(s)://HOST[:PORT]``, or the server cannot be reached or
            names no model (``GET /v1/models``).
    """

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None, timeout: float = 600.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise ChatError(f"--url must be https://HOST:PORT (or http://), got {url!r}")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl_context, self.timeout = ssl_context, timeout
        status, raw = self._get("/v1/models")
        try:
            self.model = json.loads(raw)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatError(f"{url}/v1/models answered {status}: {_message(raw)}") from None

    def _connection(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, context=self.ssl_context,
                                               timeout=self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = self._connection()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ChatError(f"cannot reach {self.scheme}://{self.host}:{self.port}: "
                            f"{exc}") from None
        finally:
            conn.close()

    def answer(self, messages: list[dict], options: dict, on_piece: OnPiece) -> Stats:
        body = json.dumps(request_body(self.model, messages, options)).encode()
        conn, stats, t0 = self._connection(), Stats(), time.monotonic()
        try:      # closing the connection (Ctrl-C too) cancels the request in the server
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ChatError(f"the server answered {resp.status}: {_message(resp.read())}")
            for data in _sse_data(resp):
                self._event(json.loads(data), stats, t0, on_piece)
        except (OSError, http.client.HTTPException) as exc:
            raise ChatError(f"{self.scheme}://{self.host}:{self.port}: {exc}") from None
        finally:
            conn.close()
        stats.total_s = time.monotonic() - t0
        return stats

    @staticmethod
    def _event(chunk: dict, stats: Stats, t0: float, on_piece: OnPiece) -> None:
        """One SSE chunk: its deltas, its ``usage``, or the error a stream ends with."""
        if "error" in chunk:
            raise ChatError(f"the server: {_message(json.dumps(chunk).encode())}")
        usage = chunk.get("usage")
        if usage:
            stats.prompt_tokens = usage.get("prompt_tokens", 0)
            stats.completion_tokens = usage.get("completion_tokens", 0)
            stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if not stats.ttft_s and (delta.get("content") or delta.get("reasoning_content")):
                stats.ttft_s = time.monotonic() - t0
            _pieces([delta], on_piece)


def _sse_data(resp) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response as they come, up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


def _message(raw: bytes) -> str:
    """The ``error.message`` (or ``error``, ``message``) of an error body, else its text."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:500]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)
