"""Deployments -> instances: which hosts run a deployment, how many instances, which ports."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.models import Deployment, Host, Instance


class PlacementError(ValueError):
    """A deployment cannot be placed as asked (e.g. a host has no free port)."""


def target_hosts(session: Session, deployment: Deployment) -> list[Host]:
    """Named hosts that are registered plus every host carrying all the placement labels."""
    hosts = session.exec(select(Host).order_by(col(Host.id))).all()
    names = set(deployment.placement_hosts)
    labels = deployment.placement_labels
    chosen = []
    for host in hosts:
        by_name = host.name in names
        by_labels = bool(labels) and all(host.labels.get(k) == v for k, v in labels.items())
        if by_name or by_labels:
            chosen.append(host)
    return chosen


def free_port(host: Host, used: set[int]) -> int:
    """The lowest port of the host's range not used by another instance."""
    for port in range(host.port_range_start, host.port_range_end + 1):
        if port not in used:
            return port
    raise PlacementError(
        f"host {host.name} has no free port in {host.port_range_start}-{host.port_range_end}: "
        "scale something down or widen the agent's --ports range"
    )


def bump_generation(session: Session, host_ids: Iterable[int]) -> None:
    """Tell these hosts their desired state changed (the next heartbeat reply carries it)."""
    ids = sorted(set(host_ids))
    if ids:
        session.execute(
            update(Host)
            .where(col(Host.id).in_(ids))
            .values(desired_generation=col(Host.desired_generation) + 1)
        )


def reconcile_deployment(session: Session, deployment: Deployment, now: datetime) -> set[int]:
    """Create / delete / update instances so each target host has `instances_per_host`.

    Returns the ids of hosts whose desired state changed (their generation is bumped).
    """
    assert deployment.id is not None
    changed: set[int] = set()
    existing = session.exec(
        select(Instance).where(Instance.deployment_id == deployment.id).order_by(col(Instance.id))
    ).all()
    by_host: dict[int, list[Instance]] = {}
    for inst in existing:
        by_host.setdefault(inst.host_id, []).append(inst)
    targets = {h.id: h for h in target_hosts(session, deployment) if h.id is not None}
    for host_id, instances in by_host.items():
        keep = deployment.instances_per_host if host_id in targets else 0
        for inst in sorted(instances, key=lambda i: i.ordinal)[keep:]:
            session.delete(inst)
            changed.add(host_id)
    session.flush()
    for host_id, host in targets.items():
        mine = sorted(by_host.get(host_id, []), key=lambda i: i.ordinal)
        kept = mine[: deployment.instances_per_host]
        desired = "stopped" if host.draining else "running"
        for inst in kept:
            if inst.version_id != deployment.stable_version_id or inst.desired_state != desired:
                inst.version_id = deployment.stable_version_id
                inst.desired_state = desired
                session.add(inst)
                changed.add(host_id)
        if len(kept) < deployment.instances_per_host:
            used = set(session.exec(select(Instance.port).where(Instance.host_id == host_id)).all())
            ordinals = {i.ordinal for i in kept}
            for ordinal in range(deployment.instances_per_host):
                if ordinal in ordinals:
                    continue
                port = free_port(host, used)
                used.add(port)
                session.add(
                    Instance(
                        deployment_id=deployment.id,
                        host_id=host_id,
                        version_id=deployment.stable_version_id,
                        ordinal=ordinal,
                        port=port,
                        desired_state=desired,
                        created_at=now,
                    )
                )
                changed.add(host_id)
    session.flush()
    bump_generation(session, changed)
    return changed


def reconcile_host(session: Session, host: Host, now: datetime) -> set[int]:
    """Re-place every deployment after a host registered, changed labels, drained or undrained."""
    changed: set[int] = set()
    for deployment in session.exec(select(Deployment).order_by(col(Deployment.id))).all():
        changed |= reconcile_deployment(session, deployment, now)
    return changed
