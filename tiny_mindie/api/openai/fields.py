"""The top-level fields of the OpenAI routes' bodies: those read, those accepted that change
nothing in the answer, and those refused; anything else is a 400 ``unknown_parameter`` naming
it, as OpenAI answers ("never accept a field and silently ignore it").

docs/api.md lists the same fields for users.
"""

from __future__ import annotations

from ..chat.guided import GUIDED
from ..chat.structured import unknown_parameter
from ..errors import APIError, Kind, bad

#: Read by both routes (:mod:`.request`, :mod:`..chat.guided`).
COMMON = frozenset({
    "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_k", "top_p", "min_p", "typical_p", "best_of", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "logit_bias", "response_format", "logprobs", *GUIDED})
#: Read by ``/v1/chat/completions`` only.
CHAT = COMMON | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                 "functions", "function_call", "chat_template_kwargs", "reasoning_effort",
                 "reasoning", "continue_final_message", "add_generation_prompt"}
#: Read by ``/v1/completions`` only (chat's own fields are refused there by name).
COMPLETION = COMMON | {"prompt", "echo", "suffix"}

#: Accepted on both routes, with no effect on the answer: ``name -> JSON type`` (None: any).
#: Identification and caching hints (OpenAI's, vLLM's, llama.cpp's), what OpenAI's SDK,
#: LangChain, pydantic-ai, instructor and the OpenAI Agents SDK send.
NO_EFFECT = {
    "user": str, "safety_identifier": str, "metadata": dict, "store": bool,
    "service_tier": str, "prompt_cache_key": str, "prompt_cache_retention": str,
    "prompt_cache_options": dict, "prediction": dict, "request_id": str, "cache_salt": str,
    "priority": int, "cache_prompt": bool, "spaces_between_special_tokens": bool,
    "guided_decoding_backend": str,
}

#: Known fields that would change the answer and are not implemented: refused (400
#: ``unsupported_parameter``) unless null or one of the values that change nothing.
UNSUPPORTED = {
    "audio": (), "modalities": (["text"],), "web_search_options": (), "verbosity": (),
    "moderation": (), "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "early_stopping": (False,), "prompt_logprobs": (), "allowed_token_ids": (),
    "bad_words": ([],), "truncate_prompt_tokens": (), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "structural_tag": (), "guided_whitespace_pattern": (), "documents": (),
    "chat_template": (), "mm_processor_kwargs": (), "add_special_tokens": (True,),
    "kv_transfer_params": (), "vllm_xargs": (),
}
#: Chat's own: ``echo`` (``/v1/completions`` reads it); ``add_special_tokens`` is vLLM's
#: default there when false (the template writes them), on completions when true (BOS as the
#: model wants it).
CHAT_UNSUPPORTED = {"echo": (False,), "add_special_tokens": (False,)}

_TYPE_NAMES = {str: "a string", dict: "an object", bool: "a boolean", int: "an integer"}


def check_fields(obj: dict, chat: bool) -> None:
    """Every top-level field of ``obj`` is read by the route (:data:`CHAT` or
    :data:`COMPLETION`), has no effect (:data:`NO_EFFECT`, of its type), or is refused.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming a field of :data:`UNSUPPORTED` (and
            chat's ``echo``) sent with an effect; 400 naming a no-effect field of the wrong
            type; 400 ``unknown_parameter`` naming any other field.
    """
    known = CHAT if chat else COMPLETION
    refused = {**UNSUPPORTED, **CHAT_UNSUPPORTED} if chat else UNSUPPORTED
    for name, value in obj.items():
        if name in known:
            continue
        if name in NO_EFFECT:
            kind = NO_EFFECT[name]
            if value is not None and not _is(value, kind):
                raise bad(f"Parameter {name} must be {_TYPE_NAMES[kind]}.", name)
        elif name in refused:
            if value is not None and not any(_same(value, v) for v in refused[name]):
                raise APIError(Kind.BAD_REQUEST, f"Unsupported parameter: '{name}' is not "
                               "supported by this server.", param=name,
                               code="unsupported_parameter")
        else:
            raise unknown_parameter(name)


def _is(value, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _same(a, b) -> bool:
    """JSON equality that tells ``true`` from ``1``."""
    return type(a) is type(b) and a == b or (
        type(a) in (int, float) and type(b) in (int, float) and a == b)
