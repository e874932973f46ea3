"""The append-only audit log: one function writes, inside the caller's transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session

from controlplane.models import Event


def record_event(
    session: Session,
    now: datetime,
    actor: str,
    kind: str,
    subject: str,
    message: str,
    **data: Any,
) -> Event:
    """Append an event; it commits (or rolls back) with the change it describes."""
    event = Event(time=now, actor=actor, kind=kind, subject=subject, message=message, data=data)
    session.add(event)
    return event
