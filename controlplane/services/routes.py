"""The routing table gateways poll (`GET /api/v1/routes`): where each deployment's requests go.

Per deployment: the model names it serves (its own name), the stable pool (the stable version
and its ready instances) and, while a rollout is active, the canary pool at the rollout's weight;
for one that may scale to zero, how long a gateway holds a request while it wakes.
Beside them, the client tokens gateways accept (hashes, never secrets) with their grants: the
deployments each may use, whether it may pin a pool, its concurrency cap.

An instance is in a pool only when it can take a request now: observed ready, desired running,
on a host that is ready and not draining, with an advertise address (an instance whose host
gave none is left out rather than guessed at) and a working agent token (the address is the
agent's word: once its token is revoked or expired, not another request goes there, without
waiting for its heartbeats to be missed), neither a standby nor being retired by the autoscaler,
and running the pool's version (the digest it
reports is the version's: an instance moved to another version is out until its engine
restarted on it).

Gateways poll every second, each of them, so this is a constant number of queries however large
the fleet, and the ETag is a hash of the table itself: every replica computes the same one for
the same store, with no generation counter to keep.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, or_, select

from controlplane.models import ApiToken, Deployment, Host, Instance, ModelVersion
from controlplane.services.hosts import has_agent_token
from controlplane.services.placement import active_rollouts, load_versions
from protocol.gateway import DeploymentRoute, RouteClient, RouteInstance, RoutePool, RouteTable
from protocol.vocabulary import Role
from protocol.wire import DesiredInstanceState, HostState, InstanceState


def routing_table(session: Session, now: datetime) -> RouteTable:
    """The routing table as the store holds it now, with its ETag (five queries)."""
    deployments = [
        (d.id, d.name, d.stable_version_id, d.autoscale)
        for d in session.exec(select(Deployment).order_by(col(Deployment.name))).all()
    ]
    rollouts = active_rollouts(session)
    wanted = [stable_id for _id, _name, stable_id, _policy in deployments] + [
        r.to_version_id for r in rollouts.values()
    ]
    labels = {vid: v.label for vid, v in load_versions(session, wanted).items()}
    pools = _ready_instances(session, now)
    routes = []
    for dep_id, name, stable_id, policy in deployments:
        assert dep_id is not None
        rollout = rollouts.get(dep_id)
        canary = None
        if rollout is not None:
            canary = RoutePool(
                version_id=rollout.to_version_id,
                version=labels[rollout.to_version_id],
                instances=pools.get((dep_id, rollout.to_version_id), []),
            )
        routes.append(
            DeploymentRoute(
                deployment=name,
                model_names=[name],
                stable=RoutePool(
                    version_id=stable_id,
                    version=labels[stable_id],
                    instances=pools.get((dep_id, stable_id), []),
                ),
                canary=canary,
                canary_weight=rollout.canary_weight if rollout is not None else 0,
                cold_start_timeout_s=policy.cold_start_timeout_s
                if policy is not None and policy.min == 0
                else None,
            )
        )
    table = RouteTable(etag="", deployments=routes, clients=_clients(session, now))
    table.etag = table_etag(table)
    return table


def table_etag(table: RouteTable) -> str:
    """SHA-256 hex of the table's canonical JSON (sorted keys, no spaces), its ETag left out."""
    body = table.model_dump(mode="json", exclude={"etag"})
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """True when an `If-None-Match` header names ETAG (quoted or not, weak or not) or is `*`."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        tag = candidate.strip()
        if tag == "*":
            return True
        tag = tag.removeprefix("W/").strip('"')
        if tag == etag:
            return True
    return False


def _ready_instances(session: Session, now: datetime) -> dict[tuple[int, int], list[RouteInstance]]:
    """Instances that can take a request now, by (deployment id, version id), in id order."""
    engine_tls = col(Host.facts)["engine_tls"].as_boolean()
    rows = session.execute(
        sa.select(
            col(Instance.id),
            col(Instance.deployment_id),
            col(Instance.version_id),
            col(Instance.port),
            col(Instance.api_key),
            col(Host.name),
            col(Host.advertise_address),
            engine_tls,
        )
        .join(Host, col(Host.id) == col(Instance.host_id))
        .join(ModelVersion, col(ModelVersion.id) == col(Instance.version_id))
        .where(
            col(Instance.observed_state) == InstanceState.READY.value,
            col(Instance.desired_state) == DesiredInstanceState.RUNNING.value,
            # Autoscaling: standby instances wait to be promoted, retiring ones to stop.
            col(Instance.standby).is_(False),
            col(Instance.retire_at).is_(None),
            col(Host.state) == HostState.READY.value,
            col(Host.draining).is_(False),
            col(Host.advertise_address).is_not(None),
            has_agent_token(now),
            # Until the agent applied the spec, the engine there is the one being replaced.
            col(Host.applied_generation) >= col(Instance.spec_generation),
            or_(
                col(Instance.observed_digest).is_(None),
                col(Instance.observed_digest) == col(ModelVersion.digest),
            ),
        )
        .order_by(col(Instance.id))
    ).all()
    pools: dict[tuple[int, int], list[RouteInstance]] = {}
    for inst_id, dep_id, version_id, port, api_key, host, address, tls in rows:
        assert inst_id is not None and address is not None
        pools.setdefault((dep_id, version_id), []).append(
            RouteInstance(
                id=inst_id,
                host=host,
                address=address,
                port=port,
                scheme="https" if tls else "http",
                api_key=api_key,
            )
        )
    return pools


def _clients(session: Session, now: datetime) -> list[RouteClient]:
    """Client tokens that work now: not revoked, not expired (by key id)."""
    rows = session.exec(
        select(ApiToken)
        .where(
            col(ApiToken.role) == Role.CLIENT.value,
            col(ApiToken.revoked_at).is_(None),
            or_(col(ApiToken.expires_at).is_(None), col(ApiToken.expires_at) > now),
            or_(col(ApiToken.uses_left).is_(None), col(ApiToken.uses_left) > 0),
        )
        .order_by(col(ApiToken.key_id))
    ).all()
    return [
        RouteClient(
            key_id=t.key_id,
            name=t.name,
            secret_sha256=t.secret_sha256,
            deployments=sorted(t.deployments) if t.deployments is not None else None,
            expires_at=t.expires_at,
            allow_pool_pin=t.allow_pool_pin,
            max_concurrency=t.max_concurrency,
        )
        for t in rows
    ]
