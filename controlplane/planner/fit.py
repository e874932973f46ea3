"""One host: the instances a deployment will have there, with ports, GPUs and memory checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from controlplane.planner.changes import Problem
from controlplane.planner.views import DeploymentView, HostView, InstanceView, VersionView
from protocol.engine_config import DeploymentEngineConfig


def kv_reserve_tokens(engine_config: Mapping[str, Any]) -> int:
    """KV-cache tokens to reserve per instance: max_seq_len × max_concurrent_requests.

    Keys the config leaves out take the engine's defaults (4096 × 32); a config stored before
    validation existed that no longer validates counts as all defaults.
    """
    try:
        config = DeploymentEngineConfig.model_validate(engine_config)
    except ValidationError:
        config = DeploymentEngineConfig()
    return config.model.max_seq_len * config.service.max_concurrent_requests


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
    """A problem when some instance's version does not fit in the memory of its GPUs."""
    memory = {g.index: g.memory_bytes for g in draft.host.gpus}
    if not memory:
        return None  # GPUs not reported yet: nothing to check against
    tokens = deployment.kv_reserve_tokens
    for slot in draft.slots:
        version = versions.get(slot.version_id)
        plan = version.memory_plan if version else None
        if version is None or plan is None:
            continue
        need = plan.required_bytes(tokens)
        indices = slot.gpu_indices or tuple(memory)
        have = sum(memory.get(i, 0) for i in indices)
        if need > have:
            message = (
                f"deployment {deployment.name} does not fit on host {draft.host.name}: "
                f"{version.label} needs {gib(need)} per instance (weights "
                f"{gib(plan.weights_bytes)} + activations {gib(plan.activation_bytes)} + KV "
                f"reserve {gib(plan.kv_bytes_per_token * tokens)} for {tokens} tokens), its "
                f"{len(indices)} GPU(s) have {gib(have)}: raise --gpus-per-instance or lower "
                "max_seq_len / max_concurrent_requests"
            )
            return Problem(deployment.id, draft.host.id, "memory", message)
    return None
