"""What `dctl logs` and `dctl requests` ask: a deployment's log lines and request summaries.

Lines come in pages in the order they were stored (one host's in its own order; hosts
interleaved as their heartbeats came, seconds apart), each page sorted by time; `next_cursor`
continues after it, and following (`--follow`) is asking again with the cursor. `grep` is a
case-insensitive substring; `request` finds a request id in the field the agent extracted or
anywhere in the line.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from controlplane.models import Deployment, Host, Instance, LogLine, RequestRecord
from controlplane.services.errors import Invalid
from protocol.logs import LogEntry, LogPage, RequestOut

DEFAULT_SINCE = timedelta(hours=1)
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000


def _bounded(limit: int | None, default: int = DEFAULT_LIMIT) -> int:
    if limit is None:
        return default
    if not 1 <= limit <= MAX_LIMIT:
        raise Invalid(f"limit: give 1..{MAX_LIMIT} (got {limit})")
    return limit


def log_page(
    session: Session,
    now: datetime,
    deployment: Deployment,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    instance: int | None = None,
    host: str | None = None,
    grep: str | None = None,
    request: str | None = None,
    agent: bool = False,
    after: int | None = None,
    limit: int | None = None,
) -> LogPage:
    """The deployment's lines matching the filters, after cursor AFTER (else from SINCE,
    default an hour ago), at most LIMIT."""
    assert deployment.id is not None
    count = _bounded(limit)
    where: list[Any] = []
    hosts = _deployment_hosts(session, deployment.id)
    mine = col(LogLine.deployment_id) == deployment.id
    if agent:
        # Its hosts' agents' own lines beside its engines'.
        theirs = (col(LogLine.source) == "agent") & col(LogLine.host_id).in_(hosts)
        mine = or_(mine, theirs)
    where.append(mine)
    if after is not None:
        where.append(col(LogLine.id) > after)
    else:
        where.append(col(LogLine.time) >= (since or now - DEFAULT_SINCE))
    if until is not None:
        where.append(col(LogLine.time) <= until)
    if instance is not None:
        where.append(col(LogLine.instance_id) == instance)
    if host is not None:
        where.append(col(LogLine.host_id).in_(select(Host.id).where(Host.name == host)))
    if grep:
        where.append(func.lower(col(LogLine.line)).contains(grep.lower(), autoescape=True))
    if request:
        by_field = col(LogLine.request_id) == request
        where.append(or_(by_field, col(LogLine.line).contains(request, autoescape=True)))
    rows = session.exec(
        select(LogLine, Host.name)
        .join(Host, col(Host.id) == col(LogLine.host_id))
        .where(*where)
        .order_by(col(LogLine.id))
        .limit(count)
    ).all()
    names = {deployment.id: deployment.name}
    items = [
        LogEntry(
            id=line.id or 0,
            time=line.time,
            host=host_name,
            source="agent" if line.source == "agent" else "engine",
            deployment=names.get(line.deployment_id or 0),
            instance_id=line.instance_id,
            line=line.line,
            request_id=line.request_id,
        )
        for line, host_name in rows
    ]
    cursor = max((i.id for i in items), default=after or _last_id(session))
    dropped = sum(line.dropped for line, _host in rows)
    items.sort(key=lambda i: (i.time, i.id))
    return LogPage(items=items, next_cursor=cursor, dropped=dropped)


def _deployment_hosts(session: Session, deployment_id: int) -> list[int]:
    """The hosts the deployment's instances run on now."""
    query = select(Instance.host_id).where(Instance.deployment_id == deployment_id).distinct()
    return list(session.exec(query).all())


def _last_id(session: Session) -> int:
    """The newest line's id: an empty page's cursor, so following starts from now."""
    newest = session.exec(select(func.max(LogLine.id))).one()
    return int(newest or 0)


def deployment_requests(
    session: Session,
    now: datetime,
    deployment: Deployment,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    slowest: int | None = None,
    errors: bool = False,
    request: str | None = None,
    limit: int | None = None,
) -> list[RequestOut]:
    """The deployment's request summaries: newest first, or its SLOWEST N; ERRORS: only those
    answered 5xx (or not at all, status 0); REQUEST: one request id, in any range."""
    where: list[Any] = [col(RequestRecord.deployment_id) == deployment.id]
    if request is not None:
        where.append(col(RequestRecord.request_id) == request)
    else:
        where.append(col(RequestRecord.time) >= (since or now - DEFAULT_SINCE))
    if until is not None:
        where.append(col(RequestRecord.time) <= until)
    if errors:
        where.append(or_(col(RequestRecord.status) >= 500, col(RequestRecord.status) == 0))
    query = select(RequestRecord).where(*where)
    if slowest is not None:
        query = query.order_by(col(RequestRecord.latency_s).desc()).limit(_bounded(slowest))
    else:
        query = query.order_by(col(RequestRecord.time).desc()).limit(_bounded(limit, 100))
    return [
        RequestOut(deployment=deployment.name, **row.model_dump(exclude={"id", "deployment_id"}))
        for row in session.exec(query).all()
    ]
