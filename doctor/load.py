"""Load failures: corrupt or missing snapshot files, memory plans larger than the GPUs, failed
preflight checks, instances that fail or crash-loop, and readiness slower than the start-up grace.
"""

from __future__ import annotations

import math
import re

from doctor.findings import Finding, FleetSnapshot, configured, gib
from protocol.rest import DeploymentOut, HostOut, VersionOut
from protocol.version_ref import VersionRef

# Where the agent's reasons name the file: "file PATH does not match the manifest", "... PATH:
# No such file". The rule quotes the file when it can find one.
_FILE = re.compile(r"file (\S+?)[,:]? |(\S+\.(?:safetensors|json|bin|pt|model)\b)")
_GRACE = re.compile(r"not ready within the start-up grace of (\d+(?:\.\d+)?) s")
BROKEN_STATES = ("failed", "crash_loop")


def _file_in(text: str) -> str:
    match = _FILE.search(text)
    return (match.group(1) or match.group(2)) if match else "?"


def snapshot_failures(snap: FleetSnapshot) -> list[Finding]:
    """A host could not fetch or verify a snapshot its deployments need: name the file."""
    wanted = {v.digest: ref for ref, v in snap.versions.items()}
    found = []
    for host in snap.hosts:
        for failure in host.facts.snapshot_failures if host.facts else []:
            ref = wanted.get(failure.digest)
            if ref is None and snap.versions:
                continue  # not a version of the deployments looked at
            found.append(
                Finding(
                    rule="load.snapshot",
                    severity="error",
                    subject=f"host/{host.name}",
                    summary=f"snapshot of {ref or failure.digest[:12]} failed verification "
                    f"(file {_file_in(failure.error)})",
                    evidence={
                        "version": str(ref) if ref else "?",
                        "digest": failure.digest[:12],
                        "file": _file_in(failure.error),
                        "error": failure.error,
                    },
                    fix="restore the file at the version's source (it must match the manifest) "
                    "or register a new version with `dctl model register` and roll out to it; "
                    "the agent retries the fetch by itself",
                )
            )
    return found


def _host_capacity(host: HostOut, gpus: int | None, fraction: float) -> tuple[int, float]:
    """(GPUs an instance gets, bytes it may use) on HOST: its largest GPUs times the fraction."""
    sizes = sorted((g.memory_total_bytes for g in host.gpus), reverse=True)
    take = sizes[: gpus or len(sizes)]
    return len(take), sum(take) * fraction


def memory_plan(snap: FleetSnapshot) -> list[Finding]:
    """A version's memory plan (weights + activations + KV) is larger than an instance's GPUs."""
    found = []
    for dep in snap.deployments:
        version = snap.versions.get(VersionRef(dep.model, dep.version))
        if version is None or version.memory_plan is None:
            continue
        found.extend(_memory_findings(snap, dep, version))
    return found


