"""Host health: a host with no heartbeat for 3 intervals is not_ready, after 10 unreachable.

`HostHealthMonitor` holds the rules; `HostHealthController` runs them as a controller (on the
replica that holds the controllers' lease, see `loop`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from controlplane.eventlog import record_event
from controlplane.models import GatewayProcess, Host, MetricSample, TrafficWindow
from protocol.wire import HostState

NOT_READY_AFTER_INTERVALS = 3
UNREACHABLE_AFTER_INTERVALS = 10
DEFAULT_SAMPLE_RETENTION = timedelta(hours=24)
PRUNE_EVERY = timedelta(minutes=1)


@dataclass(frozen=True)
class Transition:
    """A host changed health state."""

    host: str
    previous: str
    current: str


def health_for(silence_s: float, interval_s: float) -> HostState:
    """The state a host is in after `silence_s` seconds without a heartbeat."""
    if silence_s >= UNREACHABLE_AFTER_INTERVALS * interval_s:
        return HostState.UNREACHABLE
    if silence_s >= NOT_READY_AFTER_INTERVALS * interval_s:
        return HostState.NOT_READY
    return HostState.READY


class HostHealthMonitor:
    """Marks silent hosts not_ready / unreachable (heartbeats mark them ready again)."""

    def __init__(
        self,
        engine: Engine,
        clock: Callable[[], datetime],
        sample_retention: timedelta = DEFAULT_SAMPLE_RETENTION,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._retention = sample_retention

    def sweep(self, now: datetime | None = None) -> list[Transition]:
        """Check every host once; write the state changes and their events in one transaction."""
        now = now or self._clock()
        transitions: list[Transition] = []
        with Session(self._engine) as session:
            # Only the columns the decision needs: this runs every second over the whole fleet.
            hosts = session.execute(
                sa.select(
                    col(Host.id),
                    col(Host.name),
                    col(Host.state),
                    col(Host.last_seen_at),
                    col(Host.registered_at),
                    col(Host.heartbeat_interval_s),
                ).where(col(Host.state) != HostState.UNREACHABLE.value)
            ).all()
            for host in hosts:
                seen = host.last_seen_at or host.registered_at
                silence = (now - seen).total_seconds()
                state = health_for(silence, host.heartbeat_interval_s)
                # Only heartbeats make a host ready again; the sweep only degrades.
                previous = host.state
                if state == HostState.READY or state.value == previous:
                    continue
                result = session.execute(
                    update(Host)
                    # A heartbeat that landed since the read wins: last_seen_at moved.
                    .where(
                        col(Host.id) == host.id,
                        col(Host.state) == previous,
                        col(Host.last_seen_at).is_(None) | (col(Host.last_seen_at) <= seen),
                    )
                    .values(state=state.value)
                    .execution_options(synchronize_session=False)
                )
                if not getattr(result, "rowcount", 0):
                    continue  # a heartbeat got there first
                record_event(
                    session,
                    now,
                    "system:hosthealth",
                    f"host.{state.value}",
                    f"host/{host.name}",
                    f"host {host.name} is {state.value}: no heartbeat for {silence:.0f}s "
                    f"(interval {host.heartbeat_interval_s:g}s)",
                    previous=previous,
                    silence_s=round(silence, 3),
                )
                transitions.append(Transition(host.name, previous, state.value))
            session.commit()
        return transitions

    def prune_samples(self, now: datetime | None = None) -> int:
        """Delete metric samples, gateway traffic windows and gateways silent for longer than the
        retention; returns how many rows."""
        cutoff = (now or self._clock()) - self._retention
        with self._engine.begin() as conn:
            samples = conn.execute(delete(MetricSample).where(col(MetricSample.time) < cutoff))
            windows = conn.execute(
                delete(TrafficWindow).where(col(TrafficWindow.ended_at) < cutoff)
            )
            # Gateways silent that long are gone (a restarted one heartbeats under a new id).
            gone = conn.execute(
                delete(GatewayProcess).where(col(GatewayProcess.last_seen_at) < cutoff)
            )
        return sum(int(getattr(r, "rowcount", 0) or 0) for r in (samples, windows, gone))


class HostHealthController:
    """The host-health controller: a sweep every tick, pruning of samples and traffic windows
    once a minute."""

    name = "host-health"

    def __init__(self, monitor: HostHealthMonitor, prune_every: timedelta = PRUNE_EVERY) -> None:
        self.monitor = monitor
        self._prune_every = prune_every
        self._pruned_at: datetime | None = None

    def tick(self, now: datetime) -> None:
        """Degrade silent hosts; prune old samples when a minute has passed since the last time."""
        self.monitor.sweep(now)
        if self._pruned_at is None or now - self._pruned_at >= self._prune_every:
            self.monitor.prune_samples(now)
            self._pruned_at = now
