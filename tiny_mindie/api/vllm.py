"""vLLM 0.2's form of ``POST /generate`` (spec §4): ``{"prompt", "n"?, "stream"?, sampling
fields at the top level}`` -> ``{"text": [prompt + output, ...]}``; streamed, a chunked body of
such objects each followed by a NUL byte (vLLM 0.2's api_server). Errors have TGI's shape.
"""

from __future__ import annotations

from ..engine.request import GenerationParams, TokenEvent
from ..llm import LLM, MAX_SEED
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from .drive import NUL_JSON, build, collect, merged, send_stream
from .errors import TGI, invalid
from .validate import (
    INF,
    INT32_MAX,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    get_stop_list,
    refuse_set,
    refuse_unknown,
)

#: The fields of vLLM 0.2's ``/generate`` read here (its ``SamplingParams`` that the engine
#: holds; ``use_beam_search``, ``length_penalty``, ``early_stopping`` and the penalties are
#: refused when set otherwise than neutral; ``skip_special_tokens`` and
#: ``spaces_between_special_tokens`` change nothing: special tokens never reach the text); any
#: other that is not null is a 422 naming it.
FIELDS = frozenset({"prompt", "stream", "n", "best_of", "use_beam_search", "length_penalty",
                    "early_stopping", "presence_penalty", "frequency_penalty", "temperature",
                    "top_k", "top_p", "min_p", "seed", "repetition_penalty", "max_tokens",
                    "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
                    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"})


def parse_vllm(obj: dict, llm: LLM) -> tuple[str, GenerationParams, bool]:
    """vLLM 0.2's ``/generate`` body: ``prompt``, ``stream`` and sampling fields at the top
    level. Returns ``(prompt, params, stream)``, ``params`` the request's (its ``n``
    samples).

    Raises:
        APIError: 422 naming a malformed, out-of-range or unknown field, or a refused one.
    """
    prompt = obj.get("prompt")
    if prompt is None:
        raise invalid("Prompt must not be null")
    if not isinstance(prompt, str):
        raise invalid("The type of prompt is abnormal")
    if not prompt:
        raise invalid("Prompt must not be empty")
    refuse_unknown(obj, FIELDS)
    if obj.get("use_beam_search"):
        raise invalid("Parameter use_beam_search is not supported.")
    for name in ("presence_penalty", "frequency_penalty"):
        refuse_set(obj, name, (None, 0, 0.0))
    refuse_set(obj, "length_penalty", (None, 1, 1.0))
    refuse_set(obj, "early_stopping", (None, False))
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        get_bool(obj, name, True)
    n = get_int(obj, "n", 1, 1, 16)
    best_of = get_int(obj, "best_of", None, 1, 16)
    if best_of not in (None, n):
        raise invalid("Parameter best_of different from n is not supported.")
    # vLLM: temperature >= 0 (0 = greedy), top_p in (0, 1], top_k -1 (off) or >= 1.
    temperature = get_float(obj, "temperature", 1.0, 0.0, INF, lo_open=False, hi_open=True)
    top_k = get_int(obj, "top_k", -1, -1, INT32_MAX)
    if top_k == 0:
        raise invalid("Parameter top_k must be -1 (disable), or at least 1, got 0.")
    top_p = get_float(obj, "top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False)
    greedy = temperature == 0.0
    seed = get_int(obj, "seed", None, 0, MAX_SEED)
    repetition_penalty = get_float(obj, "repetition_penalty", 1.0, 0.0, 2.0,
                                   lo_open=True, hi_open=False)
    max_new_tokens = get_int(obj, "max_tokens", 16, 1, INT32_MAX)
    min_tokens = get_int(obj, "min_tokens", 0, 0, INT32_MAX)
    min_p = get_float(obj, "min_p", 0.0, 0.0, 1.0, lo_open=False, hi_open=False)
    stop = get_stop_list(obj, "stop", 64)
    include_stop_string = get_bool(obj, "include_stop_str_in_output", False)
    ignore_eos = get_bool(obj, "ignore_eos", False)
    ids = obj.get("stop_token_ids")
    stop_token_ids = () if ids is None else check_token_ids(ids, "stop_token_ids",
                                                            llm.tokenizer.vocab_size)
    if min_tokens > max_new_tokens:
        raise invalid(f"Parameter min_tokens must be at most max_tokens ({max_new_tokens}"
                      f"), got {min_tokens}.", "min_tokens")
    params = GenerationParams(
        temperature=1.0 if greedy else temperature, top_k=max(top_k, 0), top_p=top_p,
        do_sample=not greedy, seed=seed, repetition_penalty=repetition_penalty,
        max_new_tokens=max_new_tokens, min_tokens=min_tokens, min_p=min_p, stop=stop,
        include_stop_string=include_stop_string, ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids, n=n)
    return prompt, params, get_bool(obj, "stream", False, "Field")


async def vllm_generate(req: Request, stream: ResponseStream, llm: LLM,
                        obj: dict) -> Response | None:
    """``{"prompt", ...}`` -> ``{"text": [prompt + output, ...]}`` (``n`` outputs); with
    ``"stream": true`` a chunked body of ``{"text": [...]}`` objects each followed by a NUL
    byte, every one holding the texts so far (vLLM 0.2's api_server)."""
    prompt, params, streaming = parse_vllm(obj, llm)
    requests = await build(llm, prompt, params)
    if not streaming:
        done = await collect(llm, requests, stream)
        if done is None:
            return None
        return json_response(200, {"text": [prompt + (evs[-1].generated_text or "")
                                            for evs in done]})
    texts = [""] * params.n

    def event(item: tuple[int, TokenEvent]) -> list[dict]:
        k, ev = item
        texts[k] = ev.generated_text if ev.is_last else texts[k] + ev.text
        return [{"text": [prompt + t for t in texts]}]

    await send_stream(stream, merged(llm, requests, record=stream.record), TGI, event,
                      framing=NUL_JSON)
    return None
