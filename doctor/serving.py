"""Serving: queue overflow (429) and timeouts (504), queues at their limit, slow generation and
where the time goes, GPUs idle while queues grow, and fault injection left on."""

from __future__ import annotations

from doctor.findings import (
    Finding,
    FleetSnapshot,
    Points,
    configured,
    histogram_mean,
    label,
    matching,
    total,
)
from protocol.rest import DeploymentOut

ERRORS = "dllm_request_errors_total"
FINISHED = "dllm_requests_finished_total"
WAITING = "dllm_requests_waiting"
RUNNING = "dllm_requests_running"
# Share of a deployment's requests refused with 429 (engine queue full) or timed out (504):
# a few in a hundred is a user-visible outage for them; one in a hundred is worth a look.
REFUSED_WARN, REFUSED_ERROR = 0.01, 0.05
# A queue this full (of `service.max_queue`) refuses the next burst.
QUEUE_NEAR_LIMIT = 0.9
# Tokens per forward below this mean the block is decoded nearly one token per step: the
# parallel-decoding win of a diffusion model is gone (AR models sit at 1.0).
TOKENS_PER_FORWARD_LOW = 1.5
# More than half the block's positions as steps: the confidence threshold rarely lets several
# tokens through at once.
STEPS_PER_BLOCK_HIGH_SHARE = 0.5
# Requests waiting at least as many as running (and not a handful): time in the queue is
# most of a request's latency, so more compute per request would not help.
QUEUE_DOMINATES_RATIO, QUEUE_DOMINATES_MIN = 1.0, 4
# A GPU below this utilisation while requests pile up is not the bottleneck: admission is.
GPU_IDLE_PERCENT = 30.0


def _errors(series: dict[str, Points], reason: str) -> float:
    return sum(total(p) for k, p in matching(series, ERRORS) if label(k, "reason") == reason)


def _all_errors(series: dict[str, Points]) -> float:
    return sum(total(p) for _, p in matching(series, ERRORS))


def _requests(series: dict[str, Points]) -> float:
    return sum(total(p) for _, p in matching(series, FINISHED)) + _all_errors(series)


def _deployment_series(snap: FleetSnapshot, dep: DeploymentOut) -> list[dict[str, Points]]:
    hosts = {h.name for h in snap.hosts}
    return [snap.instance_series.get(i.id, {}) for i in dep.instances if i.host in hosts]


def overflow_and_timeouts(snap: FleetSnapshot) -> list[Finding]:
    """429 (queue full) and 504 (timeout) shares of a deployment's requests."""
    found = []
    for dep in snap.deployments:
        per_instance = _deployment_series(snap, dep)
        requests = sum(_requests(s) for s in per_instance)
        full = sum(_errors(s, "queue_full") for s in per_instance)
        timeouts = sum(_errors(s, "timeout") for s in per_instance)
        traffic = snap.traffic.get(dep.name)
        gw_requests = sum(v.requests for v in traffic.versions) if traffic else 0
        gw_timeouts = sum(v.errors_timeout for v in traffic.versions) if traffic else 0
        max_queue = int(configured(dep, "service", "max_queue"))
        slots = int(configured(dep, "service", "max_concurrent_requests"))
        timeout_s = float(configured(dep, "service", "request_timeout_s"))
        if requests and full / requests >= REFUSED_WARN:
            share = full / requests
            found.append(
                Finding(
                    rule="serving.queue_overflow",
                    severity="error" if share >= REFUSED_ERROR else "warning",
                    subject=f"deployment/{dep.name}",
                    summary=f"{share:.0%} of requests refused with 429 (engine queue full)",
                    evidence={
                        "rejected_429": int(full),
                        "requests": int(requests),
                        "share": round(share, 3),
                        "max_queue": max_queue,
                        "max_concurrent_requests": slots,
                    },
                    fix=f"add instances (`dctl deploy scale {dep.name} "
                    f"{dep.instances_per_host + 1}`), raise service.max_queue to "
                    f"{max(2 * max_queue, 8)} or service.max_concurrent_requests to {2 * slots} "
                    f"(`dctl deploy configure {dep.name} --engine-config FILE`) if memory allows; "
                    "size the queue from a load test: too short refuses, too long makes waits",
                )
            )
        worst = max(
            (timeouts / requests if requests else 0.0, int(timeouts), int(requests), "engine"),
            (
                gw_timeouts / gw_requests if gw_requests else 0.0,
                gw_timeouts,
                gw_requests,
                "gateway",
            ),
        )
        share, count, total_requests, where = worst
        if share >= REFUSED_WARN:
            found.append(
                Finding(
                    rule="serving.timeouts",
                    severity="error" if share >= REFUSED_ERROR else "warning",
                    subject=f"deployment/{dep.name}",
                    summary=f"{share:.0%} of requests timed out (504, seen by the {where})",
                    evidence={
                        "timeouts_504": count,
                        "requests": total_requests,
                        "share": round(share, 3),
                        "request_timeout_s": timeout_s,
                    },
                    fix=f"add instances (`dctl deploy scale {dep.name} "
                    f"{dep.instances_per_host + 1}`) or lower the load; if long outputs are "
                    f"expected, raise service.request_timeout_s (now {timeout_s:.0f} s) and the "
                    "clients' timeouts with it",
                )
            )
    return found


