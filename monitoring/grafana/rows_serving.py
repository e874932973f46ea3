"""Rows about the engines: requests, latency, queues, and block-diffusion decoding itself."""

from __future__ import annotations

from monitoring.grafana.dashboard import Panel, Row, Target
from monitoring.grafana.promql import DEPLOYMENT, RATE, mean, percentiles, quantile, rate

EXPERT_RATE = f"rate(dllm_expert_tokens_total{{{DEPLOYMENT}}}[{RATE}])"

ENGINE = Row(
    "Engine",
    (
        Panel(
            "Finished requests",
            (
                Target(
                    rate(
                        "dllm_requests_finished_total",
                        DEPLOYMENT,
                        "deployment, version, finish_reason",
                    ),
                    "{{deployment}} {{version}} {{finish_reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Errors by reason",
            (
                Target(
                    rate("dllm_request_errors_total", DEPLOYMENT, "deployment, reason"),
                    "{{deployment}} {{reason}}",
                ),
            ),
            "Refused or failed requests; invalid_request and context_length_exceeded are the "
            "client's.",
            unit="reqps",
        ),
        Panel(
            "Request latency",
            percentiles(
                "dllm_e2e_request_latency_seconds",
                DEPLOYMENT,
                "deployment, version",
                "{{deployment}} {{version}}",
            ),
            "Admission to last token, at the engine.",
            unit="s",
        ),
        Panel(
            "Time to first token",
            percentiles(
                "dllm_time_to_first_token_seconds",
                DEPLOYMENT,
                "deployment, version",
                "{{deployment}} {{version}}",
            ),
            "Admission to the first committed block.",
            unit="s",
            threshold=10,
        ),
        Panel(
            "Queue wait",
            percentiles(
                "dllm_request_queue_seconds",
                DEPLOYMENT,
                "deployment, version",
                "{{deployment}} {{version}}",
            ),
            "Arrival to a batch slot: when this approaches the latency, add instances.",
            unit="s",
        ),
        Panel(
            "Queue depth",
            (
                Target(f"dllm_requests_waiting{{{DEPLOYMENT}}}", "waiting {{instance}}"),
                Target(f"dllm_requests_running{{{DEPLOYMENT}}}", "running {{instance}}"),
            ),
            "Waiting for a batch slot vs being decoded, per instance.",
        ),
        Panel(
            "Tokens per second",
            (
                Target(
                    rate("dllm_generated_tokens_total", DEPLOYMENT, "deployment, version"),
                    "generated {{deployment}} {{version}}",
                ),
                Target(
                    rate("dllm_prompt_tokens_total", DEPLOYMENT, "deployment, version"),
                    "prompt {{deployment}} {{version}}",
                ),
            ),
        ),
        Panel(
            "Batch size",
            (
                Target(
                    mean("dllm_batch_size", DEPLOYMENT, "deployment, instance"),
                    "mean {{instance}}",
                ),
            ),
            "Requests per engine step.",
        ),
        Panel(
            "KV cache used",
            (
                Target(
                    f"dllm_kv_cache_used_bytes{{{DEPLOYMENT}}} "
                    f"/ dllm_kv_cache_total_bytes{{{DEPLOYMENT}}}",
                    "{{instance}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Served snapshot",
            (
                Target(
                    "count by (deployment, version, snapshot_digest) "
                    f"(dllm_model_info{{{DEPLOYMENT}}})",
                    "{{deployment}} {{version}} {{snapshot_digest}}",
                ),
            ),
            "Instances per snapshot digest: two digests under one version is a bad copy.",
            kind="stat",
        ),
    ),
)

DIFFUSION = Row(
    "Diffusion",
    (
        Panel(
            "Denoising steps per block",
            (
                Target(
                    "sum by (le) "
                    f"(increase(dllm_denoising_steps_per_block_bucket{{{DEPLOYMENT}}}[{RATE}]))",
                    "{{le}}",
                    format="heatmap",
                ),
            ),
            "How many denoising steps each committed block took.",
            kind="heatmap",
        ),
        Panel(
            "Mean steps per block",
            (
                Target(
                    mean("dllm_denoising_steps_per_block", DEPLOYMENT, "deployment, version"),
                    "{{deployment}} {{version}}",
                ),
            ),
        ),
        Panel(
            "Tokens per forward",
            (
                Target(
                    mean("dllm_tokens_per_forward", DEPLOYMENT, "deployment, version"),
                    "{{deployment}} {{version}}",
                ),
                Target(
                    mean("dllm_tokens_per_forward", DEPLOYMENT, "deployment, version", "1h"),
                    "an hour ago {{deployment}} {{version}}",
                ),
            ),
            "Generated tokens per forward; alert when under 70% of an hour ago.",
        ),
        Panel(
            "Denoising step time",
            (
                Target(
                    quantile(0.5, "dllm_denoise_step_seconds", DEPLOYMENT, "instance, block_size"),
                    "p50 {{instance}} block {{block_size}}",
                ),
                Target(
                    quantile(0.99, "dllm_denoise_step_seconds", DEPLOYMENT, "instance, block_size"),
                    "p99 {{instance}} block {{block_size}}",
                ),
            ),
            "Duration of one denoising forward, per instance and block size.",
            unit="s",
        ),
        Panel(
            "Denoising step jitter (p99 / p50)",
            (
                Target(
                    quantile(0.99, "dllm_denoise_step_seconds", DEPLOYMENT, "instance, block_size")
                    + "\n/ "
                    + quantile(
                        0.5, "dllm_denoise_step_seconds", DEPLOYMENT, "instance, block_size"
                    ),
                    "{{instance}} block {{block_size}}",
                ),
            ),
            "One instance far above its peers suggests a GPU fault.",
        ),
        Panel(
            "Expert load skew (max / mean)",
            (
                Target(
                    f"max by (instance, layer) ({EXPERT_RATE})\n"
                    f"/ avg by (instance, layer) ({EXPERT_RATE})",
                    "{{instance}} layer {{layer}}",
                ),
            ),
            "Tokens routed to the busiest expert over the mean, per MoE layer; 1 is even.",
        ),
    ),
)
