"""The autoscaler's rules: a deployment's policy, load and clocks in, its next instance count out.

Pure, like the planner: no session, no clock of its own. The controller
(`controlplane.autoscaler.controller`) gathers the `Load`, calls `decide`, and applies the result.

The rules, for `replicas` serving instances, of which `ready` are ready:
- Bounds: a count outside [min, max] (the policy changed) moves inside at once ("clamp").
- Wake: at zero, a gateway holding a request asks for an instance: max(1, min) at once ("wake").
- Up: queue = waiting requests / ready instances. Over `target_queue` for `up_after_s` (and no
  change within `cooldown_s`): ceil(replicas x queue / target_queue) instances, at least one
  more, at most max. At max it stays, "pinned at max" until the queue falls.
- Down: the instances the running requests need at `target_utilization` of
  `max_concurrent` each (none when nothing runs, nothing waits and the gateways saw no request;
  else at least one). Fewer than now for `down_after_s` (and no change within the cooldown): the
  most of them wanted during that time, at least min ("down"). Never while a restart runs.
- With no ready instance (all starting), only bounds and wake apply: load is unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.autoscaler.state import AutoscaleState
from protocol.autoscale import AutoscaleAction, AutoscaleDecision, AutoscalePolicy


@dataclass(frozen=True)
class Load:
    """What the deployment is doing now."""

    replicas: int
    ready: int  # serving instances ready now
    running: int  # requests being decoded on them
    waiting: int  # requests waiting for a batch slot on them
    max_concurrent: int  # per instance (`service.max_concurrent_requests`)
    gateway_rps: float = 0.0  # what the gateways served, requests per second, lately
    wake_requested_at: datetime | None = None
    restarting: bool = False

    def queue_per_instance(self) -> float | None:
        """Waiting requests per ready instance (None: none ready)."""
        return self.waiting / self.ready if self.ready else None

    def utilization(self) -> float | None:
        """Running requests over what the ready instances can run, 0..1 (None: none ready)."""
        if not self.ready:
            return None
        return self.running / (self.ready * max(1, self.max_concurrent))

    def figures(self) -> dict[str, float | int | None]:
        """The numbers a decision is made on, as its event records them."""
        queue, utilization = self.queue_per_instance(), self.utilization()
        return {
            "replicas": self.replicas,
            "ready": self.ready,
            "running": self.running,
            "waiting": self.waiting,
            "max_concurrent": self.max_concurrent,
            "queue_per_instance": None if queue is None else round(queue, 3),
            "utilization": None if utilization is None else round(utilization, 3),
            "gateway_rps": round(self.gateway_rps, 3),
        }


@dataclass(frozen=True)
class Outcome:
    """The state to keep, and a decision when the count changes."""

    state: AutoscaleState
    decision: AutoscaleDecision | None = None

    @property
    def replicas(self) -> int | None:
        """The new count, or None when it stays."""
        return self.decision.to_replicas if self.decision is not None else None


def decide(policy: AutoscalePolicy, state: AutoscaleState, load: Load, now: datetime) -> Outcome:
    """The next count of serving instances, if it changes (rules in the module docstring)."""
    current = load.replicas
    bounded = min(max(current, policy.min), policy.max)
    if bounded != current:
        reason = f"outside the policy's bounds {policy.min}..{policy.max}"
        return _change(state, now, "clamp", load, bounded, reason)
    if current == 0:
        woken = load.wake_requested_at
        asked = woken is not None and (state.last_change_at is None or woken > state.last_change_at)
        if asked:
            target = max(1, policy.min)
            reason = "a request waits at the gateway for this deployment, scaled to zero"
            return _change(state, now, "wake", load, target, reason)
        return Outcome(state.model_copy(update=_cleared()))
    queue = load.queue_per_instance()
    if queue is None:
        return Outcome(state)  # nothing ready: load unknown, wait for the instances
    cooled = state.last_change_at is None or now - state.last_change_at >= _s(policy.cooldown_s)

    over = queue > policy.target_queue
    over_since = (state.over_since or now) if over else None
    pinned = state.pinned_at_max_since
    if over_since is not None and now - over_since >= _s(policy.up_after_s):
        if current >= policy.max:
            pinned = pinned or now
        elif cooled:
            target = min(
                policy.max, max(current + 1, math.ceil(current * queue / policy.target_queue))
            )
            held = (now - over_since).total_seconds()
            reason = (
                f"{queue:.2f} requests waiting per instance, over the target "
                f"{policy.target_queue:g} for {held:.0f}s"
            )
            return _change(state, now, "up", load, target, reason)
    if not over:
        pinned = None

    wanted = _needed(policy, load)
    under = not over and wanted < current and not load.restarting
    if not under:
        fields = {"over_since": over_since, "under_since": None, "under_floor": 0}
        return Outcome(state.model_copy(update={**fields, "pinned_at_max_since": pinned}))
    under_since = state.under_since or now
    floor = max(wanted, state.under_floor) if state.under_since else wanted
    if now - under_since >= _s(policy.down_after_s) and cooled:
        utilization = load.utilization() or 0.0
        held = (now - under_since).total_seconds()
        reason = (
            f"utilisation {utilization:.0%} under the target {policy.target_utilization:.0%} "
            f"for {held:.0f}s: {floor} instance(s) carry the load"
        )
        if floor == 0:
            reason = f"idle for {held:.0f}s: no request running, waiting or arriving"
        return _change(state, now, "down", load, floor, reason)
    fields = {"over_since": over_since, "under_since": under_since, "under_floor": floor}
    return Outcome(state.model_copy(update={**fields, "pinned_at_max_since": pinned}))


def _needed(policy: AutoscalePolicy, load: Load) -> int:
    """Instances the running requests need at the target utilisation, within the bounds."""
    idle = load.running == 0 and load.waiting == 0 and load.gateway_rps == 0
    if idle:
        return policy.min
    per_instance = max(1, load.max_concurrent) * policy.target_utilization
    return max(policy.min, 1, math.ceil(load.running / per_instance))


def _change(
    state: AutoscaleState,
    now: datetime,
    action: AutoscaleAction,
    load: Load,
    target: int,
    reason: str,
) -> Outcome:
    decision = AutoscaleDecision(
        time=now,
        action=action,
        from_replicas=load.replicas,
        to_replicas=target,
        reason=reason,
        figures=load.figures(),
    )
    updated = state.model_copy(
        update={**_cleared(), "last_change_at": now, "last_decision": decision}
    )
    return Outcome(updated, decision)


def _cleared() -> dict[str, object]:
    return {"over_since": None, "under_since": None, "under_floor": 0, "pinned_at_max_since": None}


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)
