"""What the planner decides: changes to instances, and where a deployment does not fit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from controlplane.planner.views import InstanceView


@dataclass(frozen=True)
class Create:
    """A new instance."""

    deployment_id: int
    host_id: int
    ordinal: int
    version_id: int
    port: int
    gpu_indices: tuple[int, ...]
    desired_state: str
    standby: bool = False


@dataclass(frozen=True)
class Delete:
    """An instance to remove (its agent stops it)."""

    instance_id: int
    host_id: int


@dataclass(frozen=True)
class UpdateVersion:
    """An instance to restart on another version."""

    instance_id: int
    host_id: int
    version_id: int


@dataclass(frozen=True)
class UpdateGpus:
    """An instance to restart on other GPUs."""

    instance_id: int
    host_id: int
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class UpdateDesiredState:
    """An instance to stop (its host drains) or to run again."""

    instance_id: int
    host_id: int
    desired_state: str


@dataclass(frozen=True)
class UpdateStandby:
    """An instance to move into the gateway's pools (promoted) or out of them (standby)."""

    instance_id: int
    host_id: int
    standby: bool


Change = Create | Delete | UpdateVersion | UpdateGpus | UpdateDesiredState | UpdateStandby


@dataclass(frozen=True)
class Problem:
    """Why a deployment does not fit on a host; the message says what to change."""

    deployment_id: int
    # None: not one host's problem (the deployment's hosts together have too little room).
    host_id: int | None
    kind: Literal["ports", "gpus", "memory", "capacity"]
    message: str


@dataclass
class Plan:
    """The changes that bring the store to the desired state, and where that cannot be done."""

    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def host_ids(self) -> set[int]:
        """Hosts whose desired state changes (a standby flag is the control plane's alone)."""
        return {c.host_id for c in self.changes if not isinstance(c, UpdateStandby)}


def apply_changes(
    instances: Sequence[InstanceView], changes: Iterable[Change], first_new_id: int | None = None
) -> list[InstanceView]:
    """The instances after `changes`.

    Created ones have no id yet: they get ids counting down from `first_new_id` (by default
    from just below every id given).
    """
    by_id = {i.id: i for i in instances}
    next_id = min([0, *by_id]) - 1 if first_new_id is None else first_new_id
    for change in changes:
        if isinstance(change, Create):
            by_id[next_id] = InstanceView(
                id=next_id,
                deployment_id=change.deployment_id,
                host_id=change.host_id,
                ordinal=change.ordinal,
                port=change.port,
                version_id=change.version_id,
                gpu_indices=change.gpu_indices,
                desired_state=change.desired_state,
                standby=change.standby,
            )
            next_id -= 1
        elif isinstance(change, Delete):
            del by_id[change.instance_id]
        else:
            by_id[change.instance_id] = updated(by_id[change.instance_id], change)
    return list(by_id.values())


_T = TypeVar("_T", InstanceView, Create)


def updated(
    target: _T, change: UpdateVersion | UpdateGpus | UpdateDesiredState | UpdateStandby
) -> _T:
    """`target` (a stored or a planned instance) with one field changed."""
    if isinstance(change, UpdateStandby):
        return replace(target, standby=change.standby)
    if isinstance(change, UpdateVersion):
        return replace(target, version_id=change.version_id)
    if isinstance(change, UpdateGpus):
        return replace(target, gpu_indices=change.gpu_indices)
    return replace(target, desired_state=change.desired_state)
