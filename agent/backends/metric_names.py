"""Other engines' Prometheus series under the dctl engine's names, for the heartbeat.

The control plane, the doctor and the TUI read the dctl engine's series (`dllm_requests_running`,
`dllm_time_to_first_token_seconds`, ...). vLLM (`vllm:*`), SGLang (`sglang:*`) and llama.cpp's
server (`llamacpp:*`) export the same figures under their own names and with their own labels
(model name, engine index): each is renamed here, its labels dropped but the finish reason, and
label sets that differ only in dropped labels are added up (two vLLM engine cores make one
instance). Their other series stay on their own `/metrics` for Prometheus and are left out of
the heartbeat. The diffusion figures (steps per block, tokens per forward) have no counterpart,
so for these engines they are absent, never zero.
"""

from __future__ import annotations

# Family names as `prometheus_client`'s parser gives them (a counter without `_total`) ->
# (the dctl engine's family, labels kept: theirs -> ours).
FOREIGN_SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "vllm:num_requests_running": ("dllm_requests_running", {}),
    "vllm:num_requests_waiting": ("dllm_requests_waiting", {}),
    "vllm:time_to_first_token_seconds": ("dllm_time_to_first_token_seconds", {}),
    "vllm:e2e_request_latency_seconds": ("dllm_e2e_request_latency_seconds", {}),
    "vllm:request_queue_time_seconds": ("dllm_request_queue_seconds", {}),
    "vllm:prompt_tokens": ("dllm_prompt_tokens", {}),
    "vllm:generation_tokens": ("dllm_generated_tokens", {}),
    "vllm:request_success": ("dllm_requests_finished", {"finished_reason": "finish_reason"}),
    "sglang:num_running_reqs": ("dllm_requests_running", {}),
    "sglang:num_queue_reqs": ("dllm_requests_waiting", {}),
    "sglang:time_to_first_token_seconds": ("dllm_time_to_first_token_seconds", {}),
    "sglang:e2e_request_latency_seconds": ("dllm_e2e_request_latency_seconds", {}),
    "sglang:queue_time_seconds": ("dllm_request_queue_seconds", {}),
    "sglang:prompt_tokens": ("dllm_prompt_tokens", {}),
    "sglang:generation_tokens": ("dllm_generated_tokens", {}),
    "llamacpp:requests_processing": ("dllm_requests_running", {}),
    "llamacpp:requests_deferred": ("dllm_requests_waiting", {}),
    "llamacpp:prompt_tokens": ("dllm_prompt_tokens", {}),
    "llamacpp:tokens_predicted": ("dllm_generated_tokens", {}),
}
FOREIGN_PREFIXES = ("vllm:", "sglang:", "llamacpp:")
# What the heartbeat carries for a backend, by the dctl family: the doctor and the README say
# which of these each kind lacks.
DIFFUSION_FAMILIES = ("dllm_denoising_steps_per_block", "dllm_tokens_per_forward")


def is_foreign(family: str) -> bool:
    """Whether FAMILY is another engine's series (renamed or left out)."""
    return family.startswith(FOREIGN_PREFIXES)


def renamed(
    family: str, sample: str, labels: dict[str, str]
) -> tuple[str, str, dict[str, str]] | None:
    """(family, sample name, labels) under the dctl engine's names; None for a foreign series
    the heartbeat leaves out. A series of the dctl engine (or any other) comes back unchanged."""
    if not is_foreign(family):
        return family, sample, labels
    target = FOREIGN_SERIES.get(family)
    if target is None:
        return None
    name, kept = target
    ours = {kept[k]: v for k, v in labels.items() if k in kept}
    if "le" in labels:
        ours["le"] = labels["le"]
    return name, name + sample[len(family) :], ours
