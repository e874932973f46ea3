"""Hardware suspicions: silent hosts, one GPU hotter or busier than its peers, expert load skew,
and denoising step time jitter on one instance (the seeds: "abnormal jitter may signal a hardware
fault")."""

from __future__ import annotations

import statistics

from doctor.findings import Finding, FleetSnapshot, Points, label, matching, median, total

# A GPU this much hotter than its peers' median under the same work has a cooling problem
# (fan, airflow, paste); over the absolute limit it throttles whatever its peers do.
HOT_DELTA_C = 15.0
HOT_ABSOLUTE_C = 85.0
# Utilisation points above the peers' median: one card carries the host's work (placement or
# a stuck process), worth knowing rather than wrong.
BUSY_DELTA_PERCENT = 50.0
# max / mean of tokens routed per expert in one layer: top-k routing of a balanced model stays
# well under 2; beyond this one expert's GPU sets the pace (expert parallelism stalls on it).
EXPERT_SKEW = 2.5
# An instance's mean denoising forward this many times its peers' median (same deployment,
# same block size) is slow hardware, not the model; so is a coefficient of variation of its
# 10 s means this high.
STEP_SLOW_RATIO = 2.0
STEP_JITTER_CV = 0.5
MIN_STEP_POINTS = 3
STEP = "dllm_denoise_step_seconds"
# What the agent sends per layer instead of per-expert counters (see agent/engine_metrics.py).
EXPERT_SKEW_SERIES = "dllm_expert_load_skew"
EXPERT_HOT_SERIES = "dllm_expert_load_hot_expert"


def host_silent(snap: FleetSnapshot) -> list[Finding]:
    """A host whose agent stopped heartbeating: its instances are not served (or not seen)."""
    found = []
    for host in snap.hosts:
        if host.state == "ready":
            continue
        mine = [i.id for _, i in snap.instances() if i.host == host.name]
        found.append(
            Finding(
                rule="fleet.host_silent",
                severity="error" if mine else "warning",
                subject=f"host/{host.name}",
                summary=f"host is {host.state.replace('_', ' ')}: no heartbeat from its agent",
                evidence={
                    "state": host.state,
                    "last_seen_at": host.last_seen_at.isoformat() if host.last_seen_at else "never",
                    "instances": len(mine),
                },
                fix=f"check that `dctl agent` still runs on {host.name} (its log) and reaches the "
                f"control plane; `dctl host drain {host.name}` if it stays away",
            )
        )
    return found


def _deployments_on(snap: FleetSnapshot, host: str, index: int) -> str:
    names = sorted(
        {
            d.name
            for d, i in snap.instances()
            if i.host == host and (not i.gpu_indices or index in i.gpu_indices)
        }
    )
    return ",".join(names) or "NAME"


def gpu_outliers(snap: FleetSnapshot) -> list[Finding]:
    """A GPU much hotter or busier than the other GPUs of its host."""
    found = []
    for host in snap.hosts:
        for gpu in host.gpus:
            peers = [g for g in host.gpus if g.index != gpu.index]
            peer_temp = median(g.temperature_c for g in peers if g.temperature_c is not None)
            temp = gpu.temperature_c
            if temp is not None and (
                temp >= HOT_ABSOLUTE_C
                or (peer_temp is not None and temp - peer_temp >= HOT_DELTA_C)
            ):
                found.append(
                    Finding(
                        rule="hardware.gpu_hot",
                        severity="warning",
                        subject=f"host/{host.name}/gpu{gpu.index}",
                        summary=f"GPU {gpu.index} at {temp:.0f} °C"
                        + (f", peers' median {peer_temp:.0f} °C" if peer_temp is not None else ""),
                        evidence={"temperature_c": temp, "peer_median_c": peer_temp or "?"},
                        fix=f"check the GPU's cooling; drain the host while it is looked at "
                        f"(`dctl host drain {host.name}`)",
                    )
                )
            peer_util = median(
                g.utilization_percent for g in peers if g.utilization_percent is not None
            )
            util = gpu.utilization_percent
            if (
                util is not None
                and peer_util is not None
                and util - peer_util >= BUSY_DELTA_PERCENT
            ):
                on_it = _deployments_on(snap, host.name, gpu.index)
                found.append(
                    Finding(
                        rule="hardware.gpu_busy",
                        severity="info",
                        subject=f"host/{host.name}/gpu{gpu.index}",
                        summary=f"GPU {gpu.index} at {util:.0f}% while its peers' median is "
                        f"{peer_util:.0f}%",
                        evidence={"utilization_percent": util, "peer_median_percent": peer_util},
                        fix="if its experts are the hot ones (see hardware.expert_skew), "
                        "replicate them or rebalance the routing; else give instances their own "
                        f"GPUs (`dctl deploy configure {on_it} --gpus-per-instance N`) or look "
                        "for a stray process on that GPU",
                    )
                )
    return found


