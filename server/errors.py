"""The one place where errors become HTTP responses, shaped like OpenAI's (and vLLM's)
error object: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from capsteer.config.errors import CapsteerError

# The `type` OpenAI's SDK maps to its exception classes.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


def error_object(status: int, message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def error_body(status: int, message: str, param: str | None) -> bytes:
    """The error object as bytes, for the ASGI middleware."""
    return json.dumps(error_object(status, message, param)).encode()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The error object as a FastAPI response, for the routes."""
    return JSONResponse(error_object(status, message, param), status_code=status)


def from_exception(exc: CapsteerError, param: str | None = None) -> JSONResponse:
    """A capsteer error as the status its class means; `param` names the field when the
    error does not carry one."""
    return error_response(exc.status, str(exc), exc.param or param)


def exception_body(exc: CapsteerError, param: str | None = None) -> tuple[int, bytes]:
    """The same, as (status, bytes) for the ASGI middleware."""
    return exc.status, error_body(exc.status, str(exc), exc.param or param)
