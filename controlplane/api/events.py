"""`/api/v1/events`: the audit log, filtered, with cursor pagination."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from sqlmodel import col, select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.models import Event
from protocol.rest import EventOut, EventPage

router = APIRouter(prefix="/api/v1/events", tags=["events"])


@router.get("", response_model=EventPage)
def list_events(
    session: SessionDep,
    _who: Viewer,
    after: Annotated[
        int | None, Query(ge=0, le=2**62, description="only events with id > after")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    kind: Annotated[str | None, Query(max_length=64, description="exact kind or prefix.*")] = None,
    subject: Annotated[str | None, Query(max_length=200)] = None,
    since: datetime | None = None,
) -> EventPage:
    """Oldest first after the cursor; without `after`, the newest `limit` events."""
    query = select(Event)
    if kind:
        if kind.endswith(".*"):
            query = query.where(col(Event.kind).startswith(kind[:-1]))
        else:
            query = query.where(Event.kind == kind)
    if subject:
        query = query.where(Event.subject == subject)
    if since is not None:
        query = query.where(col(Event.time) >= since)
    if after is not None:
        rows = list(
            session.exec(
                query.where(col(Event.id) > after).order_by(col(Event.id)).limit(limit)
            ).all()
        )
    else:
        rows = list(session.exec(query.order_by(col(Event.id).desc()).limit(limit)).all())
        rows.reverse()
    items = [
        EventOut(
            id=e.id or 0,
            time=e.time,
            actor=e.actor,
            kind=e.kind,
            subject=e.subject,
            message=e.message,
            data=e.data,
        )
        for e in rows
    ]
    cursor = items[-1].id if items else (after or 0)
    return EventPage(items=items, next_cursor=cursor)
