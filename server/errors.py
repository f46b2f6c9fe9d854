"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import AerieError, ContextLengthExceededError, InvalidRequestError

logger = logging.getLogger("aerie.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ClientDisconnected(Exception):
    """The client went away before its response was complete."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
        headers=error.headers,
    )


def api_error_from_engine(exc: AerieError) -> APIError:
    """Map the engine's bad-input errors to a 400 with the offending parameter."""
    code = "context_length_exceeded" if isinstance(exc, ContextLengthExceededError) else None
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    return APIError(400, str(exc), param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(AerieError)
    async def _engine_error(request: Request, exc: AerieError) -> JSONResponse:
        return error_response(api_error_from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        # a malformed body's "location" is a character offset, not a parameter
        param = None if first.get("type") == "json_invalid" else ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", exc))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(
            APIError(
                exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)
            )
        )

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
        logger.info("client left %s before its response; the request was aborted", request.url.path)
        return Response(status_code=499)  # nobody reads it: the client is gone

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))
