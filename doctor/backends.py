"""Engines other than dctl's: which figures a deployment's instances cannot give.

A deployment on vLLM, SGLang or a command engine is served and rolled out like any other, but
its instances report less: none of them reports the diffusion figures (rollouts show those as
n/a and judge errors and latency from the gateway), and a command engine reports what its own
`/metrics` exports under names the agent knows, or nothing. The doctor says so once per
deployment, so nobody reads an empty panel as an idle engine.
"""

from __future__ import annotations

from doctor.findings import Finding, FleetSnapshot, Severity
from protocol.engine_kinds import DIFFUSION_FIGURES, REPORTED_FIGURES, engine_kind

# What the agent reads of an engine's /metrics, by the dctl engine's series names.
_ENGINE_SERIES = ("dllm_requests_running", "dllm_requests_waiting", "dllm_generated_tokens")


def backend_figures(snap: FleetSnapshot) -> list[Finding]:
    """Per deployment on another engine: the figures it lacks, and whether any arrive."""
    found = []
    for dep in snap.deployments:
        kind = engine_kind(dep.engine_config)
        if kind == "dctl":
            continue
        engine = dep.engine_config.get("engine") or {}
        scraped = kind != "command" or engine.get("metrics_path", "/metrics") is not None
        reported = list(REPORTED_FIGURES.get(kind, ()))
        arriving = any(
            name.startswith(_ENGINE_SERIES)
            for inst in dep.instances
            for name in snap.instance_series.get(inst.id, {})
        )
        if kind == "command":
            reported = ["what its /metrics exports under vLLM, SGLang or llama.cpp names"]
            if not scraped:
                reported = []
        lacks = [*DIFFUSION_FIGURES] + ([] if scraped else ["queue and running requests"])
        summary = (
            f"runs on the {kind} engine: no {', no '.join(lacks)} from its instances "
            "(rollouts show them as n/a and judge errors and latency from the gateway)"
        )
        evidence: dict[str, float | int | str] = {
            "engine": kind,
            "reported": ", ".join(reported) or "nothing (engine.metrics_path is null)",
            "figures_arriving": "yes" if arriving else "no",
        }
        fix = "nothing to fix: the gateway's figures (requests, errors, latency, TTFT, tokens)"
        fix += " cover every engine"
        severity: Severity = "info"
        if scraped and not arriving and any(i.observed_state == "ready" for i in dep.instances):
            severity = "warning"
            summary += "; its ready instances sent no engine figures the agent reads"
            path = engine.get("metrics_path", "/metrics") if kind == "command" else "/metrics"
            fix = (
                f"check that the engine serves Prometheus text at {path} (SGLang needs "
                "--enable-metrics, which dctl passes); for a command engine without metrics "
                "set engine.metrics_path: null"
            )
        found.append(
            Finding(
                rule="engine.figures",
                severity=severity,
                subject=f"deployment/{dep.name}",
                summary=summary,
                evidence=evidence,
                fix=fix,
            )
        )
    return found
