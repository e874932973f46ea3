"""What the planner reads: hosts, deployments, instances, versions, the active rollout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from protocol.wire import DesiredInstanceState, MemoryPlan

RUNNING = DesiredInstanceState.RUNNING.value
STOPPED = DesiredInstanceState.STOPPED.value


@dataclass(frozen=True)
class GpuView:
    """One GPU of a host: its index and memory."""

    index: int
    memory_bytes: int


@dataclass(frozen=True)
class HostView:
    """A host as placement sees it."""

    id: int
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False
    gpus: tuple[GpuView, ...] = ()  # empty: the host has not reported its GPUs yet
    port_range: tuple[int, int] = (18000, 18099)


@dataclass(frozen=True)
class DeploymentView:
    """What a deployment asks for."""

    id: int
    name: str
    stable_version_id: int
    placement_hosts: frozenset[str] = frozenset()
    placement_labels: Mapping[str, str] = field(default_factory=dict)
    instances_per_host: int = 1
    gpus_per_instance: int | None = None
    kv_reserve_tokens: int = 0
    # `parallel.size` of its engine config where the ranks run on GPUs, one each (`gpu_ranks`);
    # None: one rank per GPU an instance gets.
    parallel_size: int | None = None
    # Instances a rolling restart holds stopped until their agent reports them stopped.
    held_stopped: frozenset[int] = frozenset()
    # A count for the whole deployment instead of `instances_per_host` on each host (autoscaled,
    # or fixed when autoscaling was turned off): `total` instances, `standby` of them out of
    # the pools. None: per host.
    total: int | None = None
    standby: int = 0
    # Scaled down: out of the pools, still holding their ports and GPUs until they stop.
    retiring: frozenset[int] = frozenset()
    # Scaled down and drained: to be deleted (their agent stops them).
    retired: frozenset[int] = frozenset()

    def selects(self, host: HostView) -> bool:
        """True when the placement names this host or the host carries all its labels."""
        labels = self.placement_labels
        by_labels = bool(labels) and all(host.labels.get(k) == v for k, v in labels.items())
        return host.name in self.placement_hosts or by_labels


@dataclass(frozen=True)
class InstanceView:
    """An instance as stored (any deployment's: other deployments' hold ports and GPUs)."""

    id: int
    deployment_id: int
    host_id: int
    ordinal: int
    port: int
    version_id: int
    gpu_indices: tuple[int, ...] = ()
    desired_state: str = RUNNING
    standby: bool = False


@dataclass(frozen=True)
class VersionView:
    """A model version: how to name it in a message and the memory it needs (if known)."""

    label: str
    memory_plan: MemoryPlan | None = None


@dataclass(frozen=True)
class RolloutView:
    """The part of an active rollout the planner needs: which version, on how many instances,
    and how many of those may be extra instances (surge) rather than taken from stable."""

    canary_version_id: int
    canary_instances: int
    surge: int = 0

    def extra(self) -> int:
        """Instances beyond the deployment's own: surge ones, while the canary needs them."""
        return max(0, min(self.surge, self.canary_instances))
