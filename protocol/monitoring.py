"""What a Prometheus needs to find the fleet: metrics URLs, gateways' heartbeats, scrape targets.

Every part serves its own `/metrics`; the control plane knows where, because agents report the
URL their metrics server actually bound (`HostFacts.metrics_url`: the demo's agent binds port 0)
and gateways heartbeat (`POST /api/v1/gateways/heartbeat`, gateway token) with theirs.
`GET /api/v1/metrics/targets` (viewer) answers Prometheus `file_sd` groups of every live target;
`dctl metrics targets` writes them to the file a Prometheus watches.
"""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from protocol.api_model import ApiModel
from protocol.wire import Address, Port, check_metrics_url

GATEWAYS_PATH = "/api/v1/gateways"
GATEWAY_HEARTBEAT_PATH = "/api/v1/gateways/heartbeat"
TARGETS_PATH = "/api/v1/metrics/targets"
METRICS_PATH = "/metrics"
# A gateway silent for this many of its heartbeat intervals is not live (as for hosts).
GATEWAY_SILENT_INTERVALS = 3

Scheme = Literal["http", "https"]
TargetRole = Literal["engine", "agent", "gateway", "controlplane"]
# Labels a target may carry besides Prometheus' own `__scheme__` and `__metrics_path__`.
TARGET_LABELS = ("role", "host", "deployment", "version", "instance_id")
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def is_wildcard(address: str) -> bool:
    """True for an address that means "every interface" (no one can connect to it as such)."""
    return address in _WILDCARDS


def host_port(address: str, port: int) -> str:
    """`address:port`, with an IPv6 literal in brackets (`[::1]:9401`)."""
    try:
        if ipaddress.ip_address(address.strip("[]")).version == 6:
            return f"[{address.strip('[]')}]:{port}"
    except ValueError:
        pass  # a DNS name
    return f"{address}:{port}"


def same_address(a: str, b: str) -> bool:
    """True when A and B name the same host: IP literals compared as addresses (`::1` is
    `0:0::1`, brackets or not), DNS names without regard to case."""
    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return a.strip("[]").lower() == b.strip("[]").lower()


def metrics_url(scheme: Scheme, bound: str, port: int, advertise: str | None) -> str:
    """The URL of a metrics server bound to BOUND:PORT, as other machines reach it: a wildcard
    bind is reached at ADVERTISE (the address the part advertises), anything else as bound."""
    address = advertise if is_wildcard(bound) and advertise else bound
    if is_wildcard(address):
        address = "127.0.0.1"  # nothing better is known: at least this machine can scrape it
    return f"{scheme}://{host_port(address, port)}{METRICS_PATH}"


# `scheme://host:port/path`, as checked by `split_metrics_url`.
MetricsUrl = Annotated[str, Field(max_length=512), AfterValidator(check_metrics_url)]


def split_metrics_url(url: str) -> tuple[Scheme, str, str]:
    """(scheme, `host:port`, path) of a metrics URL that `MetricsUrl` accepted."""
    parts = urlsplit(url)
    scheme: Scheme = "https" if parts.scheme == "https" else "http"
    assert parts.hostname is not None and parts.port is not None
    return scheme, host_port(parts.hostname, parts.port), parts.path or METRICS_PATH


# --- gateways ----------------------------------------------------------------------------------


class GatewayHeartbeat(ApiModel):
    """`POST /api/v1/gateways/heartbeat` (gateway token), every `interval_s`: where a gateway
    serves, its version and its /metrics. The first one registers it."""

    gateway: str = Field(min_length=1, max_length=128, description="hostname-pid-random")
    address: Address = Field(description="where clients reach it (IP or DNS name)")
    port: Port
    scheme: Scheme = "http"
    version: str = Field(default="", max_length=64, description="the gateway's dctl version")
    metrics_url: MetricsUrl | None = None
    interval_s: float = Field(default=5.0, gt=0, le=3600, description="seconds between beats")


class GatewayOut(ApiModel):
    """A gateway as the control plane knows it; `live` until it is silent for 3 intervals."""

    gateway: str
    address: str
    port: int
    scheme: Scheme
    version: str
    metrics_url: str | None
    interval_s: float
    first_seen_at: datetime
    last_seen_at: datetime
    live: bool


# --- scrape targets ----------------------------------------------------------------------------


class ScrapeTargetGroup(ApiModel):
    """One Prometheus `file_sd` group: targets (`host:port`) sharing labels.

    `labels` holds `role` and, where they apply, `host`, `deployment`, `version` (the model
    version an engine serves, `MODEL:VERSION`) and `instance_id`, besides Prometheus' own
    `__scheme__` and `__metrics_path__`.
    """

    targets: list[str]
    labels: dict[str, str] = Field(default_factory=dict)
