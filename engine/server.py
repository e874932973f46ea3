"""The HTTP layer: OpenAI-compatible routes, health probes and /metrics (FastAPI).

Only HTTP lives here: authentication, admission answers, streaming, response shapes. Turning a
body into engine inputs is `engine.api_requests`; decoding is the EngineCore's, reached through
`AsyncEngine`. Every error a client can cause is answered in the OpenAI shape with a 4xx/5xx
status that says what to do; nothing a client sends yields a 500 or a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.api_requests import (
    chat_max_tokens,
    chat_prompt,
    check_chat_size,
    check_prompt_sizes,
    check_request,
    completion_prompts,
    params_error,
    parse_body,
    sampling_params,
)
from engine.async_engine import AsyncEngine
from engine.chaos import Chaos
from engine.errors import EngineError, EngineStopped, InvalidParams, QueueFull, RequestAbandoned
from engine.metrics import EngineMetrics
from engine.params import SamplingParams
from engine.request_guards import authorize, client_gone, read_body
from engine.request_log import RequestLog
from protocol.engine_config import ServeConfig
from protocol.openai import (
    BaseRequest,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIErrorReply,
    Usage,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    new_id,
    usage_comment,
)
from runtime.asgi_body import until_disconnected

log = logging.getLogger("engine.server")

# Seconds a client told "queue full" or "not ready" should wait before retrying.
RETRY_AFTER_S = 1
# The routes that generate: the requests a drain waits for.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class ServedModel:
    """What the routes need of the loaded model."""

    engine: AsyncEngine
    tokenizer: Any  # engine.tokenizer.Tokenizer
    default_block: int


@dataclass
class ServerState:
    """Lifecycle of one server process: loading -> ready -> draining (or failed)."""

    config: ServeConfig
    metrics: EngineMetrics
    model: ServedModel | None = None
    draining: bool = False
    failure: str | None = None
    started: float = field(default_factory=time.time)
    # Generation requests from their arrival to the last byte of their answer: what a drain
    # waits for (the engine's own count ends before the answer is written, and starts after
    # the body is read and tokenized).
    answering: int = 0

    @property
    def phase(self) -> str:
        """loading | ready | draining | failed."""
        if self.failure:
            return "failed"
        if self.draining:
            return "draining"
        return "ready" if self.model is not None else "loading"


class DisconnectWatch:
    """Notices a client that closed its connection, by reading the ASGI receive channel.

    uvicorn drops writes to a closed connection silently, and Starlette's `is_disconnected()`
    probe consumes messages; a task that owns the channel once the body is read is exact.
    """

    def __init__(self, request: Request) -> None:
        self._task = asyncio.create_task(until_disconnected(request.receive))

    async def gone(self) -> bool:
        """True once the client has disconnected."""
        return self._task.done()

    def close(self) -> None:
        """Stop watching."""
        self._task.cancel()


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


def _error_response(err: OpenAIErrorReply) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application of one engine server."""
    config, metrics = state.config, state.metrics
    app = FastAPI(title="dctl engine", version="1", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(RequestLog)
    app.add_middleware(AnswerCount, state=state)
    chaos = Chaos(config.chaos)

    @app.exception_handler(OpenAIErrorReply)
    async def _api_error(request: Request, exc: OpenAIErrorReply) -> JSONResponse:
        if exc.metric_reason:
            metrics.record_error(exc.metric_reason)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods keep the OpenAI error shape.
        return _error_response(OpenAIErrorReply(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        metrics.record_error("engine_error")
        body = OpenAIErrorReply(500, "internal error; see the server log").body()
        return JSONResponse(body, status_code=500)

    def require_ready() -> ServedModel:
        if state.draining:
            raise OpenAIErrorReply(
                503, "the server is shutting down; retry on another instance", code="draining"
            )
        if state.model is None:
            raise OpenAIErrorReply(
                503,
                f"the model is not ready ({state.phase}); retry shortly",
                code="not_ready",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return state.model

    async def parse(request: Request, schema: type[BaseRequest]) -> Any:
        raw = await read_body(request, config.service.max_body_bytes)
        ignore = config.service.unknown_fields == "ignore"
        body, unknown = parse_body(raw, schema, ignore_unknown=ignore)
        if unknown:
            metrics.unknown_fields.inc(len(unknown))
            log.info("ignored unknown request fields: %s", ", ".join(unknown)[:512])
        if body.model != config.model.name:
            raise OpenAIErrorReply(
                404,
                f"model {body.model!r} is not served here; this server serves "
                f"{config.model.name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def validate(served: ServedModel, params: SamplingParams, prompt: list[int]) -> None:
        check_request(
            params,
            prompt,
            max_seq_len=config.model.max_seq_len,
            default_block=served.default_block,
            vocab_size=served.tokenizer.vocab_size,
        )

    def admit(served: ServedModel, prompt: list[int], params: SamplingParams) -> tuple[str, Any]:
        request_id = uuid.uuid4().hex
        try:
            return request_id, served.engine.submit(request_id, prompt, params)
        except QueueFull:
            raise OpenAIErrorReply(
                429,
                f"the server is at capacity (queue full); retry after {RETRY_AFTER_S} s",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineStopped:
            raise OpenAIErrorReply(503, "the server is shutting down", code="draining") from None

    def deadline() -> float:
        return time.monotonic() + config.service.request_timeout_s

    async def collect(
        served: ServedModel, request: Request, request_id: str, updates: Any, end: float
    ) -> tuple[str, str | None, Any]:
        text, reason, stats = [], None, None
        watch = DisconnectWatch(request)
        try:
            async for u in served.engine.updates(
                request_id, updates, deadline=end, client_gone=watch.gone
            ):
                text.append(u.text_delta)
                if u.finished:
                    reason, stats = u.finish_reason, u.stats
        except (TimeoutError, EngineError) as exc:
            raise stream_error(exc) from None
        finally:
            watch.close()
        return "".join(text), reason, stats

    def stream_error(exc: Exception) -> OpenAIErrorReply:
        """What a request that failed after admission answers."""
        if isinstance(exc, TimeoutError):
            limit = config.service.request_timeout_s
            return OpenAIErrorReply(
                504, f"the request took longer than {limit:g} s", code="timeout"
            )
        if isinstance(exc, RequestAbandoned):
            return client_gone()
        if isinstance(exc, EngineStopped):
            return OpenAIErrorReply(503, "aborted: the server is shutting down", code="draining")
        if isinstance(exc, InvalidParams):
            return params_error(exc)
        return OpenAIErrorReply(503, f"the engine failed this request: {exc}", code="engine_error")

    def usage_of(stats: Any, prompt_len: int, completion_tokens: int) -> Usage:
        prompt = stats.prompt_tokens if stats is not None else prompt_len
        completion = stats.completion_tokens if stats is not None else completion_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def sse(
        served: ServedModel,
        request: Request,
        request_id: str,
        updates: Any,
        prompt_len: int,
        frame: Callable[[str, str | None, Usage | None], dict[str, Any]],
        first: dict[str, Any] | None,
        include_usage: bool,
        continuous: bool = False,
    ) -> StreamingResponse:
        """The SSE answer; CONTINUOUS (`continuous_usage_stats`) puts the usage so far in every
        chunk, as vLLM does: completion tokens count the tokens of the blocks sent so far."""
        end = deadline()

        def counted(chunk: dict[str, Any], usage: Usage) -> dict[str, Any]:
            if continuous:
                chunk["usage"] = usage.model_dump()
            return chunk

        async def events() -> AsyncIterator[str]:
            if first is not None:
                yield f"data: {json.dumps(counted(first, usage_of(None, prompt_len, 0)))}\n\n"
            generated = 0
            usage: Usage | None = None
            watch = DisconnectWatch(request)
            try:
                async for u in served.engine.updates(
                    request_id, updates, deadline=end, client_gone=watch.gone
                ):
                    generated += len(u.new_token_ids)
                    if u.text_delta:
                        chunk = counted(
                            frame(u.text_delta, None, None), usage_of(None, prompt_len, generated)
                        )
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if u.finished:
                        usage = usage_of(u.stats, prompt_len, generated)
                        chunk = counted(frame("", u.finish_reason, None), usage)
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if include_usage:
                            yield f"data: {json.dumps(frame('', None, usage))}\n\n"
            except RequestAbandoned:
                return
            except (TimeoutError, EngineError) as exc:
                # Headers are gone already: report in-band, in the OpenAI error shape.
                err = stream_error(exc)
                if err.metric_reason:
                    metrics.record_error(err.metric_reason)
                yield f"data: {json.dumps(err.body())}\n\n"
            finally:
                watch.close()
            # Always, asked or not: the gateway counts tokens by it (clients skip comments).
            yield usage_comment(usage or usage_of(None, prompt_len, generated))
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        # What vLLM and SGLang answer and benchmark clients (GuideLLM) check first: 200 once
        # the model serves, 503 while loading, draining or failed (the body says which).
        return await ready()

    @app.get("/health/live")
    async def live() -> dict[str, Any]:
        return {"status": "live", "phase": state.phase}

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        ok = state.phase == "ready"
        body: dict[str, Any] = {"status": state.phase, "model": config.model.name}
        if state.failure:
            body["error"] = state.failure
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, config.service.api_key)
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model.name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "dctl",
                    "max_model_len": config.model.max_seq_len,
                    "ready": state.phase == "ready",
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        authorize(request, config.service.api_key)
        served = require_ready()
        await chaos.strike()
        body: CompletionRequest = await parse(request, CompletionRequest)
        check_prompt_sizes(
            body.prompt,
            max_prompts=config.service.max_concurrent_requests,
            max_seq_len=config.model.max_seq_len,
            max_token_chars=served.tokenizer.max_token_chars,
        )
        # Off the event loop: probes and streams stay answered while a long prompt tokenizes.
        prompts = await asyncio.to_thread(completion_prompts, body.prompt, served.tokenizer)
        if body.stream and len(prompts) != 1:
            raise OpenAIErrorReply(400, "stream=true takes exactly one prompt", param="prompt")
        params = sampling_params(body, config.model, body.max_tokens, None, served.default_block)
        for prompt in prompts:
            validate(served, params, prompt)
        admitted: list[tuple[str, Any]] = []
        try:
            for prompt in prompts:
                admitted.append(admit(served, prompt, params))
        except OpenAIErrorReply:
            for request_id, _ in admitted:
                served.engine.abort(request_id)
            raise
        rid = new_id("cmpl")
        name = config.model.name
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            def frame(text: str, reason: str | None, usage: Usage | None) -> dict[str, Any]:
                return completion_chunk(rid, name, text, reason, usage)

            (request_id, updates) = admitted[0]
            return sse(
                served, request, request_id, updates, len(prompts[0]), frame, None, include,
                continuous,
            )  # fmt: skip
        end = deadline()
        results = []
        try:
            for i, (request_id, updates) in enumerate(admitted):
                text, reason, stats = await collect(served, request, request_id, updates, end)
                results.append((text, reason, usage_of(stats, len(prompts[i]), 0)))
        finally:
            for request_id, _ in admitted[len(results) :]:
                served.engine.abort(request_id)
        total = Usage(
            prompt_tokens=sum(u.prompt_tokens for _, _, u in results),
            completion_tokens=sum(u.completion_tokens for _, _, u in results),
            total_tokens=sum(u.total_tokens for _, _, u in results),
        )
        texts = [(text, reason) for text, reason, _ in results]
        return JSONResponse(completion_body(rid, name, texts, total))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        authorize(request, config.service.api_key)
        served = require_ready()
        await chaos.strike()
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        thinking = body.thinking if body.thinking is not None else config.model.thinking
        check_chat_size(
            body,
            max_seq_len=config.model.max_seq_len,
            max_token_chars=served.tokenizer.max_token_chars,
        )
        prompt = await asyncio.to_thread(chat_prompt, body, served.tokenizer, thinking)
        max_tokens = chat_max_tokens(
            body, len(prompt), config.model.max_seq_len, served.default_block
        )
        params = sampling_params(body, config.model, max_tokens, thinking, served.default_block)
        validate(served, params, prompt)
        request_id, updates = admit(served, prompt, params)
        rid = new_id("chatcmpl")
        name = config.model.name
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            def frame(text: str, reason: str | None, usage: Usage | None) -> dict[str, Any]:
                delta = {"content": text} if text else {}
                return chat_chunk(rid, name, delta, reason, usage)

            first = chat_chunk(rid, name, {"role": "assistant", "content": ""}, None)
            return sse(
                served, request, request_id, updates, len(prompt), frame, first, include,
                continuous,
            )  # fmt: skip
        text, reason, stats = await collect(served, request, request_id, updates, deadline())
        return JSONResponse(chat_body(rid, name, text, reason, usage_of(stats, len(prompt), 0)))

    return app
