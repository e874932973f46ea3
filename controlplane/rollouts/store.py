"""Rollout records in the store: the one module that writes `Rollout` rows.

The machine (`controlplane.rollouts.machine`) decides; this module reads a row into a
`RolloutRecord`, gathers a round's `Observations`, and carries out what the machine returns:
the record written back, then its effects (re-plans, the stable swap, events, analyses). The
controller's rounds (`advance`) and the API's commands (`command`, in the request's transaction)
come through here alike, so a command and a round cannot disagree on what a change means.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session, col, func, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Host, Instance, ModelVersion, Rollout
from controlplane.rollouts.machine import LEADERLESS_GAP, RolloutMachine, canary_size
from controlplane.rollouts.messages import (
    Command,
    Effect,
    InstanceSeen,
    Notify,
    Observations,
    RecordAnalysis,
    RecordEvent,
    Refused,
    RolloutRecord,
    SetCanary,
    SetManual,
    StageSnapshot,
    StartInstance,
    StopInstance,
    SwapStable,
    Traffic,
)
from controlplane.rollouts.ports import (
    bump_generation,
    deployment_traffic,
    load_versions,
    place_deployment,
    replan_deployment,
)
from controlplane.rollouts.progress import RolloutProgress, RolloutSettings
from controlplane.services.errors import Conflict
from protocol.engine_kinds import engine_kind
from protocol.gateway import VersionTraffic
from protocol.rollout_states import ACTIVE_STATES, RolloutKind, RolloutPhase, RolloutState
from protocol.rollouts import HostStaging
from protocol.wire import DesiredInstanceState, HostFacts, InstanceState

STOPPED_STATES = {InstanceState.STOPPED.value, InstanceState.FAILED.value}
# A notification: the URL and the JSON body (sent after the transaction commits).
Notice = tuple[str, dict[str, Any]]


# --- new records -------------------------------------------------------------------------------


def create(
    session: Session,
    now: datetime,
    actor: str,
    deployment: Deployment,
    *,
    kind: RolloutKind,
    to_version_id: int,
    phase: RolloutPhase,
    weights: list[int],
    settings: RolloutSettings,
    reason: str,
    engine_config: dict[str, Any] | None = None,
    progress: RolloutProgress | None = None,
) -> Rollout:
    """A new record of DEPLOYMENT, started (flushed, so it has its id; its start's effects
    applied)."""
    assert deployment.id is not None
    rollout = Rollout(
        deployment_id=deployment.id,
        from_version_id=deployment.stable_version_id,
        to_version_id=to_version_id,
        kind=kind,
        state=RolloutState.PROGRESSING,
        phase=phase,
        steps=[{"weight": w} for w in weights],
        settings=settings,
        progress=progress or RolloutProgress(),
        engine_config=engine_config,
        actor=actor,
        message=reason,
        ticked_at=now,
        created_at=now,
        updated_at=now,
    )
    session.add(rollout)
    session.flush()
    return rollout


# --- a command, a round ------------------------------------------------------------------------


def command(session: Session, now: datetime, actor: str, rollout: Rollout, order: Command) -> None:
    """Carry out an operator's ORDER on ROLLOUT in the caller's transaction; Conflict when it
    does not apply. A manual canary that does not fit where it lands is refused whole."""
    deployment = _deployment(session, rollout)
    machine = RolloutMachine(record_of(session, rollout, deployment))
    try:
        effects = machine.apply(order, now)
    except Refused as exc:
        raise Conflict(str(exc)) from None
    _carry_out(session, now, actor, rollout, deployment, machine.record, effects,
               strict=isinstance(order, SetManual))  # fmt: skip


def advance(
    session: Session,
    now: datetime,
    actor: str,
    rollout: Rollout,
    leaderless_gap: timedelta = LEADERLESS_GAP,
) -> list[Notice]:
    """One round of the machine on ROLLOUT; returns the notifications to send after commit."""
    deployment = _deployment(session, rollout)
    machine = RolloutMachine(record_of(session, rollout, deployment), leaderless_gap)
    effects = machine.tick(now, observe(session, now, rollout, deployment, machine))
    return _carry_out(session, now, actor, rollout, deployment, machine.record, effects)


def _carry_out(
    session: Session,
    now: datetime,
    actor: str,
    rollout: Rollout,
    deployment: Deployment,
    record: RolloutRecord,
    effects: list[Effect],
    *,
    strict: bool = False,
) -> list[Notice]:
    """Write RECORD to the row, then apply EFFECTS in order (re-plans read the row)."""
    _write(rollout, record, now)
    session.add(rollout)
    session.flush()
    notices: list[Notice] = []
    replan = False
    for effect in effects:
        if isinstance(effect, RecordEvent):
            record_event(
                session, now, actor, effect.kind, subject(deployment), effect.message,
                **effect.data,
            )  # fmt: skip
        elif isinstance(effect, RecordAnalysis):
            rollout.analysis = [*rollout.analysis, effect.analysis.model_dump(mode="json")]
        elif isinstance(effect, SetCanary):
            replan = replan or effect.instances is not None
        elif isinstance(effect, StopInstance | StartInstance):
            replan = True
        elif isinstance(effect, StageSnapshot):
            bump_generation(session, [h.id for h in staging_hosts(session, deployment) if h.id])
        elif isinstance(effect, SwapStable):
            _swap_stable(session, now, rollout, deployment)
            replan = True
        elif isinstance(effect, Notify):
            notices.append(_notice(session, rollout, deployment, effect))
    session.add(rollout)
    session.flush()
    if replan:
        if strict:
            place_deployment(session, now, deployment)
        else:
            replan_deployment(session, now, actor, deployment)
    if any(isinstance(e, SwapStable) for e in effects):
        # Every host of the deployment learns its new keep-list (the rollback target).
        hosts = session.exec(
            select(Instance.host_id).where(Instance.deployment_id == deployment.id)
        ).all()
        bump_generation(session, hosts)
    return notices


def _swap_stable(session: Session, now: datetime, rollout: Rollout, deployment: Deployment) -> None:
    old_version, old_config = deployment.stable_version_id, deployment.engine_config
    deployment.stable_version_id = rollout.to_version_id
    if rollout.engine_config is not None:
        deployment.engine_config = rollout.engine_config
    deployment.rollback_version_id = old_version
    deployment.rollback_engine_config = old_config
    deployment.updated_at = now
    session.add(deployment)
    session.flush()


def _notice(session: Session, rollout: Rollout, deployment: Deployment, notify: Notify) -> Notice:
    url = rollout.settings.policy.notify or ""
    body: dict[str, Any] = {
        "deployment": deployment.name,
        "rollout": rollout.id,
        "kind": rollout.kind.value,
        "from": label(session, rollout.from_version_id),
        "to": label(session, rollout.to_version_id),
        "state": rollout.state.value,
        "step": rollout.step_index + 1,
        "weight": rollout.canary_weight,
        "reason": rollout.message,
        "event": notify.event,
    }
    if notify.analysis is not None:
        body["analysis"] = notify.analysis.model_dump(mode="json")
    return url, body


# --- the row and the record --------------------------------------------------------------------


def record_of(session: Session, rollout: Rollout, deployment: Deployment) -> RolloutRecord:
    """What the machine knows of ROLLOUT."""
    assert rollout.id is not None
    return RolloutRecord(
        id=rollout.id,
        deployment=deployment.name,
        kind=rollout.kind,
        state=rollout.state,
        phase=rollout.phase,
        weights=tuple(int(s.get("weight", 0)) for s in rollout.steps),
        from_label=label(session, rollout.from_version_id),
        to_label=label(session, rollout.to_version_id),
        new_config=rollout.engine_config is not None,
        step_index=rollout.step_index,
        canary_weight=rollout.canary_weight,
        canary_instances=rollout.canary_instances,
        failures=rollout.failures,
        step_started_at=rollout.step_started_at,
        paused_left_s=rollout.paused_left_s,
        ticked_at=rollout.ticked_at,
        message=rollout.message,
        settings=rollout.settings,
        progress=rollout.progress,
    )


def _write(rollout: Rollout, record: RolloutRecord, now: datetime) -> None:
    before = record_fields(rollout)
    rollout.state = record.state
    rollout.phase = record.phase
    if [int(s.get("weight", 0)) for s in rollout.steps] != list(record.weights):
        rollout.steps = [{"weight": w} for w in record.weights]
    rollout.step_index = record.step_index
    rollout.canary_weight = record.canary_weight
    rollout.canary_instances = record.canary_instances
    rollout.failures = record.failures
    rollout.step_started_at = record.step_started_at
    rollout.paused_left_s = record.paused_left_s
    rollout.ticked_at = record.ticked_at
    rollout.message = record.message[:1000]
    rollout.settings = record.settings
    rollout.progress = record.progress
    if record_fields(rollout) != before:
        rollout.updated_at = now


def record_fields(rollout: Rollout) -> tuple[object, ...]:
    """What a change of the record changes (a round that only ticks changes nothing)."""
    return (rollout.state, rollout.phase, rollout.step_index, rollout.canary_weight,
            rollout.canary_instances, rollout.failures, rollout.paused_left_s, rollout.message,
            rollout.steps)  # fmt: skip


def _deployment(session: Session, rollout: Rollout) -> Deployment:
    deployment = session.get(Deployment, rollout.deployment_id)
    assert deployment is not None
    return deployment


# --- observations ------------------------------------------------------------------------------


def observe(
    session: Session,
    now: datetime,
    rollout: Rollout,
    deployment: Deployment,
    machine: RolloutMachine,
) -> Observations:
    """What a round of MACHINE on ROLLOUT sees now."""
    assert deployment.id is not None
    interval = step = None
    families: dict[int, str | None] = {}
    windows = machine.analysis_windows(now)
    if windows is not None:
        since, step_since = windows
        interval = _traffic(session, now, rollout, deployment, since)
        step = _traffic(session, now, rollout, deployment, step_since)
        families = _families(session, [deployment.stable_version_id, rollout.to_version_id])
    staging: tuple[HostStaging, ...] = ()
    if rollout.phase == RolloutPhase.STAGING:
        staging = tuple(staging_of(session, deployment, rollout.to_version_id))
    return Observations(
        own_total=own_total(session, deployment),
        ready=ready_count(session, deployment.id, rollout.to_version_id),
        canary_restarts=canary_restarts(session, rollout),
        staging=staging,
        interval=interval,
        step=step,
        current=_instance_seen(session, rollout.progress.current),
        stable_family=families.get(deployment.stable_version_id),
        canary_family=families.get(rollout.to_version_id),
        stable_engine=engine_kind(deployment.engine_config),
        canary_engine=engine_kind(
            deployment.engine_config if rollout.engine_config is None else rollout.engine_config
        ),
    )


def _families(session: Session, version_ids: list[int]) -> dict[int, str | None]:
    """The model family each version was sized by at registration (None: not recorded)."""
    views = load_versions(session, version_ids)
    return {vid: v.memory_plan.family if v.memory_plan else None for vid, v in views.items()}


def _traffic(
    session: Session, now: datetime, rollout: Rollout, deployment: Deployment, start: datetime
) -> Traffic:
    """The analysis inputs since START: the engines' figures count from the same start, as
    their samples are attributed to an instance's current version."""
    traffic = deployment_traffic(session, now, deployment.name, start, now, whole_windows=True)
    by_version: dict[int, VersionTraffic] = {v.version_id: v for v in traffic.versions}
    return Traffic(
        stable=by_version.get(deployment.stable_version_id),
        canary=by_version.get(rollout.to_version_id),
    )


