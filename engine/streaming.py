"""Streamed answers (server-sent events) and what a request that failed after admission answers.

A streamed answer sends each committed block as a chunk in the route's shape, then the finish,
the usage when asked for, a usage comment the gateway counts tokens by, and `[DONE]`. Once the
headers are gone an error can only be reported in-band, in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.api_requests import params_error
from engine.async_engine import AsyncEngine
from engine.errors import EngineError, EngineStopped, InvalidParams, RequestAbandoned
from engine.metrics import EngineMetrics
from engine.request_guards import client_gone
from protocol.openai import BaseRequest, OpenAIErrorReply, Usage, usage_comment
from runtime.asgi_body import until_disconnected

# One chunk of a route's stream: (text delta, finish reason, usage) -> the chunk's JSON.
Frame = Callable[[str, str | None, Usage | None], dict[str, Any]]


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


@dataclass(frozen=True)
class StreamShape:
    """How a route's stream looks: its chunk frame, its opening chunk, and the usage asked for."""

    frame: Frame
    first: dict[str, Any] | None
    include_usage: bool
    # vLLM's `continuous_usage_stats`: the usage so far in every chunk.
    continuous_usage: bool

    @classmethod
    def of(cls, body: BaseRequest, frame: Frame, *, first: dict[str, Any] | None) -> StreamShape:
        """The shape BODY's `stream_options` ask for."""
        options = body.stream_options
        return cls(
            frame=frame,
            first=first,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
        )


class DiffusionFigures(BaseModel):
    """How a finished request was decoded: dctl's extension of OpenAI's `usage` (`usage.dctl`),
    which the gateway copies into its request summaries."""

    steps_per_block: float  # mean denoising steps of the decoded blocks
    tokens_per_forward: float  # completion tokens / forwards the request took part in

    @classmethod
    def of(cls, stats: Sequence[Any]) -> DiffusionFigures | None:
        """The figures of the requests STATS describe together; None when no block was decoded."""
        steps = [n for s in stats for n in s.steps_per_block]
        forwards = sum(s.forwards for s in stats)
        if not steps or not forwards:
            return None
        tokens = sum(s.completion_tokens for s in stats)
        return cls(
            steps_per_block=round(sum(steps) / len(steps), 3),
            tokens_per_forward=round(tokens / forwards, 3),
        )


class DiffusionUsage(Usage):
    """`usage` with the diffusion figures: what a finished request reports, whole or streamed
    (the final usage chunk and the closing usage comment), so per-request figures need no second
    channel. OpenAI clients keep unknown usage fields (vLLM adds its own the same way)."""

    dctl: DiffusionFigures


def usage_of(stats: Any, prompt_len: int, completion_tokens: int) -> Usage:
    """The usage of a request: from its engine stats once finished (with the diffusion figures),
    else the counts so far."""
    if stats is None:
        return Usage(
            prompt_tokens=prompt_len,
            completion_tokens=completion_tokens,
            total_tokens=prompt_len + completion_tokens,
        )
    return total_usage([(stats, prompt_len)])


def total_usage(finished: Sequence[tuple[Any, int]]) -> Usage:
    """The usage of requests answered together (a completion of several prompts): each as its
    stats (None: it has none) and its prompt's length."""
    stats = [s for s, _ in finished if s is not None]
    prompt = sum(s.prompt_tokens if s is not None else n for s, n in finished)
    completion = sum(s.completion_tokens for s in stats)
    total = prompt + completion
    figures = DiffusionFigures.of(stats)
    if figures is None:
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)
    return DiffusionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, dctl=figures
    )


def failure_reply(exc: Exception, timeout_s: float) -> OpenAIErrorReply:
    """What a request that failed after admission answers (TIMEOUT_S: the limit it ran past)."""
    if isinstance(exc, TimeoutError):
        return OpenAIErrorReply(
            504, f"the request took longer than {timeout_s:g} s", code="timeout"
        )
    if isinstance(exc, RequestAbandoned):
        return client_gone()
    if isinstance(exc, EngineStopped):
        return OpenAIErrorReply(503, "aborted: the server is shutting down", code="draining")
    if isinstance(exc, InvalidParams):
        return params_error(exc)
    return OpenAIErrorReply(503, f"the engine failed this request: {exc}", code="engine_error")


def stream(
    engine: AsyncEngine,
    request: Request,
    request_id: str,
    updates: Any,
    *,
    prompt_len: int,
    shape: StreamShape,
    deadline: float,
    timeout_s: float,
    metrics: EngineMetrics,
) -> StreamingResponse:
    """The SSE answer of one admitted request, until DEADLINE (monotonic seconds). With
    `continuous_usage` every chunk carries the usage so far, as vLLM does: completion tokens
    count the tokens of the blocks sent so far."""

    def counted(chunk: dict[str, Any], usage: Usage) -> dict[str, Any]:
        if shape.continuous_usage:
            chunk["usage"] = usage.model_dump()
        return chunk

    async def events() -> AsyncIterator[str]:
        frame = shape.frame
        if shape.first is not None:
            yield f"data: {json.dumps(counted(shape.first, usage_of(None, prompt_len, 0)))}\n\n"
        generated = 0
        usage: Usage | None = None
        watch = DisconnectWatch(request)
        try:
            async for u in engine.updates(
                request_id, updates, deadline=deadline, client_gone=watch.gone
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
                    if shape.include_usage:
                        yield f"data: {json.dumps(frame('', None, usage))}\n\n"
        except RequestAbandoned:
            return
        except (TimeoutError, EngineError) as exc:
            # Headers are gone already: report in-band, in the OpenAI error shape.
            err = failure_reply(exc, timeout_s)
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