def expert_skew(snap: FleetSnapshot) -> list[Finding]:
    """Tokens per expert of one MoE layer far from even: the agent reduces each heartbeat
    interval's routed tokens to max / mean over the layer's experts (and the hottest expert);
    the mean of those over the window is judged."""
    found = []
    for dep, inst in snap.instances():
        series = snap.instance_series.get(inst.id, {})
        worst: tuple[float, str, int] | None = None
        for key, points in matching(series, EXPERT_SKEW_SERIES):
            values = [value for _, value in points]
            if not values:
                continue
            skew = statistics.fmean(values)
            if worst is None or skew > worst[0]:
                worst = (skew, label(key, "layer") or "0", len(values))
        if worst is None or worst[0] < EXPERT_SKEW:
            continue
        skew, layer, intervals = worst
        evidence: dict[str, float | int | str] = {
            "layer": layer,
            "max_over_mean": round(skew, 2),
            "intervals": intervals,
        }
        hot = series.get(f'{EXPERT_HOT_SERIES}{{layer="{layer}"}}')
        if hot:
            evidence["expert"] = str(int(hot[-1][1]))  # the hottest in the latest interval
        which = f" (expert {evidence['expert']})" if "expert" in evidence else ""
        found.append(
            Finding(
                rule="hardware.expert_skew",
                severity="warning",
                subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                summary=f"expert load skew {skew:.1f}x in layer {layer}{which}",
                evidence=evidence,
                fix="the routing sends most tokens to few experts: check the routing policy, "
                "give the hot experts replicas or GPUs of their own (expert parallelism); after a "
                "fine-tune, check its router balance before promoting it",
            )
        )
    return found


def _step_means(series: dict[str, Points]) -> dict[str, tuple[float, list[float]]]:
    """Block size -> (mean step seconds over the window, per-bucket means)."""
    out = {}
    for key, sums in matching(series, f"{STEP}_sum"):
        block = label(key, "block_size") or "?"
        counts = dict(series.get(key.replace(f"{STEP}_sum", f"{STEP}_count"), []))
        count = sum(counts.values())
        if count:
            per_bucket = [s / counts[t] for t, s in sums if counts.get(t)]
            out[block] = (total(sums) / count, per_bucket)
    return out


def step_jitter(snap: FleetSnapshot) -> list[Finding]:
    """An instance whose denoising forwards are slower than its peers', or erratic."""
    found = []
    for dep in snap.deployments:
        instances = [i for _, i in snap.instances() if i in dep.instances]
        means = {i.id: _step_means(snap.instance_series.get(i.id, {})) for i in instances}
        for inst in instances:
            for block, (mean, buckets) in means[inst.id].items():
                peer = median(
                    m[block][0] for other, m in means.items() if other != inst.id and block in m
                )
                cv = (
                    statistics.pstdev(buckets) / statistics.fmean(buckets)
                    if len(buckets) >= MIN_STEP_POINTS and statistics.fmean(buckets) > 0
                    else 0.0
                )
                slow = peer is not None and peer > 0 and mean / peer >= STEP_SLOW_RATIO
                if not slow and cv < STEP_JITTER_CV:
                    continue
                evidence: dict[str, float | int | str] = {
                    "block_size": block,
                    "step_mean_ms": round(1000 * mean, 2),
                    "step_cv": round(cv, 2),
                }
                if peer is not None:
                    evidence["fleet_median_ms"] = round(1000 * peer, 2)
                    evidence["ratio"] = round(mean / peer, 2) if peer else "?"
                found.append(
                    Finding(
                        rule="hardware.step_jitter",
                        severity="warning",
                        subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                        summary="denoising step time "
                        + ("far above the fleet's" if slow else "jittery")
                        + ": hardware suspicion (throttling, PCIe/NVLink errors, a failing GPU)",
                        evidence=evidence,
                        fix=f"check the host's GPUs (temperature, ECC, clocks); drain it "
                        f"(`dctl host drain {inst.host}`) and compare after "
                        f"`dctl restart {dep.name} --instance {inst.id}`",
                    )
                )
    return found
