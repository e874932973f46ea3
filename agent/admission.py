"""Whether the agent can apply a desired instance: the checks it passes before anything runs.

A desired state arrives over the network. Whatever one instance of it holds, the worst it may do
is get that instance refused (reported `failed`, with the reason); it must never stop the agent
or touch the other instances. Pure: data in, decision out.
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import ValidationError

from agent.gpu import GpuSnapshot
from agent.instance_spec import deployment_settings
from agent.preflight import memory_check
from protocol.engine_config import DeploymentEngineConfig, ServeConfigError
from protocol.wire import INT32_MAX, DesiredInstance


def reportable(instance_id: int) -> bool:
    """True when a heartbeat can carry an instance with this id (else it can only be logged)."""
    return 1 <= instance_id <= INT32_MAX


def refusal(desired: DesiredInstance, host_gpus: Collection[int] | None) -> str | None:
    """Why DESIRED cannot run on this host, or None when it can.

    HOST_GPUS are the indices this host has (None: not known, so not checked).
    """
    try:
        deployment_settings(desired.engine_config)
    except ServeConfigError as exc:
        return f"engine config refused: {exc}"
    indices = desired.gpu_indices
    if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
        return f"gpu_indices {indices} refused: each must be a GPU index, once"
    if host_gpus is not None:
        missing = sorted(set(indices) - set(host_gpus))
        if missing:
            return (
                f"gpu_indices {indices} refused: this host has no GPU {missing} "
                f"(it has {sorted(host_gpus)})"
            )
    return None


def memory_shortfall(desired: DesiredInstance, sample: GpuSnapshot | None) -> str | None:
    """Why DESIRED (not running yet) cannot fit its GPUs' free memory, or None when it fits.

    Without a memory plan or a GPU sample there is nothing to check.
    """
    plan = desired.model.memory_plan
    if plan is None or sample is None:
        return None
    kv_tokens = plan.max_context_tokens or 4096
    try:  # one rank per GPU unless the config says how many (`refusal` already checked it)
        ranks = DeploymentEngineConfig.model_validate(desired.engine_config).gpu_ranks
    except ValidationError:
        ranks = None
    check = memory_check(sample, plan, kv_tokens, tuple(desired.gpu_indices), ranks)
    return f"not started: {check.reason}" if check.status == "fail" else None
