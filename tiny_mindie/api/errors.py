"""MindIE's error bodies (spec §3): ``{"error": "<message>", "error_type": "<type>"}``."""

from __future__ import annotations

from ..engine.request import GenerationError
from ..server.routing import RouteError

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


class APIError(RouteError):
    """An error answered to the client with an HTTP status and MindIE's JSON body."""

    def __init__(self, status: int, message: str, headers: tuple = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)

    @property
    def error_type(self) -> str:
        return ERROR_TYPES.get(self.status, "Bad Request")

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


def invalid(message: str) -> APIError:
    """422 Input Validation Error."""
    return APIError(422, message)


_GENERATION_STATUS = {"too_long": 424, "empty": 422, "timeout": 500, "stopped": 503,
                      "cancelled": 500, "internal": 500}


def from_generation_error(err: GenerationError) -> APIError:
    """The HTTP answer for an engine error (424 too long, 500 timeout, 503 stopped, ...)."""
    return APIError(_GENERATION_STATUS.get(err.kind, 500), err.message)


class OpenAIError(APIError):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(status, message)
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> OpenAIError:
    """400 invalid_request_error."""
    return OpenAIError(400, message, param)
