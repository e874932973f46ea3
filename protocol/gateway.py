"""The gateway's contracts with the control plane: the routing table, traffic reports, queries.

The gateway (`dctl gateway`) is stateless. Every second it reads the routing table
(`GET /api/v1/routes`, role gateway, answered 304 while its ETag is unchanged); every few seconds
it posts what it served (`POST /api/v1/traffic`), per (deployment, version, pool), as counts and
mergeable histogram buckets, so the control plane can add up the windows of any number of
gateways; `GET /api/v1/deployments/{name}/traffic` reads them back merged, with the engines'
diffusion figures beside them (the rollout analysis and the TUI use it).

Latency histograms use one fixed set of bounds (`LATENCY_BUCKETS_S`), so buckets from different
gateways and windows add up by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from protocol.logs import MAX_REQUESTS_PER_REPORT, RequestSummary, TokenRefusal, TokenUsage
from protocol.rest import ApiModel
from protocol.wire import INT32_MAX, Name, VersionTag

# Upper bounds (seconds) of the latency and TTFT buckets; a last bucket counts everything above.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
BUCKET_COUNT = len(LATENCY_BUCKETS_S) + 1
MAX_COUNT = 2**53  # counts stay exact in JSON numbers

Pool = Literal["stable", "canary"]
Scheme = Literal["http", "https"]


# --- routing table -----------------------------------------------------------------------------


class RouteInstance(ApiModel):
    """A ready engine instance: where to reach it and the API key it wants."""

    id: int
    host: str
    address: str = Field(description="the host's advertise address (IP or DNS name)")
    port: int = Field(ge=1, le=65535)
    scheme: Scheme = "http"
    api_key: str = Field(description="the engine's only API key: keep out of logs")


class RoutePool(ApiModel):
    """One version of a deployment and its ready instances."""

    version_id: int = Field(description="the version's id: traffic windows report it back")
    version: str = Field(description="MODEL:VERSION, for people: the x-dctl-version header, logs")
    instances: list[RouteInstance] = Field(default_factory=list)


class DeploymentRoute(ApiModel):
    """Where a deployment's requests go: the stable pool, and the canary pool at its weight."""

    deployment: str
    model_names: list[str] = Field(description="`model` values of requests this deployment serves")
    stable: RoutePool
    canary: RoutePool | None = None
    canary_weight: int = Field(default=0, ge=0, le=100, description="percent of requests")
    cold_start_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="set when the deployment scales to zero: with no instance ready, hold a "
        "request this long, asking the control plane to wake it, before a 503",
    )


class RouteClient(ApiModel):
    """A client token the gateway accepts: its hash, never its secret, and what it is granted."""

    key_id: str
    name: str
    secret_sha256: str
    deployments: list[str] | None = Field(default=None, description="None: every deployment")
    expires_at: datetime | None = None
    allow_pool_pin: bool = Field(
        default=False, description="may pin a request's pool with `x-dctl-pool`"
    )
    max_concurrency: int | None = Field(
        default=None, ge=1, le=INT32_MAX,
        description="requests in flight at once per gateway (None: the gateway's default)",
    )  # fmt: skip


class RouteTable(ApiModel):
    """`GET /api/v1/routes`: everything a gateway needs; `etag` changes whenever any of it does."""

    etag: str
    deployments: list[DeploymentRoute] = Field(default_factory=list)
    clients: list[RouteClient] = Field(default_factory=list)


# --- traffic reports ---------------------------------------------------------------------------


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


def _check_buckets(value: list[int]) -> list[int]:
    if len(value) != BUCKET_COUNT:
        raise ValueError(f"must have {BUCKET_COUNT} buckets (LATENCY_BUCKETS_S and +Inf)")
    return value


class TrafficCounts(ApiModel):
    """What one or more gateways served of one version: counts and histogram buckets.

    `requests` counts every request that reached an instance or failed trying, client errors
    included; `errors_*` split the failures by class, `client_4xx` counts 4xx answers apart
    (they are the client's doing, not the version's). Bucket lists are per-bucket counts (not
    cumulative) over `LATENCY_BUCKETS_S` plus a last +Inf bucket.
    """

    requests: Count = 0
    errors_5xx: Count = 0
    errors_timeout: Count = 0
    errors_connect: Count = 0
    client_4xx: Count = 0
    output_tokens: Count = 0
    latency_buckets: list[Count] = Field(default_factory=lambda: [0] * BUCKET_COUNT)
    latency_sum_s: float = Field(default=0.0, ge=0)
    ttft_buckets: list[Count] = Field(default_factory=lambda: [0] * BUCKET_COUNT)
    ttft_sum_s: float = Field(default=0.0, ge=0)

    _buckets = field_validator("latency_buckets", "ttft_buckets")(_check_buckets)

    @property
    def errors(self) -> int:
        """Failures that count against the version (not the client's 4xx)."""
        return self.errors_5xx + self.errors_timeout + self.errors_connect


