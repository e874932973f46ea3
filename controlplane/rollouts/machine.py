"""The rollout machine: the lifecycle of one rollout, rollback, restart or manual canary, pure.

Data in, decision out, like `engine/decoding.py`: a `RolloutRecord` (what the `Rollout` row says),
a command from the API (`apply`) or a round's `Observations` (`tick`), and out come the new record
and the `Effect`s that the store (`controlplane.rollouts.store`, the one writer of rollout rows)
carries out (the types are in `controlplane.rollouts.messages`). No session, clock or I/O here.

    rollout:
      staging ──> waiting ──> analysing ──pass──> waiting (next step) ... ──> promoting ──> done
         │       (until the     │ inconclusive: held another interval              (promoted)
         │        canary is     │ starved (far under its weight): held once, then paused
         │        ready)        │ fail, `failure_limit` times in a row: aborted ──> ending ──> done
         └─ a host cannot fetch or verify the new version: paused
    rollback: promoting ──> done rolled_back (every instance moved, no analysis)
    restart:  restarting: each instance held stopped until seen stopped, then running until
              ready (or stopped by a drain) ──> done completed
    manual:   waiting, held at the weight and instances the operator sets ──> done rolled_back

    by hand, while active (progressing | paused):
      pause ──> paused (the step's clock stops) ── resume ──> progressing (the time it had left)
      promote ──> the next step at once (or the last: --full)
      abort | rollback ──> aborted | rolled_back, phase ending (canary weight 0, instances back on
      stable at once) ──> done after one more round (its last notification)

A step of weight w runs ceil(w% of N) of the deployment's N instances (at least one, never all:
stable keeps one while anything is analysed), plus up to `surge` extra. Every state change
records exactly one event. A round without a leader (`leaderless_gap`) does not count as step
time: the step keeps the time it had left.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta

from controlplane.rollouts.analysis import Interval, analyse, failing_reason, starved_reason
from controlplane.rollouts.messages import (
    DEFAULT_INTERVAL_S,
    Abort,
    Command,
    Effect,
    Notify,
    Observations,
    Pause,
    Promote,
    RecordAnalysis,
    RecordEvent,
    Refused,
    Resume,
    RollBack,
    RolloutRecord,
    SetCanary,
    SetManual,
    StageSnapshot,
    Start,
    StartInstance,
    StopInstance,
    SwapStable,
    Traffic,
)
from controlplane.rollouts.progress import Promotion
from protocol.rollout_states import RestartStage, RolloutKind, RolloutPhase, RolloutState
from protocol.rollouts import Analysis

# Longer than this between two rounds means no leader ran: the gap does not count as step time.
LEADERLESS_GAP = timedelta(seconds=3)
MESSAGE_LIMIT = 1000
# Starved intervals in a row that pause a rollout (`RolloutProgress.starved`).
STARVED_INTERVALS_TO_PAUSE = 2


def canary_size(weight: int, total: int, surge: int = 0) -> int:
    """Instances a step of WEIGHT percent runs on a deployment of TOTAL instances of its own,
    with up to SURGE extra ones: never the last stable one."""
    if weight >= 100:
        return total + surge
    return min(max(1, math.ceil(weight * total / 100)), max(total - 1, 0) + surge)


class RolloutMachine:
    """One record's lifecycle: `apply` a command, `tick` a round; `record` is where it stands."""

    def __init__(self, record: RolloutRecord, leaderless_gap: timedelta = LEADERLESS_GAP) -> None:
        self.record = record
        self.leaderless_gap = leaderless_gap
        self._effects: list[Effect] = []

    # --- start ---------------------------------------------------------------------------------

    def apply(self, command: Command, now: datetime) -> list[Effect]:
        """Carry out an operator's COMMAND; Refused when it does not apply."""
        self._effects = []
        if isinstance(command, Start):
            self._start(command, now)
        elif isinstance(command, SetManual):
            self._set_manual(command, now)
        elif not self.record.active:
            raise Refused(f"{self.record.name} is {self.record.state}: nothing to change")
        elif isinstance(command, Promote):
            self._promote_by_hand(command, now)
        elif isinstance(command, Pause):
            self._pause_by_hand(command, now)
        elif isinstance(command, Resume):
            self._resume_by_hand(command, now)
        elif isinstance(command, Abort):
            self._end(now, RolloutState.ABORTED, command.reason)
        elif isinstance(command, RollBack):
            self._end(now, RolloutState.ROLLED_BACK, command.reason)
        return self._effects

    def _start(self, command: Start, now: datetime) -> None:
        r = self.record
        if r.kind == RolloutKind.ROLLOUT:
            self._emit(StageSnapshot())
            steps = " -> ".join(f"{w}%" for w in r.weights)
            interval = r.settings.policy.interval_s or DEFAULT_INTERVAL_S
            config = " with a new engine config" if r.new_config else ""
            self._event(
                "rollout.started",
                f"rollout {r.id} of deployment {r.deployment} started: {r.from_label} -> "
                f"{r.to_label}{config}, steps {steps}, {interval:g} s each",
                steps=list(r.weights),
                reason=command.reason,
            )
        elif r.kind == RolloutKind.ROLLBACK:
            at_once = ", all at once" if r.settings.all_at_once else ""
            self._event(
                "rollback.started",
                f"rollback {r.id} of deployment {r.deployment}: {r.from_label} -> "
                f"{r.to_label}{at_once}",
                reason=command.reason,
            )
        elif r.kind == RolloutKind.RESTART:
            queue = list(r.progress.queue)
            self._event(
                "restart.started",
                f"restart {r.id} of deployment {r.deployment}: {len(queue)} instance(s), "
                "one at a time",
                instances=queue,
                reason=command.reason,
            )

    # --- a round -------------------------------------------------------------------------------

    def analysis_windows(self, now: datetime) -> tuple[datetime, datetime] | None:
        """When this round will analyse: (interval start, step start), the windows whose
        traffic `Observations.interval` and `.step` must hold. None: no analysis this round."""
        r = self.record
        if r.state != RolloutState.PROGRESSING or r.phase != RolloutPhase.ANALYSING:
            return None
        if r.kind != RolloutKind.ROLLOUT or r.progress.pending is not None:
            return None
        started = self._step_started_at(now)
        if started is None or now < started + r.interval:
            return None
        since = r.progress.interval_since or started
        return since, r.progress.step_since or since

    def tick(self, now: datetime, seen: Observations) -> list[Effect]:
        """One round: the record moves on as far as SEEN allows."""
        self._effects = []
        self._update(step_started_at=self._step_started_at(now), ticked_at=now)
        r = self.record
        if r.phase == RolloutPhase.ENDING:
            self._update(phase=RolloutPhase.DONE)
        elif r.state == RolloutState.PROGRESSING and r.kind == RolloutKind.RESTART:
            self._restart(now, seen)
        elif r.state == RolloutState.PROGRESSING and r.kind != RolloutKind.MANUAL:
            self._rollout(now, seen)
        self._notices()
        return self._effects

    def _step_started_at(self, now: datetime) -> datetime | None:
        """The step's clock, moved on by a gap without a leader."""
        r = self.record
        started = r.step_started_at
        if r.ticked_at is not None and started is not None and r.state == RolloutState.PROGRESSING:
            gap = now - r.ticked_at
            if gap > self.leaderless_gap:
                return started + gap
        return started

    def _rollout(self, now: datetime, seen: Observations) -> None:
        # A promote a control plane before the machine left for its next round (`dctl db
        # upgrade` moved it into the progress): carried out as a promote is now.
        pending = self.record.progress.pending
        if pending is not None:
            self._progress(pending=None)
            if pending == Promotion.FULL or self.record.phase != RolloutPhase.PROMOTING:
                self._next_step(full=pending == Promotion.FULL)
        # A phase that ends hands over to the next within the same round.
        for _ in range(4):
            phase = self.record.phase
            if phase == RolloutPhase.STAGING:
                self._stage(now, seen)
            elif phase == RolloutPhase.WAITING:
                self._wait_for_canary(now, seen)
            elif phase == RolloutPhase.ANALYSING:
                self._maybe_analyse(now, seen)
            elif phase == RolloutPhase.PROMOTING:
                self._promote(now, seen)
            if self.record.phase == phase or self.record.state != RolloutState.PROGRESSING:
                break

    # --- staging -------------------------------------------------------------------------------

    def _stage(self, now: datetime, seen: Observations) -> None:
        """Wait until every host of the deployment holds the new snapshot, verified; pause with
        the host and the agent's reason (it names the file) when one cannot get it."""
        r = self.record
        for host in seen.staging:
            if host.state == "failed":
                reason = (
                    f"pre-staging: host {host.host} cannot fetch or verify {r.to_label}: "
                    f"{host.error}"
                )
                self._pause(now, reason)
                self._event(
                    "rollout.paused",
                    f"rollout {r.id} of deployment {r.deployment} paused: {reason}",
                    RolloutState.PAUSED,
                    host=host.host,
                )
                return
        pending = [h.host for h in seen.staging if h.state != "ready"]
        if pending:
            self._update(message=f"pre-staging {r.to_label}: waiting for {', '.join(pending)}")
            return
        first = r.weights[r.step_index]
        message = f"{r.to_label} is on every host of the deployment, verified"
        phase = RolloutPhase.PROMOTING if first >= 100 else RolloutPhase.WAITING
        self._update(phase=phase, message=message)
        self._event("rollout.staged", f"rollout {r.id} of deployment {r.deployment}: {message}")

    # --- a canary step -------------------------------------------------------------------------

    def _wait_for_canary(self, now: datetime, seen: Observations) -> None:
        """The step's instances run the new pair; once they are ready it takes its weight."""
        r = self.record
        weight = r.weights[r.step_index]
        need = canary_size(weight, seen.own_total, r.settings.surge)
        if need < 1:
            reason = (
                f"deployment has {seen.own_total} instance(s): no room for a canary beside stable"
            )
            self._end(now, RolloutState.ABORTED, reason)
            return
        if r.canary_instances != need:
            self._set_canary(instances=need)
        if seen.ready < need:
            return
        self._set_canary(weight=weight)
        self._update(phase=RolloutPhase.ANALYSING, step_started_at=now)
        self._progress(restarts_at=seen.canary_restarts, interval_since=now, step_since=now)
        self._event(
            "rollout.step",
            f"rollout {r.id} of deployment {r.deployment}: step {r.step_index + 1}/"
            f"{len(r.weights)}, {need} canary instance(s) ready, {weight}% of requests",
            step=r.step_index + 1,
            weight=weight,
        )

    def _maybe_analyse(self, now: datetime, seen: Observations) -> None:
        """At the end of each interval: canary against stable, then on, again, or abort."""
        windows = self.analysis_windows(now)
        if windows is None or seen.interval is None:  # not due, or not observed for it
            return
        since, step_since = windows
        r = self.record
        policy = r.settings.policy
        restarts = max(seen.canary_restarts - r.progress.restarts_at, 0)

        def judge(start: datetime, traffic: Traffic) -> Analysis:
            # The engines' figures count from the same start: their samples are attributed to
            # an instance's current version, and an instance that ran stable until the step
            # began must not lend the canary its old figures.
            return analyse(
                Interval(
                    time=now,
                    since=start,
                    step=r.step_index + 1,
                    weight=r.canary_weight,
                    stable=traffic.stable,
                    canary=traffic.canary,
                    canary_restarts=restarts,
                    stable_family=seen.stable_family,
                    canary_family=seen.canary_family,
                    stable_engine=seen.stable_engine,
                    canary_engine=seen.canary_engine,
                ),
                policy,
            )

        result = judge(since, seen.interval)
        unjudged = result.verdict in ("inconclusive", "starved")
        if unjudged and step_since < since and seen.step is not None:
            # Too little in the last interval (a canary the gateway ejects gets almost nothing):
            # judge everything since the step's weight took effect instead; a starved interval
            # only when the whole step fails, as a canary ejected for its errors does.
            whole = judge(step_since, seen.step)
            if result.verdict == "inconclusive" or whole.verdict == "fail":
                result = whole
        self._emit(RecordAnalysis(result))
        self._progress(interval_since=now)
        if result.verdict != "starved" and r.progress.starved:
            self._progress(starved=0)
        self._update(step_started_at=now)  # the next analysis is an interval from now
        if result.verdict == "fail":
            failures = r.failures + 1
            limit = policy.failure_limit or 1
            reason = failing_reason(result)
            self._update(failures=failures)
            self._event(
                "rollout.analysis_failed",
                f"rollout {r.id} of deployment {r.deployment}, step {result.step}: analysis "
                f"failed ({failures}/{policy.failure_limit}): {reason}",
                step=result.step,
                failures=failures,
            )
            if failures >= limit:
                self._end(now, RolloutState.ABORTED, f"step {result.step}: {reason}")
            return
        if result.verdict == "starved" and r.progress.starved + 1 < STARVED_INTERVALS_TO_PAUSE:
            # Once may be the gateways' lag: a canary that just became ready is not in the
            # routing table they poll yet, and stable got the interval's first seconds.
            self._progress(starved=r.progress.starved + 1)
            self._update(message=f"step {result.step} extended: {starved_reason(result)}")
            return
        if result.verdict == "starved":
            # Not judgeable, and not the canary's fault for sure: the operator decides
            # (the analysis module's docstring says why this pauses).
            self._progress(starved=0)
            reason = f"step {result.step}: {starved_reason(result)}"
            self._pause(now, reason)
            self._event(
                "rollout.paused",
                f"rollout {r.id} of deployment {r.deployment} paused: {reason}",
                RolloutState.PAUSED,
                step=result.step,
            )
            return
        if result.verdict == "inconclusive":
            self._update(
                message=f"step {result.step} extended: {result.canary_requests} canary and "
                f"{result.stable_requests} stable requests in the interval, "
                f"{policy.min_requests} needed in each"
            )
            return
        self._update(failures=0)
        self._next_step(full=False)

    def _next_step(self, *, full: bool) -> None:
        r = self.record
        last = len(r.weights) - 1
        k = last if full else min(r.step_index + 1, last)
        self._update(
            step_index=k,
            step_started_at=None,
            phase=RolloutPhase.PROMOTING if r.weights[k] >= 100 else RolloutPhase.WAITING,
            message=f"step {k + 1}/{len(r.weights)}: {r.weights[k]}%",
        )

    # --- promotion -----------------------------------------------------------------------------

    def _promote(self, now: datetime, seen: Observations) -> None:
        """All requests to the new pair; one more instance moves each time all are ready."""
        r = self.record
        total = seen.own_total + r.settings.surge
        if r.canary_weight != 100 and seen.ready >= 1:
            self._set_canary(weight=100)
        if r.canary_instances < total:
            if seen.ready >= r.canary_instances:
                step = total if r.settings.all_at_once else r.canary_instances + 1
                self._set_canary(instances=step)
            return
        if seen.ready < total:
            return
        self._finish()

    def _finish(self) -> None:
        r = self.record
        state = RolloutState.PROMOTED if r.kind == RolloutKind.ROLLOUT else RolloutState.ROLLED_BACK
        message = f"{r.to_label} is stable; {r.from_label} is kept for rollback"
        self._update(
            state=state,
            phase=RolloutPhase.DONE,
            canary_instances=0,
            canary_weight=0,
            message=message,
        )
        self._emit(SwapStable())
        self._event(f"{r.kind}.{state}", f"{r.name} {state.replace('_', ' ')}: {message}", state)

    # --- restarts ------------------------------------------------------------------------------

    def _restart(self, now: datetime, seen: Observations) -> None:
        """One instance at a time: held stopped until its agent reports it stopped, then
        running until it is ready again. One that a drain stops meanwhile is done: it starts
        afresh when its host is undrained."""
        progress = self.record.progress
        current = progress.current
        if current is None:
            if not progress.queue:
                message = f"{len(progress.done)} instance(s) restarted"
                self._update(state=RolloutState.COMPLETED, phase=RolloutPhase.DONE, message=message)
                self._event(
                    "restart.completed", f"{self.record.name}: {message}", RolloutState.COMPLETED
                )
                return
            current, *queue = progress.queue
            self._progress(queue=tuple(queue), current=current, stage=RestartStage.STOPPING)
            self._emit(StopInstance(current))
            return
        instance = seen.current
        if instance is None:  # deleted meanwhile (scaled down): nothing to restart
            self._progress(current=None, stage=None)
        elif progress.stage == RestartStage.STOPPING and instance.stopped:
            self._progress(stage=RestartStage.STARTING)
            self._emit(StartInstance(current))
        elif progress.stage == RestartStage.STARTING and (instance.held_stopped or instance.ready):
            done = (*progress.done, current)
            self._progress(current=None, stage=None, done=done)
            how = "stopped on a draining host" if instance.held_stopped else "ready again"
            self._event(
                "restart.instance",
                f"restart {self.record.id}: instance {current} of deployment "
                f"{self.record.deployment} {how} ({len(done)}/{len(done) + len(progress.queue)})",
                instance=current,
            )

    # --- by hand -------------------------------------------------------------------------------

    def _promote_by_hand(self, command: Promote, now: datetime) -> None:
        r = self.record
        if r.kind != RolloutKind.ROLLOUT:
            raise Refused(f"a {r.kind} has no steps to promote")
        resumed = r.state == RolloutState.PAUSED
        if resumed:
            self._resume(now)
        # At once, in the request's transaction: the next step (none past promotion), or all the
        # way; the next round sizes its canary as for any step.
        if command.full or self.record.phase != RolloutPhase.PROMOTING:
            self._next_step(full=command.full)
        why = command.reason
        self._event(
            "rollout.promote",
            f"{r.name}: promote{' --full' if command.full else ''} ({why})",
            RolloutState.PROGRESSING if resumed else None,
            reason=why,
        )

    def _pause_by_hand(self, command: Pause, now: datetime) -> None:
        if self.record.state == RolloutState.PAUSED:
            return
        self._pause(now, command.reason)
        self._event(
            "rollout.pause",
            f"{self.record.name}: pause ({command.reason})",
            RolloutState.PAUSED,
            reason=command.reason,
        )

    def _resume_by_hand(self, command: Resume, now: datetime) -> None:
        if self.record.state != RolloutState.PAUSED:
            raise Refused(f"{self.record.name} is not paused")
        self._resume(now)
        self._event(
            "rollout.resume",
            f"{self.record.name}: resume ({command.reason})",
            RolloutState.PROGRESSING,
            reason=command.reason,
        )

    def _set_manual(self, command: SetManual, now: datetime) -> None:
        r = self.record
        if r.kind != RolloutKind.MANUAL or not r.active:
            raise Refused(f"{r.name} is not an active manual canary")
        if (r.canary_weight, r.canary_instances) == (command.weight, command.instances):
            return
        first = r.canary_instances == 0 and not r.weights
        steps = (*r.weights, command.weight)
        self._update(weights=steps, step_index=len(steps) - 1)
        self._set_canary(instances=command.instances, weight=command.weight)
        kind, verb = ("canary.started", "started") if first else ("canary.updated", "changed")
        self._event(
            kind,
            f"canary {r.to_label} of deployment {r.deployment} {verb}: {command.weight}% of "
            f"requests, {command.instances} instance(s)",
            version=r.to_label,
            weight=command.weight,
            instances=command.instances,
        )

    def _pause(self, now: datetime, reason: str) -> None:
        """Stop the step's clock where it is; the canary keeps its weight."""
        r = self.record
        left = None
        if r.step_started_at is not None:
            left = max((r.interval - (now - r.step_started_at)).total_seconds(), 0.0)
        self._update(
            state=RolloutState.PAUSED,
            paused_left_s=left if left is not None else r.paused_left_s,
            message=reason or "paused by hand",
        )

    def _resume(self, now: datetime) -> None:
        """Restart the step's clock with the time that was left."""
        r = self.record
        started = r.step_started_at
        if r.paused_left_s is not None:
            started = now - (r.interval - timedelta(seconds=r.paused_left_s))
        self._update(
            state=RolloutState.PROGRESSING,
            step_started_at=started,
            paused_left_s=None,
            message="resumed",
            ticked_at=now,
        )

    # --- the end -------------------------------------------------------------------------------

    def _end(self, now: datetime, state: RolloutState, reason: str) -> None:
        """Abort (or roll back) an active record: canary weight 0 at once, its instances back
        on the stable version (kept on the hosts: nothing to download)."""
        r = self.record
        if r.kind == RolloutKind.MANUAL:
            self._end_manual(state)
            return
        self._update(state=state, message=reason[:MESSAGE_LIMIT], phase=RolloutPhase.ENDING)
        self._set_canary(instances=0, weight=0)
        if r.kind == RolloutKind.RESTART:
            self._progress(current=None, stage=None)
            self._emit(StartInstance())  # the instance it held stopped runs again
        message = f"{r.name} {state.replace('_', ' ')}: {reason}"
        self._event(f"{r.kind}.{state}", message, state, reason=reason)

    def _end_manual(self, state: RolloutState) -> None:
        """A manual canary has no last notification to send: done at once."""
        r = self.record
        self._update(state=state, phase=RolloutPhase.DONE, message="ended by hand")
        self._set_canary(instances=0, weight=0)
        self._event(
            "canary.ended",
            f"canary {r.to_label} of deployment {r.deployment} ended: its instances run the "
            "stable version again",
            state,
            version=r.to_label,
        )

    # --- notifications -------------------------------------------------------------------------

    def _notices(self) -> None:
        """A notice for each failed analysis of the round, and for a state not yet notified
        (changes by hand included: they are noticed at the next round)."""
        r = self.record
        if not r.settings.policy.notify:
            return
        failed = [
            e.analysis
            for e in self._effects
            if isinstance(e, RecordAnalysis) and e.analysis.verdict == "fail"
        ]
        for analysis in failed:
            self._emit(Notify("analysis_failed", analysis))
        if r.progress.notified_state != r.state:
            self._progress(notified_state=r.state)
            self._emit(Notify("state"))

    # --- the record and the effects ------------------------------------------------------------

    def _update(self, **fields: object) -> None:
        self.record = replace(self.record, **fields)  # type: ignore[arg-type]

    def _progress(self, **fields: object) -> None:
        self._update(progress=self.record.progress.model_copy(update=fields))

    def _set_canary(self, instances: int | None = None, weight: int | None = None) -> None:
        r = self.record
        if instances is not None and instances != r.canary_instances:
            self._update(canary_instances=instances)
            self._emit(SetCanary(instances=instances))
        if weight is not None and weight != r.canary_weight:
            self._update(canary_weight=weight)
            self._emit(SetCanary(weight=weight))

    def _emit(self, effect: Effect) -> None:
        self._effects.append(effect)

    def _event(
        self, kind: str, message: str, state: RolloutState | None = None, **data: object
    ) -> None:
        self._emit(RecordEvent(kind, message, {"rollout": self.record.id, **data}, state))