def _instance_seen(session: Session, instance_id: int | None) -> InstanceSeen | None:
    instance = session.get(Instance, instance_id) if instance_id is not None else None
    if instance is None:
        return None
    running = instance.desired_state == DesiredInstanceState.RUNNING.value
    return InstanceSeen(
        stopped=instance.observed_state in STOPPED_STATES,
        ready=running and instance.observed_state == InstanceState.READY.value,
        held_stopped=not running,
    )


def staging_of(session: Session, deployment: Deployment, version_id: int) -> list[HostStaging]:
    """Pre-staging of VERSION_ID on each host of DEPLOYMENT, from the snapshots each agent
    reports holding (and those it could not fetch or verify)."""
    version = session.get(ModelVersion, version_id)
    if version is None:
        return []
    staging = []
    for host in staging_hosts(session, deployment):
        facts = HostFacts.model_validate(host.facts or {})
        failed = [f for f in facts.snapshot_failures if f.digest == version.digest]
        if version.digest in facts.snapshots:
            staging.append(HostStaging(host=host.name, state="ready"))
        elif failed:
            staging.append(HostStaging(host=host.name, state="failed", error=failed[0].error))
        else:
            staging.append(HostStaging(host=host.name, state="fetching"))
    return staging


# --- queries -----------------------------------------------------------------------------------


