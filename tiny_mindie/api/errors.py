"""One taxonomy of errors: each :class:`Kind` is answered with one HTTP status and counted in
``/metrics`` under one failure reason; each API family writes an error in its own
:class:`Style` (MindIE's ``{"error", "error_type"}``, TGI's type names, OpenAI's
``{"error": {"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error", "error":
{"type", "message"}}``), spec §3, §4.

=============  ======  ==========  ==========================================================
kind           status  reason      raised for
=============  ======  ==========  ==========================================================
BAD_REQUEST    400     validation  OpenAI: a bad field its own checks find
NOT_FOUND      404     validation  an unknown model, request id or route
INVALID        422     validation  a bad field (the shared validators, naming it: OpenAI 400);
                                   a body not JSON
TOO_DEEP       422     validation  a body nested deeper than ``MAX_JSON_DEPTH`` (OpenAI: 400)
TOO_LARGE      413     validation  a body over ``maxRequestLength``, on a route whose family has
                                   its own body for it (the parser refuses it; MindIE's routes
                                   answer MindIE's 413 body, :mod:`.server_errors`)
EMPTY          422     validation  an empty prompt (engine)
TOO_LONG       424     too_long    a prompt longer than ``maxInputTokenLen`` (engine; OpenAI:
                                   400 ``context_length_exceeded``)
TIMEOUT        500     timeout     a client, token or end-to-end time limit (engine)
CANCELLED      500     cancelled   the client left or read too slowly (engine)
INTERNAL       500     internal    a server bug (engine)
STOPPED        503     stopped     the service is stopping (engine, ``/stopService``)
LOADING        503     stopped     the model is still being pulled or loaded (the app)
=============  ======  ==========  ==========================================================

The engine's kinds (:class:`~tiny_mindie.engine.request.ErrorKind`) are the members of the same
names (:func:`from_generation_error`).
"""

from __future__ import annotations

import enum

from ..engine.request import GenerationError
from ..server.routing import RouteError

#: MindIE's ``error_type`` of each status (also the 404/405 of the router and the busy 503).
ERROR_TYPES = {
    400: "Bad Request",
    404: "NotFoundError",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    422: "Input Validation Error",
    424: "Generation Error",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}


class Kind(enum.Enum):
    """What went wrong; :attr:`status` and :attr:`reason` from the table above."""

    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    INVALID = "invalid"
    TOO_DEEP = "too_deep"
    TOO_LARGE = "too_large"
    EMPTY = "empty"
    TOO_LONG = "too_long"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    STOPPED = "stopped"
    LOADING = "loading"

    @property
    def status(self) -> int:
        return _ANSWERS[self][0]

    @property
    def reason(self) -> str:
        """The ``reason`` label of ``request_failed_total``
        (:data:`~tiny_mindie.api.metrics.FAIL_REASONS`)."""
        return _ANSWERS[self][1]


_ANSWERS = {Kind.BAD_REQUEST: (400, "validation"), Kind.NOT_FOUND: (404, "validation"),
            Kind.INVALID: (422, "validation"), Kind.TOO_DEEP: (422, "validation"),
            Kind.TOO_LARGE: (413, "validation"),
            Kind.EMPTY: (422, "validation"), Kind.TOO_LONG: (424, "too_long"),
            Kind.TIMEOUT: (500, "timeout"), Kind.CANCELLED: (500, "cancelled"),
            Kind.INTERNAL: (500, "internal"), Kind.STOPPED: (503, "stopped"),
            Kind.LOADING: (503, "stopped")}


class APIError(RouteError):
    """An error answered to the client: its kind's status and a body in :attr:`style`, which
    the family's routes set (:func:`tiny_mindie.api.drive.route`); MindIE's by default.

    Attributes:
        kind, message: what went wrong, in MindIE's wording where MindIE has one.
        param, code: OpenAI's ``param`` and ``code`` (other styles leave them out).
        headers: extra response headers.
        engine_error: the engine's error this answers (:func:`from_generation_error`), else
            ``None``.
    """

    def __init__(self, kind: Kind, message: str, *, param: str | None = None,
                 code: str | None = None, headers: tuple = ()):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.headers = list(headers)
        self.engine_error: GenerationError | None = None
        self.style: Style = MINDIE

    @property
    def status(self) -> int:
        return self.style.status(self)

    def body(self) -> dict:
        return self.style.body(self)


def invalid(message: str, param: str | None = None) -> APIError:
    """422 Input Validation Error; ``param`` names the bad field (OpenAI's style answers that
    400, :class:`OpenAIStyle`)."""
    return APIError(Kind.INVALID, message, param=param)


def bad(message: str, param: str | None = None) -> APIError:
    """400 (OpenAI's invalid_request_error) about the field ``param``."""
    return APIError(Kind.BAD_REQUEST, message, param=param)