@dataclass
class Tally:
    """Traffic counts being added up: `TrafficCounts` without validation, cheap to add to.

    The gateway keeps its open windows in these; the control plane merges stored windows with
    them. `add` takes anything with the same fields (another tally, a stored row, a
    `TrafficCounts`); histogram buckets add up by position.
    """

    requests: int = 0
    errors_5xx: int = 0
    errors_timeout: int = 0
    errors_connect: int = 0
    client_4xx: int = 0
    output_tokens: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * BUCKET_COUNT)
    latency_sum_s: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * BUCKET_COUNT)
    ttft_sum_s: float = 0.0

    def add(self, other: Any) -> None:
        """Add OTHER's counts to these."""
        self.requests += other.requests
        self.errors_5xx += other.errors_5xx
        self.errors_timeout += other.errors_timeout
        self.errors_connect += other.errors_connect
        self.client_4xx += other.client_4xx
        self.output_tokens += other.output_tokens
        self.latency_sum_s += other.latency_sum_s
        self.ttft_sum_s += other.ttft_sum_s
        # Stored rows were validated when they came in; a short list adds what it has.
        for mine, theirs in ((self.latency_buckets, other.latency_buckets),
                             (self.ttft_buckets, other.ttft_buckets)):  # fmt: skip
            mine[: len(theirs)] = [a + b for a, b in zip(mine, theirs, strict=False)]

    @property
    def errors(self) -> int:
        """Failures that count against the version (5xx, timeouts, connect failures)."""
        return self.errors_5xx + self.errors_timeout + self.errors_connect


class TrafficWindow(TrafficCounts):
    """One (deployment, version, pool) of a report.

    The version is its id, as the routing table's pool gave it. A gateway older than version
    ids (which sent `version: MODEL:VERSION`) is refused with a 422 naming `version_id`: a
    gateway talks to a control plane of its own release.
    """

    deployment: Name
    version_id: int = Field(ge=1, le=INT32_MAX, description="the pool's `version_id`")
    pool: Pool


class TrafficReport(ApiModel):
    """`POST /api/v1/traffic` (role gateway): what one gateway served from `started_at`."""

    gateway: str = Field(min_length=1, max_length=128, description="the reporting process's id")
    address: str | None = Field(default=None, max_length=255)
    port: int | None = Field(default=None, ge=1, le=65535)
    started_at: datetime
    ended_at: datetime
    windows: list[TrafficWindow] = Field(default_factory=list, max_length=4096)
    # One per request (sampled above the gateway's `summary_sample_rps`), and the requests it
    # refused per token and reason (`protocol.logs`).
    requests: list[RequestSummary] = Field(default_factory=list, max_length=MAX_REQUESTS_PER_REPORT)
    refusals: list[TokenRefusal] = Field(default_factory=list, max_length=1024)
    # Per client token and deployment, every request of the interval (the audit's counts).
    usage: list[TokenUsage] = Field(default_factory=list, max_length=4096)

    @field_validator("started_at", "ended_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        # A time without a zone is UTC, as everywhere in the API.
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)

    @model_validator(mode="after")
    def _ordered(self) -> TrafficReport:
        if self.ended_at < self.started_at:
            raise ValueError("ended_at is before started_at")
        return self


class TrafficAccepted(ApiModel):
    """The answer to a report: windows stored, and those skipped (deployment unknown, or the
    version not one of its model's, e.g. deleted since the gateway's last routing table) as
    `DEPLOYMENT version VERSION_ID`."""

    accepted: int
    skipped: list[str] = Field(default_factory=list)


# --- traffic queries ---------------------------------------------------------------------------


class VersionTraffic(TrafficCounts):
    """A version's merged traffic over the queried range, with its quantiles and the engines'
    diffusion figures (means over the range; None when no instance reported any)."""

    version_id: int = Field(description="what to look a version up by")
    version: str = Field(description="MODEL:VERSION, for people")
    pool: Pool | None = Field(default=None, description="the pool it was last served from")
    error_rate: float | None = Field(description="errors / requests; None without requests")
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    latency_p99_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    steps_per_block: float | None = None
    tokens_per_forward: float | None = None


class TrafficPoint(ApiModel):
    """One step of a version's series."""

    time: datetime
    requests: int
    errors: int
    output_tokens: int
    latency_p95_s: float | None
    ttft_p95_s: float | None


class VersionSeries(ApiModel):
    """A version's traffic over time, one point per `step_s` that saw traffic."""

    version_id: int
    version: str = Field(description="MODEL:VERSION, for people")
    points: list[TrafficPoint]


class DeploymentTraffic(ApiModel):
    """`GET /api/v1/deployments/{name}/traffic?since=&until=&step_s=`."""

    deployment: str
    since: datetime
    until: datetime
    step_s: int
    gateways: int = Field(description="distinct gateways that reported in the range")
    versions: list[VersionTraffic]
    series: list[VersionSeries]


# --- manual canary (the rollout controller drives the same thing) ------------------------------


class CanarySet(ApiModel):
    """`PUT /api/v1/deployments/{name}/canary` (operator): run VERSION on INSTANCES instances
    and send it WEIGHT percent of the gateway's requests. Starts a canary or changes it."""

    version: VersionTag = Field(description="VERSION tag of a version of the deployment's model")
    weight: int = Field(ge=0, le=100)
    instances: int = Field(
        default=1, ge=1, le=INT32_MAX, description="fewer than the deployment's instances"
    )


class CanaryOut(ApiModel):
    """The deployment's canary as it stands."""

    deployment: str
    stable: str = Field(description="MODEL:VERSION of the stable version")
    canary: str | None = Field(
        description="MODEL:VERSION of the canary (after a DELETE: the one ended)"
    )
    weight: int = Field(description="percent of gateway requests to the canary (0 once ended)")
    instances: int = Field(description="instances running the canary (0 once ended)")
    state: str = Field(description="the rollout's state: progressing, paused, rolled_back, ...")
