"""MindIE's bodies for the error answers the HTTP server writes by itself
(:class:`~tiny_mindie.server.conn.ErrorAnswers`): a request its parser refused, and a handler
that failed.

A refused request gets ``{"error": message, "error_type": reason}``, the status's reason phrase
as the type (``Bad Request``, ``Request Timeout``, ``Expectation Failed``, ...), as MindIE's own
errors name theirs; a body over the limit gets MindIE's 413 body
``{"message": "Request body too large. Maximum allowed size is 40MB."}``. A failed handler gets
500 ``{"error": "Internal server error", "error_type": "Incomplete Generation"}``. Each refused
request gets its access record (:func:`~tiny_mindie.server.routing.log_refused`).
"""

from __future__ import annotations

from ..server.conn import ErrorAnswers, Response, json_response
from ..server.http import HTTPError
from ..server.http_response import reason_phrase
from ..server.routing import log_refused
from .errors import error_body

__all__ = ["ANSWERS", "body_too_large_message", "rejected"]


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


#: What the app hands :func:`~tiny_mindie.server.listen.start_listeners`.
ANSWERS = ErrorAnswers(rejected=rejected,
                       failed=json_response(500, error_body(500, "Internal server error")),
                       refused=log_refused)