def from_generation_error(err: GenerationError) -> APIError:
    """The answer for an engine error (424 too long, 500 timeout, 503 stopped, ...)."""
    answer = APIError(Kind(err.kind.value), err.message)
    answer.engine_error = err
    return answer


def error_body(status: int, message: str) -> dict:
    """MindIE's JSON error body (spec §3) for ``status`` and ``message``."""
    return {"error": message, "error_type": ERROR_TYPES.get(status, "Bad Request")}


class Style:
    """MindIE's error style: ``{"error": message, "error_type": ERROR_TYPES[status]}``."""

    def status(self, err: APIError) -> int:
        return err.kind.status

    def body(self, err: APIError) -> dict:
        return error_body(self.status(err), err.message)


class TGIStyle(Style):
    """TGI's: MindIE's shape with TGI's ``error_type`` names (``validation`` 422, ``generation``
    424, ``incomplete_generation`` 500, ``overloaded`` 503), so TGI's clients raise their typed
    exceptions."""

    TYPES = {422: "validation", 424: "generation", 500: "incomplete_generation",
             503: "overloaded"}

    def body(self, err: APIError) -> dict:
        status = self.status(err)
        return {"error": err.message,
                "error_type": self.TYPES.get(status) or ERROR_TYPES.get(status, "Bad Request")}


class OpenAIStyle(Style):
    """OpenAI's: ``{"error": {"message", "type", "param", "code"}}``, ``type``
    ``invalid_request_error`` below 500 else ``server_error``; a bad field is 400, also where
    the shared validators say 422 (an :data:`~Kind.INVALID` naming its ``param``; a body that is
    no JSON object names none and stays 422); a body nested too deep is a bad field (400: valid
    JSON, but no field may nest so deep); a prompt too long is 400 with the code
    ``context_length_exceeded``, as OpenAI and vLLM answer it (the ``openai`` SDK raises
    ``BadRequestError``, litellm ``ContextWindowExceededError``), where MindIE and TGI say 424."""

    def status(self, err: APIError) -> int:
        if err.kind in (Kind.TOO_DEEP, Kind.TOO_LONG) or (err.kind is Kind.INVALID
                                                          and err.param is not None):
            return 400
        return err.kind.status

    def body(self, err: APIError) -> dict:
        code = err.code or ("context_length_exceeded" if err.kind is Kind.TOO_LONG else None)
        return {"error": {"message": err.message,
                          "type": "invalid_request_error" if self.status(err) < 500
                          else "server_error",
                          "param": err.param, "code": code}}


class ResponsesEventStyle(OpenAIStyle):
    """An error in an OpenAI Responses stream (after its head): the ``error`` event,
    ``{"type": "error", "code", "message", "param", "sequence_number"}``; ``sequence``
    gives the event's number."""

    def __init__(self, sequence=None):
        self.sequence = sequence

    def body(self, err: APIError) -> dict:
        inner = super().body(err)["error"]
        out = {"type": "error", "code": inner["code"] or inner["type"],
               "message": inner["message"], "param": inner["param"]}
        if self.sequence is not None:
            out["sequence_number"] = self.sequence()
        return out


class AnthropicStyle(OpenAIStyle):
    """Anthropic's: ``{"type": "error", "error": {"type", "message"}}``, the statuses as
    OpenAI's (a bad field 400, a prompt too long 400), the error's ``type`` by status
    (``invalid_request_error``, ``not_found_error``, ``request_too_large``, ``api_error``,
    ``overloaded_error``), which the ``anthropic`` SDK raises as its typed exceptions."""

    TYPES = {404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}

    def body(self, err: APIError) -> dict:
        status = self.status(err)
        kind = self.TYPES.get(status) or ("invalid_request_error" if status < 500
                                          else "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}


class TEIStyle(Style):
    """Text Embeddings Inference's (``POST /embed``): ``{"error", "error_type"}`` with its
    statuses and type names: an empty input 400 ``Empty`` (an error whose ``tei_type``
    attribute says so), a bad field, too many inputs or an input over the context 413
    ``Validation``, a body that is no JSON object 422 ``Validation``, 503 ``Unhealthy``; the
    rest as MindIE's."""

    TYPES = {400: "Empty", 413: "Validation", 422: "Validation", 503: "Unhealthy"}

    def status(self, err: APIError) -> int:
        if getattr(err, "tei_type", None) == "Empty":
            return 400
        if err.kind in (Kind.INVALID, Kind.BAD_REQUEST, Kind.TOO_DEEP, Kind.EMPTY):
            return 413 if err.param is not None else 422
        return 413 if err.kind is Kind.TOO_LONG else err.kind.status

    def body(self, err: APIError) -> dict:
        status = self.status(err)
        return {"error": err.message,
                "error_type": self.TYPES.get(status) or ERROR_TYPES.get(status, "Bad Request")}


MINDIE, TGI, OPENAI, ANTHROPIC = Style(), TGIStyle(), OpenAIStyle(), AnthropicStyle()
TEI = TEIStyle()
