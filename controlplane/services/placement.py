"""Placement: load what the planner reads, run it, turn its changes into instance rows.

The rules live in `controlplane/planner/`; this module only does the I/O around them: views
from the store in a few queries (active rollouts included: their canaries run on
`canary_instances` of the deployment's instances), rows written from the changes, a fresh API key
for every new instance, and the generation of every host whose desired state changed bumped.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import (
    Deployment,
    Gpu,
    Host,
    Instance,
    Model,
    ModelVersion,
    Rollout,
)
from controlplane.planner import (
    Create,
    Delete,
    DeploymentView,
    GpuView,
    HostView,
    InstanceView,
    Plan,
    RolloutView,
    UpdateDesiredState,
    UpdateGpus,
    UpdateStandby,
    UpdateVersion,
    VersionView,
    gpu_ranks,
    kv_reserve_tokens,
    plan_deployment,
    plan_fleet,
)
from controlplane.services.errors import Conflict, Invalid
from protocol.rollout_states import ACTIVE_STATES, RestartStage, RolloutKind
from protocol.version_ref import VersionRef
from protocol.wire import MemoryPlan

# Engine API keys carry a prefix so a leaked one is recognisable (and greppable) as dctl's.
INSTANCE_KEY_PREFIX = "dctl_ik_"


def new_instance_key() -> str:
    """A random API key for one engine instance."""
    return INSTANCE_KEY_PREFIX + secrets.token_urlsafe(32)


def bump_generation(session: Session, host_ids: Iterable[int]) -> None:
    """Tell these hosts their desired state changed (the next heartbeat reply carries it)."""
    ids = sorted(set(host_ids))
    if ids:
        session.execute(
            update(Host)
            .where(col(Host.id).in_(ids))
            .values(desired_generation=col(Host.desired_generation) + 1)
        )


def place_deployment(session: Session, now: datetime, deployment: Deployment) -> Plan:
    """Plan and apply one deployment; where it does not fit, raise and write nothing.

    Ports running out is a 409 (as it always was: the fleet is full); GPUs or memory that do not
    fit are a 422 (the request asks for something impossible).
    """
    plan, _hosts = _plan_one(session, deployment, now)
    if plan.problems:
        message = "; ".join(p.message for p in plan.problems)
        if all(p.kind == "ports" for p in plan.problems):
            raise Conflict(message)
        raise Invalid(message)
    apply_plan(session, plan, now)
    return plan


def replan_deployment(session: Session, now: datetime, actor: str, deployment: Deployment) -> Plan:
    """Plan and apply one deployment, applying what fits; an event names each host where the
    rest does not (as `place_fleet` does). For changes that must not be refused, such as ending
    a canary: what does not fit now is placed by a later planning."""
    plan, hosts = _plan_one(session, deployment, now)
    apply_plan(session, plan, now)
    assert deployment.id is not None
    _record_problems(session, now, actor, plan, {deployment.id: deployment.name}, hosts)
    return plan


def _plan_one(
    session: Session, deployment: Deployment, now: datetime | None = None
) -> tuple[Plan, list[HostView]]:
    """The plan of one deployment with its active rollout, and the hosts it was made for
    (retiring instances whose time came by NOW deleted; None: none are)."""
    assert deployment.id is not None
    view = deployment_view(
        deployment,
        load_held(session, [deployment.id]).get(deployment.id),
        load_retiring(session, now, [deployment.id]).get(deployment.id),
    )
    hosts = load_hosts(session)
    rollout = load_rollouts(session, [view.id]).get(view.id)
    wanted = [view.stable_version_id] + ([rollout.canary_version_id] if rollout else [])
    plan = plan_deployment(
        view, rollout, hosts, load_instances(session), load_versions(session, wanted)
    )
    return plan, hosts


def surge_problems(
    session: Session, deployment: Deployment, version_id: int, surge: int
) -> list[str]:
    """Why SURGE extra instances of VERSION_ID would not fit beside the deployment's own (an
    empty list: they fit). Nothing is written."""
    assert deployment.id is not None
    view = deployment_view(
        deployment, retiring=load_retiring(session, None, [deployment.id]).get(deployment.id)
    )
    hosts = load_hosts(session)
    rollout = RolloutView(version_id, surge, surge)
    wanted = [view.stable_version_id, version_id]
    plan = plan_deployment(
        view, rollout, hosts, load_instances(session), load_versions(session, wanted)
    )
    return [p.message for p in plan.problems]


def place_fleet(session: Session, now: datetime, actor: str) -> Plan:
    """Plan and apply every deployment after a host changed (registered, drained, relabelled).

    Where a deployment no longer fits, what fits is applied and an event says what does not:
    the host change that caused it has happened already and is not refused.
    """
    held = load_held(session)
    retiring = load_retiring(session, now)
    views = [
        deployment_view(d, held.get(d.id or 0), retiring.get(d.id or 0))
        for d in session.exec(select(Deployment)).all()
    ]
    hosts = load_hosts(session)
    rollouts = load_rollouts(session)
    plan = plan_fleet(
        views,
        rollouts,
        hosts,
        load_instances(session),
        load_versions(
            session,
            [v.stable_version_id for v in views] + [r.canary_version_id for r in rollouts.values()],
        ),
    )
    apply_plan(session, plan, now)
    _record_problems(session, now, actor, plan, {v.id: v.name for v in views}, hosts)
    return plan


def _record_problems(
    session: Session,
    now: datetime,
    actor: str,
    plan: Plan,
    deployment_names: dict[int, str],
    hosts: Sequence[HostView],
) -> None:
    host_names = {h.id: h.name for h in hosts}
    for problem in plan.problems:
        record_event(
            session,
            now,
            actor,
            "deployment.unplaced",
            f"deployment/{deployment_names[problem.deployment_id]}",
            problem.message,
            host=host_names[problem.host_id] if problem.host_id is not None else None,
            reason=problem.kind,
        )


def apply_plan(session: Session, plan: Plan, now: datetime) -> None:
    """Write the plan's changes to instance rows and bump the generation of their hosts."""
    touched = {c.instance_id for c in plan.changes if not isinstance(c, Create)}
    rows = {
        row.id: row
        for row in session.exec(select(Instance).where(col(Instance.id).in_(touched))).all()
    }
    # Deletions first and flushed: a new instance may take a port one of them frees.
    for change in plan.changes:
        if isinstance(change, Delete):
            session.delete(rows[change.instance_id])
    session.flush()
    # Instances whose version changed: until their agent applies it, they run the old one. (A
    # new instance runs nothing else; one moved to other GPUs still serves its version.)
    respecified: list[Instance] = []
    for change in plan.changes:
        if isinstance(change, Create):
            session.add(
                Instance(
                    deployment_id=change.deployment_id,
                    host_id=change.host_id,
                    version_id=change.version_id,
                    ordinal=change.ordinal,
                    port=change.port,
                    gpu_indices=list(change.gpu_indices),
                    api_key=new_instance_key(),
                    desired_state=change.desired_state,
                    standby=change.standby,
                    created_at=now,
                )
            )
        elif isinstance(change, UpdateVersion):
            rows[change.instance_id].version_id = change.version_id
            respecified.append(rows[change.instance_id])
        elif isinstance(change, UpdateGpus):
            rows[change.instance_id].gpu_indices = list(change.gpu_indices)
        elif isinstance(change, UpdateDesiredState):
            rows[change.instance_id].desired_state = change.desired_state
        elif isinstance(change, UpdateStandby):
            rows[change.instance_id].standby = change.standby
    session.flush()
    bump_generation(session, plan.host_ids())
    ids = [row.id for row in respecified if row.id is not None]
    if ids:
        # The generation that carries the new spec: the host's, just bumped.
        session.execute(
            update(Instance)
            .where(col(Instance.id).in_(ids))
            .values(
                spec_generation=select(Host.desired_generation)
                .where(col(Host.id) == col(Instance.host_id))
                .scalar_subquery()
            ),
            execution_options={"synchronize_session": False},
        )
        for row in respecified:
            session.refresh(row, ["spec_generation"])