def queue_at_limit(snap: FleetSnapshot) -> list[Finding]:
    """An instance's waiting queue reached `service.max_queue` (or nearly) in the window."""
    found = []
    for dep, inst in snap.instances():
        waiting = snap.instance_series.get(inst.id, {}).get(WAITING, [])
        max_queue = int(configured(dep, "service", "max_queue"))
        peak = max((v for _, v in waiting), default=0.0)
        if not waiting or peak < max(QUEUE_NEAR_LIMIT * max_queue, 1):
            continue
        found.append(
            Finding(
                rule="serving.queue_full",
                severity="warning",
                subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                summary=f"queue depth reached {peak:.0f} of service.max_queue {max_queue}",
                evidence={"queue_depth_peak": int(peak), "max_queue": max_queue},
                fix=f"add instances (`dctl deploy scale {dep.name} {dep.instances_per_host + 1}`) "
                f"or raise service.max_queue / service.max_concurrent_requests",
            )
        )
    return found


def slow_generation(snap: FleetSnapshot) -> list[Finding]:
    """Diffusion decoding that gains little per forward, for the threshold or steps in use."""
    found = []
    for dep in snap.deployments:
        merged: dict[str, Points] = {}
        for series in _deployment_series(snap, dep):
            for name, points in series.items():
                merged.setdefault(name, []).extend(points)
        tpf = histogram_mean(merged, "dllm_tokens_per_forward")
        steps = histogram_mean(merged, "dllm_denoising_steps_per_block")
        block = configured(dep, "model", "block_size") or 32
        mode_steps = configured(dep, "model", "steps")
        threshold = float(configured(dep, "model", "threshold"))
        low_tpf = tpf is not None and tpf < TOKENS_PER_FORWARD_LOW
        many_steps = steps is not None and steps > STEPS_PER_BLOCK_HIGH_SHARE * block
        if not (low_tpf or many_steps):
            continue
        # The seeds: lower the steps gradually and watch quality; `dctl tune` measures both.
        if mode_steps is not None:
            fix = f"lower model.steps (now {mode_steps}; e.g. {max(1, int(mode_steps) // 2)})"
        else:
            fix = (
                f"lower model.threshold (now {threshold}; e.g. {round(threshold - 0.1, 2)}) or "
                f"cap model.max_steps at {max(1, int(block) // 4)}"
            )
        fix += (
            f", step by step, checking quality (`dctl tune --deployment {dep.name}` measures both)"
        )
        evidence: dict[str, float | int | str] = {"threshold": threshold, "block_size": int(block)}
        if tpf is not None:
            evidence["tokens_per_forward"] = round(tpf, 2)
        if steps is not None:
            evidence["steps_per_block"] = round(steps, 1)
        found.append(
            Finding(
                rule="slow.decoding",
                severity="warning",
                subject=f"deployment/{dep.name}",
                summary="slow generation: few tokens per forward / many denoising steps per block",
                evidence=evidence,
                # A decoding change is canaried like a release: tune --apply starts the rollout.
                fix=fix
                + f"; canary the change with `dctl tune --deployment {dep.name} ... --apply`"
                f" or `dctl rollout {dep.name} --engine-config FILE --canary 10%`",
            )
        )
    return found


