"""One host: the instances a deployment will have there, with ports, GPUs and memory checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from controlplane.planner.changes import Problem
from controlplane.planner.views import DeploymentView, HostView, InstanceView, VersionView
from protocol.engine_config import DeploymentEngineConfig


def engine_settings(engine_config: Mapping[str, Any]) -> DeploymentEngineConfig:
    """A deployment's stored engine config with the engine's defaults for what it leaves out; a
    config stored before validation existed that no longer validates counts as all defaults."""
    try:
        return DeploymentEngineConfig.model_validate(engine_config)
    except ValidationError:
        return DeploymentEngineConfig()


def kv_reserve_tokens(engine_config: Mapping[str, Any]) -> int:
    """KV-cache tokens to reserve per instance: max_seq_len × max_concurrent_requests.

    Keys the config leaves out take the engine's defaults (4096 × 32).
    """
    config = engine_settings(engine_config)
    return config.model.max_seq_len * config.service.max_concurrent_requests


def gpu_ranks(engine_config: Mapping[str, Any]) -> int | None:
    """The ranks an instance runs, one per GPU, when its engine config sets `parallel.size`;
    None when it leaves it to the instance's GPU count, or runs on the CPU (no GPU per rank)."""
    return engine_settings(engine_config).gpu_ranks


def gib(n: int) -> str:
    """Bytes as GiB for a person, one decimal."""
    return f"{n / 2**30:.1f} GiB"


@dataclass
class Slot:
    """One instance of the deployment on a host after this plan: kept (`current`) or new."""

    host: HostView
    ordinal: int
    gpu_indices: tuple[int, ...]
    current: InstanceView | None = None
    port: int = 0
    version_id: int = 0
    standby: bool = False


@dataclass
class HostDraft:
    """A deployment's instances on one host as planned, or why they do not fit there."""

    host: HostView
    slots: list[Slot]
    problem: Problem | None = None


def draft_host(
    deployment: DeploymentView,
    host: HostView,
    kept: list[InstanceView],
    others: list[InstanceView],
    wanted: int | None = None,
) -> HostDraft:
    """The instances the deployment will have on `host` (`wanted`, default its instances per
    host), with ports and GPUs, or a problem."""
    wanted = deployment.instances_per_host if wanted is None else wanted
    used_ordinals = {i.ordinal for i in kept}
    new_ordinals = [o for o in range(wanted + len(kept)) if o not in used_ordinals]
    slots = [Slot(host, i.ordinal, i.gpu_indices, current=i, port=i.port) for i in kept]
    slots += [Slot(host, o, ()) for o in new_ordinals[: wanted - len(kept)]]

    used_ports = {i.port for i in [*kept, *others]}
    first, last = host.port_range
    free_ports = iter(p for p in range(first, last + 1) if p not in used_ports)
    for slot in slots:
        if slot.current is None:
            port = next(free_ports, None)
            if port is None:
                message = (
                    f"host {host.name} has no free port in {first}-{last}: scale something "
                    "down or widen the agent's --ports range"
                )
                return HostDraft(host, slots, Problem(deployment.id, host.id, "ports", message))
            slot.port = port
    return HostDraft(host, slots, _assign_gpus(deployment, host, slots, others))


