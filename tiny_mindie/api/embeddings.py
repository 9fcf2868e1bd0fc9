"""The embedding routes of three ecosystems, on the business plane, answered by the embedding
model (``--embedding-model``) through its batching thread
(:class:`~tiny_mindie.engine.embedder.Embedder`); bodies are checked by
:mod:`.embeddings_request`.

* OpenAI ``POST /v1/embeddings`` -> ``{"object": "list", "data": [{"object": "embedding",
  "embedding": [float, ...], "index": i}, ...], "model", "usage": {"prompt_tokens",
  "total_tokens"}}``; with ``encoding_format: "base64"`` each ``embedding`` is the base64 of
  its little-endian float32 bytes (as OpenAI sends it). Errors are OpenAI's (400 naming the
  field; 400 ``context_length_exceeded`` for an input over the context; 404 for another
  ``model``).
* Text Embeddings Inference ``POST /embed`` -> ``[[float, ...], ...]`` (one vector per input,
  also for a single string). Errors are TEI's (:class:`~.errors.TEIStyle`).
* llama-server ``POST /embedding`` -> ``[{"index": i, "embedding": [[float, ...]]}, ...]``:
  the pooled vector as a one-row matrix, as llama-server answers it for a pooling model.
  Errors are OpenAI's shape, as llama-server's.

Bodies are parsed and answers written in worker threads, off the event loop. Nothing generates,
so ``/metrics``' request counters leave these out; the embedding series count
them (:mod:`.metrics`), and each request has its access log line (``prompt_tokens``: the
tokens encoded). A server without an embedding model answers them 404; a stopping one 503.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from ..model.encoder_pool import finish
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS, SUCCESS, RequestRecord
from .drive import route
from .embeddings_request import EmbedJob, parse_llama, parse_openai, parse_tei
from .errors import OPENAI, TEI, APIError, Kind, invalid
from .manage import STOPPED
from .validate import read_json_object

PATHS = ("/v1/embeddings", "/embed", "/embedding")


def routes(app) -> list:
    """The three embedding routes of ``app``."""
    async def openai_route(req: Request, stream: ResponseStream, params: dict) -> Response:
        emb, obj = await _body(app, req)
        model = obj.get("model")
        if model is not None and model != emb.name:
            raise APIError(Kind.NOT_FOUND, f"The model `{model}` does not exist: the embedding "
                           f"model served is `{emb.name}`.", param="model",
                           code="model_not_found")
        job = await asyncio.to_thread(parse_openai, obj, emb.model.tokenizer, emb.model.config)
        vectors = await _encode(emb, job, stream.record)

        def answer() -> Response:
            data = [{"object": "embedding", "index": i,
                     "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                                   if job.base64 else v.tolist())}
                    for i, v in enumerate(vectors)]
            return json_response(200, {"object": "list", "data": data, "model": emb.name,
                                       "usage": {"prompt_tokens": job.tokens,
                                                 "total_tokens": job.tokens}})
        return await asyncio.to_thread(answer)

    async def tei_route(req: Request, stream: ResponseStream, params: dict) -> Response:
        emb, obj = await _body(app, req)
        job = await asyncio.to_thread(parse_tei, obj, emb.model.tokenizer, emb.model.config)
        vectors = await _encode(emb, job, stream.record)
        return await asyncio.to_thread(lambda: json_response(200, vectors.tolist()))

    async def llama_route(req: Request, stream: ResponseStream, params: dict) -> Response:
        emb, obj = await _body(app, req)
        job = await asyncio.to_thread(parse_llama, obj, emb.model.tokenizer, emb.model.config)
        vectors = await _encode(emb, job, stream.record)
        return await asyncio.to_thread(lambda: json_response(
            200, [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]))

    return [route("POST", "/v1/embeddings", BUSINESS, openai_route, style=OPENAI),
            route("POST", "/embed", BUSINESS, tei_route, style=TEI),
            route("POST", "/embedding", BUSINESS, llama_route, style=OPENAI)]


async def _body(app, req: Request):
    """The embedder and the request's JSON object.

    Raises:
        APIError: 404 without an embedding model, 503 while stopping, 422 for a body that is
            no JSON object (invalid UTF-8 included)."""
    emb = app.embedder
    if emb is None:
        raise APIError(Kind.NOT_FOUND, "No embedding model is served: start the server with "
                                       "--embedding-model NAME|PATH (docs/embeddings.md).")
    if app.shutdown.stopping:
        raise APIError(Kind.STOPPED, STOPPED)
    return emb, await read_json_object(req.body)


async def _encode(emb, job: EmbedJob, record: RequestRecord | None) -> np.ndarray:
    """The vectors of ``job`` (float32 ``[inputs, dimensions]``), finished as it asks; its
    tokens counted in the request's access ``record`` (``None``: none).

    Raises:
        APIError: 400 (OpenAI) / 413 (TEI) for ids the encoder refuses."""
    try:
        pooled = await asyncio.wrap_future(emb.submit(job.ids))
    except ValueError as exc:
        raise invalid(f"an input the model cannot encode: {exc}", "input") from None
    if job.p_norm is not None and job.p_norm != 2:
        vectors = _p_normalized(pooled, job.p_norm)
    elif job.p_norm == 2:
        vectors = finish(pooled)
    else:
        vectors = finish(pooled, normalize=job.normalize, dimensions=job.dimensions)
    if record is not None:
        record.count("prompt_tokens", job.tokens)
        record.report(SUCCESS)
    return vectors


def _p_normalized(v: np.ndarray, p: int) -> np.ndarray:
    """llama-server's ``embd_normalize``: -1 as they are, 0 by the largest absolute value
    (scaled to 32760), 1 taxicab, 2 Euclidean, p > 2 the p-norm; a zero vector stays zero."""
    v = v.astype(np.float64)
    if p < 0:
        return v.astype(np.float32)
    if p == 0:
        norm = np.abs(v).max(-1, keepdims=True) / 32760.0
    else:
        norm = (np.abs(v) ** p).sum(-1, keepdims=True) ** (1.0 / p)
    return np.where(norm > 0, v / np.where(norm > 0, norm, 1.0), 0.0).astype(np.float32)
