"""Rollouts, rollbacks and restarts as the API starts and steers them (operator role): the
request is checked here, then made a record and a command of the rollout machine, carried out by
its store (`controlplane.rollouts.store`, the one writer of rollout rows) in the request's
transaction; the controller (`controlplane.rollouts.controller`) moves them on. Every change
records an Event."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from controlplane.models import Deployment, Host, Instance, Model, ModelVersion, Rollout
from controlplane.rollouts import store
from controlplane.rollouts.messages import (
    Abort,
    Command,
    Pause,
    Promote,
    Resume,
    RollBack,
    Start,
)
from controlplane.rollouts.progress import RolloutProgress, RolloutSettings
from controlplane.rollouts.webhook import check_target
from controlplane.services.canary import locked_deployment
from controlplane.services.deployments import (
    check_parallel,
    checked_engine_config,
    get_deployment,
)
from controlplane.services.errors import Conflict, Invalid, NotFound
from controlplane.services.models import deployable_version, find_version
from controlplane.services.placement import load_versions, surge_problems
from controlplane.services.traffic import canary_share
from protocol.rollout_policy import DEFAULT_POLICY, RolloutPolicy
from protocol.rollout_states import (
    ACTIVE_STATES,
    CANARY_KINDS,
    RolloutKind,
    RolloutPhase,
    RolloutState,
)
from protocol.rollouts import (
    Analysis,
    InstanceProgress,
    RestartCreate,
    RollbackCreate,
    RolloutAction,
    RolloutCreate,
    RolloutOut,
)
from protocol.version_ref import VersionRef
from protocol.wire import InstanceState

HISTORY_LIMIT = 50


def _version_tag(session: Session, deployment: Deployment, ref: str) -> str:
    """The VERSION of REF (VERSION or MODEL:VERSION of the deployment's own model)."""
    model = session.get(Model, deployment.model_id)
    assert model is not None
    if ":" not in ref:
        return ref
    try:
        named = VersionRef.parse(ref)
        name, tag = named.model, named.version
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    if name != model.name:
        raise Invalid(
            f"deployment {deployment.name} serves model {model.name!r}, not {name!r}: "
            f"name a version of {model.name}"
        )
    return tag


def _refuse_if_busy(session: Session, deployment: Deployment) -> None:
    assert deployment.id is not None
    busy = store.active_of(session, deployment.id)
    if busy is not None:
        raise Conflict(
            f"deployment {deployment.name} already has an active {busy.kind} ({busy.id}, "
            f"{busy.state}): wait for it, or `dctl rollout abort {deployment.name}`"
        )


def start_rollout(
    session: Session,
    now: datetime,
    actor: str,
    name: str,
    spec: RolloutCreate,
    notify_allow_private: bool = False,
) -> Rollout:
    """Start a rollout: Conflict when one is active, Invalid when the plan cannot run or its
    `notify` URL names a private address (`[controlplane] notify_allow_private`)."""
    check_target(spec.policy.notify, "policy.notify", notify_allow_private)
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    _refuse_if_busy(session, deployment)
    to_id = deployment.stable_version_id
    if spec.to is not None:
        model = session.get(Model, deployment.model_id)
        assert model is not None
        _model, version = deployable_version(
            session, model.name, _version_tag(session, deployment, spec.to)
        )
        assert version.id is not None
        to_id = version.id
    config = checked_engine_config(spec.engine_config) if spec.engine_config is not None else None
    target = session.get(ModelVersion, to_id)
    target_model = session.get(Model, target.model_id) if target is not None else None
    if target is not None and target_model is not None:
        # The canary's ranks must start: the same 422 as deploy create / configure.
        ref = VersionRef(target_model.name, target.version)
        check_parallel(deployment, ref, target, config)
    if to_id == deployment.stable_version_id:
        if config is None:
            raise Invalid(
                f"{store.label(session, to_id)} is already deployment {name}'s stable version: "
                "name another version with --to, or give a new --engine-config"
            )
        to_id = _config_version(session, now, to_id, config)
    total = store.own_total(session, deployment)
    if total < 2 and spec.surge == 0:
        raise Invalid(
            f"deployment {name} runs {total} instance(s): a canary needs one beside at least one "
            f"stable instance. Add --surge 1 (an extra instance where GPUs are free) or scale "
            f"it first (`dctl deploy scale {name} 2`, or more hosts)"
        )
    if spec.surge:
        problems = surge_problems(session, deployment, to_id, spec.surge)
        if problems:
            raise Invalid(
                f"--surge {spec.surge}: no room for {spec.surge} extra instance(s) of deployment "
                f"{name}: {'; '.join(problems)}"
            )
    # The rollout's own thresholds, else the deployment's, else the built-in defaults.
    policy = RolloutPolicy.model_validate(
        {
            **DEFAULT_POLICY.model_dump(),
            **deployment.rollout_policy,
            **spec.policy.model_dump(exclude_none=True),
        }
    )
    rollout = store.create(
        session,
        now,
        actor,
        deployment,
        kind=RolloutKind.ROLLOUT,
        to_version_id=to_id,
        phase=RolloutPhase.STAGING,
        weights=spec.weights(),
        settings=RolloutSettings(policy=policy, surge=spec.surge),
        reason=spec.reason or "started",
        engine_config=config,
    )
    store.command(session, now, actor, rollout, Start(spec.reason))
    return rollout


def _config_version(session: Session, now: datetime, stable_id: int, config: dict[str, Any]) -> int:
    """The version a rollout of an engine config alone goes to: the stable weights under a tag
    of their own (`VERSION-config-HASH`), registered once per config.

    Pools, routes, traffic and figures are told apart by version; this one has the stable's
    digest, so hosts already hold its snapshot and fetch nothing.
    """
    stable = session.get(ModelVersion, stable_id)
    assert stable is not None and stable.id is not None
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    tag = f"{stable.version[:45]}-config-{digest}"
    existing = session.exec(
        select(ModelVersion).where(
            ModelVersion.model_id == stable.model_id, ModelVersion.version == tag
        )
    ).first()
    if existing is not None and existing.id is not None:
        return existing.id
    alias = ModelVersion(
        model_id=stable.model_id,
        version=tag,
        line=stable.line,
        parent_id=stable.id,
        digest=stable.digest,
        manifest=stable.manifest,
        total_bytes=stable.total_bytes,
        memory_plan=stable.memory_plan,
        source_uri=stable.source_uri,
        notes=f"the weights of {stable.version} under a new engine config (rollout)",
        created_at=now,
    )
    session.add(alias)
    session.flush()
    assert alias.id is not None
    return alias.id


def act(
    session: Session, now: datetime, actor: str, name: str, action: str, body: RolloutAction
) -> Rollout:
    """promote [--full], abort, pause or resume the active rollout (NotFound when none)."""
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    rollout = store.active_of(session, deployment.id)
    if rollout is None:
        raise NotFound(f"active rollout of deployment {name!r}")
    why = body.reason or f"{action} by {actor}"
    orders: dict[str, Command] = {
        "promote": Promote(body.full, why),
        "abort": Abort(why),
        "pause": Pause(why),
        "resume": Resume(why),
    }
    if action not in orders:
        raise Invalid(f"unknown action {action!r}: promote, abort, pause or resume")
    store.command(session, now, actor, rollout, orders[action])
    return rollout


def start_rollback(
    session: Session, now: datetime, actor: str, name: str, spec: RollbackCreate
) -> Rollout:
    """Back to the previous stable pair (or the named version) without analysis. During an
    active rollout: that rollout ends `rolled_back` (its canary goes away at once)."""
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    active = store.active_of(session, deployment.id)
    if active is not None and active.kind in CANARY_KINDS and spec.to is None:
        store.command(session, now, actor, active, RollBack(spec.reason or "rolled back"))
        return active
    _refuse_if_busy(session, deployment)
    config = None
    if spec.to is not None:
        model = session.get(Model, deployment.model_id)
        assert model is not None
        found = find_version(session, model.name, _version_tag(session, deployment, spec.to))
        if found is None:
            raise NotFound(f"version {spec.to!r} of model {model.name!r}")
        target = found[1].id
    else:
        target = deployment.rollback_version_id
        config = deployment.rollback_engine_config
        if target is None:
            raise Conflict(
                f"deployment {name} has no earlier version to go back to (no rollout was promoted"
                " yet): name one with --to"
            )
    assert target is not None
    if session.get(ModelVersion, target) is None:
        raise Conflict(f"the version to go back to (id {target}) was deleted: name one with --to")
    if target == deployment.stable_version_id:
        raise Conflict(
            f"{store.label(session, target)} is already deployment {name}'s stable version"
        )
    if store.instance_total(session, deployment.id) == 0:
        raise Conflict(f"deployment {name} has no instances to move")
    rollout = store.create(
        session,
        now,
        actor,
        deployment,
        kind=RolloutKind.ROLLBACK,
        to_version_id=target,
        phase=RolloutPhase.PROMOTING,
        weights=[100],
        settings=RolloutSettings(policy=DEFAULT_POLICY, all_at_once=spec.all_at_once),
        reason=spec.reason or "rollback",
        engine_config=config,
    )
    store.command(session, now, actor, rollout, Start(spec.reason))
    return rollout


def start_restart(
    session: Session, now: datetime, actor: str, name: str, spec: RestartCreate
) -> Rollout:
    """Restart the deployment's instances (or those on HOST, or INSTANCE) one at a time."""
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    _refuse_if_busy(session, deployment)
    query = select(Instance.id, Host.name).join(Host, col(Host.id) == col(Instance.host_id))
    rows: list[tuple[int | None, str]] = list(
        session.exec(
            query.where(Instance.deployment_id == deployment.id).order_by(col(Instance.id))
        ).all()
    )
    if spec.host is not None:
        rows = [r for r in rows if r[1] == spec.host]
        if not rows:
            raise NotFound(f"instances of deployment {name} on host {spec.host!r}")
    if spec.instance is not None:
        rows = [r for r in rows if r[0] == spec.instance]
        if not rows:
            raise NotFound(f"instance {spec.instance} of deployment {name}")
    if not rows:
        raise Conflict(f"deployment {name} has no instances to restart")
    queue = [int(r[0]) for r in rows if r[0] is not None]
    rollout = store.create(
        session,
        now,
        actor,
        deployment,
        kind=RolloutKind.RESTART,
        to_version_id=deployment.stable_version_id,
        phase=RolloutPhase.RESTARTING,
        weights=[],
        settings=RolloutSettings(policy=DEFAULT_POLICY),
        reason=spec.reason or "restart",
        progress=RolloutProgress(queue=tuple(queue)),
    )
    store.command(session, now, actor, rollout, Start(spec.reason))
    return rollout


def current(session: Session, name: str) -> Rollout:
    """The active rollout of NAME, else its most recent one (NotFound: never had one)."""
    deployment = get_deployment(session, name)
    assert deployment.id is not None
    rollout = (
        store.active_of(session, deployment.id)
        or session.exec(
            select(Rollout)
            .where(Rollout.deployment_id == deployment.id)
            .order_by(col(Rollout.id).desc())
        ).first()
    )
    if rollout is None:
        raise NotFound(f"rollout of deployment {name!r} (it never had one)")
    return rollout


def history(session: Session, name: str, limit: int = HISTORY_LIMIT) -> list[Rollout]:
    """NAME's rollouts, rollbacks and restarts, newest first."""
    deployment = get_deployment(session, name)
    return list(
        session.exec(
            select(Rollout)
            .where(Rollout.deployment_id == deployment.id)
            .order_by(col(Rollout.id).desc())
            .limit(limit)
        ).all()
    )


def by_id(session: Session, name: str, rollout_id: int) -> Rollout:
    """One of NAME's records."""
    deployment = get_deployment(session, name)
    rollout = session.get(Rollout, rollout_id)
    if rollout is None or rollout.deployment_id != deployment.id:
        raise NotFound(f"rollout {rollout_id} of deployment {name!r}")
    return rollout


def view(session: Session, now: datetime, rollout: Rollout, *, admin: bool) -> RolloutOut:
    """The API's view of a record, with its instances as they stand; the `notify` URL whole
    for an ADMIN only (`RolloutPolicy.masked`)."""
    deployment = session.get(Deployment, rollout.deployment_id)
    assert deployment is not None and deployment.id is not None
    policy = rollout.settings.policy
    active = rollout.state in ACTIVE_STATES and rollout.kind != RolloutKind.RESTART
    time_left = None
    if rollout.state == RolloutState.PAUSED and rollout.paused_left_s is not None:
        time_left = rollout.paused_left_s
    elif rollout.phase == RolloutPhase.ANALYSING and rollout.step_started_at is not None:
        spent = (now - rollout.step_started_at).total_seconds()
        time_left = max((policy.interval_s or 0.0) - spent, 0.0)
    rows = session.exec(
        select(Instance, Host.name)
        .join(Host, col(Host.id) == col(Instance.host_id))
        .where(Instance.deployment_id == deployment.id)
        .order_by(col(Instance.id))
    ).all()
    labels = load_versions(session, list({inst.version_id for inst, _host in rows}))
    instances = [
        InstanceProgress(
            id=inst.id or 0,
            host=host,
            version=labels[inst.version_id].label if inst.version_id in labels else "",
            pool="canary" if active and inst.version_id == rollout.to_version_id else "stable",
            state=inst.observed_state,
            ready=inst.observed_state == InstanceState.READY.value,
            restarts=inst.restart_count,
        )
        for inst, host in rows
    ]
    canary_ready = store.ready_count(session, deployment.id, rollout.to_version_id) if active else 0
    stable_ready = store.ready_count(session, deployment.id, deployment.stable_version_id)
    analyses = [Analysis.model_validate(a) for a in rollout.analysis]
    staging = []
    if rollout.phase == RolloutPhase.STAGING:
        staging = store.staging_of(session, deployment, rollout.to_version_id)
    weights = [int(s.get("weight", 0)) for s in rollout.steps]
    before_first = (
        rollout.phase in (RolloutPhase.STAGING, RolloutPhase.WAITING) and rollout.step_index == 0
    )
    step = 0 if before_first else rollout.step_index + 1
    return RolloutOut(
        id=rollout.id or 0,
        deployment=deployment.name,
        kind=rollout.kind,
        state=rollout.state,
        step=min(step, len(weights)) if weights else 0,
        steps=weights,
        weight=rollout.canary_weight,
        # Only while a step is timed (analysing): the requests its next analysis will judge.
        served=canary_share(session, now, deployment.name, rollout.step_started_at)
        if active and rollout.step_started_at is not None
        else None,
        from_=store.label(session, rollout.from_version_id),
        to=store.label(session, rollout.to_version_id),
        engine_config_changed=rollout.engine_config is not None,
        phase=rollout.phase,
        canary_instances=rollout.canary_instances,
        canary_ready=canary_ready,
        stable_ready=stable_ready,
        step_started_at=rollout.step_started_at,
        time_left_s=time_left,
        policy=policy if admin else policy.masked(),
        analysis=analyses[-1] if analyses else None,
        analyses=analyses,
        reason=rollout.message,
        actor=rollout.actor,
        instances=instances,
        staging=staging,
        created_at=rollout.created_at,
        updated_at=rollout.updated_at,
    )
