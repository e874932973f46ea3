"""Hosts: look up, label, drain / undrain, remove, and their downsampled metric history.

A host's `labels` are the operator's (`PATCH /hosts/{name}/labels`, or stamped by the bootstrap
token that registered it) and the only ones placement reads; what its agent reports is kept in
`reported_labels` and counts for nothing until an operator adopts it. An agent chooses its
labels, so trusting them would let any bootstrap token draw a deployment (its API key, weights
and prompts) onto a host of its choosing.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, or_, select

from controlplane.eventlog import record_event
from controlplane.models import ApiToken, Host, MetricSample
from controlplane.services.errors import NotFound
from controlplane.services.placement import place_fleet
from protocol.rest import HostLabelChange
from protocol.vocabulary import Role
from protocol.wire import HostState

# One series of `samples`: (name, instance id or None) -> (time, value) points, oldest first.
SeriesKey = tuple[str, int | None]


def list_hosts(session: Session, state: HostState | None = None) -> list[Host]:
    """Every host by name, or only those in `state`."""
    query = select(Host).order_by(col(Host.name))
    if state is not None:
        query = query.where(Host.state == state.value)
    return list(session.exec(query).all())


def get_host(session: Session, name: str) -> Host:
    """The host called `name`, or NotFound."""
    host = session.exec(select(Host).where(Host.name == name)).first()
    if host is None:
        raise NotFound(f"host {name!r}")
    return host


def has_agent_token(now: datetime) -> sa.ColumnElement[bool]:
    """SQL: the host (`Host.id`) holds an agent token that works at NOW (not revoked, not
    expired). The gateway sends nothing to the address of a host without one: an address is the
    agent's to give, and a revoked or expired agent keeps none."""
    return sa.exists().where(
        col(ApiToken.host_id) == col(Host.id),
        col(ApiToken.role) == Role.AGENT.value,
        col(ApiToken.revoked_at).is_(None),
        or_(col(ApiToken.expires_at).is_(None), col(ApiToken.expires_at) > now),
    )


def holds_agent_token(session: Session, now: datetime, host: Host) -> bool:
    """True when HOST holds an agent token that works at NOW (see `has_agent_token`)."""
    found = session.exec(select(Host.id).where(Host.id == host.id, has_agent_token(now))).first()
    return found is not None


def change_labels(
    session: Session, now: datetime, actor: str, name: str, change: HostLabelChange
) -> Host:
    """Adopt the reported labels, set and remove labels (in that order); placement follows."""
    host = get_host(session, name)
    before = dict(host.labels)
    labels = {**before, **host.reported_labels} if change.adopt else dict(before)
    labels.update(change.labels)
    for key in change.remove:
        labels.pop(key, None)
    if labels == before:
        return host
    # A new dict (the JSON column sees a new value, not a mutation), in key order: shown as is.
    host.labels = labels = dict(sorted(labels.items()))
    session.add(host)
    session.flush()
    place_fleet(session, now, actor)
    shown = ", ".join(f"{k}={v}" for k, v in labels.items()) or "none"
    record_event(
        session,
        now,
        actor,
        "host.labeled",
        f"host/{name}",
        f"host {name} labels: {shown}" + (" (reported labels adopted)" if change.adopt else ""),
        labels=labels,
        before=before,
    )
    return host


def set_draining(session: Session, now: datetime, actor: str, name: str, draining: bool) -> Host:
    """Drain a host (its instances are stopped, kept in place) or let it run them again."""
    host = get_host(session, name)
    if host.draining == draining:
        return host
    host.draining = draining
    session.add(host)
    session.flush()
    place_fleet(session, now, actor)
    verb = "draining: its instances are stopped" if draining else "no longer draining"
    record_event(
        session,
        now,
        actor,
        "host.drained" if draining else "host.undrained",
        f"host/{name}",
        f"host {name} is {verb}",
    )
    return host


def remove_host(session: Session, now: datetime, actor: str, name: str) -> int:
    """Forget a host: its GPUs, instances and agent tokens go with it. Returns its id."""
    host = get_host(session, name)
    assert host.id is not None
    host_id = host.id
    session.delete(host)
    session.flush()
    # Nothing moves elsewhere (instances are per host), but the rules run after every host
    # change, so whatever the host held (ports, GPUs) is seen as free in one place.
    place_fleet(session, now, actor)
    record_event(session, now, actor, "host.removed", f"host/{name}", f"host {name} removed")
    return host_id


def samples(
    session: Session, host: Host, since: datetime, series: str | None = None
) -> dict[SeriesKey, list[tuple[datetime, float]]]:
    """The host's downsampled series since `since`; `series` is an exact name or `prefix.*`."""
    query = select(MetricSample).where(
        MetricSample.host_id == host.id, col(MetricSample.time) >= since
    )
    if series:
        if series.endswith(".*"):
            query = query.where(col(MetricSample.name).startswith(series[:-1]))
        else:
            query = query.where(MetricSample.name == series)
    grouped: dict[SeriesKey, list[tuple[datetime, float]]] = {}
    for sample in session.exec(query.order_by(col(MetricSample.time))).all():
        grouped.setdefault((sample.name, sample.instance_id), []).append(
            (sample.time, sample.value)
        )
    return grouped
