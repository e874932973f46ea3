"""The autoscaler's rules (`controlplane.autoscaler.decide`): pure, on a clock the test moves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.autoscaler.decide import Load, Outcome, decide
from controlplane.autoscaler.state import AutoscaleState
from protocol.autoscale import AutoscalePolicy

T0 = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
POLICY = AutoscalePolicy(
    min=1, max=8, target_queue=4, target_utilization=0.8, up_after_s=30, down_after_s=600,
    cooldown_s=60,
)  # fmt: skip


def load(replicas: int = 2, ready: int | None = None, running: int = 0, waiting: int = 0,
         **extra: object) -> Load:  # fmt: skip
    return Load(
        replicas=replicas,
        ready=replicas if ready is None else ready,
        running=running,
        waiting=waiting,
        max_concurrent=10,
        **extra,  # type: ignore[arg-type]
    )


def run(
    seconds: list[float],
    each: Load,
    policy: AutoscalePolicy = POLICY,
    state: AutoscaleState | None = None,
) -> list[Outcome]:
    """decide() at T0 + each of SECONDS with the same load, the state carried along."""
    state = state or AutoscaleState()
    outcomes = []
    for s in seconds:
        outcome = decide(policy, state, each, T0 + timedelta(seconds=s))
        state = outcome.state
        outcomes.append(outcome)
    return outcomes


def test_a_queue_over_target_scales_up_only_once_it_held_for_up_after() -> None:
    busy = load(replicas=2, running=20, waiting=20)  # 10 waiting per instance, target 4
    early, late = run([0, 29], busy)[-1], run([0, 30], busy)[-1]
    assert early.decision is None and early.state.over_since == T0
    assert late.decision is not None and late.decision.action == "up"
    # ceil(2 x 10 / 4) = 5: as many as bring the queue to target, not one at a time.
    assert (late.decision.from_replicas, late.replicas) == (2, 5)
    assert late.decision.figures["queue_per_instance"] == 10.0
    assert late.decision.figures["waiting"] == 20
    assert "10.00 requests waiting per instance" in late.decision.reason


def test_a_queue_that_falls_back_restarts_the_clock() -> None:
    busy, calm = load(waiting=20, running=20), load(waiting=2, running=20)
    state = run([0, 20], busy)[-1].state
    state = decide(POLICY, state, calm, T0 + timedelta(seconds=25)).state
    assert state.over_since is None
    assert run([31, 40], busy, state=state)[-1].decision is None  # 9 s over, not 30


def test_no_change_within_the_cooldown_of_the_last_one() -> None:
    busy = load(replicas=3, running=30, waiting=30)
    changed = AutoscaleState(last_change_at=T0)
    outcomes = run([0, 30, 59, 60], busy, state=changed)
    assert [o.decision is not None for o in outcomes] == [False, False, False, True]


def test_at_max_it_stays_and_says_it_is_pinned() -> None:
    busy = load(replicas=8, running=80, waiting=80)
    outcome = run([0, 30, 45], busy)[-1]
    assert outcome.decision is None
    assert outcome.state.pinned_at_max_since == T0 + timedelta(seconds=30)
    calm = decide(POLICY, outcome.state, load(replicas=8, running=60), T0 + timedelta(seconds=50))
    assert calm.state.pinned_at_max_since is None


def test_low_utilisation_scales_down_after_down_after_to_what_carries_the_peak() -> None:
    # 4 instances of 10 slots; 9 running then 14: at 80% a slot count of 8 per instance.
    state = run([0], load(replicas=4, running=9))[-1].state
    state = decide(POLICY, state, load(replicas=4, running=14), T0 + timedelta(seconds=300)).state
    assert state.under_since == T0 and state.under_floor == 2
    before = decide(POLICY, state, load(replicas=4, running=9), T0 + timedelta(seconds=599))
    assert before.decision is None
    after = decide(POLICY, before.state, load(replicas=4, running=9), T0 + timedelta(seconds=600))
    assert after.decision is not None and after.decision.action == "down"
    assert after.replicas == 2  # the most needed in the window (14 running), not the last (9)


def test_never_below_min_and_never_down_while_a_restart_runs() -> None:
    idle = load(replicas=3)
    assert run([0, 600], idle)[-1].replicas == 1  # min 1, though nothing runs
    restarting = load(replicas=3, restarting=True)
    assert run([0, 600, 1200], restarting)[-1].decision is None


def test_scale_to_zero_needs_a_quiet_gateway_too() -> None:
    zero = POLICY.model_copy(update={"min": 0})
    trickle = load(replicas=1, gateway_rps=0.2)  # requests come and go between heartbeats
    assert run([0, 600, 1200], trickle, policy=zero)[-1].replicas is None
    quiet = run([0, 600], load(replicas=1), policy=zero)[-1]
    assert quiet.replicas == 0 and quiet.decision is not None
    assert "idle for 600s" in quiet.decision.reason


def test_a_waiting_request_wakes_a_deployment_at_zero_at_once() -> None:
    zero = POLICY.model_copy(update={"min": 0, "cooldown_s": 600})
    state = AutoscaleState(last_change_at=T0)  # it just scaled to zero: cooldown ignored
    nothing = decide(zero, state, load(replicas=0), T0 + timedelta(seconds=1))
    assert nothing.decision is None
    asked = load(replicas=0, wake_requested_at=T0 + timedelta(seconds=2))
    woken = decide(zero, state, asked, T0 + timedelta(seconds=3))
    assert woken.decision is not None and woken.decision.action == "wake"
    assert woken.replicas == 1
    # The same request, seen again after the wake, does not count twice.
    again = decide(zero, woken.state, asked, T0 + timedelta(seconds=4))
    assert again.decision is None


def test_a_count_outside_new_bounds_moves_inside_at_once() -> None:
    narrower = POLICY.model_copy(update={"min": 3, "max": 5})
    assert run([0], load(replicas=1), policy=narrower)[0].replicas == 3
    assert run([0], load(replicas=7), policy=narrower)[0].replicas == 5


def test_no_ready_instance_means_no_load_based_decision() -> None:
    starting = load(replicas=2, ready=0, waiting=0)
    assert run([0, 1000], starting)[-1].decision is None