def _assign_gpus(
    deployment: DeploymentView, host: HostView, slots: list[Slot], others: list[InstanceView]
) -> Problem | None:
    """Give each slot its GPU indices (in place), or say why they do not fit."""
    per_instance = deployment.gpus_per_instance
    if not slots:
        return None
    if not host.gpus:
        # GPUs not reported yet: kept instances keep what they hold, new ones get all (`()`).
        for slot in slots:
            if per_instance is None or slot.current is None:
                slot.gpu_indices = ()
        return None
    on_host = {g.index for g in host.gpus}
    claimed = {g for i in others for g in i.gpu_indices if g in on_host}
    whole_host_others = any(not i.gpu_indices for i in others)
    free = set() if whole_host_others else on_host - claimed
    head = f"deployment {deployment.name} does not fit on host {host.name}"
    if per_instance is None:
        ranks = deployment.parallel_size
        if ranks is not None and ranks != len(on_host):
            # The engine runs one rank per GPU it is given: it would refuse to start here.
            message = (
                f"{head}: its engine config sets parallel.size {ranks}, and each instance gets "
                f"all {len(on_host)} GPUs of the host (one rank per GPU): set "
                f"--gpus-per-instance {ranks}, or parallel.size {len(on_host)}"
            )
            return Problem(deployment.id, host.id, "gpus", message)
        if not claimed:
            for slot in slots:
                slot.gpu_indices = ()
            return None
        message = (
            f"{head}: each instance asks all {len(on_host)} GPUs, {len(on_host - claimed)} "
            "are free (other deployments' instances hold the rest): set --gpus-per-instance"
        )
        return Problem(deployment.id, host.id, "gpus", message)
    asked = per_instance * len(slots)
    if asked > len(free):
        why = " (another deployment's instance uses all of them)" if whole_host_others else ""
        message = (
            f"{head}: {asked} GPU(s) asked ({len(slots)} instance(s) × {per_instance}), "
            f"{len(free)} free of {len(on_host)}{why}: lower --gpus-per-instance or the "
            "instances per host, or place it elsewhere"
        )
        return Problem(deployment.id, host.id, "gpus", message)
    taken: set[int] = set()
    reassign = []
    for slot in slots:
        held = set(slot.gpu_indices)
        if len(held) == per_instance and held <= free and not held & taken:
            taken |= held  # still valid: keeping it spares the instance a restart
        else:
            reassign.append(slot)
    spare = sorted(free - taken)
    for slot in reassign:
        slot.gpu_indices, spare = tuple(spare[:per_instance]), spare[per_instance:]
    return None


def memory_problem(
    deployment: DeploymentView, draft: HostDraft, versions: Mapping[int, VersionView]
) -> Problem | None:
    """A problem when some instance's version does not fit in the memory of its GPUs: each GPU
    runs one rank, which holds its share of the weights and of the KV reserve and the whole
    activation headroom (`MemoryPlan.rank_bytes`)."""
    memory = {g.index: g.memory_bytes for g in draft.host.gpus}
    if not memory:
        return None  # GPUs not reported yet: nothing to check against
    tokens = deployment.kv_reserve_tokens
    for slot in draft.slots:
        version = versions.get(slot.version_id)
        plan = version.memory_plan if version else None
        if version is None or plan is None:
            continue
        indices = slot.gpu_indices or tuple(memory)
        ranks = deployment.parallel_size or len(indices)
        need = plan.rank_bytes(tokens, ranks)
        have = min(memory.get(i, 0) for i in indices)
        if need > have:
            message = _memory_message(deployment, draft.host, version, tokens, ranks, need)
            gpus = f"its GPU has {gib(have)}"
            if len(indices) > 1:
                gpus = f"the smallest of its {len(indices)} GPUs has {gib(have)}"
            fix = (
                "raise --gpus-per-instance (and parallel.size) or lower max_seq_len / "
                "max_concurrent_requests"
            )
            return Problem(deployment.id, draft.host.id, "memory", f"{message}, {gpus}: {fix}")
    return None


def _memory_message(
    deployment: DeploymentView,
    host: HostView,
    version: VersionView,
    tokens: int,
    ranks: int,
    need: int,
) -> str:
    """What the instance needs on each GPU, and of what."""
    plan = version.memory_plan
    assert plan is not None
    head = f"deployment {deployment.name} does not fit on host {host.name}: {version.label}"
    kv = plan.kv_bytes_per_token * tokens
    if ranks == 1:
        return (
            f"{head} needs {gib(need)} per instance (weights {gib(plan.weights_bytes)} + "
            f"activations {gib(plan.activation_bytes)} + KV reserve {gib(kv)} for {tokens} "
            "tokens)"
        )
    weights = -(-plan.weights_bytes // ranks)
    kv_share = round(kv * plan.rank_kv_share(ranks))
    return (
        f"{head} needs {gib(need)} on each GPU, a rank's share with parallel.size {ranks} "
        f"(weights {gib(weights)} of {gib(plan.weights_bytes)} + activations "
        f"{gib(plan.activation_bytes)} + KV reserve {gib(kv_share)} of {gib(kv)} for {tokens} "
        "tokens)"
    )
