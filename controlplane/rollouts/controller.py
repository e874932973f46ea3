"""The rollout controller: every round, moves each active rollout, rollback and restart on.

A rollout of steps w1 < w2 < ... < 100, each held for the policy's interval:

    waiting    canary_size(w_k) instances run the new pair; weight stays where it was until they
               are ready, then becomes w_k and the step's clock starts
    analysing  at the end of each interval: canary against stable over that interval
               pass -> next step (or promoting after the last below 100)
               inconclusive -> the step is extended by an interval
               fail -> again, until `failure_limit` consecutive failures abort
    promoting  every request to the canary pool; the remaining instances move to the new pair
               one at a time (or all at once), each ready before the next; then the new pair is
               stable, the old one the rollback target
    ending     after an abort or a rollback by hand: the last notification, then done

A rollback is a rollout that starts at `promoting`. A restart takes its instances one at a time:
desired `stopped` until the agent reports it stopped, then `running` until it is ready again.

Everything lives in the rollout row, so a control plane killed mid-step resumes where it was;
the time without a leader is added to the step's clock (`ticked_at`), so the step keeps the time
it had left.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Instance, ModelVersion, Rollout
from controlplane.rollouts import transitions as tr
from controlplane.rollouts.analysis import Interval, analyse, failing_reason, starved_reason
from controlplane.rollouts.notify import Notice, Notifier
from controlplane.rollouts.ports import bump_generation, deployment_traffic, replan_deployment
from controlplane.rollouts.progress import Promotion
from protocol.gateway import VersionTraffic
from protocol.rollout_policy import notify_origin
from protocol.rollouts import (
    ACTIVE_STATES,
    Analysis,
    RestartStage,
    RolloutKind,
    RolloutPhase,
    RolloutState,
)
from protocol.wire import InstanceState

log = logging.getLogger("controlplane.rollouts")

ACTOR = "controller:rollouts"
# Longer than this between two rounds means no leader ran: the gap does not count as step time.
LEADERLESS_GAP = timedelta(seconds=3)
STOPPED_STATES = {InstanceState.STOPPED.value, InstanceState.FAILED.value}


class RolloutController:
    """Runs every active rollout one round (`tick`); each in its own transaction."""

    name = "rollouts"

    def __init__(
        self,
        engine: Engine,
        notifier: Notifier | None = None,
        leaderless_gap: timedelta = LEADERLESS_GAP,
        notify_allow_private: bool = False,
    ) -> None:
        self._engine = engine
        self.leaderless_gap = leaderless_gap
        self.notifier = notifier or Notifier(
            self._notice_failed, allow_private=notify_allow_private
        )

    def tick(self, now: datetime) -> None:
        """One round over the rollouts that are active or still have an ending to record."""
        with Session(self._engine) as session:
            ids = session.exec(
                select(Rollout.id).where(
                    col(Rollout.state).in_(ACTIVE_STATES)
                    | (col(Rollout.phase) == RolloutPhase.ENDING)
                )
            ).all()
        for rollout_id in ids:
            with Session(self._engine) as session:
                rollout = session.exec(
                    select(Rollout).where(Rollout.id == rollout_id).with_for_update()
                ).first()
                if rollout is None:
                    continue
                notices = self._advance(session, now, rollout)
                session.commit()
            for url, body in notices:
                self.notifier.send(url, body)

    # --- one rollout -----------------------------------------------------------------------

    def _advance(self, session: Session, now: datetime, rollout: Rollout) -> list[tuple[str, Any]]:
        deployment = session.get(Deployment, rollout.deployment_id)
        assert deployment is not None
        before = (rollout.state, rollout.step_index, len(rollout.analysis))
        if rollout.ticked_at is not None and rollout.step_started_at is not None:
            gap = now - rollout.ticked_at
            if gap > self.leaderless_gap and rollout.state == RolloutState.PROGRESSING:
                rollout.step_started_at += gap
        rollout.ticked_at = now
        if rollout.phase == RolloutPhase.ENDING:
            rollout.phase = RolloutPhase.DONE
        elif rollout.state == RolloutState.PROGRESSING and rollout.kind != RolloutKind.MANUAL:
            if rollout.kind == RolloutKind.RESTART:
                self._restart(session, now, rollout, deployment)
            else:
                self._rollout(session, now, rollout, deployment)
        session.add(rollout)
        return self._notices(session, rollout, deployment, before)

    def _rollout(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        promote = rollout.progress.pending
        if promote is not None:
            rollout.progress = rollout.progress.model_copy(update={"pending": None})
            if promote == Promotion.FULL or rollout.phase != RolloutPhase.PROMOTING:
                self._next_step(session, now, rollout, deployment, full=promote == Promotion.FULL)
        # A phase that ends hands over to the next within the same round.
        for _ in range(4):
            phase = rollout.phase
            if phase == RolloutPhase.STAGING:
                self._stage(session, now, rollout, deployment)
            elif phase == RolloutPhase.WAITING:
                self._wait_for_canary(session, now, rollout, deployment)
            elif phase == RolloutPhase.ANALYSING:
                self._maybe_analyse(session, now, rollout, deployment)
            elif phase == RolloutPhase.PROMOTING:
                self._promote(session, now, rollout, deployment)
            if rollout.phase == phase or rollout.state != RolloutState.PROGRESSING:
                break

    def _stage(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        """Wait until every host of the deployment holds the new snapshot, verified; pause with
        the host and the agent's reason (it names the file) when one cannot get it."""
        version = session.get(ModelVersion, rollout.to_version_id)
        assert version is not None
        label = tr.label(session, rollout.to_version_id)
        pending = []
        for host in tr.staging_hosts(session, deployment):
            state, error = tr.staged(host, version.digest)
            if state == "failed":
                reason = f"pre-staging: host {host.name} cannot fetch or verify {label}: {error}"
                tr.pause(session, now, ACTOR, rollout, reason)
                record_event(
                    session,
                    now,
                    ACTOR,
                    "rollout.paused",
                    tr.subject(deployment),
                    f"rollout {rollout.id} of deployment {deployment.name} paused: {reason}",
                    rollout=rollout.id,
                    host=host.name,
                )
                return
            if state != "ready":
                pending.append(host.name)
        if pending:
            rollout.message = f"pre-staging {label}: waiting for {', '.join(pending)}"
            return
        first = self._weights(rollout)[rollout.step_index]
        rollout.phase = RolloutPhase.PROMOTING if first >= 100 else RolloutPhase.WAITING
        rollout.message = f"{label} is on every host of the deployment, verified"
        record_event(
            session,
            now,
            ACTOR,
            "rollout.staged",
            tr.subject(deployment),
            f"rollout {rollout.id} of deployment {deployment.name}: {rollout.message}",
            rollout=rollout.id,
        )

    def _weights(self, rollout: Rollout) -> list[int]:
        return [int(s.get("weight", 0)) for s in rollout.steps]

    def _wait_for_canary(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        assert deployment.id is not None
        weight = self._weights(rollout)[rollout.step_index]
        total = tr.own_total(session, deployment)
        need = tr.canary_size(weight, total, tr.surge_of(rollout))
        if need < 1:
            tr.end(
                session,
                now,
                ACTOR,
                rollout,
                deployment,
                RolloutState.ABORTED,
                f"deployment has {total} instance(s): no room for a canary beside stable",
            )
            return
        if rollout.canary_instances != need:
            tr.set_canary(session, now, ACTOR, rollout, deployment, instances=need)
        if tr.ready_count(session, deployment.id, rollout.to_version_id) < need:
            return
        tr.set_canary(session, now, ACTOR, rollout, deployment, weight=weight)
        rollout.phase = RolloutPhase.ANALYSING
        rollout.step_started_at = now
        rollout.progress = rollout.progress.model_copy(
            update={
                "restarts_at": tr.canary_restarts(session, rollout),
                "interval_since": now,
                "step_since": now,
            }
        )
        record_event(
            session,
            now,
            ACTOR,
            "rollout.step",
            tr.subject(deployment),
            f"rollout {rollout.id} of deployment {deployment.name}: step "
            f"{rollout.step_index + 1}/{len(rollout.steps)}, {need} canary instance(s) ready, "
            f"{weight}% of requests",
            rollout=rollout.id,
            step=rollout.step_index + 1,
            weight=weight,
        )

    def _maybe_analyse(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        assert rollout.step_started_at is not None
        if now < rollout.step_started_at + tr.interval_of(rollout):
            return
        since = rollout.progress.interval_since or rollout.step_started_at
        step_since = rollout.progress.step_since or since
        policy = tr.policy_of(rollout)
        stable_label = tr.label(session, deployment.stable_version_id)
        canary_label = tr.label(session, rollout.to_version_id)
        restarts_now = tr.canary_restarts(session, rollout)

        def judge(start: datetime) -> Analysis:
            # The engines' figures count from the same start: their samples are attributed to
            # an instance's current version, and an instance that ran stable until the step
            # began must not lend the canary its old figures.
            traffic = deployment_traffic(
                session, now, deployment.name, start, now, whole_windows=True
            )
            by_version: dict[str, VersionTraffic] = {v.version: v for v in traffic.versions}
            return analyse(
                Interval(
                    time=now,
                    since=start,
                    step=rollout.step_index + 1,
                    weight=rollout.canary_weight,
                    stable=by_version.get(stable_label),
                    canary=by_version.get(canary_label),
                    canary_restarts=max(restarts_now - rollout.progress.restarts_at, 0),
                ),
                policy,
            )

        result = judge(since)
        if result.verdict == "inconclusive" and step_since < since:
            # Too little in the last interval (a canary the gateway ejects gets almost nothing):
            # judge everything since the step's weight took effect instead.
            result = judge(step_since)
        rollout.analysis = [*rollout.analysis, result.model_dump(mode="json")]
        rollout.progress = rollout.progress.model_copy(update={"interval_since": now})
        rollout.step_started_at = now  # the next analysis is an interval from now
        if result.verdict == "fail":
            rollout.failures += 1
            reason = failing_reason(result)
            record_event(
                session,
                now,
                ACTOR,
                "rollout.analysis_failed",
                tr.subject(deployment),
                f"rollout {rollout.id} of deployment {deployment.name}, step "
                f"{result.step}: analysis failed ({rollout.failures}/{policy.failure_limit}): "
                f"{reason}",
                rollout=rollout.id,
                step=result.step,
                failures=rollout.failures,
            )
            if rollout.failures >= (policy.failure_limit or 1):
                tr.end(
                    session,
                    now,
                    ACTOR,
                    rollout,
                    deployment,
                    RolloutState.ABORTED,
                    f"step {result.step}: {reason}",
                )
            return
        if result.verdict == "starved":
            # Not judgeable, and not the canary's fault for sure: the operator decides
            # (the analysis module's docstring says why this pauses).
            reason = f"step {result.step}: {starved_reason(result)}"
            tr.pause(session, now, ACTOR, rollout, reason)
            record_event(
                session,
                now,
                ACTOR,
                "rollout.paused",
                tr.subject(deployment),
                f"rollout {rollout.id} of deployment {deployment.name} paused: {reason}",
                rollout=rollout.id,
                step=result.step,
            )
            return
        if result.verdict == "inconclusive":
            rollout.message = (
                f"step {result.step} extended: {result.canary_requests} canary and "
                f"{result.stable_requests} stable requests in the interval, "
                f"{policy.min_requests} needed in each"
            )
            return
        rollout.failures = 0
        self._next_step(session, now, rollout, deployment, full=False)

    def _next_step(
        self,
        session: Session,
        now: datetime,
        rollout: Rollout,
        deployment: Deployment,
        *,
        full: bool,
    ) -> None:
        weights = self._weights(rollout)
        k = len(weights) - 1 if full else min(rollout.step_index + 1, len(weights) - 1)
        rollout.step_index = k
        rollout.step_started_at = None
        rollout.phase = RolloutPhase.PROMOTING if weights[k] >= 100 else RolloutPhase.WAITING
        rollout.message = f"step {k + 1}/{len(weights)}: {weights[k]}%"

    def _promote(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        """All requests to the new pair; one more instance moves each time all are ready."""
        assert deployment.id is not None
        total = tr.own_total(session, deployment) + tr.surge_of(rollout)
        ready = tr.ready_count(session, deployment.id, rollout.to_version_id)
        if rollout.canary_weight != 100 and ready >= 1:
            tr.set_canary(session, now, ACTOR, rollout, deployment, weight=100)
        if rollout.canary_instances < total:
            if ready >= rollout.canary_instances:
                step = total if rollout.settings.all_at_once else rollout.canary_instances + 1
                tr.set_canary(session, now, ACTOR, rollout, deployment, instances=step)
            return
        if ready < total:
            return
        self._finish(session, now, rollout, deployment)

    def _finish(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        old_version, old_config = deployment.stable_version_id, deployment.engine_config
        deployment.stable_version_id = rollout.to_version_id
        if rollout.engine_config is not None:
            deployment.engine_config = rollout.engine_config
        deployment.rollback_version_id = old_version
        deployment.rollback_engine_config = old_config
        deployment.updated_at = now
        session.add(deployment)
        state = (
            RolloutState.PROMOTED
            if rollout.kind == RolloutKind.ROLLOUT
            else RolloutState.ROLLED_BACK
        )
        rollout.state = state
        rollout.phase = RolloutPhase.DONE
        rollout.canary_instances = 0
        rollout.canary_weight = 0
        rollout.message = (
            f"{tr.label(session, rollout.to_version_id)} is stable; "
            f"{tr.label(session, old_version)} is kept for rollback"
        )
        session.add(rollout)
        session.flush()
        replan_deployment(session, now, ACTOR, deployment)
        # Every host of the deployment learns its new keep-list (the rollback target).
        hosts = session.exec(
            select(Instance.host_id).where(Instance.deployment_id == deployment.id)
        ).all()
        bump_generation(session, hosts)
        record_event(
            session,
            now,
            ACTOR,
            f"{rollout.kind}.{state}",
            tr.subject(deployment),
            f"{rollout.kind} {rollout.id} of deployment {deployment.name} {state.replace('_', ' ')}"
            f": {rollout.message}",
            rollout=rollout.id,
        )

    # --- restarts --------------------------------------------------------------------------

    def _restart(
        self, session: Session, now: datetime, rollout: Rollout, deployment: Deployment
    ) -> None:
        progress = rollout.progress
        current = progress.current
        if current is None:
            if not progress.queue:
                rollout.state = RolloutState.COMPLETED
                rollout.phase = RolloutPhase.DONE
                rollout.message = f"{len(progress.done)} instance(s) restarted"
                record_event(
                    session,
                    now,
                    ACTOR,
                    "restart.completed",
                    tr.subject(deployment),
                    f"restart {rollout.id} of deployment {deployment.name}: {rollout.message}",
                    rollout=rollout.id,
                )
                return
            current, *queue = progress.queue
            progress = progress.model_copy(
                update={"queue": tuple(queue), "current": current, "stage": RestartStage.STOPPING}
            )
            self._set_desired(session, current, "stopped")
        instance = session.get(Instance, current)
        if instance is None:  # deleted meanwhile (scaled down): nothing to restart
            progress = progress.model_copy(update={"current": None, "stage": None})
        elif progress.stage == RestartStage.STOPPING and instance.observed_state in STOPPED_STATES:
            progress = progress.model_copy(update={"stage": RestartStage.STARTING})
            self._set_desired(session, current, "running")
        elif (
            progress.stage == RestartStage.STARTING
            and instance.observed_state == InstanceState.READY.value
            and instance.desired_state == "running"
        ):
            done = (*progress.done, current)
            progress = progress.model_copy(update={"current": None, "stage": None, "done": done})
            record_event(
                session,
                now,
                ACTOR,
                "restart.instance",
                tr.subject(deployment),
                f"restart {rollout.id}: instance {current} of deployment {deployment.name} "
                f"ready again ({len(done)}/{len(done) + len(progress.queue)})",
                rollout=rollout.id,
                instance=current,
            )
        rollout.progress = progress
        rollout.updated_at = now

    def _set_desired(self, session: Session, instance_id: int, state: str) -> None:
        instance = session.get(Instance, instance_id)
        if instance is None:
            return
        instance.desired_state = state
        session.add(instance)
        session.flush()
        bump_generation(session, [instance.host_id])

    # --- notifications ---------------------------------------------------------------------

    def _notices(
        self,
        session: Session,
        rollout: Rollout,
        deployment: Deployment,
        before: tuple[str, int, int],
    ) -> list[tuple[str, Any]]:
        """A notice for a state change (recorded by the row: by hand changes count too) and
        for each new failed analysis."""
        url = tr.policy_of(rollout).notify
        if not url:
            return []
        body = {
            "deployment": deployment.name,
            "rollout": rollout.id,
            "kind": rollout.kind,
            "from": tr.label(session, rollout.from_version_id),
            "to": tr.label(session, rollout.to_version_id),
            "state": rollout.state,
            "step": rollout.step_index + 1,
            "weight": rollout.canary_weight,
            "reason": rollout.message,
        }
        notices: list[tuple[str, Any]] = [
            (url, {**body, "event": "analysis_failed", "analysis": analysis})
            for analysis in rollout.analysis[before[2] :]
            if analysis.get("verdict") == "fail"
        ]
        if rollout.progress.notified_state != rollout.state:
            rollout.progress = rollout.progress.model_copy(update={"notified_state": rollout.state})
            notices.append((url, {**body, "event": "state"}))
        return notices

    def _notice_failed(self, notice: Notice, error: str) -> None:
        with Session(self._engine) as session:
            now = datetime.now(UTC)
            record_event(
                session,
                now,
                ACTOR,
                "rollout.notify_failed",
                f"deployment/{notice.body.get('deployment', '')}",
                f"notification to {notify_origin(notice.url)} failed: {error} "
                f"({len(notice.attempts)} attempt{'' if len(notice.attempts) == 1 else 's'})",
                rollout=notice.body.get("rollout"),
                event=notice.body.get("event"),
            )
            session.commit()
