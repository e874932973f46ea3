"""Rows about client traffic: the gateway per deployment version, and rollouts between them."""

from __future__ import annotations

from monitoring.grafana.dashboard import Panel, Row, Target
from monitoring.grafana.promql import DEPLOYMENT, ROUTED, mean, percentiles, quantile, rate

GATEWAY = Row(
    "Gateway by version",
    (
        Panel(
            "Requests by status",
            (
                Target(
                    rate("dctl_gateway_requests_total", ROUTED, "deployment, version, code"),
                    "{{deployment}} {{version}} {{code}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "429 and 504",
            (
                Target(
                    # Refusals before routing (token rate limits) have no deployment: name them.
                    "label_replace(\n  "
                    + rate("dctl_gateway_requests_total", 'code=~"429|504"', "deployment, code")
                    + ',\n  "deployment", "(before routing)", "deployment", ""\n)',
                    "{{deployment}} {{code}}",
                ),
            ),
            "Throttled (engine queues full, token rate limits) and timed out requests.",
            unit="reqps",
        ),
        Panel(
            "Latency",
            percentiles(
                "dctl_gateway_request_duration_seconds",
                ROUTED,
                "deployment, version",
                "{{deployment}} {{version}}",
            ),
            "Receiving a request to its last byte, as clients see it. Alert: p95 over 30 s.",
            unit="s",
            threshold=30,
        ),
        Panel(
            "Time to first byte",
            percentiles(
                "dctl_gateway_ttft_seconds",
                ROUTED,
                "deployment, version",
                "{{deployment}} {{version}}",
            ),
            unit="s",
        ),
        Panel(
            "Output tokens per second",
            (
                Target(
                    rate("dctl_gateway_output_tokens_total", ROUTED, "deployment, version"),
                    "{{deployment}} {{version}}",
                ),
            ),
        ),
        Panel(
            "In flight, retries and ejections",
            (
                Target("sum by (instance) (dctl_gateway_inflight)", "in flight {{instance}}"),
                Target(
                    rate("dctl_gateway_retries_total", DEPLOYMENT, "deployment, reason"),
                    "retries/s {{deployment}} {{reason}}",
                ),
                Target(
                    "sum by (deployment, version) "
                    f"(increase(dctl_gateway_ejections_total{{{DEPLOYMENT}}}[1h]))",
                    "ejections (1h) {{deployment}} {{version}}",
                ),
            ),
        ),
    ),
)

# The control plane's view of each deployment's rollout (`dctl_rollout_*`). Several replicas
# report the same store: `max by` keeps one series each, and during a change between their
# scrapes the info side may hold two, so it is the "many" side of the join.
ROLLOUT_STATE = (
    f"max by (deployment, from, to, state, phase) (dctl_rollout_info{{{DEPLOYMENT}}})\n"
    f"* on (deployment) group_left ()\nmax by (deployment) (dctl_rollout_step{{{DEPLOYMENT}}})"
)

ROLLOUTS = Row(
    "Rollouts",
    (
        Panel(
            "Rollout now: step index and state",
            (Target(ROLLOUT_STATE, "{{deployment}} {{from}} -> {{to}}: {{state}} ({{phase}})"),),
            "Each deployment's current rollout, else its latest. The value is the index of the "
            "plan's step it is at, from 0 (`dctl rollout status` counts from 1). Alert: paused "
            "for over an hour.",
            kind="stat",
            width=12,
            height=6,
        ),
        Panel(
            "Canary weight",
            (
                Target(
                    f"max by (deployment) (dctl_rollout_weight{{{DEPLOYMENT}}})",
                    "{{deployment}}",
                ),
            ),
            "The percent of requests the rollout gives its canary now; below, the share the "
            "gateway actually sent each version.",
            unit="percent",
            width=12,
            height=6,
        ),
        Panel(
            "Traffic share by version",
            (
                Target(
                    rate("dctl_gateway_requests_total", ROUTED, "deployment, version, pool")
                    + "\n/ ignoring (version, pool) group_left "
                    + rate("dctl_gateway_requests_total", ROUTED, "deployment"),
                    "{{deployment}} {{version}} ({{pool}})",
                ),
            ),
            "What the gateway sent each version; the canary's weight in practice.",
            unit="percentunit",
        ),
        Panel(
            "Success rate by version",
            (
                Target(
                    rate(
                        "dctl_gateway_requests_total",
                        f'{ROUTED}, code!~"5.."',
                        "deployment, version",
                    )
                    + "\n/ "
                    + rate("dctl_gateway_requests_total", ROUTED, "deployment, version"),
                    "{{deployment}} {{version}}",
                ),
            ),
            "Answers that were not 5xx; a canary under its stable version is a reason to abort.",
            unit="percentunit",
        ),
        Panel(
            "p95 latency, canary vs stable",
            (
                Target(
                    quantile(
                        0.95, "dctl_gateway_request_duration_seconds", ROUTED, "deployment, pool"
                    ),
                    "{{deployment}} {{pool}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Ready instances by version",
            (
                Target(
                    f'count by (deployment, version) (up{{role="engine", {DEPLOYMENT}}} == 1)',
                    "{{deployment}} {{version}}",
                ),
            ),
        ),
        Panel(
            "Engine errors by version",
            (
                Target(
                    rate(
                        "dllm_request_errors_total",
                        f'{DEPLOYMENT}, reason!~"invalid_request|context_length_exceeded|'
                        'model_not_found|unauthorized"',
                        "deployment, version",
                    ),
                    "{{deployment}} {{version}}",
                ),
            ),
            "Failures an operator can act on, per version.",
            unit="reqps",
        ),
        Panel(
            "Tokens per forward by version",
            (
                Target(
                    mean("dllm_tokens_per_forward", DEPLOYMENT, "deployment, version"),
                    "{{deployment}} {{version}}",
                ),
            ),
            "A new version that needs more forwards per token decodes slower.",
        ),
    ),
)
