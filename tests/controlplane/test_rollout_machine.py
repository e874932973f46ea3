"""The rollout machine driven by Hypothesis with random commands and observations: whatever the
sequence, weights stay within 0..100 (0 once it is over), a deployment has one active record at a
time, every state change records exactly one event, and no sequence leaves a record where it can
never finish."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from controlplane.rollouts.machine import RolloutMachine, canary_size
from controlplane.rollouts.messages import (
    Abort,
    Command,
    Effect,
    InstanceSeen,
    Observations,
    Pause,
    Promote,
    RecordEvent,
    Refused,
    Resume,
    RollBack,
    RolloutRecord,
    SetManual,
    Start,
    Traffic,
)
from controlplane.rollouts.progress import Promotion, RolloutProgress, RolloutSettings
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S, VersionTraffic
from protocol.rollout_policy import DEFAULT_POLICY
from protocol.rollout_states import RestartStage, RolloutKind, RolloutPhase, RolloutState
from protocol.rollouts import HostStaging

START = datetime(2026, 1, 1, tzinfo=UTC)
INTERVAL = timedelta(seconds=DEFAULT_POLICY.interval_s or 300)
KINDS = list(RolloutKind)
PHASE_OF = {
    RolloutKind.ROLLOUT: RolloutPhase.STAGING,
    RolloutKind.ROLLBACK: RolloutPhase.PROMOTING,
    RolloutKind.RESTART: RolloutPhase.RESTARTING,
    RolloutKind.MANUAL: RolloutPhase.WAITING,
}


def traffic(requests: int, errors: int, latency_s: float) -> VersionTraffic:
    buckets = [0] * BUCKET_COUNT
    buckets[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= latency_s)] = requests
    return VersionTraffic(
        version_id=1, version="demo:v1", requests=requests, errors_5xx=errors,
        latency_buckets=buckets, latency_sum_s=latency_s * requests, ttft_buckets=buckets,
        ttft_sum_s=latency_s * requests,
        error_rate=errors / requests if requests else None,
    )  # fmt: skip


HEALTHY = Traffic(stable=traffic(500, 0, 0.2), canary=traffic(500, 0, 0.2))
traffics = st.one_of(
    st.none(),
    st.builds(
        lambda s, c, e, lat: Traffic(traffic(s, 0, 0.2), traffic(c, min(e, c), lat)),
        st.integers(0, 400), st.integers(0, 400), st.integers(0, 400),
        st.sampled_from([0.1, 0.2, 2.0]),
    ),
)  # fmt: skip
stagings = st.lists(
    st.builds(HostStaging, host=st.sampled_from(["a", "b"]),
              state=st.sampled_from(["fetching", "ready", "failed"])),
    max_size=2,
)  # fmt: skip
instances = st.one_of(st.none(), st.builds(InstanceSeen, st.booleans(), st.booleans(),
                                           st.booleans()))  # fmt: skip
commands = st.one_of(
    st.builds(Promote, full=st.booleans(), reason=st.just("by hand")),
    st.builds(Pause, reason=st.just("by hand")),
    st.builds(Resume, reason=st.just("by hand")),
    st.builds(Abort, reason=st.just("by hand")),
    st.builds(RollBack, reason=st.just("by hand")),
    st.builds(SetManual, weight=st.integers(1, 100), instances=st.integers(1, 3)),
)


def state_events(effects: list[Effect]) -> list[RecordEvent]:
    return [e for e in effects if isinstance(e, RecordEvent) and e.state is not None]


class Deployment(RuleBasedStateMachine):
    """One deployment of `total` instances and the records started on it, one after another."""

    @initialize(total=st.integers(1, 5), surge=st.integers(0, 1))
    def setup(self, total: int, surge: int) -> None:
        self.total, self.surge = total, surge
        self.now = START
        self.records: list[RolloutMachine] = []

    @property
    def machine(self) -> RolloutMachine | None:
        return self.records[-1] if self.records else None

    def _step(self, machine: RolloutMachine, effects: list[Effect], before: RolloutState) -> None:
        changed = machine.record.state != before
        events = state_events(effects)
        assert len(events) == (1 if changed else 0), (before, machine.record.state, events)
        if changed:
            assert events[0].state == machine.record.state

    @rule(kind=st.sampled_from(KINDS), weights=st.sampled_from([(10, 50, 100), (100,), (50,)]))
    def start(self, kind: RolloutKind, weights: tuple[int, ...]) -> None:
        if self.machine is not None and self.machine.record.active:
            return  # the services refuse a second active record: `dctl rollout abort` first
        weights = weights if weights[-1] == 100 else (*weights, 100)
        record = RolloutRecord(
            id=len(self.records) + 1, deployment="web", kind=kind, state=RolloutState.PROGRESSING,
            phase=PHASE_OF[kind], weights=() if kind == RolloutKind.MANUAL else weights,
            settings=RolloutSettings(policy=DEFAULT_POLICY, surge=self.surge),
            progress=RolloutProgress(queue=(1, 2) if kind == RolloutKind.RESTART else ()),
            ticked_at=self.now,
        )  # fmt: skip
        machine = RolloutMachine(record, leaderless_gap=timedelta(hours=1))
        machine.apply(Start(), self.now)
        if kind == RolloutKind.MANUAL:
            machine.apply(SetManual(10, 1), self.now)
        self.records.append(machine)

    @rule(command=commands)
    def command(self, command: Command) -> None:
        if self.machine is None:
            return
        before = self.machine.record.state
        try:
            effects = self.machine.apply(command, self.now)
        except Refused:
            effects = []
        self._step(self.machine, effects, before)

    @rule(
        seconds=st.sampled_from([0, 30, 300, 3600]), ready=st.integers(0, 6),
        interval=traffics, step=traffics, staging=stagings, current=instances,
    )  # fmt: skip
    def round(
        self, seconds: int, ready: int, interval: Traffic | None, step: Traffic | None,
        staging: list[HostStaging], current: InstanceSeen | None,
    ) -> None:  # fmt: skip
        if self.machine is None:
            return
        self.now += timedelta(seconds=seconds)
        seen = Observations(
            own_total=self.total, ready=ready, staging=tuple(staging), interval=interval,
            step=step, current=current,
        )  # fmt: skip
        before = self.machine.record.state
        self._step(self.machine, self.machine.tick(self.now, seen), before)

    @invariant()
    def weights_and_instances_stay_in_range(self) -> None:
        for machine in self.records:
            r = machine.record
            assert 0 <= r.canary_weight <= 100
            assert (
                0 <= r.canary_instances <= self.total + self.surge or r.kind == RolloutKind.MANUAL
            )
            if not r.active:
                assert (r.canary_weight, r.canary_instances) == (0, 0)

    @invariant()
    def one_active_record(self) -> None:
        assert sum(m.record.active for m in self.records) <= 1

    @invariant()
    def it_can_always_finish(self) -> None:
        """From where it stands, a cooperative fleet (every instance ready, every host staged,
        healthy traffic) and at most an operator's resume (or a manual canary's end) take it
        to done."""
        if self.machine is None:
            return
        trial = RolloutMachine(self.machine.record, leaderless_gap=timedelta(hours=1))
        now = self.now
        if trial.record.state == RolloutState.PAUSED:
            trial.apply(Resume(), now)
        if trial.record.kind == RolloutKind.MANUAL and trial.record.active:
            trial.apply(RollBack(), now)
        for _ in range(40):
            if trial.record.phase == RolloutPhase.DONE:
                break
            now += INTERVAL
            r = trial.record
            stage = r.progress.stage
            current = InstanceSeen(
                stopped=stage == RestartStage.STOPPING,
                ready=stage == RestartStage.STARTING,
                held_stopped=False,
            )
            trial.tick(now, Observations(
                own_total=self.total, ready=max(r.canary_instances, 1),
                staging=(HostStaging(host="a", state="ready"),),
                interval=HEALTHY, step=HEALTHY, current=current,
            ))  # fmt: skip
        assert trial.record.phase == RolloutPhase.DONE, trial.record
        assert not trial.record.active


TestRolloutMachine = Deployment.TestCase
TestRolloutMachine.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_a_step_takes_its_share_but_never_the_last_stable_instance() -> None:
    assert [canary_size(w, 4) for w in (1, 25, 50, 99, 100)] == [1, 1, 2, 3, 4]
    assert canary_size(50, 1) == 0  # no room beside stable: the rollout aborts
    assert canary_size(50, 1, surge=1) == 1


def test_a_promote_takes_effect_at_once_and_an_old_pending_one_at_the_next_round() -> None:
    analysing = RolloutRecord(
        id=1, deployment="web", kind=RolloutKind.ROLLOUT, state=RolloutState.PAUSED,
        phase=RolloutPhase.ANALYSING, weights=(10, 50, 100), canary_weight=10,
        canary_instances=1, step_started_at=START, paused_left_s=30.0, ticked_at=START,
    )  # fmt: skip
    machine = RolloutMachine(analysing)
    effects = machine.apply(Promote(reason="by hand"), START)
    # Resumed and at the next step at once: no round needed, one event for the state change.
    after = machine.record
    assert (after.state, after.step_index, after.phase) == (
        RolloutState.PROGRESSING, 1, RolloutPhase.WAITING,
    )  # fmt: skip
    assert [e.state for e in state_events(effects)] == [RolloutState.PROGRESSING]
    assert after.progress.pending is None
    # A record a control plane from before left with a pending promote (migration 0007).
    old = replace(analysing, state=RolloutState.PROGRESSING,
                  progress=RolloutProgress(pending=Promotion.FULL))  # fmt: skip
    machine = RolloutMachine(old)
    machine.tick(START, Observations(own_total=4))
    assert (machine.record.step_index, machine.record.phase) == (2, RolloutPhase.PROMOTING)
    assert machine.record.progress.pending is None
