"""Degradation over uptime: latency or GPU memory creeping up, which a rolling restart resets."""

from __future__ import annotations

import itertools

from doctor.findings import Finding, FleetSnapshot, Points
from protocol.rest import DeploymentOut

# Over the window, second-half mean vs first-half mean of latency, or GPU memory growth as a
# share of the card: sustained growth that a restart resets (fragmentation, leaks).
LATENCY_CREEP_RATIO = 1.5
MEMORY_CREEP_SHARE = 0.10
MIN_POINTS_FOR_TREND = 6  # a minute of 10 s buckets


def _halves(points: Points) -> tuple[float, float]:
    half = len(points) // 2
    first = [v for _, v in points[:half]]
    second = [v for _, v in points[half:]]
    return sum(first) / len(first), sum(second) / len(second)


def creeping(snap: FleetSnapshot) -> list[Finding]:
    """Latency or GPU memory growing over uptime: what a rolling restart resets."""
    found = []
    for dep, inst in snap.instances():
        series = snap.instance_series.get(inst.id, {})
        sums = series.get("dllm_e2e_request_latency_seconds_sum", [])
        counts = dict(series.get("dllm_e2e_request_latency_seconds_count", []))
        means = [(t, s / counts[t]) for t, s in sums if counts.get(t)]
        if len(means) >= MIN_POINTS_FOR_TREND:
            before, after = _halves(means)
            if before > 0 and after / before >= LATENCY_CREEP_RATIO:
                found.append(_creep(dep, inst.id, inst.host, "latency", {
                    "latency_first_half_s": round(before, 3),
                    "latency_second_half_s": round(after, 3),
                    "ratio": round(after / before, 2),
                }))  # fmt: skip
    for host in snap.hosts:
        gpu_series = snap.host_series.get(host.name, {})
        for gpu in host.gpus:
            used = gpu_series.get(f"gpu{gpu.index}.memory_used_bytes", [])
            if len(used) < MIN_POINTS_FOR_TREND or not gpu.memory_total_bytes:
                continue
            values = [v for _, v in used]
            rising = all(b >= a for a, b in itertools.pairwise(values))
            growth = (values[-1] - values[0]) / gpu.memory_total_bytes
            # Still growing in the later half: an engine loading its weights grows once, then
            # stays flat, which is no creep.
            late = (values[-1] - values[len(values) // 2]) / gpu.memory_total_bytes
            if rising and growth >= MEMORY_CREEP_SHARE and late >= MEMORY_CREEP_SHARE / 2:
                for dep, inst in snap.instances():
                    if inst.host == host.name and (
                        not inst.gpu_indices or gpu.index in inst.gpu_indices
                    ):
                        found.append(_creep(dep, inst.id, host.name, f"GPU {gpu.index} memory", {
                            "gpu": gpu.index,
                            "memory_growth_share": round(growth, 3),
                            "memory_first_gib": round(values[0] / 2**30, 1),
                            "memory_last_gib": round(values[-1] / 2**30, 1),
                        }))  # fmt: skip
    return found


def _creep(
    dep: DeploymentOut, instance: int, host: str, what: str, evidence: dict[str, float | int | str]
) -> Finding:
    return Finding(
        rule="degradation.uptime",
        severity="warning",
        subject=f"instance/{instance} ({dep.name} on {host})",
        summary=f"{what} creeping up over uptime",
        evidence=evidence,
        fix=f"rolling restart: `dctl restart {dep.name}` (one instance at a time)",
    )
