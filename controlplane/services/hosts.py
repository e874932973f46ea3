"""Hosts: look up, drain / undrain, remove, and their downsampled metric history."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import Host, MetricSample
from controlplane.services.errors import NotFound
from controlplane.services.placement import place_fleet
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
