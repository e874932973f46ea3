"""Prometheus metrics of one engine server (prefix `dllm_`), on a registry of its own.

Names follow Prometheus conventions: base units in the name (`_seconds`, `_bytes`), counters
exposed with `_total`, only bounded label values (finish reasons, error reasons, layer/expert
indices of the loaded model).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
TOKENS_PER_FORWARD_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# One denoising forward, 1 ms to 10 s: fine steps at the fast end, where a healthy GPU's
# forwards sit and where jitter (a hardware suspicion) first shows.
DENOISE_STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
                        0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)  # fmt: skip

# Reasons a request is refused or fails; the label value set is closed.
ERROR_REASONS = (
    "invalid_request",
    "context_length_exceeded",
    "model_not_found",
    "unauthorized",
    "queue_full",
    "not_ready",
    "timeout",
    "engine_error",
    "chaos_injected",  # a fault the engine config's `chaos` section asked for
)


class ExpertTokenCollector(Collector):
    """Exports the model's cumulative expert routing counts, refreshed by the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: list[list[int]] = []

    def update(self, counts: Sequence[Sequence[int]]) -> None:
        """Replace the snapshot: counts[layer][expert], cumulative since start-up."""
        with self._lock:
            self._counts = [list(row) for row in counts]

    def collect(self) -> Iterable[Metric]:
        """One sample per (MoE layer, expert)."""
        family = CounterMetricFamily(
            "dllm_expert_tokens",
            "Tokens routed to each expert, by layer and expert.",
            labels=["layer", "expert"],
        )
        with self._lock:
            rows = list(self._counts)
        for layer, row in enumerate(rows):
            if not any(row):
                continue  # dense layer: no router, no samples
            for expert, count in enumerate(row):
                family.add_metric([str(layer), str(expert)], count)
        yield family


class EngineMetrics:
    """Every `dllm_` metric of one server, registered on a fresh `CollectorRegistry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "dllm_requests_running", "Requests being decoded now.", registry=r
        )
        self.requests_waiting = Gauge(
            "dllm_requests_waiting", "Requests admitted but waiting for a batch slot.", registry=r
        )
        self.max_queue = Gauge(
            "dllm_max_queue",
            "Requests allowed to wait for a batch slot (service.max_queue); more are refused "
            "with 429.",
            registry=r,
        )
        self.e2e_latency = Histogram(
            "dllm_e2e_request_latency_seconds",
            "Time from admission to the last token of a finished request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "dllm_request_queue_seconds",
            "Time a finished request waited for a batch slot (queue wait; the rest of its "
            "latency is compute).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "dllm_time_to_first_token_seconds",
            "Time from admission to the first committed block.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dllm_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generated_tokens = Counter(
            "dllm_generated_tokens", "Tokens generated for finished requests.", registry=r
        )
        self.requests_finished = Counter(
            "dllm_requests_finished",
            "Finished requests by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=r,
        )
        self.steps_per_block = Histogram(
            "dllm_denoising_steps_per_block",
            "Denoising steps each committed block took.",
            buckets=STEPS_BUCKETS,
            registry=r,
        )
        self.tokens_per_forward = Histogram(
            "dllm_tokens_per_forward",
            "Generated tokens per forward pass, per finished request.",
            buckets=TOKENS_PER_FORWARD_BUCKETS,
            registry=r,
        )
        self.denoise_step = Histogram(
            "dllm_denoise_step_seconds",
            "Duration of one denoising forward (all requests of one block size), by block size.",
            ["block_size"],
            buckets=DENOISE_STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "dllm_batch_size", "Requests in each engine step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.kv_cache_used = Gauge(
            "dllm_kv_cache_used_bytes", "KV cache bytes holding committed tokens.", registry=r
        )
        self.kv_cache_total = Gauge(
            "dllm_kv_cache_total_bytes", "KV cache bytes allocated.", registry=r
        )
        self.errors = Counter(
            "dllm_request_errors", "Refused or failed requests by reason.", ["reason"], registry=r
        )
        for reason in ERROR_REASONS:
            self.errors.labels(reason=reason)  # export zeros, so rate() works from the start
        # No label: the field names come from clients, so they go to the log, not to a label.
        self.unknown_fields = Counter(
            "dllm_request_unknown_fields",
            "Request fields this API does not know, dropped under service.unknown_fields: "
            "ignore (one per field per request).",
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(finish_reason=reason)
        self.model_info = Info("dllm_model", "The model this server serves.", registry=r)
        # Rank 0 exports the instance's figures once; the other ranks export nothing.
        self.parallel_ranks = Gauge(
            "dllm_parallel_ranks",
            "Processes (torch.distributed ranks) the served model is split over; 1: one process.",
            registry=r,
        )
        self.expert_tokens = ExpertTokenCollector()
        r.register(self.expert_tokens)

    def set_model_info(self, name: str, snapshot_digest: str | None, **extra: str) -> None:
        """Fill `dllm_model_info{model=..., snapshot_digest=...} 1`."""
        self.model_info.info({"model": name, "snapshot_digest": snapshot_digest or "", **extra})

    def record_error(self, reason: str) -> None:
        """Count one refused or failed request."""
        self.errors.labels(reason=reason if reason in ERROR_REASONS else "engine_error").inc()
