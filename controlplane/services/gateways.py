"""Gateways that heartbeat: record a beat (the first registers the gateway), list them, liveness.

A gateway is live while it heartbeats: silent for `GATEWAY_SILENT_INTERVALS` of its own interval,
it is not (the rule hosts follow, `controlplane.controllers.host_health`). Rows of gateways
silent for longer than the sample retention are pruned with the samples (a restarted gateway
has a new id).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import GatewayProcess
from protocol.monitoring import GATEWAY_SILENT_INTERVALS, GatewayHeartbeat, GatewayOut


def is_live(last_seen_at: datetime, interval_s: float, now: datetime) -> bool:
    """True while a gateway last seen at LAST_SEEN_AT is within its silence allowance."""
    return (now - last_seen_at).total_seconds() < GATEWAY_SILENT_INTERVALS * interval_s


def record_heartbeat(
    session: Session, now: datetime, beat: GatewayHeartbeat, token_name: str
) -> GatewayProcess:
    """Store BEAT as the gateway's current state (its first beat registers it, with an event).

    Commits. Two first beats of one gateway racing each other end as one row: the loser's
    insert fails on the unique name and it updates the winner's row instead.
    """
    try:
        row = _upsert(session, now, beat, token_name)
        session.commit()
    except IntegrityError:
        session.rollback()
        row = _upsert(session, now, beat, token_name)
        session.commit()
    return row


def _upsert(
    session: Session, now: datetime, beat: GatewayHeartbeat, token_name: str
) -> GatewayProcess:
    row = session.exec(select(GatewayProcess).where(GatewayProcess.name == beat.gateway)).first()
    if row is None:
        row = GatewayProcess(name=beat.gateway, first_seen_at=now, last_seen_at=now, port=0,
                             address="")  # fmt: skip
        record_event(
            session, now, f"token:{token_name}", "gateway.registered", f"gateway/{beat.gateway}",
            f"gateway {beat.gateway} serves at {beat.scheme}://{beat.address}:{beat.port} "
            f"(dctl {beat.version or 'unknown'})",
            address=beat.address, port=beat.port, version=beat.version,
        )  # fmt: skip
    row.address, row.port, row.scheme = beat.address, beat.port, beat.scheme
    row.version, row.metrics_url, row.interval_s = beat.version, beat.metrics_url, beat.interval_s
    row.token_name = token_name[:63]
    row.last_seen_at = now
    session.add(row)
    session.flush()
    return row


def gateway_out(row: GatewayProcess, now: datetime) -> GatewayOut:
    """The API view of a gateway row, with its liveness as of NOW."""
    return GatewayOut(
        gateway=row.name,
        address=row.address,
        port=row.port,
        scheme="https" if row.scheme == "https" else "http",
        version=row.version,
        metrics_url=row.metrics_url,
        interval_s=row.interval_s,
        first_seen_at=row.first_seen_at,
        last_seen_at=row.last_seen_at,
        live=is_live(row.last_seen_at, row.interval_s, now),
    )


def list_gateways(session: Session, now: datetime) -> list[GatewayOut]:
    """Every gateway known (live or silent), most recently seen first."""
    rows = session.exec(
        select(GatewayProcess).order_by(col(GatewayProcess.last_seen_at).desc())
    ).all()
    return [gateway_out(row, now) for row in rows]
