"""Keeps the logs' tables bounded: a controller that prunes once a minute.

- log lines older than `log_retention_s`, and past `log_max_lines_per_instance` per instance
  (an agent's own lines: per host), the oldest first;
- request summaries older than `request_retention_s`, and past `request_max_rows` in all;
- per-token use older than `audit_retention_s` (the audit looks back 7 days by default).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col

from controlplane.models import LogLine, RequestRecord, TokenUse
from controlplane.settings import ControlPlaneSettings

PRUNE_EVERY = timedelta(minutes=1)


class LogRetention:
    """The `log-retention` controller (`tick`), run by the leader under the lease."""

    name = "log-retention"

    def __init__(self, engine: Engine, settings: ControlPlaneSettings) -> None:
        self._engine = engine
        self._settings = settings
        self._pruned_at: datetime | None = None

    def tick(self, now: datetime) -> None:
        """Prune when a minute has passed since the last time."""
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY:
            return
        self.prune(now)
        self._pruned_at = now

    def prune(self, now: datetime) -> int:
        """Delete what is past its bounds; returns how many rows."""
        s = self._settings
        with self._engine.begin() as conn:
            gone = _rowcount(
                conn.execute(
                    delete(LogLine).where(
                        col(LogLine.time) < now - timedelta(seconds=s.log_retention_s)
                    )
                )
            )
            gone += _cap_lines(conn, s.log_max_lines_per_instance)
            gone += _rowcount(
                conn.execute(
                    delete(RequestRecord).where(
                        col(RequestRecord.time) < now - timedelta(seconds=s.request_retention_s)
                    )
                )
            )
            gone += _cap_requests(conn, s.request_max_rows)
            gone += _rowcount(
                conn.execute(
                    delete(TokenUse).where(
                        col(TokenUse.ended_at) < now - timedelta(seconds=s.audit_retention_s)
                    )
                )
            )
        return gone


def _rowcount(result: object) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


def _cap_lines(conn: Connection, cap: int) -> int:
    """Keep the newest CAP lines of each instance, and of each host's agent."""
    gone = 0
    over = conn.execute(
        select(col(LogLine.instance_id), col(LogLine.host_id), func.count())
        .group_by(col(LogLine.instance_id), col(LogLine.host_id))
        .having(func.count() > cap)
    ).all()
    for instance_id, host_id, _count in over:
        same = (
            col(LogLine.instance_id) == instance_id
            if instance_id is not None
            else (col(LogLine.instance_id).is_(None) & (col(LogLine.host_id) == host_id))
        )
        oldest_kept = conn.execute(
            select(col(LogLine.id)).where(same).order_by(col(LogLine.id).desc()).offset(cap - 1)
        ).first()
        if oldest_kept is not None:
            gone += _rowcount(
                conn.execute(delete(LogLine).where(same, col(LogLine.id) < oldest_kept[0]))
            )
    return gone


def _cap_requests(conn: Connection, cap: int) -> int:
    """Keep the newest CAP request summaries."""
    oldest_kept = conn.execute(
        select(col(RequestRecord.id)).order_by(col(RequestRecord.id).desc()).offset(cap - 1)
    ).first()
    if oldest_kept is None:
        return 0
    return _rowcount(
        conn.execute(delete(RequestRecord).where(col(RequestRecord.id) < oldest_kept[0]))
    )
