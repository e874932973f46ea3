"""PromQL building blocks of the dashboard: the variables' selectors and histogram helpers."""

from __future__ import annotations

from monitoring.grafana.dashboard import Target

RATE = "$__rate_interval"
DEPLOYMENT = 'deployment=~"$deployment"'
HOST = 'host=~"$host"'
# The gateway labels refusals made before routing with an empty deployment; they belong to
# no deployment's panel.
ROUTED = 'deployment=~"$deployment", deployment!=""'


def rate(metric: str, selector: str, by: str) -> str:
    """Per-second rate of a counter, summed by BY."""
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def quantile(q: float, histogram: str, selector: str, by: str) -> str:
    """The Q quantile of a histogram (base name), by BY."""
    return (
        f"histogram_quantile({q}, sum by ({by}, le) "
        f"(rate({histogram}_bucket{{{selector}}}[{RATE}])))"
    )


def mean(histogram: str, selector: str, by: str, offset: str = "") -> str:
    """The mean observation of a histogram (base name) by BY, optionally OFFSET earlier."""
    shift = f" offset {offset}" if offset else ""
    return (
        f"sum by ({by}) (rate({histogram}_sum{{{selector}}}[{RATE}]{shift}))\n"
        f"/ sum by ({by}) (rate({histogram}_count{{{selector}}}[{RATE}]{shift}))"
    )


def percentiles(histogram: str, selector: str, by: str, legend: str) -> tuple[Target, ...]:
    """p50, p95 and p99 of a histogram, one target each."""
    return tuple(
        Target(quantile(q, histogram, selector, by), f"p{round(q * 100)} {legend}")
        for q in (0.5, 0.95, 0.99)
    )
