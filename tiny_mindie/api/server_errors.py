"""MindIE's bodies for the error answers the HTTP server writes by itself
(:class:`~tiny_mindie.server.conn.ErrorAnswers`): a request its parser refused, and a handler
that failed.

A refused request gets ``{"error": message, "error_type": reason}``, the status's reason phrase
as the type (``Bad Request``, ``Request Timeout``, ``Expectation Failed``, ...), as MindIE's own
errors name theirs; a body over the limit gets MindIE's 413 body
``{"message": "Request body too large. Maximum allowed size is 40MB."}``, or on a route whose
family has an error shape of its own (OpenAI's, Anthropic's) that family's 413 body with the
same message (:func:`answers`). A failed handler gets
500 ``{"error": "Internal server error", "error_type": "Incomplete Generation"}``. Each refused
request gets its access record (:func:`~tiny_mindie.server.routing.log_refused`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..server.conn import ErrorAnswers, Response, json_response
from ..server.http import HTTPError
from ..server.http_response import reason_phrase
from ..server.routing import Route, log_refused
from .errors import ANTHROPIC, OPENAI, APIError, Kind, error_body

__all__ = ["ANSWERS", "answers", "body_too_large_message", "rejected"]


def body_too_large_message(max_body_bytes: int) -> str:
    """MindIE's 413 message for a body limit of ``max_body_bytes`` bytes (given in MB:
    ``40`` for 40 MiB, ``0.5`` for 512 KiB)."""
    return f"Request body too large. Maximum allowed size is {max_body_bytes / 2**20:g}MB."


def rejected(exc: HTTPError) -> Response:
    """The JSON answer to a request the parser refused with ``exc``."""
    if exc.status == 413 and exc.limit is not None:
        return json_response(413, {"message": body_too_large_message(exc.limit)})
    return json_response(exc.status, {"error": exc.message,
                                      "error_type": reason_phrase(exc.status) or "Bad Request"})


#: The families whose 413 body is their own error body (OpenAI's, Anthropic's).
_OWN_413 = (OPENAI, ANTHROPIC)

#: MindIE's answers, whatever the route.
ANSWERS = ErrorAnswers(rejected=rejected,
                       failed=json_response(500, error_body(500, "Internal server error")),
                       refused=log_refused)


def answers(routes: Sequence[Route]) -> ErrorAnswers:
    """What the app hands :func:`~tiny_mindie.server.listen.start_listeners`: :data:`ANSWERS`,
    with a body over the limit answered in the error shape of the family whose route its
    request-line names, where that family has its own (an OpenAI SDK raises its typed
    ``413`` error on it, Anthropic's ``request_too_large``)."""
    def in_style(exc: HTTPError) -> Response:
        if exc.status == 413 and exc.limit is not None and exc.request_line is not None:
            method, target = exc.request_line
            path = target.split("?", 1)[0]
            style = next((r.style for r in routes if r.method == method
                          and r.match(path) is not None), None)
            if any(style is own for own in _OWN_413):
                err = APIError(Kind.TOO_LARGE, body_too_large_message(exc.limit))
                return json_response(413, style.body(err))
        return rejected(exc)
    return ErrorAnswers(rejected=in_style, failed=ANSWERS.failed, refused=log_refused)