def queue_vs_compute(snap: FleetSnapshot) -> list[Finding]:
    """Where latency goes: waiting for a slot (queue), or decoding (compute) with idle GPUs."""
    found = []
    for dep, inst in snap.instances():
        series = snap.instance_series.get(inst.id, {})
        waiting = series.get(WAITING, [])
        running = series.get(RUNNING, [])
        if not waiting:
            continue
        last_wait, last_run = waiting[-1][1], (running[-1][1] if running else 0.0)
        growing = len(waiting) >= 2 and waiting[-1][1] > waiting[0][1]
        util = _gpu_util(snap, inst.host, inst.gpu_indices)
        slots = int(configured(dep, "service", "max_concurrent_requests"))
        if growing and util is not None and util < GPU_IDLE_PERCENT and last_wait > 0:
            found.append(
                Finding(
                    rule="slow.gpu_idle_queue_growing",
                    severity="warning",
                    subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                    summary=f"GPU utilisation {util:.0f}% while the queue grew "
                    f"{waiting[0][1]:.0f} -> {last_wait:.0f}",
                    evidence={
                        "gpu_utilization_percent": round(util, 1),
                        "queue_first": int(waiting[0][1]),
                        "queue_last": int(last_wait),
                        "max_concurrent_requests": slots,
                    },
                    fix=f"raise service.max_concurrent_requests (now {slots}) so more requests "
                    "decode together; check that the engine runs on the GPU (resources.device)",
                )
            )
        elif last_wait >= QUEUE_DOMINATES_MIN and last_wait >= QUEUE_DOMINATES_RATIO * max(
            last_run, 1
        ):
            found.append(
                Finding(
                    rule="slow.queue_wait",
                    severity="info",
                    subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                    summary="queue wait dominates latency: more requests wait than decode",
                    evidence={"waiting": int(last_wait), "running": int(last_run)},
                    fix=f"add instances (`dctl deploy scale {dep.name} "
                    f"{dep.instances_per_host + 1}`); faster decoding alone will not help",
                )
            )
    return found


def _gpu_util(snap: FleetSnapshot, host_name: str, indices: list[int]) -> float | None:
    host = snap.host(host_name)
    if host is None:
        return None
    values = [
        g.utilization_percent
        for g in host.gpus
        if (not indices or g.index in indices) and g.utilization_percent is not None
    ]
    return sum(values) / len(values) if values else None


def chaos_left_on(snap: FleetSnapshot) -> list[Finding]:
    """Fault injection (`chaos`) in a deployment's engine config: every request pays for it."""
    found = []
    for dep in snap.deployments:
        latency_ms = int(configured(dep, "chaos", "extra_latency_ms") or 0)
        error_rate = float(configured(dep, "chaos", "error_rate") or 0.0)
        if not latency_ms and not error_rate:
            continue
        evidence: dict[str, float | int | str] = {
            "extra_latency_ms": latency_ms,
            "error_rate": error_rate,
        }
        traffic = snap.traffic.get(dep.name)
        p95 = max((v.latency_p95_s or 0.0 for v in traffic.versions), default=0.0) if traffic else 0
        if p95:
            evidence["gateway_latency_p95_s"] = round(p95, 3)
        found.append(
            Finding(
                rule="serving.chaos",
                severity="warning",
                subject=f"deployment/{dep.name}",
                summary="fault injection is on: "
                + ", ".join(
                    part
                    for part in (
                        f"+{latency_ms} ms on every request" if latency_ms else "",
                        f"{error_rate:.0%} of requests fail" if error_rate else "",
                    )
                    if part
                ),
                evidence=evidence,
                fix="remove the `chaos` section from the engine config when the game day is over "
                f"(`dctl deploy configure {dep.name} --engine-config FILE`)",
            )
        )
    return found
