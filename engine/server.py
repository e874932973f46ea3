"""The HTTP layer: OpenAI-compatible routes, health probes and /metrics (FastAPI).

Only HTTP lives here: the routes, declared once at module level, gate a request (the API key)
and hand it to the server's `OpenAIServing` (`engine.serving`), found on `app.state`; the
middleware counts the answers a drain waits for; the exception handlers keep every error in the
OpenAI shape. Turning a body into engine inputs is `engine.api_requests`; decoding is the
EngineCore's, reached through `AsyncEngine`. Every error a client can cause is answered with a
4xx/5xx status that says what to do; nothing a client sends yields a 500 or a stack trace.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.request_guards import authorize
from engine.request_log import RequestLog
from engine.serving import RETRY_AFTER_S, OpenAIServing, ServedModel, ServerState
from protocol.openai import OpenAIErrorReply

__all__ = [
    "GENERATION_PATHS",
    "RETRY_AFTER_S",
    "AnswerCount",
    "OpenAIServing",
    "ServedModel",
    "ServerState",
    "create_app",
    "router",
]

log = logging.getLogger("engine.server")

# The routes that generate: the requests a drain waits for.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class AnswerCount:
    """ASGI middleware: counts the generation requests being answered (`ServerState.answering`).

    It wraps the whole ASGI call, so a streamed answer counts until its last event is sent, not
    only until its handler returns the response object.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.answering -= 1


def _serving(request: Request) -> OpenAIServing:
    """The app's serving object (set by `create_app`)."""
    serving: OpenAIServing = request.app.state.serving
    return serving


Serving = Annotated[OpenAIServing, Depends(_serving)]

router = APIRouter()


@router.get("/health")
async def health(serving: Serving) -> JSONResponse:
    """Readiness under the path vLLM and SGLang answer it."""
    # What vLLM and SGLang answer and benchmark clients (GuideLLM) check first: 200 once
    # the model serves, 503 while loading, draining or failed (the body says which).
    return serving.readiness()


@router.get("/health/live")
async def live(serving: Serving) -> dict[str, Any]:
    """Liveness: 200 whenever the process answers."""
    return serving.liveness()


@router.get("/health/ready")
async def ready(serving: Serving) -> JSONResponse:
    """Readiness: 200 once the model serves, else 503."""
    return serving.readiness()


@router.get("/metrics")
async def prometheus(serving: Serving) -> Response:
    """The engine's metrics in Prometheus' text format (no API key: scrapers hold none)."""
    return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request, serving: Serving) -> dict[str, Any]:
    """The model served here."""
    authorize(request, serving.api_key)
    return serving.model_list()


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, serving: Serving) -> Response:
    """OpenAI text completions."""
    authorize(request, serving.api_key)
    return await serving.create_completion(request)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, serving: Serving) -> Response:
    """OpenAI chat completions."""
    authorize(request, serving.api_key)
    return await serving.create_chat_completion(request)


def _error_response(err: OpenAIErrorReply) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: OpenAIErrorReply) -> JSONResponse:
    if exc.metric_reason:
        _serving(request).metrics.record_error(exc.metric_reason)
    return _error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods keep the OpenAI error shape.
    return _error_response(OpenAIErrorReply(exc.status_code, str(exc.detail)))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    _serving(request).metrics.record_error("engine_error")
    body = OpenAIErrorReply(500, "internal error; see the server log").body()
    return JSONResponse(body, status_code=500)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application of one engine server."""
    app = FastAPI(title="dctl engine", version="1", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.serving = OpenAIServing(state)
    app.add_middleware(RequestLog)
    app.add_middleware(AnswerCount, state=state)
    app.exception_handler(OpenAIErrorReply)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)
    app.include_router(router)
    return app
