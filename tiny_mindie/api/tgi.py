"""Hugging Face TGI family (TGI 0.9.4 behaviour), spec §4; ``/generate`` with vLLM 0.2's
``prompt`` goes to :mod:`.vllm`.

Routes: ``POST /generate``, ``POST /generate_stream``, ``POST /`` (a one-element JSON array, or
a stream with ``"stream": true``), ``GET /info``. Thin adapters over the engine, like ``/infer``.

What tiny_mindie fills in:

* ``details.tokens[].logprob``: the real natural-log probability of each generated token under
  the distribution it was sampled from (MindIE leaves it null).
* ``details.prefill`` (``decoder_input_details``): the prompt's ids and texts; every ``logprob``
  is null. The backends return logits for the last position of a chunk only, so the prompt's
  own log-probabilities would cost one forward pass per prompt token; they are not computed.
* ``top_n_tokens`` (1 .. 5, TGI's default ``max_top_n_tokens``): the most likely tokens of the
  distribution each token was sampled from, with their logprobs, in ``details.top_tokens``
  (one list per generated token) and in each stream event's ``top_tokens`` (TGI >= 1.1).
* ``best_of`` (> 1) is refused (``/info`` says ``max_best_of: 1``).
* a matched ``stop`` string is kept at the end of the text, as TGI does.
* ``grammar`` (TGI >= 1.4.3): ``{"type": "json", "value": <JSON schema>}`` (alias
  ``json_object``), ``{"type": "json_schema", "value": {"name", "schema"}}`` or ``{"type":
  "regex", "value": <regex>}`` constrains the output (:mod:`.chat.structured`); when the grammar is
  complete generation ends (``finish_reason`` ``eos_token``).

Errors have TGI's (and MindIE's) shape ``{"error", "error_type"}`` with MindIE's messages and
TGI's ``error_type`` names (``validation`` 422, ``generation`` 424, ``incomplete_generation``
500, ``overloaded`` 503), so TGI's clients raise their typed exceptions.
"""

from __future__ import annotations

import asyncio
import math
import os
import re

from .._version import __version__
from ..engine.request import GenerationParams, GenerationRequest, TokenEvent
from ..llm import LLM, MAX_SEED
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS, MANAGEMENT
from .chat.structured import tgi_grammar
from .drive import build, collect, merged, route, send_stream
from .errors import TGI, invalid
from .mindie import read_inputs, read_parameters, speculation_details
from .validate import (
    INF,
    INT32_MAX,
    get_bool,
    get_float,
    get_int,
    get_stop_list,
    read_json_object,
    refuse_set,
    refuse_unknown,
)
from .vllm import vllm_generate

MAX_TOP_N_TOKENS = 5        # TGI's launcher default (--max-top-n-tokens)
MAX_STOP_SEQUENCES = 4      # TGI's default --max-stop-sequences
#: TGI's ``parameters`` (0.9.4's, ``top_n_tokens``, ``grammar``, ``adapter_id`` and
#: ``frequency_penalty`` of later versions, the last two refused when set); any other that is
#: not null is a 422 naming it.
PARAMETERS = frozenset({"best_of", "temperature", "repetition_penalty", "top_k", "top_p",
                        "typical_p", "do_sample", "max_new_tokens", "return_full_text", "stop",
                        "truncate", "watermark", "details", "decoder_input_details", "seed",
                        "top_n_tokens", "grammar", "adapter_id", "frequency_penalty"})


