"""The rendezvous of a parallel engine's ranks, as the agent gives it at each launch.

An instance with `parallel.size` N > 1 is still one engine process to the agent: rank 0, which
starts ranks 1..N-1 itself, all of them in its process group (`agent.engine_process` signals
and kills that group as one). The ranks meet on `torch.distributed`'s env:// rendezvous, on a
port of this host's loopback that the agent picks free at every launch, so a restart never
waits for the port of the ranks it just killed.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any

from agent.instance_spec import InstanceSpec

RENDEZVOUS_ADDRESS = "127.0.0.1"
# torch.distributed's launch variables: an engine's come from its agent alone, never from the
# environment the agent itself was started in.
DISTRIBUTED_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
)


def free_local_port() -> int:
    """A TCP port of the loopback that is free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((RENDEZVOUS_ADDRESS, 0))
        return int(sock.getsockname()[1])


def may_run_ranks(spec: InstanceSpec, config: Mapping[str, Any]) -> bool:
    """Whether the engine of SPEC, with its engine CONFIG, may start more than one rank.

    `parallel.size` decides when set; left out, the engine runs one rank per GPU it sees
    (`gpu_indices`, or all of the host's for `()`) and one on a CPU.
    """
    parallel = config.get("parallel") or {}
    size = parallel.get("size")
    if size is not None:
        return int(size) > 1
    resources = config.get("resources") or {}
    if resources.get("device", spec.device) == "cpu":
        return False
    return len(spec.gpu_indices) != 1


def rendezvous_env(
    spec: InstanceSpec, config: Mapping[str, Any], pick_port: Callable[[], int]
) -> dict[str, str]:
    """`MASTER_ADDR` / `MASTER_PORT` for an engine that may run several ranks (a port from
    PICK_PORT, picked now); nothing for one that runs one."""
    if not may_run_ranks(spec, config):
        return {}
    return {"MASTER_ADDR": RENDEZVOUS_ADDRESS, "MASTER_PORT": str(pick_port())}