# --- views of the store ------------------------------------------------------------------------


@dataclass(frozen=True)
class Retiring:
    """A deployment's scaled-down instances: still draining, and drained (to delete)."""

    draining: frozenset[int] = frozenset()
    drained: frozenset[int] = frozenset()


def deployment_view(
    deployment: Deployment,
    held_stopped: frozenset[int] | None = None,
    retiring: Retiring | None = None,
) -> DeploymentView:
    """What the planner needs of a deployment row (and of its restart: HELD_STOPPED; of its
    scaled-down instances: RETIRING)."""
    assert deployment.id is not None
    retiring = retiring or Retiring()
    total = None
    standby = 0
    if deployment.replicas is not None:
        policy = deployment.autoscale
        standby = policy.standby_beside(deployment.replicas) if policy is not None else 0
        total = deployment.replicas + standby
    return DeploymentView(
        id=deployment.id,
        name=deployment.name,
        stable_version_id=deployment.stable_version_id,
        placement_hosts=frozenset(deployment.placement_hosts),
        placement_labels=dict(deployment.placement_labels),
        instances_per_host=deployment.instances_per_host,
        gpus_per_instance=deployment.gpus_per_instance,
        kv_reserve_tokens=kv_reserve_tokens(deployment.engine_config),
        parallel_size=gpu_ranks(deployment.engine_config),
        held_stopped=held_stopped or frozenset(),
        total=total,
        standby=standby,
        retiring=retiring.draining,
        retired=retiring.drained,
    )


