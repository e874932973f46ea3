"""`/api/v1/events`: the audit log, filtered, with cursor pagination.

Below admin, every URL in an event reads as its scheme and host (`protocol.rollout_policy.
notify_origin`): events written before webhook URLs were shortened at the source carry whole
ones, whose user, password, path or query may be the secret.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlmodel import col, select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.auth import Role
from controlplane.models import Event
from protocol.rest import EventOut, EventPage
from protocol.rollout_policy import notify_origin

# A URL in free text: a scheme, `://`, then up to whitespace, a quote or a bracket.
_URL_RE = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s\"'<>]+")


def _origins_only(value: Any) -> Any:
    """VALUE with every URL in its strings (nested too) cut to its scheme and host."""
    if isinstance(value, str):
        return _URL_RE.sub(lambda m: notify_origin(m.group(0)), value) if "://" in value else value
    if isinstance(value, dict):
        return {k: _origins_only(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_origins_only(v) for v in value]
    return value


router = APIRouter(prefix="/api/v1/events", tags=["events"])


@router.get("", response_model=EventPage)
def list_events(
    session: SessionDep,
    who: Viewer,
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
    shown = (lambda v: v) if who.may(Role.ADMIN) else _origins_only
    items = [
        EventOut(
            id=e.id or 0,
            time=e.time,
            actor=e.actor,
            kind=e.kind,
            subject=e.subject,
            message=shown(e.message),
            data=shown(e.data),
        )
        for e in rows
    ]
    cursor = items[-1].id if items else (after or 0)
    return EventPage(items=items, next_cursor=cursor)
