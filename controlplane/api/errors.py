"""API errors: every failure is JSON `{"error", "message"}` with a message saying what to fix."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.services.errors import DomainError

log = logging.getLogger("controlplane.api")


class ApiError(Exception):
    """An HTTP-level failure (no token, no database) answered with `status` and a JSON body.

    Business rules raise `controlplane.services.errors` instead, mapped below.
    """

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def _body(code: str, message: str, details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"error": code, "message": message, "details": details or []}


def error_response(exc: ApiError) -> JSONResponse:
    """The JSON reply to an `ApiError`; also sent by middleware that answers before the app."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    return JSONResponse(
        _body(exc.code, exc.message), status_code=exc.status, headers={**headers, **exc.headers}
    )


def _where(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every exception into a JSON error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(DomainError)
    async def _domain_error(_request: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(_body(exc.code, exc.message), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": _where(tuple(e.get("loc", ()))), "msg": str(e.get("msg", ""))}
            for e in exc.errors()
        ]
        first = details[0] if details else {"loc": "body", "msg": "invalid request"}
        message = f"{first['loc']}: {first['msg']}"
        if len(details) > 1:
            message += f" (and {len(details) - 1} more problem(s))"
        return JSONResponse(_body("invalid_request", message, details), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "http_error")
        return JSONResponse(
            _body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(IntegrityError)
    async def _integrity(_request: Request, exc: IntegrityError) -> JSONResponse:
        # Two requests raced for the same unique name: the loser learns it already exists.
        log.info("integrity error: %s", exc.orig)
        return JSONResponse(
            _body("conflict", "the request conflicts with stored data (it may already exist)"),
            status_code=409,
        )

    @app.exception_handler(DataError)
    async def _data(_request: Request, exc: DataError) -> JSONResponse:
        # Validation should catch these first; this is the net under it (e.g. NUL in text).
        log.info("data error: %s", exc.orig)
        return JSONResponse(
            _body(
                "invalid_request",
                "a value cannot be stored: remove NUL characters and keep numbers in range",
            ),
            status_code=422,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: JSON like every other error, details in the log only.
        log.error("unhandled error", exc_info=exc)
        return JSONResponse(
            _body("internal", "internal error in the control plane: see its log"),
            status_code=500,
        )

    @app.exception_handler(OperationalError)
    async def _operational(_request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return JSONResponse(
            _body("unavailable", "the database is busy or unreachable: retry shortly"),
            status_code=503,
            headers={"Retry-After": "1"},
        )
