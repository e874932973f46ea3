"""The desired-state planner's rules, as properties over random fleets and as examples."""

from __future__ import annotations

from collections import Counter
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.planner import (
    Create,
    DeploymentView,
    GpuView,
    HostView,
    InstanceView,
    Plan,
    RolloutView,
    UpdateDesiredState,
    UpdateGpus,
    UpdateVersion,
    VersionView,
    apply_changes,
    gpu_ranks,
    kv_reserve_tokens,
    plan_deployment,
    plan_fleet,
)
from protocol.wire import MemoryPlan

GIB = 2**30
STABLE, CANARY = 1, 2
VERSIONS = {
    STABLE: VersionView("demo:v1", MemoryPlan(weights_bytes=30 * GIB, kv_bytes_per_token=0)),
    CANARY: VersionView("demo:v2", None),
}
LABELS = [{}, {"pool": "a"}, {"pool": "b"}]


@st.composite
def hosts(draw: st.DrawFn) -> list[HostView]:
    """1-4 hosts: some without GPUs reported, some draining, some with few ports."""
    count = draw(st.integers(1, 4))
    found = []
    for i in range(1, count + 1):
        gpus = draw(st.integers(0, 8))
        memory = draw(st.sampled_from([24, 80, 141])) * GIB
        ports = draw(st.integers(1, 8))
        found.append(
            HostView(
                id=i,
                name=f"h{i}",
                labels=draw(st.sampled_from(LABELS)),
                draining=draw(st.booleans()),
                gpus=tuple(GpuView(g, memory) for g in range(gpus)),
                port_range=(18000, 18000 + ports - 1),
            )
        )
    return found


@st.composite
def deployments(draw: st.DrawFn, host_names: list[str]) -> list[DeploymentView]:
    """1-3 deployments placed by name and/or label, with or without GPUs per instance."""
    count = draw(st.integers(1, 3))
    found = []
    for i in range(1, count + 1):
        named = draw(st.lists(st.sampled_from(host_names), max_size=len(host_names), unique=True))
        found.append(
            DeploymentView(
                id=i,
                name=f"d{i}",
                stable_version_id=STABLE,
                placement_hosts=frozenset(named),
                placement_labels=draw(st.sampled_from(LABELS)),
                instances_per_host=draw(st.integers(0, 3)),
                gpus_per_instance=draw(st.sampled_from([None, 1, 2, 3])),
                kv_reserve_tokens=4096,
            )
        )
    return found


@st.composite
def fleets(
    draw: st.DrawFn,
) -> tuple[list[HostView], list[DeploymentView], list[DeploymentView]]:
    """Hosts, the deployments as first placed, and as they are asked for now (rescaled...)."""
    found = draw(hosts())
    names = [h.name for h in found]
    return found, draw(deployments(names)), draw(deployments(names))


def placed(
    hosts: list[HostView], before: list[DeploymentView], now: list[DeploymentView]
) -> tuple[Plan, list[InstanceView]]:
    """Place `before` from nothing, then plan `now` over the result: its plan and the outcome."""
    first = apply_changes([], plan_fleet(before, {}, hosts, [], VERSIONS).changes)
    # Give the created instances real ids, as the store would.
    existing = [
        InstanceView(i + 1, x.deployment_id, x.host_id, x.ordinal, x.port, x.version_id,
                     x.gpu_indices, x.desired_state)
        for i, x in enumerate(first)
    ]  # fmt: skip
    plan = plan_fleet(now, {}, hosts, existing, VERSIONS)
    return plan, apply_changes(existing, plan.changes)


FLEET = settings(max_examples=200, deadline=None)