def load_retiring(
    session: Session, now: datetime | None, deployment_ids: Collection[int] | None = None
) -> dict[int, Retiring]:
    """The instances being retired, of each deployment that has some (of DEPLOYMENT_IDS; None:
    all), split by whether their time came by NOW (None: none did) (one query)."""
    query = select(Instance.id, Instance.deployment_id, Instance.retire_at).where(
        col(Instance.retire_at).is_not(None)
    )
    if deployment_ids is not None:
        query = query.where(col(Instance.deployment_id).in_(set(deployment_ids)))
    found: dict[int, tuple[set[int], set[int]]] = {}
    for inst_id, dep_id, retire_at in session.exec(query).all():
        assert inst_id is not None and retire_at is not None
        draining, drained = found.setdefault(dep_id, (set(), set()))
        (drained if now is not None and retire_at <= now else draining).add(inst_id)
    return {
        dep_id: Retiring(frozenset(draining), frozenset(drained))
        for dep_id, (draining, drained) in found.items()
    }


def load_hosts(session: Session) -> list[HostView]:
    """Every host with its GPUs (two queries)."""
    gpus: dict[int, list[GpuView]] = {}
    for host_id, index, memory in session.exec(
        select(Gpu.host_id, Gpu.index, Gpu.memory_total_bytes).order_by(col(Gpu.index))
    ).all():
        gpus.setdefault(host_id, []).append(GpuView(index, memory))
    hosts = session.exec(select(Host).order_by(col(Host.id))).all()
    return [
        HostView(
            id=host.id,
            name=host.name,
            labels=dict(host.labels),
            draining=host.draining,
            gpus=tuple(gpus.get(host.id, [])),
            port_range=(host.port_range_start, host.port_range_end),
        )
        for host in hosts
        if host.id is not None
    ]


def load_instances(session: Session) -> list[InstanceView]:
    """Every instance (one query): they all hold ports and GPUs on their hosts."""
    return [
        InstanceView(
            id=row.id,
            deployment_id=row.deployment_id,
            host_id=row.host_id,
            ordinal=row.ordinal,
            port=row.port,
            version_id=row.version_id,
            gpu_indices=tuple(row.gpu_indices),
            desired_state=row.desired_state,
            standby=row.standby,
        )
        for row in session.exec(select(Instance).order_by(col(Instance.id))).all()
        if row.id is not None
    ]


def active_rollouts(
    session: Session, deployment_ids: Collection[int] | None = None
) -> dict[int, Rollout]:
    """The active canary-bearing rollout (a rollout or rollback, not a restart) of each
    deployment that has one (of DEPLOYMENT_IDS; None: all), by deployment id (one query).
    Should two ever be active, the newest counts."""
    query = select(Rollout).where(
        col(Rollout.state).in_(ACTIVE_STATES), col(Rollout.kind) != RolloutKind.RESTART
    )
    if deployment_ids is not None:
        query = query.where(col(Rollout.deployment_id).in_(set(deployment_ids)))
    rows = session.exec(query.order_by(col(Rollout.id))).all()
    return {row.deployment_id: row for row in rows}


def load_held(
    session: Session, deployment_ids: Collection[int] | None = None
) -> dict[int, frozenset[int]]:
    """The instance an active restart holds stopped, of each deployment that has one (of
    DEPLOYMENT_IDS; None: all), by deployment id (one query)."""
    query = select(Rollout).where(
        col(Rollout.state).in_(ACTIVE_STATES), col(Rollout.kind) == RolloutKind.RESTART
    )
    if deployment_ids is not None:
        query = query.where(col(Rollout.deployment_id).in_(set(deployment_ids)))
    return {
        row.deployment_id: frozenset({row.progress.current})
        for row in session.exec(query).all()
        if row.progress.current is not None and row.progress.stage == RestartStage.STOPPING
    }


def load_rollouts(
    session: Session, deployment_ids: Collection[int] | None = None
) -> dict[int, RolloutView]:
    """What the planner needs of the active rollouts, by deployment id (one query)."""
    return {
        dep_id: RolloutView(row.to_version_id, row.canary_instances, row.settings.surge)
        for dep_id, row in active_rollouts(session, deployment_ids).items()
    }


def load_versions(session: Session, ids: Sequence[int]) -> dict[int, VersionView]:
    """These versions' names and memory plans (one query)."""
    rows = session.exec(
        select(ModelVersion.id, Model.name, ModelVersion.version, ModelVersion.memory_plan)
        .join(Model, col(Model.id) == col(ModelVersion.model_id))
        .where(col(ModelVersion.id).in_(set(ids)))
    ).all()
    return {
        vid: VersionView(str(VersionRef(name, tag)), MemoryPlan(**plan) if plan else None)
        for vid, name, tag, plan in rows
        if vid is not None
    }
