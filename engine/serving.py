"""`OpenAIServing`: what the OpenAI routes do between the HTTP request and the engine.

It holds what one server serves from: its lifecycle (`ServerState`: the configuration with the
served name and the limits, the metrics, and once loaded the `ServedModel`: the engine client,
the tokenizer, the default block size). Per request it checks readiness, parses and checks the
body (`engine.api_requests`), admits the prompts to the `AsyncEngine`, and answers in the
OpenAI shape, whole or streamed (`engine.streaming`). The routes (`engine.server`) only gate
and call it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api_requests import (
    chat_max_tokens,
    chat_prompt,
    check_chat_size,
    check_prompt_sizes,
    check_request,
    completion_prompts,
    parse_body,
    sampling_params,
)
from engine.async_engine import AsyncEngine
from engine.chaos import Chaos
from engine.errors import EngineError, EngineStopped, QueueFull
from engine.metrics import EngineMetrics
from engine.params import SamplingParams
from engine.request_guards import read_body
from engine.streaming import (
    DisconnectWatch,
    StreamShape,
    failure_reply,
    stream,
    total_usage,
    usage_of,
)
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
)

# The HTTP layer's one logger, whichever of its modules writes.
log = logging.getLogger("engine.server")

# Seconds a client told "queue full" or "not ready" should wait before retrying.
RETRY_AFTER_S = 1


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


Admitted = tuple[str, Any]  # (request id, its update queue)


class OpenAIServing:
    """The OpenAI completions, chat, models and health answers of one engine server."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.config = state.config
        self.metrics = state.metrics
        self.name = state.config.model.name  # the model name clients send
        self.api_key = state.config.service.api_key
        self.chaos = Chaos(state.config.chaos)

    # ---- probes and listing -------------------------------------------------------------

    def liveness(self) -> dict[str, Any]:
        """The process answers; the body says which phase it is in."""
        return {"status": "live", "phase": self.state.phase}

    def readiness(self) -> JSONResponse:
        """200 once the model serves, 503 while loading, draining or failed (the body says)."""
        state = self.state
        body: dict[str, Any] = {"status": state.phase, "model": self.name}
        if state.failure:
            body["error"] = state.failure
        return JSONResponse(body, status_code=200 if state.phase == "ready" else 503)

    def model_list(self) -> dict[str, Any]:
        """The /v1/models body: the one model served here."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.name,
                    "object": "model",
                    "created": int(self.state.started),
                    "owned_by": "dctl",
                    "max_model_len": self.config.model.max_seq_len,
                    "ready": self.state.phase == "ready",
                }
            ],
        }

    # ---- generation ---------------------------------------------------------------------

    async def create_completion(self, request: Request) -> Response:
        """/v1/completions: one prompt or several, answered whole or (one prompt) streamed."""
        config = self.config
        served = self.require_ready()
        await self.chaos.strike()
        body: CompletionRequest = await self.parse(request, CompletionRequest)
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
            self.validate(served, params, prompt)
        admitted: list[Admitted] = []
        try:
            for prompt in prompts:
                admitted.append(self.admit(served, prompt, params))
        except OpenAIErrorReply:
            for request_id, _ in admitted:
                served.engine.abort(request_id)
            raise
        rid, name = new_id("cmpl"), self.name
        if body.stream:

            def frame(text: str, reason: str | None, usage: Usage | None) -> dict[str, Any]:
                return completion_chunk(rid, name, text, reason, usage)

            shape = StreamShape.of(body, frame, first=None)
            return self.stream(served, request, admitted[0], len(prompts[0]), shape)
        end = self.deadline()
        results = []
        try:
            for i, (request_id, updates) in enumerate(admitted):
                text, reason, stats = await self.collect(served, request, request_id, updates, end)
                results.append((text, reason, (stats, len(prompts[i]))))
        finally:
            for request_id, _ in admitted[len(results) :]:
                served.engine.abort(request_id)
        total = total_usage([finished for _, _, finished in results])
        texts = [(text, reason) for text, reason, _ in results]
        return JSONResponse(completion_body(rid, name, texts, total))

    async def create_chat_completion(self, request: Request) -> Response:
        """/v1/chat/completions: one conversation through the chat template, whole or streamed."""
        config = self.config
        served = self.require_ready()
        await self.chaos.strike()
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
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
        self.validate(served, params, prompt)
        request_id, updates = self.admit(served, prompt, params)
        rid, name = new_id("chatcmpl"), self.name
        if body.stream:

            def frame(text: str, reason: str | None, usage: Usage | None) -> dict[str, Any]:
                delta = {"content": text} if text else {}
                return chat_chunk(rid, name, delta, reason, usage)

            first = chat_chunk(rid, name, {"role": "assistant", "content": ""}, None)
            shape = StreamShape.of(body, frame, first=first)
            return self.stream(served, request, (request_id, updates), len(prompt), shape)
        end = self.deadline()
        text, reason, stats = await self.collect(served, request, request_id, updates, end)
        return JSONResponse(chat_body(rid, name, text, reason, usage_of(stats, len(prompt), 0)))

    # ---- the steps of a generation request ----------------------------------------------

    def require_ready(self) -> ServedModel:
        """The loaded model, or a 503: draining (retry elsewhere) or not ready (retry soon)."""
        state = self.state
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

    async def parse(self, request: Request, schema: type[BaseRequest]) -> Any:
        """The body as SCHEMA, for the model served here (404 for another one)."""
        service = self.config.service
        raw = await read_body(request, service.max_body_bytes)
        ignore = service.unknown_fields == "ignore"
        body, unknown = parse_body(raw, schema, ignore_unknown=ignore)
        if unknown:
            self.metrics.unknown_fields.inc(len(unknown))
            log.info("ignored unknown request fields: %s", ", ".join(unknown)[:512])
        if body.model != self.name:
            raise OpenAIErrorReply(
                404,
                f"model {body.model!r} is not served here; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def validate(self, served: ServedModel, params: SamplingParams, prompt: list[int]) -> None:
        """Refuse (400) what the engine would refuse, before it is admitted."""
        check_request(
            params,
            prompt,
            max_seq_len=self.config.model.max_seq_len,
            default_block=served.default_block,
            vocab_size=served.tokenizer.vocab_size,
        )

    def admit(self, served: ServedModel, prompt: list[int], params: SamplingParams) -> Admitted:
        """Submit one prompt to the engine: 429 when its queue is full, 503 when draining."""
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

    def deadline(self) -> float:
        """When a request admitted now times out (monotonic seconds)."""
        return time.monotonic() + self.config.service.request_timeout_s

    async def collect(
        self, served: ServedModel, request: Request, request_id: str, updates: Any, end: float
    ) -> tuple[str, str | None, Any]:
        """A request's whole text, finish reason and stats; its failure as an error reply."""
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
            raise failure_reply(exc, self.config.service.request_timeout_s) from None
        finally:
            watch.close()
        return "".join(text), reason, stats

    def stream(
        self,
        served: ServedModel,
        request: Request,
        admitted: Admitted,
        prompt_len: int,
        shape: StreamShape,
    ) -> Response:
        """The SSE answer of one admitted request (`engine.streaming.stream`)."""
        request_id, updates = admitted
        return stream(
            served.engine,
            request,
            request_id,
            updates,
            prompt_len=prompt_len,
            shape=shape,
            deadline=self.deadline(),
            timeout_s=self.config.service.request_timeout_s,
            metrics=self.metrics,
        )
