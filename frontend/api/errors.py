"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from pagoda.protocol.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


def _printable(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


class APIError(Exception):
    """An error to return to the client in the API's own shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # A message may quote the request (a model name, say): keep it
        # encodable as UTF-8 even when the request held lone surrogates.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = None if param is None else _printable(param)
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(
        err.status, "invalid_request_error" if err.status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(request: HTTPConnection, err: APIError) -> JSONResponse:
    """The error in the shape of the API the route belongs to (HTTP or WebSocket scope)."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)
    return err.response()


def validation_api_error(exc: ValidationError) -> APIError:
    """A pydantic validation failure as a short 400 naming the field."""
    errors = exc.errors()
    loc = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    msg = errors[0]["msg"] if errors else "invalid value"
    return APIError(400, _short(f"{loc or 'body'}: {msg}"), loc)


async def read_json(request: Request) -> Any:
    """The request body as JSON; a 400 when it is not JSON or nests too deep to parse."""
    try:
        return await request.json()
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None


def error_json(err: APIError) -> str:
    return json.dumps(err.body())


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
            param = None
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(request, APIError(400, _short(message), param))

    @app.exception_handler(ValidationError)
    async def _inner_validation(request: Request, exc: ValidationError) -> JSONResponse:
        # A model a handler builds from request fields (a chat request made
        # from /tokenize's messages, say) is still the client's input.
        return error_response(request, validation_api_error(exc))

    @app.exception_handler(SamplingParamsError)
    async def _params(request: Request, exc: SamplingParamsError) -> JSONResponse:
        # Raised by prompt and parameter checks in routes that do not map errors
        # themselves (the render and tokenize routes).
        return error_response(request, APIError(400, _short(str(exc)), exc.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, APIError(exc.status_code, _short(str(exc.detail))))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}"))