def _logprob(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class TGIParams:
    """A validated TGI ``parameters`` object: the request's :attr:`generation` parameters
    (``top_n_tokens`` its ``top_logprobs``) and the answer's options."""

    def __init__(self, p: dict, llm: LLM):
        refuse_unknown(p, PARAMETERS)
        # TGI 0.9.4 ranges: temperature > 0, top_p and typical_p in (0, 1), top_k > 0,
        # repetition_penalty > 0, max_new_tokens >= 1 (default 20).
        temperature = get_float(p, "temperature", None, 0.0, INF, lo_open=True, hi_open=True)
        top_k = get_int(p, "top_k", None, 1, INT32_MAX)
        top_p = get_float(p, "top_p", None, 0.0, 1.0, lo_open=True, hi_open=True)
        typical_p = get_float(p, "typical_p", None, 0.0, 1.0, lo_open=True, hi_open=True)
        do_sample = get_bool(p, "do_sample", False)
        seed = get_int(p, "seed", None, 0, MAX_SEED)
        repetition_penalty = get_float(p, "repetition_penalty", 1.0, 0.0, INF,
                                       lo_open=True, hi_open=True)
        max_new_tokens = get_int(p, "max_new_tokens", 20, 1, INT32_MAX)
        watermark = get_bool(p, "watermark", False)
        stop = get_stop_list(p, "stop", MAX_STOP_SEQUENCES)
        self.details = get_bool(p, "details", False)
        self.decoder_input_details = get_bool(p, "decoder_input_details", False)
        self.return_full_text = get_bool(p, "return_full_text", False)
        self.truncate = get_int(p, "truncate", None, 1, llm.engine.max_input_len)
        best_of = get_int(p, "best_of", None, 1, INT32_MAX)
        if best_of not in (None, 1):
            raise invalid("Parameter best_of != 1 is not allowed for this endpoint "
                          "(max_best_of is 1).")
        self.top_n_tokens = get_int(p, "top_n_tokens", None, 0, MAX_TOP_N_TOKENS) or 0
        constraint = tgi_grammar(llm.tokenizer, p.get("grammar"))
        refuse_set(p, "adapter_id")
        refuse_set(p, "frequency_penalty", (None, 0, 0.0))
        # TGI samples when do_sample is true or any warper is set (even with do_sample false).
        self.generation = GenerationParams(
            temperature=1.0 if temperature is None else temperature, top_k=top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            typical_p=1.0 if typical_p is None else typical_p,
            do_sample=True if do_sample else None, seed=seed,
            repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
            watermark=watermark, stop=stop, include_stop_string=True,
            top_logprobs=self.top_n_tokens, constraint=constraint)


def parse_tgi(obj: dict, llm: LLM) -> tuple[str, TGIParams]:
    """``{"inputs", "parameters"}`` -> (prompt text, parameters); 422 on anything malformed,
    and naming a field or parameter nothing reads."""
    refuse_unknown(obj, ("inputs", "parameters", "stream"), "Field")
    return read_inputs(obj), TGIParams(read_parameters(obj), llm)


async def _tgi_request(llm: LLM, prompt: str, params: TGIParams) -> GenerationRequest:
    if params.truncate is None:
        return (await build(llm, prompt, params.generation))[0]
    # TGI keeps the last `truncate` tokens of the prompt.
    ids = await asyncio.to_thread(llm.encode_tail, prompt, params.truncate)
    return (await build(llm, ids, params.generation))[0]


def _token_text(llm: LLM, ev: TokenEvent) -> tuple[str, bool]:
    """(text, special) of a generated token for TGI: an end-of-generation token shows its
    piece (``</s>``) and is special; every other token carries the text the stream adds."""
    if ev.text or not llm.tokenizer.is_special(ev.token_id):
        return ev.text, False
    return llm.tokenizer.token_text(ev.token_id), True


def _token(llm: LLM, ev: TokenEvent) -> dict:
    text, special = _token_text(llm, ev)
    return {"id": ev.token_id, "text": text, "logprob": _logprob(ev.logprob), "special": special}


def _piece(llm: LLM, token_id: int, logprob: float | None) -> dict:
    """A token by itself (a prompt token, an alternative): its own piece as text."""
    tok = llm.tokenizer
    special = tok.is_special(token_id)
    text = (tok.token_text(token_id) if special
            else tok.token_bytes(token_id).decode("utf-8", errors="replace"))
    return {"id": token_id, "text": text, "logprob": _logprob(logprob), "special": special}


def _prefill(llm: LLM, request: GenerationRequest) -> list[dict]:
    return [{k: v for k, v in _piece(llm, i, None).items() if k != "special"}
            for i in request.prompt_ids]


def _top_tokens(llm: LLM, ev: TokenEvent) -> list[dict]:
    return [_piece(llm, i, lp) for i, lp in ev.top_logprobs or ()]


async def tgi_plain(req: Request, stream: ResponseStream, llm: LLM, obj: dict,
                    as_list: bool) -> Response | None:
    prompt, params = await asyncio.to_thread(parse_tgi, obj, llm)   # grammar compile
    request = await _tgi_request(llm, prompt, params)
    done = await collect(llm, [request], stream)
    if done is None:
        return None
    events = done[0]
    last = events[-1]
    text = last.generated_text or ""
    if params.return_full_text:
        text = prompt + text
    out: dict = {"generated_text": text}
    if params.details:
        out["details"] = {
            "finish_reason": last.finish_reason, "generated_tokens": len(events),
            "seed": request.sampling.seed, "prompt_tokens": len(request.prompt_ids),
            "prefill": _prefill(llm, request) if params.decoder_input_details else [],
            "tokens": [_token(llm, ev) for ev in events],
            **speculation_details(last),
        }
        if params.top_n_tokens:
            out["details"]["top_tokens"] = [_top_tokens(llm, ev) for ev in events]
    return json_response(200, [out] if as_list else out)


async def tgi_stream(req: Request, stream: ResponseStream, llm: LLM, obj: dict) -> Response | None:
    prompt, params = await asyncio.to_thread(parse_tgi, obj, llm)   # grammar compile
    if params.decoder_input_details:
        raise invalid("Parameter decoder_input_details == true is not supported when "
                      "streaming tokens.")
    request = await _tgi_request(llm, prompt, params)

    def event(item: tuple[int, TokenEvent]) -> list[dict]:
        ev = item[1]
        out: dict = {"token": _token(llm, ev), "generated_text": None, "details": None}
        if params.top_n_tokens:
            out["top_tokens"] = _top_tokens(llm, ev)
        if ev.is_last:
            text = ev.generated_text or ""
            out["generated_text"] = prompt + text if params.return_full_text else text
            if params.details:
                out["details"] = {"finish_reason": ev.finish_reason,
                                  "generated_tokens": ev.index + 1,
                                  "seed": request.sampling.seed,
                                  "prompt_tokens": len(request.prompt_ids),
                                  **speculation_details(ev)}
        return [out]

    await send_stream(stream, merged(llm, [request], record=stream.record), TGI, event)
    return None


# ---- /info ---------------------------------------------------------------------------------

def info(app) -> dict:
    """TGI's ``GET /info``, filled from the model, the engine and the configuration."""
    llm: LLM = app.llm
    eng = llm.engine
    m = re.search(r"(?i)\b(BF16|F16|F32|Q\d_[0-9A-Z_]+|IQ\d_\w+)\.gguf$", os.path.basename(
        str(llm.model_path)))
    device = str(llm.backend.device)
    return {
        "model_id": llm.model_name,
        "model_sha": None,
        "model_dtype": m.group(1).upper() if m else "gguf",
        "model_device_type": "npu" if "CANN" in device.upper() else "cpu",
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": app.max_link_num,
        "max_best_of": 1,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_length": eng.max_input_len,
        "max_total_tokens": eng.max_seq_len,
        "waiting_served_ratio": 1.2,
        "max_batch_total_tokens": eng.stats()["total_slots"] * eng.max_seq_len,
        "max_waiting_tokens": 20,
        "validation_workers": 1,
        "version": __version__,
        "sha": None,
        "docker_label": None,
        "backend": llm.backend.name,            # tiny_mindie: which backend and where it runs
        "execution_provider": device,
    }


def routes(app) -> list:
    """The TGI family's routes, ``/generate`` shared with vLLM 0.2 (spec §4)."""
    async def generate(req, stream, params):
        obj = await read_json_object(req.body)
        if "prompt" in obj and "inputs" in obj:
            raise invalid("Input conflict: /generate takes TGI's inputs or vLLM's prompt, "
                          "not both.")
        if "prompt" in obj:
            return await vllm_generate(req, stream, app.llm, obj)
        return await tgi_plain(req, stream, app.llm, obj, as_list=False)

    async def generate_stream(req, stream, params):
        return await tgi_stream(req, stream, app.llm, await read_json_object(req.body))

    async def root(req, stream, params):
        obj = await read_json_object(req.body)
        if get_bool(obj, "stream", False, "Field"):
            return await tgi_stream(req, stream, app.llm, obj)
        return await tgi_plain(req, stream, app.llm, obj, as_list=True)

    async def get_info(req, stream, params):
        return json_response(200, info(app))

    return [
        route("POST", "/generate", BUSINESS, generate, style=TGI, generation=True),
        route("POST", "/generate_stream", BUSINESS, generate_stream, style=TGI, generation=True),
        route("POST", "/", BUSINESS, root, style=TGI, generation=True),
        route("GET", "/info", MANAGEMENT, get_info),
    ]
