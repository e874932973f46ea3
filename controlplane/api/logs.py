"""Logs through the control plane: a deployment's log lines (a page, or followed as Server-Sent
Events), the gateways' request summaries, and the access audit (admin)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controlplane.api.deps import Admin, ContextDep, SessionDep, Viewer
from controlplane.logs.audit import access_audit
from controlplane.logs.queries import deployment_requests, log_page
from controlplane.services.deployments import get_deployment
from protocol.logs import AuditReport, LogPage, RequestOut

router = APIRouter(prefix="/api/v1", tags=["logs"])

NamePath = Annotated[str, PathParam(max_length=63)]
# How often a follower asks the store for new lines, and sends a comment when there were none
# (so proxies keep the stream open and a dead client is noticed).
FOLLOW_POLL_S = 0.5
KEEPALIVE_S = 15.0


class LogFilters:
    """The filters `logs` and `logs/follow` share (query parameters)."""

    def __init__(
        self,
        since: Annotated[datetime | None, Query(description="default: an hour ago")] = None,
        until: datetime | None = None,
        instance: int | None = None,
        host: Annotated[str | None, Query(max_length=63)] = None,
        grep: Annotated[str | None, Query(max_length=200, description="case-insensitive")] = None,
        request: Annotated[str | None, Query(max_length=128, description="a request id")] = None,
        agent: Annotated[bool, Query(description="its hosts' agents' lines too")] = False,
        after: Annotated[int | None, Query(ge=0, description="the cursor of a page")] = None,
        limit: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    ) -> None:
        self.fields: dict[str, Any] = {
            "since": since, "until": until, "instance": instance, "host": host, "grep": grep,
            "request": request, "agent": agent, "after": after, "limit": limit,
        }  # fmt: skip


@router.get("/deployments/{name}/logs", response_model=LogPage)
def deployment_logs(
    name: NamePath,
    session: SessionDep,
    ctx: ContextDep,
    _who: Viewer,
    filters: Annotated[LogFilters, Depends()],
) -> LogPage:
    """The deployment's engines' log lines (with `agent`, its hosts' agents' too), as the
    agents shipped them (redacted on the host), oldest first; `next_cursor` continues."""
    deployment = get_deployment(session, name)
    return log_page(session, ctx.clock(), deployment, **filters.fields)


@router.get("/deployments/{name}/logs/follow")
async def follow_logs(
    name: NamePath,
    request: Request,
    ctx: ContextDep,
    _who: Viewer,
    filters: Annotated[LogFilters, Depends()],
    max_s: Annotated[
        float, Query(gt=0, le=3600, description="the stream ends then: reconnect with the cursor")
    ] = 300.0,
) -> StreamingResponse:
    """New lines as they come, as Server-Sent Events (`event: line`, `data: LogEntry`), from
    cursor `after` (default: now), until the client goes or `max_s` passes (a bounded
    connection, as a watch has; the client reconnects with the last line's id)."""

    def page(after: int | None) -> LogPage:
        with Session(ctx.engine) as session:
            deployment = get_deployment(session, name)
            fields = {**filters.fields, "after": after}
            if after is None:
                fields["limit"] = 1  # where "now" is: the newest line's id
            return log_page(session, ctx.clock(), deployment, **fields)

    start = filters.fields["after"]
    first = await run_in_threadpool(page, start)  # a 404 here, before the stream starts
    cursor = first.next_cursor if start is None else start

    async def events() -> AsyncIterator[bytes]:
        nonlocal cursor
        quiet_since = started = time.monotonic()
        while time.monotonic() - started < max_s and not await request.is_disconnected():
            found = await run_in_threadpool(page, cursor)
            for item in found.items:
                yield f"event: line\ndata: {item.model_dump_json()}\n\n".encode()
            cursor = found.next_cursor
            if found.items:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                yield b": keep-alive\n\n"
                quiet_since = time.monotonic()
            if not found.items:
                await asyncio.sleep(FOLLOW_POLL_S)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@router.get("/deployments/{name}/requests", response_model=list[RequestOut])
def requests_of(
    name: NamePath,
    session: SessionDep,
    ctx: ContextDep,
    _who: Viewer,
    since: datetime | None = None,
    until: datetime | None = None,
    slowest: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    errors: bool = False,
    request: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int | None, Query(ge=1, le=10_000)] = None,
) -> list[RequestOut]:
    """The gateways' summaries of the deployment's requests (sampled above each gateway's
    rate): newest first, or the `slowest` N; `errors`: answers >= 500 or none."""
    deployment = get_deployment(session, name)
    return deployment_requests(
        session, ctx.clock(), deployment, since=since, until=until, slowest=slowest,
        errors=errors, request=request, limit=limit,
    )  # fmt: skip


@router.get("/audit", response_model=AuditReport)
def audit(
    session: SessionDep,
    ctx: ContextDep,
    _who: Admin,
    since: Annotated[datetime | None, Query(description="default: 7 days ago")] = None,
) -> AuditReport:
    """Per client token: requests, errors, 429s, deployments, first and last seen, the
    requests the gateways refused (by what the key is now: revoked, expired, unknown) and the
    anomalies (a rate or error share that jumped, an expired or revoked token still tried)."""
    return access_audit(session, ctx.clock(), since)
