"""Errors the OpenAI way: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Every error path of the server goes through ``APIError`` or one of the handlers
here, so no Python traceback ever reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    """An error for the client: status, message, and the request field it concerns."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One readable line and the offending field, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return (f"{param}: {msg}" if param else msg), param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal server error ({type(exc).__name__})"), status_code=500)
