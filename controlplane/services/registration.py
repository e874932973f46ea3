"""Agent registration: a host joins the fleet (or rejoins it) and gets an agent token.

Registering a name that exists re-keys that host: its old agent tokens are revoked (an agent
that lost its data directory registers again), and its labels, ports and facts are replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.auth import Role, mint_token
from controlplane.eventlog import record_event
from controlplane.models import ApiToken, Host
from controlplane.services.placement import place_fleet
from protocol.wire import RegisterRequest


@dataclass(frozen=True)
class Registration:
    """A registered host and its new agent token's secret (to show once)."""

    host_id: int
    host_name: str
    agent_token: str
    heartbeat_interval_s: float


def register_agent(
    session: Session,
    now: datetime,
    request: RegisterRequest,
    *,
    actor: str,
    heartbeat_interval_s: float,
) -> Registration:
    """Create (or re-key) the host named in `request` and mint an agent token bound to it.

    Flushes but does not commit: the caller commits, in the same transaction as whatever it
    spent to be allowed to register (a bootstrap token's use).
    """
    host = session.exec(select(Host).where(Host.name == request.name)).first()
    if host is None:
        host = Host(name=request.name, registered_at=now, heartbeat_interval_s=heartbeat_interval_s)
        kind, verb = "host.registered", "registered"
    else:
        # The old agent token stops working; the new agent presents the new one.
        session.execute(
            update(ApiToken)
            .where(col(ApiToken.host_id) == host.id, col(ApiToken.revoked_at).is_(None))
            .values(revoked_at=now)
        )
        kind, verb = "host.reregistered", "registered again"
        if host.advertise_address != request.advertise_address:
            # Engines bind to this address: the desired state changed.
            host.desired_generation += 1
    host.labels = dict(request.labels)
    host.port_range_start, host.port_range_end = request.port_range
    host.heartbeat_interval_s = heartbeat_interval_s
    host.advertise_address = request.advertise_address
    host.last_seen_at = now
    host.state = "ready"
    if request.facts:
        host.facts = request.facts.model_dump(mode="json")
    session.add(host)
    session.flush()
    assert host.id is not None
    # Observed state was written outside a heartbeat: every replica's memory of what it last
    # wrote of this host is now stale (see controlplane.heartbeats).
    session.execute(
        update(Host)
        .where(col(Host.id) == host.id)
        .values(heartbeat_seq=col(Host.heartbeat_seq) + 1)
        .execution_options(synchronize_session=False)
    )
    new = mint_token(
        f"agent-{request.name}"[:63], Role.AGENT, now, host_id=host.id, created_by=actor
    )
    session.add(new.row)
    place_fleet(session, now, actor)
    record_event(
        session,
        now,
        actor,
        kind,
        f"host/{request.name}",
        f"host {request.name} {verb} (ports {request.port_range[0]}-{request.port_range[1]})",
        labels=request.labels,
    )
    return Registration(
        host_id=host.id,
        host_name=host.name,
        agent_token=new.secret,
        heartbeat_interval_s=heartbeat_interval_s,
    )
