"""A whole-deployment count (`DeploymentView.total`) spread over its hosts, where there is room.

Instances stay where they are (moving one is a restart); new ones go to the host with the fewest
of the deployment's instances among those with room left (ties: the lower host id), so they
spread evenly for as long as the GPUs allow; fewer come off the host with the most (ties: the
higher id). Room on a host is what its free GPUs hold at `gpus_per_instance` each (instances on
all of a host's GPUs share it only with each other) and its free ports; a host that has not
reported its GPUs yet is counted by its ports only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controlplane.planner.changes import Problem
from controlplane.planner.views import DeploymentView, HostView, InstanceView


@dataclass(frozen=True)
class Spread:
    """How many instances each host gets, and a problem when they do not all fit."""

    wanted: dict[int, int]
    problem: Problem | None = None


def spread(
    deployment: DeploymentView,
    total: int,
    hosts: Sequence[HostView],
    own: Mapping[int, Sequence[InstanceView]],
    others: Mapping[int, Sequence[InstanceView]],
) -> Spread:
    """TOTAL instances over HOSTS (the deployment's targets, draining ones left out)."""
    room = {h.id: _room(deployment, h, others.get(h.id, ())) for h in hosts}
    wanted = {h.id: min(len(own.get(h.id, ())), room[h.id]) for h in hosts}
    while sum(wanted.values()) > total:
        fullest = max(wanted, key=lambda hid: (wanted[hid], hid))
        wanted[fullest] -= 1
    while sum(wanted.values()) < total:
        open_hosts = [hid for hid in wanted if wanted[hid] < room[hid]]
        if not open_hosts:
            break
        emptiest = min(open_hosts, key=lambda hid: (wanted[hid], hid))
        wanted[emptiest] += 1
    placed = sum(wanted.values())
    if placed >= total:
        return Spread(wanted)
    per = deployment.gpus_per_instance
    unit = f"{per} GPU(s) each" if per else "all GPUs of a host each"
    where = ", ".join(h.name for h in hosts) or "none (all draining or none selected)"
    message = (
        f"deployment {deployment.name} wants {total} instance(s) ({unit}); its hosts ({where}) "
        f"have room for {placed}: free GPUs, widen the placement or lower the autoscaler's max"
    )
    return Spread(wanted, Problem(deployment.id, None, "capacity", message))


# A host that reports no GPUs yet is limited by its ports alone.
def _room(deployment: DeploymentView, host: HostView, others: Sequence[InstanceView]) -> int:
    """Instances of the deployment the host can hold beside OTHERS (other deployments' and the
    deployment's own retiring ones)."""
    first, last = host.port_range
    ports = (last - first + 1) - len({i.port for i in others})
    if not host.gpus:
        return max(ports, 0)
    on_host = {g.index for g in host.gpus}
    per = deployment.gpus_per_instance
    if any(not i.gpu_indices for i in others):
        return 0  # another instance holds all of the host's GPUs
    claimed = {g for i in others for g in i.gpu_indices if g in on_host}
    if per is None:
        return max(ports, 0) if not claimed else 0
    return max(min(len(on_host - claimed) // per, ports), 0)
