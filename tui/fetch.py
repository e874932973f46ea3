"""What each view shows, fetched from the control plane in one go: async functions of a client.

Each returns a frozen snapshot that a view renders whole, so a refresh never shows half of one
answer and half of the previous. They run only inside the views' refresh workers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from client import AsyncControlPlaneClient, ClientError, calls
from protocol.gateway import DeploymentTraffic
from protocol.rest import DeploymentOut, EventOut, FleetStatus, HostOut, ModelOut, SeriesOut
from protocol.rollout_states import ACTIVE_STATES
from protocol.rollouts import RolloutOut

SAMPLE_MINUTES = 10


@dataclass(frozen=True)
class OverviewData:
    """The start screen: counts, deployments, hosts, active rollouts, the newest events."""

    status: FleetStatus
    hosts: list[HostOut]
    deployments: list[DeploymentOut]
    rollouts: list[RolloutOut]
    events: list[EventOut]


@dataclass(frozen=True)
class FleetData:
    """Hosts and deployments (the hosts table counts instances per host from the latter)."""

    hosts: list[HostOut]
    deployments: list[DeploymentOut]


@dataclass(frozen=True)
class DeploymentsData:
    """Every deployment with its gateway traffic over the last minutes (None: not available)."""

    deployments: list[DeploymentOut]
    traffic: dict[str, DeploymentTraffic | None]


@dataclass(frozen=True)
class DeploymentDetailData:
    """One deployment, its rollout (active or latest), traffic and its model's versions."""

    deployment: DeploymentOut
    rollout: RolloutOut | None
    traffic: DeploymentTraffic | None
    model: ModelOut | None


@dataclass(frozen=True)
class HostDetailData:
    """One host with its instances, and its GPU series of the last minutes."""

    host: HostOut
    series: list[SeriesOut] = field(default_factory=list)


@dataclass(frozen=True)
class ModelsData:
    """Models with their versions, and who holds each: deployments and hosts."""

    models: list[ModelOut]
    deployments: list[DeploymentOut]
    hosts: list[HostOut]


@dataclass(frozen=True)
class EventsData:
    """Events newer than the cursor, oldest first, and the cursor to ask from next time."""

    events: list[EventOut]
    cursor: int


async def active_rollout(client: AsyncControlPlaneClient, name: str) -> RolloutOut | None:
    """Deployment NAME's rollout, or None when it never had one."""
    try:
        return await client.send(calls.get_rollout(name))
    except ClientError as exc:
        if exc.status == 404:
            return None
        raise


async def traffic(client: AsyncControlPlaneClient, name: str) -> DeploymentTraffic | None:
    """Deployment NAME's traffic (default range); None when it cannot be had (e.g. no rights)."""
    try:
        return await client.send(calls.deployment_traffic(name))
    except ClientError as exc:
        if exc.status is None:
            raise  # the control plane is gone: the banner says so
        return None


async def overview(client: AsyncControlPlaneClient, events: int = 8) -> OverviewData:
    """Everything the overview shows."""
    status, hosts, deployments, page = await asyncio.gather(
        client.send(calls.status()),
        client.send(calls.list_hosts()),
        client.send(calls.list_deployments()),
        client.send(calls.list_events(limit=events)),
    )
    latest = await asyncio.gather(*(active_rollout(client, d.name) for d in deployments))
    active = [r for r in latest if r is not None and r.state in ACTIVE_STATES]
    return OverviewData(status, hosts, deployments, active, list(reversed(page.items)))


async def fleet(client: AsyncControlPlaneClient) -> FleetData:
    """Hosts and deployments."""
    hosts, deployments = await asyncio.gather(
        client.send(calls.list_hosts()), client.send(calls.list_deployments())
    )
    return FleetData(hosts, deployments)


async def deployments(client: AsyncControlPlaneClient) -> DeploymentsData:
    """Deployments and each one's traffic."""
    found = await client.send(calls.list_deployments())
    answers = await asyncio.gather(*(traffic(client, d.name) for d in found))
    return DeploymentsData(found, {d.name: t for d, t in zip(found, answers, strict=True)})


async def deployment_detail(client: AsyncControlPlaneClient, name: str) -> DeploymentDetailData:
    """Deployment NAME with its rollout, traffic and model."""
    deployment = await client.send(calls.get_deployment(name))
    rollout, flow, model = await asyncio.gather(
        active_rollout(client, name),
        traffic(client, name),
        client.send(calls.get_model(deployment.model)),
    )
    return DeploymentDetailData(deployment, rollout, flow, model)


async def host_detail(client: AsyncControlPlaneClient, name: str) -> HostDetailData:
    """Host NAME with its instances and GPU series."""
    host, found = await asyncio.gather(
        client.send(calls.get_host(name)),
        client.send(calls.host_samples(name, minutes=SAMPLE_MINUTES)),
    )
    series = [s for s in found if s.name.startswith("gpu")]
    return HostDetailData(host, series)


async def models(client: AsyncControlPlaneClient) -> ModelsData:
    """Models, deployments and hosts."""
    found, deployed, hosts = await asyncio.gather(
        client.send(calls.list_models()),
        client.send(calls.list_deployments()),
        client.send(calls.list_hosts()),
    )
    return ModelsData(found, deployed, hosts)


async def events(client: AsyncControlPlaneClient, after: int | None, limit: int) -> EventsData:
    """Events after cursor AFTER (None: the newest LIMIT)."""
    page = await client.send(calls.list_events(after=after, limit=limit))
    return EventsData(page.items, page.next_cursor)


async def rollouts(client: AsyncControlPlaneClient, per_deployment: int = 20) -> list[RolloutOut]:
    """Every deployment's rollouts, rollbacks and restarts, newest first."""
    found = await client.send(calls.list_deployments())
    pages = await asyncio.gather(
        *(client.send(calls.rollout_history(d.name, limit=per_deployment)) for d in found)
    )
    merged = [rollout for page in pages for rollout in page]
    return sorted(merged, key=lambda r: (r.created_at, r.id), reverse=True)


def rate(traffic_: DeploymentTraffic | None, requests: int) -> float | None:
    """Requests per second over the traffic's range."""
    if traffic_ is None:
        return None
    span = (traffic_.until - traffic_.since).total_seconds()
    return requests / span if span > 0 else None


def newest_first(items: list[EventOut], before: list[EventOut], keep: int) -> list[EventOut]:
    """ITEMS (oldest first, newer than BEFORE) put on top of BEFORE (newest first), KEEP at most."""
    return [*reversed(items), *before][:keep]
