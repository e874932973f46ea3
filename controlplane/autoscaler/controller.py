"""The autoscaler controller: every round, each autoscaled deployment's count follows its load.

Per deployment, in its own transaction (its row locked): gather the load its engines reported
(`Instance.requests_running` / `_waiting` of its ready serving instances), the gateways' recent
request rate, a pending wake; `decide` (pure); apply a change through
`controlplane.services.autoscale.apply_count`, which records it as an Event with its figures.
Every round also stops the instances whose drain time came, and retries placing a deployment
that wants more instances than are placed (GPUs taken elsewhere may have come free).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from controlplane.autoscaler.decide import Load, decide
from controlplane.autoscaler.state import AutoscaleState
from controlplane.eventlog import record_event
from controlplane.models import Deployment, Instance, Rollout, TrafficWindow
from controlplane.planner import Plan
from controlplane.planner.fit import engine_settings
from controlplane.services import autoscale
from controlplane.services.placement import replan_deployment
from protocol.rollout_states import ACTIVE_STATES, RolloutKind

ACTOR = "autoscaler"
log = logging.getLogger("controlplane.autoscaler")
# The gateways' request rate is read over this window (they report every 5 s by default).
RATE_WINDOW = timedelta(seconds=30)
# A deployment short of instances is placed again at most this often.
REPLACE_EVERY = timedelta(seconds=10)


class AutoscaleController:
    """Runs the autoscaler over every autoscaled deployment once per round (`tick`)."""

    name = "autoscaler"

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._placed_at: dict[int, datetime] = {}

    def tick(self, now: datetime) -> None:
        """One round over the deployments that have a policy."""
        with Session(self._engine) as session:
            ids = session.exec(
                select(Deployment.id).where(col(Deployment.autoscale).is_not(None))
            ).all()
            rates = _gateway_rates(session, now)
        for dep_id in ids:
            assert dep_id is not None
            try:
                with Session(self._engine) as session:
                    self._round(session, now, dep_id, rates.get(dep_id, 0.0))
                    session.commit()
            except Exception:  # one deployment's failure must not stop the others
                log.exception("autoscaler round failed for deployment %s", dep_id)

    def _round(self, session: Session, now: datetime, dep_id: int, rate: float) -> None:
        deployment = session.exec(
            select(Deployment).where(Deployment.id == dep_id).with_for_update()
        ).first()
        if deployment is None or deployment.autoscale is None:
            return
        policy = deployment.autoscale
        instances = autoscale.instances_of(session, dep_id)
        ready = [i for i in autoscale.serving(instances) if autoscale.is_ready(i)]
        load = Load(
            replicas=deployment.replicas or 0,
            ready=len(ready),
            running=sum(i.requests_running or 0 for i in ready),
            waiting=sum(i.requests_waiting or 0 for i in ready),
            max_concurrent=engine_settings(
                deployment.engine_config
            ).service.max_concurrent_requests,
            gateway_rps=rate,
            wake_requested_at=deployment.wake_requested_at,
            restarting=_restarting(session, dep_id),
        )
        before = deployment.autoscale_state
        outcome = decide(policy, before, load, now)
        state = outcome.state
        plan: Plan | None = None
        if outcome.decision is not None:
            plan = autoscale.apply_count(session, now, deployment, outcome.decision)
        elif any(i.retire_at is not None and i.retire_at <= now for i in instances):
            plan = replan_deployment(session, now, ACTOR, deployment)  # drained: stop them
        elif _short(deployment, instances) and self._due(dep_id, now):
            plan = replan_deployment(session, now, ACTOR, deployment)
        if plan is not None:
            self._placed_at[dep_id] = now
        instances = autoscale.instances_of(session, dep_id) if plan is not None else instances
        state = _starved(state, deployment, instances, plan, now)
        if state.pinned_at_max_since is not None and before.pinned_at_max_since is None:
            record_event(
                session,
                now,
                ACTOR,
                "autoscale.pinned",
                f"deployment/{deployment.name}",
                f"deployment {deployment.name} is at its max of {policy.max} instance(s) and "
                "its queue is still over target: raise --max or add GPUs",
                figures=load.figures(),
            )
        if state.starved_since is not None and before.starved_since is None:
            record_event(
                session,
                now,
                ACTOR,
                "autoscale.unplaced",
                f"deployment/{deployment.name}",
                f"deployment {deployment.name} wants more instances than fit: "
                f"{state.starved_reason}",
                figures=load.figures(),
            )
        if state != before:
            deployment.autoscale_state = state
            session.add(deployment)

    def _due(self, dep_id: int, now: datetime) -> bool:
        last = self._placed_at.get(dep_id)
        return last is None or now - last >= REPLACE_EVERY


def _short(deployment: Deployment, instances: Sequence[Instance]) -> bool:
    """True when fewer instances are placed than the deployment wants."""
    return len([i for i in instances if i.retire_at is None]) < wanted_total(deployment)


def wanted_total(deployment: Deployment) -> int:
    """Serving plus standby instances the deployment wants (standby only beside serving)."""
    replicas = deployment.replicas or 0
    policy = deployment.autoscale
    return replicas + (policy.standby_beside(replicas) if policy is not None else 0)


def _starved(
    state: AutoscaleState,
    deployment: Deployment,
    instances: Sequence[Instance],
    plan: Plan | None,
    now: datetime,
) -> AutoscaleState:
    """STATE with its starved clock and reason brought up to date."""
    if not _short(deployment, instances):
        if state.starved_since is None:
            return state
        return state.model_copy(update={"starved_since": None, "starved_reason": ""})
    reason = state.starved_reason
    if plan is not None and plan.problems:
        reason = "; ".join(p.message for p in plan.problems)[:1000]
    placed = len([i for i in instances if i.retire_at is None])
    reason = reason or f"{placed} of {wanted_total(deployment)} instance(s) placed"
    return state.model_copy(
        update={"starved_since": state.starved_since or now, "starved_reason": reason}
    )


def _restarting(session: Session, dep_id: int) -> bool:
    """True while a rolling restart of the deployment runs (no scale-down meanwhile)."""
    found = session.exec(
        select(Rollout.id).where(
            Rollout.deployment_id == dep_id,
            col(Rollout.state).in_(ACTIVE_STATES),
            Rollout.kind == RolloutKind.RESTART,
        )
    ).first()
    return found is not None


def _gateway_rates(session: Session, now: datetime) -> dict[int, float]:
    """Requests per second the gateways served each deployment over the last RATE_WINDOW."""
    rows = session.exec(
        select(TrafficWindow.deployment_id, func.sum(TrafficWindow.requests))
        .where(col(TrafficWindow.ended_at) > now - RATE_WINDOW)
        .group_by(col(TrafficWindow.deployment_id))
    ).all()
    return {dep_id: float(total or 0) / RATE_WINDOW.total_seconds() for dep_id, total in rows}
