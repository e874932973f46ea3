"""The planner's whole-deployment counts (autoscaling): spread where GPUs are free, standby
instances, instances being retired."""

from __future__ import annotations

from collections import Counter

from controlplane.planner import (
    Create,
    Delete,
    DeploymentView,
    GpuView,
    HostView,
    InstanceView,
    RolloutView,
    UpdateStandby,
    VersionView,
    apply_changes,
    plan_deployment,
)

STABLE, CANARY = 1, 2
VERSIONS = {STABLE: VersionView("demo:v1"), CANARY: VersionView("demo:v2")}
GPU = 141 * 2**30


def host(hid: int, gpus: int = 8, draining: bool = False) -> HostView:
    return HostView(
        id=hid,
        name=f"h{hid}",
        gpus=tuple(GpuView(i, GPU) for i in range(gpus)),
        draining=draining,
    )


def web(total: int, standby: int = 0, **extra: object) -> DeploymentView:
    return DeploymentView(
        id=1,
        name="web",
        stable_version_id=STABLE,
        placement_hosts=frozenset({"h1", "h2"}),
        gpus_per_instance=1,
        total=total,
        standby=standby,
        **extra,  # type: ignore[arg-type]
    )


def other(iid: int, host_id: int, gpus: tuple[int, ...]) -> InstanceView:
    """An instance of another deployment holding GPUS."""
    return InstanceView(iid, 9, host_id, 0, 18050 + iid, STABLE, gpus)


def per_host(instances: list[InstanceView]) -> Counter[int]:
    return Counter(i.host_id for i in instances if i.deployment_id == 1)


def test_a_total_spreads_evenly_and_fills_where_gpus_are_free() -> None:
    hosts = [host(1), host(2)]
    plan = plan_deployment(web(5), None, hosts, [], VERSIONS)
    assert not plan.problems
    after = apply_changes([], plan.changes)
    assert per_host(after) == {1: 3, 2: 2}
    # Host 2 has 2 GPUs left (another deployment holds 6): the rest goes to host 1.
    held = [other(100 + g, 2, (g,)) for g in range(6)]
    plan = plan_deployment(web(9), None, hosts, held, VERSIONS)
    assert not plan.problems
    assert per_host(apply_changes(held, plan.changes)) == {1: 7, 2: 2}


def test_more_than_fits_is_placed_as_far_as_it_goes_and_says_why() -> None:
    hosts = [host(1, gpus=2), host(2, gpus=2)]
    plan = plan_deployment(web(6), None, hosts, [], VERSIONS)
    assert per_host(apply_changes([], plan.changes)) == {1: 2, 2: 2}
    [problem] = plan.problems
    assert problem.kind == "capacity" and problem.host_id is None
    assert "wants 6 instance(s)" in problem.message and "room for 4" in problem.message


def test_instances_stay_where_they_are_and_a_smaller_total_takes_from_the_fullest() -> None:
    hosts = [host(1), host(2)]
    first = apply_changes([], plan_deployment(web(4), None, hosts, [], VERSIONS).changes)
    plan = plan_deployment(web(5), None, hosts, first, VERSIONS)
    assert [type(c) for c in plan.changes] == [Create]  # nothing moved, one added
    five = apply_changes(first, plan.changes)
    plan = plan_deployment(web(3), None, hosts, five, VERSIONS)
    assert all(isinstance(c, Delete) for c in plan.changes)
    assert per_host(apply_changes(five, plan.changes)) == {1: 2, 2: 1}


def test_draining_hosts_give_their_instances_to_the_others() -> None:
    start = apply_changes(
        [], plan_deployment(web(4), None, [host(1), host(2)], [], VERSIONS).changes
    )
    hosts = [host(1), host(2, draining=True)]
    after = apply_changes(start, plan_deployment(web(4), None, hosts, start, VERSIONS).changes)
    assert per_host(after) == {1: 4}


def test_standby_instances_are_kept_and_a_scale_up_promotes_one_first() -> None:
    hosts = [host(1), host(2)]
    first = apply_changes([], plan_deployment(web(3, standby=1), None, hosts, [], VERSIONS).changes)
    assert sum(i.standby for i in first) == 1
    [spare] = [i for i in first if i.standby]
    # One more serving instance: the loaded standby is promoted, the new one waits in its place.
    plan = plan_deployment(web(4, standby=1), None, hosts, first, VERSIONS)
    assert UpdateStandby(spare.id, spare.host_id, False) in plan.changes
    [created] = [c for c in plan.changes if isinstance(c, Create)]
    assert created.standby


def test_standby_instances_stay_on_stable_during_a_rollout() -> None:
    hosts = [host(1)]
    rollout = RolloutView(CANARY, canary_instances=2)
    plan = plan_deployment(web(4, standby=2), rollout, hosts, [], VERSIONS)
    created = [c for c in plan.changes if isinstance(c, Create)]
    # The canary's two instances are serving ones; the standby ones run stable.
    assert sorted((c.standby, c.version_id) for c in created) == [
        (False, CANARY), (False, CANARY), (True, STABLE), (True, STABLE),
    ]  # fmt: skip
    plan = plan_deployment(web(6, standby=2), rollout, hosts, [], VERSIONS)
    created = [c for c in plan.changes if isinstance(c, Create)]
    assert Counter((c.standby, c.version_id) for c in created) == {
        (False, CANARY): 2, (False, STABLE): 2, (True, STABLE): 2,
    }  # fmt: skip


def test_retiring_instances_hold_their_gpus_until_retired_then_go() -> None:
    hosts = [host(1, gpus=3)]
    three = apply_changes([], plan_deployment(web(3), None, hosts, [], VERSIONS).changes)
    leaving = three[0].id
    # Scaled to 2, one retiring: nothing is created or deleted while it drains, and its GPU
    # is not given to anyone.
    draining = web(2, retiring=frozenset({leaving}))
    assert plan_deployment(draining, None, hosts, three, VERSIONS).changes == []
    grown = web(3, retiring=frozenset({leaving}))
    plan = plan_deployment(grown, None, hosts, three, VERSIONS)
    assert [p.kind for p in plan.problems] == ["capacity"]  # its GPU is still taken
    gone = web(2, retired=frozenset({leaving}))
    assert plan_deployment(gone, None, hosts, three, VERSIONS).changes == [Delete(leaving, 1)]