@FLEET
@given(fleets())
def test_no_gpu_ever_runs_two_instances(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    _plan, after = placed(hosts, before, now)
    for host in hosts:
        if not host.gpus:
            continue
        on_host = [i for i in after if i.host_id == host.id]
        exclusive = [set(i.gpu_indices) for i in on_host if i.gpu_indices]
        for a, b in combinations(exclusive, 2):
            assert not a & b, f"{host.name}: {a} and {b} overlap"
        assert all(s <= {g.index for g in host.gpus} for s in exclusive)
        # An instance holding all GPUs (no indices) shares them only with others like it.
        assert not exclusive or all(i.gpu_indices for i in on_host)


@FLEET
@given(fleets())
def test_each_host_runs_the_instances_asked_when_they_fit(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    plan, after = placed(hosts, before, now)
    unfit = {(p.deployment_id, p.host_id) for p in plan.problems}
    counts = Counter((i.deployment_id, i.host_id) for i in after)
    for deployment in now:
        for host in hosts:
            got = counts[(deployment.id, host.id)]
            if not deployment.selects(host):
                assert got == 0
            elif (deployment.id, host.id) not in unfit:
                assert got == deployment.instances_per_host
                mine = [
                    i for i in after if (i.deployment_id, i.host_id) == (deployment.id, host.id)
                ]
                assert sorted(i.ordinal for i in mine) == list(range(got))
                want = deployment.gpus_per_instance
                if host.gpus and want is not None:
                    assert all(len(i.gpu_indices) == want for i in mine)
            else:
                assert got <= max(deployment.instances_per_host, 3)


@FLEET
@given(fleets())
def test_draining_hosts_run_nothing(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    _plan, after = placed(hosts, before, now)
    draining = {h.id for h in hosts if h.draining}
    for inst in after:
        assert inst.desired_state == ("stopped" if inst.host_id in draining else "running")


@FLEET
@given(fleets())
def test_ports_are_unique_per_host_and_in_its_range(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    _plan, after = placed(hosts, before, now)
    by_id = {h.id: h for h in hosts}
    ports = Counter((i.host_id, i.port) for i in after)
    assert all(n == 1 for n in ports.values())
    for inst in after:
        first, last = by_id[inst.host_id].port_range
        assert first <= inst.port <= last


@FLEET
@given(fleets())
def test_planning_a_planned_fleet_changes_nothing(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    plan, after = placed(hosts, before, now)
    again = plan_fleet(now, {}, hosts, after, VERSIONS)
    assert again.changes == []
    # The same places still do not fit (the first reason found may differ: the port that a
    # later deployment took is now gone too).
    assert {(p.deployment_id, p.host_id) for p in again.problems} == {
        (p.deployment_id, p.host_id) for p in plan.problems
    }


@FLEET
@given(fleets())
def test_instances_fit_in_the_memory_of_their_gpus(fleet: tuple) -> None:  # type: ignore[type-arg]
    hosts, before, now = fleet
    plan, after = placed(hosts, before, now)
    unfit = {(p.deployment_id, p.host_id) for p in plan.problems}
    memory = {h.id: {g.index: g.memory_bytes for g in h.gpus} for h in hosts}
    need = 30 * GIB  # demo:v1, no KV bytes
    for inst in after:
        gpus = memory[inst.host_id]
        if gpus and (inst.deployment_id, inst.host_id) not in unfit:
            have = sum(gpus[g] for g in inst.gpu_indices or gpus)
            assert have >= need


@FLEET
@given(fleets(), st.integers(0, 6))
def test_a_rollout_keeps_canary_instances_on_the_canary(fleet: tuple, canaries: int) -> None:  # type: ignore[type-arg]
    hosts, _before, now = fleet
    first = apply_changes([], plan_fleet(now, {}, hosts, [], VERSIONS).changes)
    existing = [InstanceView(n + 1, *_fields(i)) for n, i in enumerate(first)]
    rollouts = {d.id: RolloutView(CANARY, canaries) for d in now}
    plan = plan_fleet(now, rollouts, hosts, existing, VERSIONS)
    after = apply_changes(existing, plan.changes)
    unfit = {(p.deployment_id, p.host_id) for p in plan.problems}
    for deployment in now:
        mine = [i for i in after if i.deployment_id == deployment.id]
        on_canary = [i for i in mine if i.version_id == CANARY]
        if not any(p[0] == deployment.id for p in unfit):
            assert len(on_canary) == min(canaries, len(mine))
    # Planned again with the same rollout: nobody goes back to stable.
    again = plan_fleet(now, rollouts, hosts, after, VERSIONS)
    assert again.changes == []


def _fields(i: InstanceView) -> tuple:  # type: ignore[type-arg]
    return (i.deployment_id, i.host_id, i.ordinal, i.port, i.version_id, i.gpu_indices,
            i.desired_state)  # fmt: skip


# --- examples ----------------------------------------------------------------------------------


def host(id: int = 1, gpus: int = 8, memory_gib: int = 80, **extra: object) -> HostView:
    return HostView(
        id=id,
        name=f"gpu-{id}",
        gpus=tuple(GpuView(g, memory_gib * GIB) for g in range(gpus)),
        **extra,  # type: ignore[arg-type]
    )


def web(**extra: object) -> DeploymentView:
    base: dict[str, object] = {"id": 1, "name": "web", "stable_version_id": STABLE,
                               "placement_hosts": frozenset({"gpu-1"})}  # fmt: skip
    return DeploymentView(**{**base, **extra})  # type: ignore[arg-type]


def inst(
    id: int, ordinal: int, port: int, gpus: tuple[int, ...] = (), **extra: object
) -> InstanceView:
    base: dict[str, object] = {"deployment_id": 1, "host_id": 1, "version_id": STABLE}
    return InstanceView(id, ordinal=ordinal, port=port, gpu_indices=gpus, **{**base, **extra})  # type: ignore[arg-type]


def test_instances_get_disjoint_gpus_and_the_lowest_free_ports() -> None:
    plan = plan_deployment(
        web(instances_per_host=3, gpus_per_instance=2), None, [host()], [], VERSIONS
    )
    creates = [c for c in plan.changes if isinstance(c, Create)]
    assert [(c.ordinal, c.port, c.gpu_indices) for c in creates] == [
        (0, 18000, (0, 1)), (1, 18001, (2, 3)), (2, 18002, (4, 5))
    ]  # fmt: skip
    assert plan.host_ids() == {1}


def test_other_deployments_gpus_and_ports_are_left_alone() -> None:
    theirs = inst(7, 0, 18000, (0, 1, 2), deployment_id=2)
    plan = plan_deployment(web(gpus_per_instance=4), None, [host()], [theirs], VERSIONS)
    [create] = plan.changes
    assert (
        isinstance(create, Create) and create.port == 18001 and create.gpu_indices == (3, 4, 5, 6)
    )


def test_not_fitting_names_the_host_gpus_free_and_asked() -> None:
    theirs = inst(7, 0, 18000, (0, 1, 2, 3, 4, 5), deployment_id=2)
    plan = plan_deployment(
        web(instances_per_host=2, gpus_per_instance=2), None, [host()], [theirs], VERSIONS
    )
    assert plan.changes == []
    [problem] = plan.problems
    assert problem.kind == "gpus"
    assert "host gpu-1" in problem.message
    assert "4 GPU(s) asked (2 instance(s) × 2), 2 free of 8" in problem.message


def test_memory_that_does_not_fit_gives_both_figures_in_gib() -> None:
    big = {
        STABLE: VersionView("demo:v1", MemoryPlan(weights_bytes=100 * GIB, kv_bytes_per_token=1024))
    }
    plan = plan_deployment(
        web(gpus_per_instance=1, kv_reserve_tokens=2**20), None, [host()], [], big
    )
    [problem] = plan.problems
    assert problem.kind == "memory" and plan.changes == []
    assert "needs 101.0 GiB" in problem.message and "its GPU has 80.0 GiB" in problem.message
    assert "KV reserve 1.0 GiB for 1048576 tokens" in problem.message
    two = plan_deployment(
        web(gpus_per_instance=2, kv_reserve_tokens=2**20), None, [host()], [], big
    )
    assert two.problems == [] and len(two.changes) == 1


def test_each_gpu_holds_one_ranks_share_with_the_whole_activation_headroom() -> None:
    # 100 GiB of weights and 30 GiB of activations on two 80 GiB GPUs: 160 GiB in all would hold
    # the 131 GiB, but each rank holds half the weights and all the activations, 80.5 GiB.
    plan = MemoryPlan(weights_bytes=100 * GIB, activation_bytes=30 * GIB, kv_bytes_per_token=1024)
    versions = {STABLE: VersionView("demo:v1", plan)}
    two = plan_deployment(
        web(gpus_per_instance=2, kv_reserve_tokens=2**20), None, [host()], [], versions
    )
    [problem] = two.problems
    assert problem.kind == "memory" and two.changes == []
    assert (
        "needs 80.5 GiB on each GPU, a rank's share with parallel.size 2 (weights 50.0 GiB of "
        "100.0 GiB + activations 30.0 GiB + KV reserve 0.5 GiB of 1.0 GiB for 1048576 tokens), "
        "the smallest of its 2 GPUs has 80.0 GiB"
    ) in problem.message
    four = plan_deployment(
        web(gpus_per_instance=4, kv_reserve_tokens=2**20), None, [host()], [], versions
    )
    assert four.problems == [] and len(four.changes) == 1


def test_fewer_kv_heads_than_ranks_are_replicated_so_each_rank_holds_more_kv() -> None:
    # 300 GiB of weights over 4 ranks is 75 GiB each; the 16 GiB KV reserve splits 4 ways with
    # 8 K/V heads (4 GiB each: 79 GiB fits 80), but only 2 ways with 2 (8 GiB each: 83 does not).
    def plan(kv_heads: list[int]) -> dict[int, VersionView]:
        memory = MemoryPlan(
            weights_bytes=300 * GIB, kv_bytes_per_token=16 * 1024, num_kv_heads=kv_heads
        )
        return {STABLE: VersionView("demo:v1", memory)}

    deployment = web(gpus_per_instance=4, kv_reserve_tokens=2**20)
    assert plan_deployment(deployment, None, [host()], [], plan([8])).problems == []
    [problem] = plan_deployment(deployment, None, [host()], [], plan([2])).problems
    assert "needs 83.0 GiB on each GPU" in problem.message
    assert "KV reserve 8.0 GiB of 16.0 GiB" in problem.message
    # Layers that differ (sliding and full attention): the layer holding most decides.
    [mixed] = plan_deployment(deployment, None, [host()], [], plan([8, 2])).problems
    assert "needs 83.0 GiB on each GPU" in mixed.message


def test_a_parallel_size_must_match_the_gpus_of_a_whole_host() -> None:
    # GPUs per instance left to the host: each instance gets all 8, so one rank per GPU is 8.
    plan = plan_deployment(web(parallel_size=4), None, [host()], [], VERSIONS)
    [problem] = plan.problems
    assert problem.kind == "gpus" and plan.changes == []
    assert (
        "its engine config sets parallel.size 4, and each instance gets all 8 GPUs of the "
        "host (one rank per GPU): set --gpus-per-instance 4, or parallel.size 8"
    ) in problem.message
    whole = plan_deployment(web(parallel_size=8), None, [host()], [], VERSIONS)
    assert whole.problems == []
    assert [c.gpu_indices for c in whole.changes if isinstance(c, Create)] == [()]
    # A host that has not reported its GPUs yet is placed; the next planning checks it.
    assert plan_deployment(web(parallel_size=4), None, [host(gpus=0)], [], VERSIONS).problems == []


def test_hosts_without_gpus_reported_get_all_gpus_and_no_memory_check() -> None:
    big = {STABLE: VersionView("demo:v1", MemoryPlan(weights_bytes=10**15, kv_bytes_per_token=1))}
    plan = plan_deployment(
        web(instances_per_host=2, gpus_per_instance=2), None, [host(gpus=0)], [], big
    )
    assert plan.problems == []
    assert [c.gpu_indices for c in plan.changes if isinstance(c, Create)] == [(), ()]
    # Once the host reports its GPUs, the next planning gives each instance its own.
    placed = [inst(1, 0, 18000), inst(2, 1, 18001)]
    later = plan_deployment(
        web(instances_per_host=2, gpus_per_instance=2), None, [host()], placed, VERSIONS
    )
    assert later.changes == [UpdateGpus(1, 1, (0, 1)), UpdateGpus(2, 1, (2, 3))]


def test_a_valid_assignment_is_kept_and_a_changed_size_reassigned() -> None:
    placed = [inst(1, 0, 18000, (4, 5)), inst(2, 1, 18001, (0, 1))]
    same = plan_deployment(
        web(instances_per_host=2, gpus_per_instance=2), None, [host()], placed, VERSIONS
    )
    assert same.changes == []
    bigger = plan_deployment(
        web(instances_per_host=2, gpus_per_instance=4), None, [host()], placed, VERSIONS
    )
    assert bigger.changes == [UpdateGpus(1, 1, (0, 1, 2, 3)), UpdateGpus(2, 1, (4, 5, 6, 7))]
    whole = plan_deployment(web(instances_per_host=2), None, [host()], placed, VERSIONS)
    assert whole.changes == [UpdateGpus(1, 1, ()), UpdateGpus(2, 1, ())]


def test_draining_stops_instances_even_where_nothing_fits() -> None:
    placed = [inst(1, 0, 18000)]
    full = host(draining=True, port_range=(18000, 18000))
    plan = plan_deployment(web(instances_per_host=2), None, [full], placed, VERSIONS)
    assert plan.changes == [UpdateDesiredState(1, 1, "stopped")]
    assert [p.kind for p in plan.problems] == ["ports"]


def test_without_a_rollout_every_instance_runs_stable() -> None:
    placed = [inst(1, 0, 18000, version_id=CANARY)]
    plan = plan_deployment(web(), None, [host()], placed, VERSIONS)
    assert plan.changes == [UpdateVersion(1, 1, STABLE)]
    kept = plan_deployment(web(), RolloutView(CANARY, 1), [host()], placed, VERSIONS)
    assert kept.changes == []


def test_gpu_ranks_are_the_parallel_size_unless_the_ranks_run_on_cpus() -> None:
    assert gpu_ranks({}) is None  # one rank per GPU the instance gets
    assert gpu_ranks({"parallel": {"size": 4}}) == 4
    assert gpu_ranks({"parallel": {"size": 4}, "resources": {"device": "cpu"}}) is None
    assert gpu_ranks({"parallel": {"size": "many"}}) is None  # stored before validation


def test_kv_reserve_is_max_seq_len_times_concurrent_requests() -> None:
    assert kv_reserve_tokens({}) == 4096 * 32
    config = {"model": {"max_seq_len": 1024}, "service": {"max_concurrent_requests": 4}}
    assert kv_reserve_tokens(config) == 4096
    assert kv_reserve_tokens({"block_size": 4}) == 4096 * 32  # stored before validation existed
