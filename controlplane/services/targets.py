"""Prometheus scrape targets of the fleet (`GET /api/v1/metrics/targets`), live ones only.

- the control plane: at its configured `public_url` (never the caller's Host header, which
  would let anyone who reads the targets point Prometheus anywhere);
- each agent's own /metrics, at the URL it reports in its facts, while its host heartbeats, and
  only where that URL is the agent's: on the host's advertise address, at the agent's metrics
  path, on a port that is not one of its engines'. An agent chooses what it reports, and a
  target is a request Prometheus sends from inside the network (to 169.254.169.254, say);
- each engine instance that is ready (desired running) on such a host, at the host's advertise
  address and the instance's port, https when the host's engines serve TLS, labelled with the
  version it reports running (a draining host's engines stay targets while they run);
- each gateway that heartbeats, at its reported /metrics URL.

Live means "heartbeating now", by the clock (`hosthealth.health_for`, `gateways.is_live`), not
by the state the host-health controller last wrote: a host silent for 3 intervals is left out
even if no sweep ran since. Engines' /metrics needs no API key (only their OpenAI routes do), so
a target is just an address. The answer is ordered (control plane, agents by host, engines by
instance id, gateways by target) so that equal fleets give equal files.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import SplitResult, urlsplit

import sqlalchemy as sa
from sqlmodel import Session, col, select

from controlplane.controllers.host_health import health_for
from controlplane.models import Deployment, GatewayProcess, Host, Instance, Model, ModelVersion
from controlplane.services.gateways import is_live
from controlplane.services.placement import load_versions
from protocol.monitoring import (
    METRICS_PATH,
    Scheme,
    ScrapeTargetGroup,
    TargetRole,
    host_port,
    same_address,
    split_metrics_url,
)
from protocol.version_ref import VersionRef
from protocol.wire import DesiredInstanceState, HostState, InstanceState, check_metrics_url


def target_group(
    role: TargetRole, scheme: Scheme, address: str, path: str = METRICS_PATH, **labels: str | None
) -> ScrapeTargetGroup:
    """One file_sd group of one target; labels given as None are left out, not empty."""
    return ScrapeTargetGroup(
        targets=[address],
        labels={
            "role": role,
            **{k: v for k, v in labels.items() if v is not None},
            "__scheme__": scheme,
            "__metrics_path__": path,
        },
    )


def control_plane_group(public_url: str) -> ScrapeTargetGroup:
    """The control plane's own target, at PUBLIC_URL (`http(s)://HOST[:PORT]`, checked by the
    settings)."""
    parts = urlsplit(public_url)
    scheme: Scheme = "https" if parts.scheme == "https" else "http"
    port = parts.port or (443 if scheme == "https" else 80)
    return target_group("controlplane", scheme, host_port(parts.hostname or "127.0.0.1", port))


def scrape_targets(
    session: Session, now: datetime, control_plane: ScrapeTargetGroup | None
) -> list[ScrapeTargetGroup]:
    """Every live scrape target of the fleet as of NOW, CONTROL_PLANE first (when given)."""
    live = _live_hosts(session, now)
    groups = [control_plane] if control_plane is not None else []
    groups += _agents(live)
    groups += _engines(session, live)
    groups += _gateways(session, now)
    return groups


def _live_hosts(session: Session, now: datetime) -> dict[int, Any]:
    """Hosts heartbeating now, by id (their name, facts and advertise address)."""
    rows = session.execute(
        sa.select(
            col(Host.id),
            col(Host.name),
            col(Host.facts),
            col(Host.advertise_address),
            col(Host.last_seen_at),
            col(Host.heartbeat_interval_s),
            col(Host.port_range_start),
            col(Host.port_range_end),
        ).order_by(col(Host.name))
    ).all()
    return {
        row.id: row
        for row in rows
        if row.last_seen_at is not None
        and health_for((now - row.last_seen_at).total_seconds(), row.heartbeat_interval_s)
        == HostState.READY
    }


def _agents(hosts: Mapping[int, Any]) -> list[ScrapeTargetGroup]:
    groups = []
    for host in hosts.values():
        url = (host.facts or {}).get("metrics_url")
        if not isinstance(url, str):
            continue  # an older agent: it does not say where its metrics are
        try:
            parts = urlsplit(check_metrics_url(url))
        except ValueError:
            continue
        if not _the_agents_own(host, parts):
            continue
        scheme, address, path = split_metrics_url(url)
        groups.append(target_group("agent", scheme, address, path, host=host.name))
    return groups


def _the_agents_own(host: Any, url: SplitResult) -> bool:
    """True when URL (checked by `check_metrics_url`) can only be the host's agent's /metrics:
    the host's advertise address, the agent's path, not an engine port of the host."""
    engine_ports = range(host.port_range_start, host.port_range_end + 1)
    return (
        host.advertise_address is not None
        and same_address(url.hostname or "", host.advertise_address)
        and url.path == METRICS_PATH
        and url.port not in engine_ports
    )


def _engines(session: Session, hosts: Mapping[int, Any]) -> list[ScrapeTargetGroup]:
    if not hosts:
        return []
    rows = session.execute(
        sa.select(
            col(Instance.id),
            col(Instance.host_id),
            col(Instance.port),
            col(Instance.version_id),
            col(Instance.observed_digest),
            col(Deployment.name),
            col(Deployment.model_id),
        )
        .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
        .where(
            col(Instance.observed_state) == InstanceState.READY.value,
            col(Instance.desired_state) == DesiredInstanceState.RUNNING.value,
            col(Instance.host_id).in_(list(hosts)),
        )
        .order_by(col(Instance.id))
    ).all()
    desired = {vid: v.label for vid, v in load_versions(session, [r[3] for r in rows]).items()}
    running = _versions_by_digest(session, {r.observed_digest for r in rows} - {None})
    groups = []
    for inst_id, host_id, port, version_id, digest, deployment, model_id in rows:
        host = hosts[host_id]
        if host.advertise_address is None:
            continue  # nowhere known to reach it (the routing table leaves it out too)
        tls = bool((host.facts or {}).get("engine_tls"))
        # The version the engine reports running: during a rollout an instance is moved to its
        # new version before its engine restarts on it.
        version = running.get((model_id, digest)) or desired.get(version_id)
        groups.append(
            target_group(
                "engine",
                "https" if tls else "http",
                host_port(host.advertise_address, port),
                host=host.name,
                deployment=deployment,
                version=version,
                instance_id=str(inst_id),
            )
        )
    return groups


def _versions_by_digest(session: Session, digests: set[str]) -> dict[tuple[int, str], str]:
    """`MODEL:VERSION` of each (model id, snapshot digest) among DIGESTS (one query)."""
    if not digests:
        return {}
    rows = session.exec(
        select(ModelVersion.model_id, ModelVersion.digest, Model.name, ModelVersion.version)
        .join(Model, col(Model.id) == col(ModelVersion.model_id))
        .where(col(ModelVersion.digest).in_(digests))
    ).all()
    return {(model_id, digest): str(VersionRef(name, tag)) for model_id, digest, name, tag in rows}


def _gateways(session: Session, now: datetime) -> list[ScrapeTargetGroup]:
    rows = session.exec(
        select(GatewayProcess).order_by(col(GatewayProcess.last_seen_at).desc())
    ).all()
    found: dict[tuple[str, str], ScrapeTargetGroup] = {}
    for row in rows:
        if not is_live(row.last_seen_at, row.interval_s, now):
            continue
        scheme: Scheme = "https" if row.scheme == "https" else "http"
        address, path = host_port(row.address, row.port), METRICS_PATH
        if row.metrics_url:  # checked when the gateway sent it
            scheme, address, path = split_metrics_url(row.metrics_url)
        # A gateway restarted at the same address is one target: its latest beat wins. No
        # `version` label: the gateway's own series carry the model `version` they served.
        found.setdefault((scheme, address), target_group("gateway", scheme, address, path,
                                                         host=row.address))  # fmt: skip
    return [found[key] for key in sorted(found, key=lambda k: (k[1], k[0]))]
