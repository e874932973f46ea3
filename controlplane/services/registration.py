"""Agent registration: a host joins the fleet (or rejoins it) and gets an agent token.

Who may register which name:

- a new name: any bootstrap token (not one bound to another host by a re-key);
- a name that exists: only a caller who proves it is that host or was sent by an admin to
  re-key it: the host's current agent token, or the one-use bootstrap token `dctl host rekey
  NAME` issues bound to that host. Anything else is a `Conflict` naming the host and how to
  re-key it, so a leaked bootstrap token cannot take over a registered host (revoke its agent
  token and receive a new one).

Registering again revokes every token bound to the host (its old agent token, the re-key token
just used, any other outstanding re-key token) and replaces its ports, address and facts.

Labels: what the agent sends is stored as the host's reported labels, which placement ignores.
The labels placement reads are the operator's: a new host gets those of the bootstrap token that
registers it (`dctl token create --role bootstrap --labels ...`), none otherwise, and
registering again keeps them (`dctl host label` changes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.auth import Principal, Role, TokenRefused, consume_use, mint_token
from controlplane.eventlog import record_event
from controlplane.models import ApiToken, Host
from controlplane.services.errors import Conflict, Forbidden
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
    caller: Principal,
    heartbeat_interval_s: float,
) -> Registration:
    """Create (or re-key) the host named in `request` and mint an agent token bound to it.

    `caller` is a bootstrap token or the host's own agent token (see the module docstring);
    one use of a limited token is spent here. Flushes but does not commit: the caller commits,
    so the use is spent only if the registration is (a refused one spends nothing).
    """
    if not consume_use(session, caller.token_id):
        raise TokenRefused(f"token {caller.name!r} has no uses left")
    actor = caller.actor
    host = session.exec(select(Host).where(Host.name == request.name)).first()
    _check_may_register(session, caller, request.name, host)
    if host is None:
        host = Host(name=request.name, registered_at=now, heartbeat_interval_s=heartbeat_interval_s)
        kind, verb = "host.registered", "registered"
        stamped = _stamped_labels(session, caller)
        host.labels = dict(stamped or {})
    else:
        # The old agent token (and any re-key token) stops working; the new agent presents
        # the new one.
        session.execute(
            update(ApiToken)
            .where(col(ApiToken.host_id) == host.id, col(ApiToken.revoked_at).is_(None))
            .values(revoked_at=now)
        )
        kind, verb = "host.reregistered", "registered again"
        if host.advertise_address != request.advertise_address:
            # Engines bind to this address: the desired state changed.
            host.desired_generation += 1
    host.reported_labels = dict(request.labels)
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
    # wrote of this host is now stale (see controlplane.heartbeat.service).
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
        labels=host.labels,
        reported_labels=request.labels,
    )
    return Registration(
        host_id=host.id,
        host_name=host.name,
        agent_token=new.secret,
        heartbeat_interval_s=heartbeat_interval_s,
    )


def _stamped_labels(session: Session, caller: Principal) -> dict[str, str] | None:
    """The labels the caller's bootstrap token stamps on the hosts it registers, if any."""
    if caller.role != Role.BOOTSTRAP:
        return None
    token = session.get(ApiToken, caller.token_id)
    return token.labels if token is not None else None


def _check_may_register(session: Session, caller: Principal, name: str, host: Host | None) -> None:
    """Refuse a caller who may not (re-)register `name` (`Forbidden`, `Conflict`)."""
    bound_to_host = host is not None and caller.host_id == host.id
    if bound_to_host:
        return  # the host's own agent token, or the admin's re-key token for it
    if caller.host_id is not None:
        bound = session.get(Host, caller.host_id)
        bound_name = bound.name if bound is not None else "a removed host"
        what = "an agent token" if caller.role == Role.AGENT else "this re-key token"
        raise Forbidden(
            f"{what} registers only the host it is bound to ({bound_name}), not {name}; "
            "a new host needs a bootstrap token (`dctl token create NAME --role bootstrap`)"
        )
    if caller.role != Role.BOOTSTRAP:
        raise Forbidden("registering a host needs a bootstrap token or the host's agent token")
    if host is not None:
        raise Conflict(
            f"host {name!r} is already registered: its agent registers again with its own "
            f"agent token, or an admin re-keys it with `dctl host rekey {name}` and starts the "
            "agent with the one-use bootstrap token that prints (POST "
            f"/api/v1/hosts/{name}/rekey)"
        )
