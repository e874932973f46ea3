"""Logs reachable from one place: engine and agent log lines shipped by agents, request
summaries and token refusals reported by gateways, and what the control plane answers about them.

Agents call out (nothing calls in): each heartbeat may carry a `LogBatch`, the next lines of
each engine's log (and of the agent's own), redacted on the host before they leave it. A batch
is dropped from the agent's buffer only once a heartbeat carrying it got a 200; lines that did
not fit the agent's bound are counted in `dropped`, never silently lost.

Gateways add `requests` (one `RequestSummary` per request, sampled above a rate) and `refusals`
(per token and reason) to their traffic reports.

The field names are those Loki / Vector / Fluent Bit users expect of JSON lines (`time` in RFC
3339, `level`, `message`, `request_id`), so a JSONL file of these models needs no custom parser.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import Field, field_validator

from protocol.api_model import ApiModel

# A longer line is cut there (and says so): one engine's traceback must not fill a batch.
MAX_LINE_CHARS = 8192
MAX_BATCH_LINES = 2000
# Bytes of line text one heartbeat carries at most (heartbeat bodies are limited to 1 MiB).
MAX_BATCH_BYTES = 256 * 1024
MAX_REQUESTS_PER_REPORT = 1000
# `x-request-id`: what the gateway and the engine accept and echo (a log-safe alphabet, never
# starting with `-`, so an id pasted into a command line never reads as an option).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"

LogSource = Literal["engine", "agent"]
# Bounds of every integer a request carries (the store's columns: 32-bit ids, 64-bit counts).
INT32_MAX = 2**31 - 1
COUNT_MAX = 2**62


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class ShippedLine(ApiModel):
    """One log line as an agent ships it (already redacted)."""

    source: LogSource = "engine"
    instance_id: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="None: the agent's own"
    )
    time: datetime = Field(description="when the agent read it (or the line's own time)")
    seq: int = Field(
        ge=0, le=COUNT_MAX, description="per (host, instance) counter: order within one time"
    )
    line: str = Field(max_length=MAX_LINE_CHARS + 64)
    request_id: str | None = Field(default=None, pattern=REQUEST_ID_PATTERN)

    _time = field_validator("time")(_utc)


class LogBatch(ApiModel):
    """The log lines one heartbeat carries, and how many the agent had to drop since the last
    batch the control plane took (its buffer's bound)."""

    lines: list[ShippedLine] = Field(default_factory=list, max_length=MAX_BATCH_LINES)
    dropped: int = Field(default=0, ge=0, le=COUNT_MAX)


class LogEntry(ApiModel):
    """`GET /api/v1/deployments/{name}/logs`: one stored line."""

    id: int
    time: datetime
    host: str
    source: LogSource
    deployment: str | None = None
    instance_id: int | None = None
    line: str
    request_id: str | None = None


class LogPage(ApiModel):
    """Lines in time order, and the cursor (`after`) that continues after the last one."""

    items: list[LogEntry]
    next_cursor: int
    dropped: int = Field(default=0, description="lines the agents had to drop in this range")


# --- gateways: request summaries and refusals ---------------------------------------------------


class RequestSummary(ApiModel):
    """One request through a gateway, as its JSONL request log writes it and as it reports it."""

    request_id: str = Field(pattern=REQUEST_ID_PATTERN)
    time: datetime = Field(description="when the request arrived")
    token: str = Field(default="", max_length=63, description="the client token's name")
    deployment: str = Field(max_length=63)
    version: str = Field(default="", max_length=200, description="MODEL:VERSION that served it")
    pool: str = Field(default="", max_length=16, description="stable | canary")
    instance_id: int | None = Field(default=None, ge=1, le=INT32_MAX)
    status: int = Field(ge=0, le=999)
    prompt_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    completion_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    steps_per_block: float | None = Field(default=None, ge=0)
    tokens_per_forward: float | None = Field(default=None, ge=0)
    ttft_s: float | None = Field(default=None, ge=0)
    latency_s: float = Field(ge=0)
    stream: bool = False

    _time = field_validator("time")(_utc)


RefusalReason = Literal["unknown", "expired", "revoked", "rate_limited", "forbidden"]


class TokenRefusal(ApiModel):
    """Requests a gateway refused for one token and reason since its last report."""

    token: str = Field(default="", max_length=63, description="its name; '' when unknown")
    key_id: str = Field(default="", max_length=32)
    reason: RefusalReason
    count: int = Field(ge=1, le=COUNT_MAX)


class TokenUsage(ApiModel):
    """Every request (not a sample) a gateway served one client token for one deployment since
    its last report: what the access audit counts."""

    token: str = Field(max_length=63, description="the client token's name")
    deployment: str = Field(max_length=63)
    requests: int = Field(ge=0, le=COUNT_MAX)
    errors: int = Field(
        default=0, ge=0, le=COUNT_MAX, description="5xx answers and failed connections"
    )
    rate_limited: int = Field(default=0, ge=0, le=COUNT_MAX, description="429s")


class RequestOut(RequestSummary):
    """`GET /api/v1/deployments/{name}/requests`: a stored summary."""

    gateway: str = ""


class TokenAudit(ApiModel):
    """One client token's use over the audited range."""

    token: str
    requests: int
    errors: int = Field(description="answers 5xx (and failed connections)")
    rate_limited: int = Field(description="429s")
    error_share: float
    deployments: list[str]
    first_seen: datetime | None
    last_seen: datetime | None
    refused: dict[str, int] = Field(default_factory=dict, description="refusals by reason")
    anomalies: list[str] = Field(default_factory=list)


class AuditReport(ApiModel):
    """`GET /api/v1/audit` (admin): per client token, and the refusals of tokens not known."""

    since: datetime
    until: datetime
    tokens: list[TokenAudit]