def _memory_findings(snap: FleetSnapshot, dep: DeploymentOut, version: VersionOut) -> list[Finding]:
    plan = version.memory_plan
    assert plan is not None
    fraction = float(configured(dep, "resources", "memory_fraction"))
    # The engine reserves KV for every batch slot at the full sequence length and refuses to
    # start when that exceeds memory_fraction of its GPU (engine/serve.py): the same sum here.
    seq_len = int(configured(dep, "model", "max_seq_len"))
    slots = int(configured(dep, "service", "max_concurrent_requests"))
    kv_tokens = slots * seq_len
    need = plan.required_bytes(kv_tokens)
    found = []
    for host_name in sorted({i.host for i in dep.instances}):
        host = snap.host(host_name)
        if host is None or not host.gpus:
            continue
        count, have = _host_capacity(host, dep.gpus_per_instance, fraction)
        if need <= have:
            continue
        per_gpu = max(g.memory_total_bytes for g in host.gpus) * fraction
        gpus_needed = math.ceil(need / per_gpu) if per_gpu else 0
        free_for_kv = have - plan.weights_bytes - plan.activation_bytes
        fits_tokens = int(free_for_kv // plan.kv_bytes_per_token) if plan.kv_bytes_per_token else 0
        options = []
        if count < gpus_needed <= len(host.gpus):
            options.append(
                f"give each instance {gpus_needed} GPUs with expert parallelism "
                f"(`dctl deploy configure {dep.name} --gpus-per-instance {gpus_needed}`)"
            )
        else:
            options.append("spread the experts over more GPUs (expert parallelism) on larger hosts")
        if fits_tokens >= seq_len:
            options.append(
                f"lower service.max_concurrent_requests to {fits_tokens // seq_len} or less"
            )
        if fits_tokens >= slots:
            options.append(f"lower model.max_seq_len to {fits_tokens // slots} or less")
        if fraction < 0.9:
            options.append(f"raise resources.memory_fraction (now {fraction})")
        options.append("serve INT8 weights when the checkpoint offers them")
        found.append(
            Finding(
                rule="load.memory_plan",
                severity="error",
                subject=f"deployment/{dep.name}@{host_name}",
                summary=f"{VersionRef(dep.model, dep.version)} needs {gib(need)} GiB but an "
                f"instance on {host_name} gets {gib(have)} GiB of GPU memory",
                evidence={
                    "needed_gib": gib(need),
                    "available_gib": gib(have),
                    "gpus_per_instance": count,
                    "memory_fraction": fraction,
                    "max_concurrent_requests": slots,
                    "max_seq_len": seq_len,
                    "weights_gib": gib(plan.weights_bytes),
                },
                fix="; ".join(options),
            )
        )
    return found


def preflight(snap: FleetSnapshot) -> list[Finding]:
    """Failed preflight checks of a host (driver/CUDA mismatch, lost GPUs, ECC, memory)."""
    found = []
    for host in snap.hosts:
        for check in host.facts.preflight if host.facts else []:
            if check.status != "fail":
                continue
            what = "driver/CUDA mismatch" if check.name == "cuda_compat" else check.name
            reason, _, fix = check.reason.partition(": ")
            found.append(
                Finding(
                    rule="load.preflight",
                    severity="error",
                    subject=f"host/{host.name}",
                    summary=f"preflight check {check.name} failed ({what})",
                    evidence={
                        "check": check.name,
                        "reason": check.reason,
                        "driver": host.facts.driver_version or "?" if host.facts else "?",
                        "cuda_driver": (host.facts.cuda_driver_version or "?")
                        if host.facts
                        else "?",
                    },
                    fix=fix or reason,
                )
            )
    return found


def failed_instances(snap: FleetSnapshot) -> list[Finding]:
    """Instances that cannot run or keep crashing (the readiness rule takes slow start-ups)."""
    found = []
    for dep, inst in snap.instances():
        # Unhealthy ones still run (and may recover): worth a warning, not an error.
        if inst.observed_state not in (*BROKEN_STATES, "unhealthy"):
            continue
        exit_reason = inst.last_exit.reason if inst.last_exit else ""
        text = f"{inst.message} {exit_reason}"
        if _GRACE.search(text):
            continue
        if "snapshot" in text or "does not match the manifest" in text:
            fix = "restore the file at the version's source or register a new version"
        elif "GPU memory" in text or "needs" in text:
            fix = (
                "see load.memory_plan: more GPUs per instance, fewer "
                "service.max_concurrent_requests, lower model.max_seq_len or INT8"
            )
        elif "preflight" in text:
            fix = "fix the host's failed preflight checks (see load.preflight)"
        elif "engine config" in text:
            fix = (
                f"correct the engine config (`dctl deploy configure {dep.name} --engine-config F`)"
            )
        else:
            fix = (
                f"read the engine's log (instance-{inst.id}.log in the agent's run directory on "
                f"{inst.host}); once fixed, `dctl restart {dep.name} --instance {inst.id}`"
            )
        evidence: dict[str, float | int | str] = {
            "state": inst.observed_state,
            "restart_count": inst.restart_count,
            "message": inst.message,
        }
        if inst.last_exit is not None:
            evidence["exit_code"] = inst.last_exit.code if inst.last_exit.code is not None else "?"
            evidence["exit_reason"] = exit_reason
        file = _file_in(text)
        if file != "?":
            evidence["file"] = file
        found.append(
            Finding(
                rule="load.instance",
                severity="warning" if inst.observed_state == "unhealthy" else "error",
                subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                summary=f"instance is {inst.observed_state.replace('_', ' ')}: {inst.message}",
                evidence=evidence,
                fix=fix,
            )
        )
    return found


def readiness(snap: FleetSnapshot) -> list[Finding]:
    """Engines killed for not getting ready within the agent's start-up grace (seed 004)."""
    found = []
    for dep, inst in snap.instances():
        exit_reason = inst.last_exit.reason if inst.last_exit else ""
        match = _GRACE.search(f"{inst.message} {exit_reason}")
        if match is None or inst.observed_state == "ready":
            continue
        grace = float(match.group(1))
        found.append(
            Finding(
                rule="load.readiness",
                severity="error" if inst.observed_state in BROKEN_STATES else "warning",
                subject=f"instance/{inst.id} ({dep.name} on {inst.host})",
                summary=f"engine not ready within the start-up grace of {grace:.0f} s; "
                "the agent keeps killing it while it loads",
                evidence={
                    "startup_grace_s": grace,
                    "restart_count": inst.restart_count,
                    "state": inst.observed_state,
                },
                fix=f"raise the agent's start-up grace to at least {2 * grace:.0f} s "
                f"(`dctl agent --startup-grace-s {2 * grace:.0f}` or DCTL_AGENT_STARTUP_GRACE_S), "
                "or make loading faster (weights on local fast disk)",
            )
        )
    return found