def subject(deployment: Deployment) -> str:
    """The events' subject."""
    return f"deployment/{deployment.name}"


def label(session: Session, version_id: int) -> str:
    """MODEL:VERSION of a version id ("(deleted)" when it is gone)."""
    found = load_versions(session, [version_id]).get(version_id)
    return found.label if found else f"(deleted version {version_id})"


def own_total(session: Session, deployment: Deployment) -> int:
    """The deployment's own instances (surge ones, beyond its instances per host, left out;
    of an autoscaled one, its serving count: standby and retiring ones left out too)."""
    if deployment.replicas is not None:
        serving = session.exec(
            select(func.count())
            .select_from(Instance)
            .where(
                Instance.deployment_id == deployment.id,
                col(Instance.standby).is_(False),
                col(Instance.retire_at).is_(None),
            )
        ).one()
        return min(serving, deployment.replicas)
    return session.exec(
        select(func.count())
        .select_from(Instance)
        .where(
            Instance.deployment_id == deployment.id,
            Instance.ordinal < deployment.instances_per_host,
        )
    ).one()


def rescale_canary(session: Session, rollout: Rollout, total: int) -> int:
    """The canary instances an active ROLLOUT keeps when its deployment scales to TOTAL serving
    instances (the autoscaler), written to it: a timed step's share of them (as the step would
    have taken), a manual canary's count while stable keeps one. Returns the count."""
    if rollout.kind == RolloutKind.MANUAL:
        count = min(rollout.canary_instances, max(total - 1, 0))
    elif rollout.phase == RolloutPhase.ANALYSING and rollout.canary_weight > 0:
        count = canary_size(rollout.canary_weight, total, rollout.settings.surge)
    else:
        return rollout.canary_instances  # a step still starting sizes itself from the total
    if count != rollout.canary_instances:
        rollout.canary_instances = count
        session.add(rollout)
    return count


