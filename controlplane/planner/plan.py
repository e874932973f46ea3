"""Deployment and fleet plans: which instances to create, change or delete."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from controlplane.planner.changes import (
    Change,
    Create,
    Delete,
    Plan,
    Problem,
    UpdateDesiredState,
    UpdateGpus,
    UpdateStandby,
    UpdateVersion,
    apply_changes,
    updated,
)
from controlplane.planner.fit import Slot, draft_host, memory_problem
from controlplane.planner.spread import spread
from controlplane.planner.views import (
    RUNNING,
    STOPPED,
    DeploymentView,
    HostView,
    InstanceView,
    RolloutView,
    VersionView,
)


def plan_deployment(
    deployment: DeploymentView,
    rollout: RolloutView | None,
    hosts: Sequence[HostView],
    instances: Sequence[InstanceView],
    versions: Mapping[int, VersionView],
) -> Plan:
    """The changes that place `deployment` (the rules are in the module docstring).

    `instances` holds the instances on the hosts, every deployment's (they hold ports and GPUs);
    `versions` at least the stable version and the rollout's canary.
    """
    plan = Plan()
    own: dict[int, list[InstanceView]] = {}
    others: dict[int, list[InstanceView]] = {}
    for inst in sorted(instances, key=lambda i: (i.ordinal, i.id)):
        if inst.deployment_id == deployment.id and inst.id in deployment.retired:
            plan.changes.append(Delete(inst.id, inst.host_id))
            continue
        # Retiring instances keep their ports and GPUs, but are no longer the deployment's.
        owned = inst.deployment_id == deployment.id and inst.id not in deployment.retiring
        (own if owned else others).setdefault(inst.host_id, []).append(inst)
    targets = [h for h in sorted(hosts, key=lambda h: h.id) if deployment.selects(h)]
    if deployment.total is not None:
        # A whole-deployment count: draining hosts give theirs up to the others.
        targets = [h for h in targets if not h.draining]
    target_ids = {h.id for h in targets}
    for host_id, mine in own.items():
        if host_id not in target_ids:
            plan.changes += [Delete(i.id, host_id) for i in mine]

    # Surge instances go one per host, in host order, on top of the deployment's own.
    extra = rollout.extra() if rollout is not None else 0
    counts = _host_counts(deployment, extra, targets, own, others, plan)
    drafts = []
    for host in targets:
        wanted = counts[host.id]
        mine = own.get(host.id, [])
        kept, dropped = mine[:wanted], mine[wanted:]
        plan.changes += [Delete(i.id, host.id) for i in dropped]
        for inst in kept:
            state = _desired_state(deployment, host, inst.id)
            if inst.desired_state != state:
                plan.changes.append(UpdateDesiredState(inst.id, host.id, state))
        drafts.append(draft_host(deployment, host, kept, others.get(host.id, []), wanted))

    slots = [s for d in drafts for s in d.slots]
    for slot in slots:
        slot.version_id = deployment.stable_version_id  # standby ones stay on it
    _choose_standby(deployment, slots)
    _choose_versions(deployment, rollout, [s for s in slots if not s.standby])
    for draft in drafts:
        problem = draft.problem or memory_problem(deployment, draft, versions)
        if problem is not None:
            plan.problems.append(problem)
            continue
        for slot in draft.slots:
            plan.changes += _slot_changes(deployment, slot)
    return plan


def plan_fleet(
    deployments: Sequence[DeploymentView],
    rollouts: Mapping[int, RolloutView],
    hosts: Sequence[HostView],
    instances: Sequence[InstanceView],
    versions: Mapping[int, VersionView],
) -> Plan:
    """Plan every deployment, each seeing the ports and GPUs the others hold.

    Deployments are planned in id order, in rounds until a round changes nothing: one planned
    early may need a port or GPUs that a later one gives up, and it gets them in the next round.
    So planning the result again changes nothing. Rounds only create, or reassign what became
    invalid, so they end; the bound is a guard.
    """
    ordered = sorted(deployments, key=lambda d: d.id)
    current = list(instances)
    next_id = min([0, *(i.id for i in instances)]) - 1
    changes: list[Change] = []
    created: dict[int, Create] = {}  # by the id the planned instance has in `current`
    problems: list[Problem] = []
    for _round in range(len(ordered) + 1):
        problems = []
        moved = False
        for deployment in ordered:
            step = plan_deployment(
                deployment, rollouts.get(deployment.id), hosts, current, versions
            )
            current = apply_changes(current, step.changes, next_id)
            problems += step.problems
            for change in step.changes:
                moved = True
                if isinstance(change, Create):
                    created[next_id] = change
                    next_id -= 1
                elif change.instance_id in created:
                    _fold(created, change)
                else:
                    changes.append(change)
        if not moved:
            break
    return Plan(changes + list(created.values()), problems)


def _fold(created: dict[int, Create], change: Change) -> None:
    """Make a change to an instance planned in an earlier round part of its Create."""
    if isinstance(change, Delete):
        del created[change.instance_id]
    elif not isinstance(change, Create):
        created[change.instance_id] = updated(created[change.instance_id], change)


def _host_counts(
    deployment: DeploymentView,
    extra: int,
    targets: list[HostView],
    own: dict[int, list[InstanceView]],
    others: dict[int, list[InstanceView]],
    plan: Plan,
) -> dict[int, int]:
    """Instances per target host: `instances_per_host` each, or the deployment's total spread
    where there is room; surge instances on top."""
    if deployment.total is not None:
        placed = spread(deployment, deployment.total + extra, targets, own, others)
        if placed.problem is not None:
            plan.problems.append(placed.problem)
        return placed.wanted
    return {
        host.id: deployment.instances_per_host
        + (extra // len(targets) + (1 if n < extra % len(targets) else 0))
        for n, host in enumerate(targets)
    }


def _choose_standby(deployment: DeploymentView, slots: list[Slot]) -> None:
    """Mark `standby` of the slots out of the pools: new instances first (so a scale-up
    promotes a standby that is loaded already, and the new one takes its place), then those on
    standby now, then the newest serving ones."""
    count = min(deployment.standby, len(slots))
    fresh = [s for s in slots if s.current is None]
    waiting = [s for s in slots if s.current is not None and s.current.standby]
    serving = sorted(
        (s for s in slots if s.current is not None and not s.current.standby),
        key=lambda s: -s.current.id if s.current else 0,
    )
    for slot in [*fresh, *waiting, *serving][:count]:
        slot.standby = True


def _choose_versions(
    deployment: DeploymentView, rollout: RolloutView | None, slots: list[Slot]
) -> None:
    """Set each slot's version: stable, or the canary on `canary_instances` of them."""
    stable = deployment.stable_version_id
    for slot in slots:
        slot.version_id = stable
    if rollout is None:
        return
    canary = rollout.canary_version_id
    on_canary = [s for s in slots if s.current and s.current.version_id == canary]
    fresh = [s for s in slots if s.current is None]
    rest = [s for s in slots if s.current and s.current.version_id != canary]
    for slot in [*on_canary, *fresh, *rest][: max(0, rollout.canary_instances)]:
        slot.version_id = canary


def _desired_state(deployment: DeploymentView, host: HostView, instance_id: int) -> str:
    """Stopped on a draining host and while a restart holds the instance stopped; else running."""
    held = host.draining or instance_id in deployment.held_stopped
    return STOPPED if held else RUNNING


def _slot_changes(deployment: DeploymentView, slot: Slot) -> list[Change]:
    """The changes that make the store hold `slot`."""
    state = STOPPED if slot.host.draining else RUNNING
    current = slot.current
    if current is None:
        return [
            Create(
                deployment_id=deployment.id,
                host_id=slot.host.id,
                ordinal=slot.ordinal,
                version_id=slot.version_id,
                port=slot.port,
                gpu_indices=slot.gpu_indices,
                desired_state=state,
                standby=slot.standby,
            )
        ]
    changes: list[Change] = []
    if current.standby != slot.standby:
        changes.append(UpdateStandby(current.id, slot.host.id, slot.standby))
    if current.version_id != slot.version_id:
        changes.append(UpdateVersion(current.id, slot.host.id, slot.version_id))
    if current.gpu_indices != slot.gpu_indices:
        changes.append(UpdateGpus(current.id, slot.host.id, slot.gpu_indices))
    return changes