def instance_total(session: Session, deployment_id: int) -> int:
    """The deployment's instances."""
    return session.exec(
        select(func.count()).select_from(Instance).where(Instance.deployment_id == deployment_id)
    ).one()


def ready_count(session: Session, deployment_id: int, version_id: int) -> int:
    """Instances of the deployment that serve VERSION now: ready, reporting its digest, on a
    host whose agent has applied the spec that made them VERSION's (`Instance.spec_generation`:
    an engine-config version has the weights of the one it replaces)."""
    version = session.get(ModelVersion, version_id)
    if version is None:
        return 0
    return session.exec(
        select(func.count())
        .select_from(Instance)
        .join(Host, col(Host.id) == col(Instance.host_id))
        .where(
            Instance.deployment_id == deployment_id,
            Instance.version_id == version_id,
            Instance.desired_state == DesiredInstanceState.RUNNING.value,
            Instance.observed_state == InstanceState.READY.value,
            Instance.observed_digest == version.digest,
            col(Host.applied_generation) >= col(Instance.spec_generation),
        )
    ).one()


def canary_restarts(session: Session, rollout: Rollout) -> int:
    """Restarts of the canary version's instances so far (summed restart counters)."""
    total = session.exec(
        select(func.coalesce(func.sum(Instance.restart_count), 0)).where(
            Instance.deployment_id == rollout.deployment_id,
            Instance.version_id == rollout.to_version_id,
        )
    ).one()
    return int(total)


def active_of(session: Session, deployment_id: int) -> Rollout | None:
    """The deployment's active rollout, rollback, restart or manual canary, if any."""
    return session.exec(
        select(Rollout)
        .where(Rollout.deployment_id == deployment_id, col(Rollout.state).in_(ACTIVE_STATES))
        .order_by(col(Rollout.id).desc())
    ).first()


def to_advance(session: Session) -> list[int]:
    """The records a round moves on: the active ones, and those with an ending to record."""
    ids = session.exec(
        select(Rollout.id).where(
            col(Rollout.state).in_(ACTIVE_STATES) | (col(Rollout.phase) == RolloutPhase.ENDING)
        )
    ).all()
    return [i for i in ids if i is not None]


def locked(session: Session, rollout_id: int) -> Rollout | None:
    """The record, its row locked until commit (PostgreSQL; SQLite has one writer anyway)."""
    return session.exec(select(Rollout).where(Rollout.id == rollout_id).with_for_update()).first()


def staging_hosts(session: Session, deployment: Deployment) -> list[Host]:
    """The hosts a rollout of DEPLOYMENT pre-stages on: those its instances run on."""
    on = select(Instance.host_id).where(Instance.deployment_id == deployment.id)
    return list(session.exec(select(Host).where(col(Host.id).in_(on)).order_by(col(Host.name))))
