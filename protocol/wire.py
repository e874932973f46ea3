"""The agent <-> control-plane wire contract (pydantic and the standard library only).

The agent imports this module and nothing else of the control plane. Two requests exist:
`POST /api/v1/agents/register` (bootstrap token, `RegisterRequest` -> `RegisterResponse`) and
`POST /api/v1/agents/heartbeat` (agent token, `Heartbeat` -> `HeartbeatReply`). Every model
ignores fields it does not know, so a newer agent can talk to an older control plane and back.

`Manifest.digest()` is the one digest of a weight snapshot: the CLI computes it at registration,
the control plane stores it, the agent keys its snapshot store by it and verifies against it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocol.logs import LogBatch
from protocol.plain_text import refuse_control_characters
from protocol.vocabulary import VersionLine

WIRE_VERSION = 1
REGISTER_PATH = "/api/v1/agents/register"
HEARTBEAT_PATH = "/api/v1/agents/heartbeat"
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
DEFAULT_PORT_RANGE = (18000, 18099)

# Host and deployment names: DNS-label-like, so they work in URLs, metric labels and hostnames.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# Model version tags are a little looser (v1, 2024-05-01, v1.2-rc1) but never contain '/' or ':'.
VERSION_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"

Name = Annotated[str, Field(pattern=NAME_PATTERN, description="DNS-label-like: a-z, 0-9, '-'")]
VersionTag = Annotated[str, Field(pattern=VERSION_PATTERN, description="letters, digits, . _ -")]
Sha256 = Annotated[str, Field(pattern=SHA256_PATTERN, description="64 lowercase hex digits")]
Port = Annotated[int, Field(ge=1, le=65535)]
# An IPv4/IPv6 address or a DNS name other machines use to reach this host.
Address = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:%-]+$")]
# Bounds that every database column can hold (32-bit ids and counters, 63-bit byte counts).
INT32_MAX = 2**31 - 1
BYTES_MAX = 2**62

# The context for reading back what a control plane stored (views of rows, replies read by the
# client): text stored before the API refused control characters is taken as it is, since the
# printers strip it (`protocol.plain_text.printable`), rather than failing the whole answer.
STORED: dict[str, Any] = {"stored": True}


def _plain_text(value: str, info: ValidationInfo) -> str:
    if info.context is not None and info.context.get("stored"):
        return value
    return refuse_control_characters(value)


# Text an agent or an operator chooses and terminals show (labels, facts, GPU names, messages):
# a control character in a request is refused, 422 naming the field (see protocol.plain_text).
PlainText = Annotated[str, AfterValidator(_plain_text)]


class InstanceState(StrEnum):
    """Observed state of one engine instance, as the agent reports it."""

    PENDING = "pending"  # known to the agent, nothing done yet
    DOWNLOADING = "downloading"  # fetching / verifying the weight snapshot
    STARTING = "starting"  # process started, waiting for /health/ready
    READY = "ready"  # serving; the gateway may route to it
    UNHEALTHY = "unhealthy"  # running but failing liveness / readiness probes
    BACKOFF = "backoff"  # exited, waiting to be restarted
    CRASH_LOOP = "crash_loop"  # restarted too often; still retried, with the longest backoff
    STOPPING = "stopping"  # draining: SIGTERM sent, waiting for exit
    STOPPED = "stopped"  # not running, on purpose
    FAILED = "failed"  # cannot run (preflight failed, snapshot rejected, bad config)


class DesiredInstanceState(StrEnum):
    """What the control plane wants an instance to be."""

    RUNNING = "running"
    STOPPED = "stopped"


class HostState(StrEnum):
    """Health of a host as the control plane sees it (from heartbeat freshness)."""

    READY = "ready"
    NOT_READY = "not_ready"  # no heartbeat for 3 intervals
    UNREACHABLE = "unreachable"  # no heartbeat for 10 intervals


GpuBackendName = Literal["nvml", "fake"]
CheckStatus = Literal["pass", "warn", "fail"]


class WireModel(BaseModel):
    """Base of every wire message: unknown fields are ignored for forward compatibility, and
    numbers must be finite (a NaN or an Infinity cannot be stored, compared or sent on)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# --- weight snapshots --------------------------------------------------------------------------


class ManifestEntry(WireModel):
    """One file of a weight snapshot: path relative to the snapshot root, size, sha256."""

    path: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0, le=BYTES_MAX)
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _relative_posix_path(cls, value: str) -> str:
        if value.startswith("/") or "\\" in value or re.match(r"^[A-Za-z]:", value):
            raise ValueError(f"manifest path {value!r} must be relative, with '/' separators")
        parts = value.split("/")
        if any(part in {"", ".", ".."} for part in parts):
            raise ValueError(f"manifest path {value!r} must not contain '', '.' or '..' parts")
        if any(ord(c) < 32 for c in value):
            raise ValueError(f"manifest path {value!r} must not contain control characters")
        return value


class Manifest(WireModel):
    """Every file of a weight snapshot; `digest()` identifies the snapshot."""

    files: list[ManifestEntry] = Field(min_length=1, max_length=100_000)

    @model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        seen: set[str] = set()
        for entry in self.files:
            if entry.path in seen:
                raise ValueError(f"manifest lists {entry.path!r} twice")
            seen.add(entry.path)
        if self.total_bytes() > BYTES_MAX:
            raise ValueError(f"manifest sizes add up to more than {BYTES_MAX} bytes")
        return self

    def canonical_json(self) -> bytes:
        """The bytes the digest is taken over: entries sorted by path, compact sorted-key JSON."""
        entries = [
            {"path": e.path, "sha256": e.sha256, "size": e.size}
            for e in sorted(self.files, key=lambda e: e.path)
        ]
        return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """sha256 (64 hex digits) of `canonical_json()`: the snapshot's content address."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    def total_bytes(self) -> int:
        """Sum of all file sizes."""
        return sum(e.size for e in self.files)


class MemoryPlan(WireModel):
    """GPU memory a model version needs, computed by the CLI at registration (no torch needed)."""

    weights_bytes: int = Field(
        ge=0, le=BYTES_MAX, description="bytes of all weights in the serving dtype"
    )
    kv_bytes_per_token: int = Field(
        ge=0, le=BYTES_MAX, description="KV cache bytes per token, all layers"
    )
    dtype: str = Field(default="bfloat16", max_length=32)
    # Rollouts compare decoding figures (steps per block, tokens per forward) within a family
    # only; None: registered before families were recorded, or by a dctl without the engine.
    family: Name | None = Field(
        default=None, description="the model family whose rules sized it: sdar, diffusion-gemma"
    )
    max_context_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    activation_bytes: int = Field(
        default=0, ge=0, le=BYTES_MAX, description="working memory headroom"
    )
    num_parameters: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    # What an instance's ranks split (engine config `parallel`); None: registered before these
    # were stored, or by a dctl without the engine, so no split is checked against them.
    num_heads: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="attention (query) heads per layer"
    )
    num_kv_heads: list[Annotated[int, Field(ge=1, le=INT32_MAX)]] | None = Field(
        default=None,
        max_length=64,
        description="K/V heads per layer, each distinct count once (layers may differ)",
    )
    num_experts: int | None = Field(
        default=None, ge=0, le=INT32_MAX, description="routed experts of a MoE layer; 0: dense"
    )
    vocab_size: int | None = Field(default=None, ge=1, le=INT32_MAX)

    def required_bytes(self, kv_tokens: int) -> int:
        """Bytes needed to hold the weights, activations and a KV cache of `kv_tokens` tokens."""
        return self.weights_bytes + self.activation_bytes + self.kv_bytes_per_token * kv_tokens

    def rank_kv_share(self, ranks: int) -> float:
        """The part of the KV cache one of RANKS ranks holds: its K/V heads of each layer.

        K/V heads split across the ranks, but a rank holds at least one (fewer heads than ranks
        are replicated), so the share is the largest over the layers' counts; 1 / RANKS when the
        counts are unknown.
        """
        if not self.num_kv_heads:
            return 1 / ranks
        return max(-(-kv // ranks) / kv for kv in self.num_kv_heads)

    def rank_bytes(self, kv_tokens: int, ranks: int) -> int:
        """Bytes one of RANKS ranks needs (on its own GPU): its share of the weights and of a
        KV cache of KV_TOKENS tokens, and the whole activation headroom (every rank runs the
        forward of the whole batch)."""
        weights = -(-self.weights_bytes // ranks)
        kv = math.ceil(self.kv_bytes_per_token * kv_tokens * self.rank_kv_share(ranks))
        return weights + self.activation_bytes + kv


# --- registration ------------------------------------------------------------------------------

LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$"


def check_labels(value: dict[str, str]) -> dict[str, str]:
    """VALUE if every key is a label name and every value fits; ValueError naming the bad one."""
    for key, val in value.items():
        if not re.match(LABEL_KEY_PATTERN, key):
            raise ValueError(f"label key {key!r}: letters, digits, '.', '_', '-', '/'")
        if len(val) > 128:
            raise ValueError(f"label {key!r}: value longer than 128 characters")
    return value


# Host labels, one rule wherever they are given: by an agent, a bootstrap token, an operator.
Labels = Annotated[dict[str, PlainText], Field(max_length=64), AfterValidator(check_labels)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, description="a label's key")]


class RegisterRequest(WireModel):
    """Sent with a bootstrap token for a new host. A registered host is registered again (a new
    agent token; the old one revoked) only with its own agent token or an admin's re-key token
    (`POST /api/v1/hosts/{name}/rekey`); any other bootstrap token gets 409."""

    name: Name = Field(description="host name in the fleet, usually the short hostname")
    labels: Labels = Field(
        default_factory=dict,
        description="what the agent reports: shown, but placement reads the operator's labels",
    )
    port_range: tuple[Port, Port] = DEFAULT_PORT_RANGE
    facts: HostFacts | None = None
    advertise_address: Address | None = Field(
        default=None, description="where engines on this host listen for other machines"
    )

    @field_validator("port_range")
    @classmethod
    def _ordered_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError(f"port range {value[0]}-{value[1]}: first port above last")
        return value


class RegisterResponse(WireModel):
    """The host record and the agent token (shown once) bound to that host."""

    host_id: int
    host_name: str
    agent_token: str
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S


# --- heartbeat: what the agent reports ---------------------------------------------------------


class PreflightCheck(WireModel):
    """Result of one preflight check."""

    name: PlainText = Field(max_length=64)
    status: CheckStatus
    reason: PlainText = Field(default="", max_length=1000)


class SnapshotFailure(WireModel):
    """A snapshot the agent could not fetch or verify."""

    digest: Sha256
    error: PlainText = Field(default="", max_length=1000)


class HostFacts(WireModel):
    """Slow-changing facts about the host; the control plane stores them when they change."""

    hostname: PlainText = Field(default="", max_length=255)
    os: PlainText = Field(default="", max_length=255)
    agent_version: PlainText = Field(default="", max_length=64)
    gpu_backend: GpuBackendName = "fake"
    driver_version: PlainText | None = Field(default=None, max_length=64)
    cuda_driver_version: PlainText | None = Field(default=None, max_length=32)
    cpu_count: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    memory_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    disk_free_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    preflight: list[PreflightCheck] = Field(default_factory=list, max_length=64)
    # The host's engines serve HTTPS (the agent gives them its engine certificate): whoever
    # connects to them (the gateway) uses https:// and verifies it. Absent from older agents.
    engine_tls: bool = False
    # Verified weight snapshots the host holds, and those it could not fetch or verify (with
    # the agent's reason, which names the file): what a rollout's pre-staging waits for.
    snapshots: list[Sha256] = Field(default_factory=list, max_length=256)
    snapshot_failures: list[SnapshotFailure] = Field(default_factory=list, max_length=16)
    # Where the agent's own /metrics answers (the port it actually bound: 0 picks one), as
    # `scheme://address:port/metrics`; what `GET /api/v1/metrics/targets` lists. Absent from
    # older agents.
    metrics_url: str | None = Field(default=None, max_length=512)

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | None) -> str | None:
        return None if value is None else check_metrics_url(value)

    def preflight_ok(self) -> bool:
        """True when no preflight check failed."""
        return all(check.status != "fail" for check in self.preflight)


def check_metrics_url(value: str) -> str:
    """VALUE if it is `http(s)://HOST:PORT[/PATH]` (no query or credentials); else ValueError."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"metrics URL {value!r}: write it as http(s)://HOST:PORT/PATH")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"metrics URL {value!r}: {exc}") from None
    if port is None:
        raise ValueError(f"metrics URL {value!r} names no port")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"metrics URL {value!r}: no query, fragment or credentials")
    return value


class GpuStatus(WireModel):
    """One GPU: identity plus its latest sample. Fields NVML does not support are None (N/A)."""

    index: int = Field(ge=0, le=1023)
    uuid: PlainText = Field(max_length=128)
    name: PlainText = Field(default="", max_length=128)
    memory_total_bytes: int = Field(default=0, ge=0, le=BYTES_MAX)
    memory_used_bytes: int = Field(default=0, ge=0, le=BYTES_MAX)
    utilization_percent: float | None = Field(default=None, ge=0, le=100)
    temperature_c: float | None = Field(default=None, ge=-50, le=200)
    power_w: float | None = Field(default=None, ge=0)
    power_limit_w: float | None = Field(default=None, ge=0)
    ecc_uncorrectable: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    persistence_mode: bool | None = None
    compute_capability: PlainText | None = Field(default=None, max_length=16)


class ExitInfo(WireModel):
    """How an engine process last ended."""

    code: int | None = Field(default=None, ge=-INT32_MAX - 1, le=INT32_MAX)
    signal: int | None = Field(default=None, ge=0, le=255)
    reason: PlainText = Field(default="", max_length=1000)
    at: datetime | None = None


class ObservedInstance(WireModel):
    """An engine instance as the agent sees it."""

    instance_id: int = Field(ge=1, le=INT32_MAX)
    state: InstanceState
    pid: int | None = Field(default=None, ge=1, le=INT32_MAX)
    port: Port | None = None
    restart_count: int = Field(default=0, ge=0, le=INT32_MAX)
    last_exit: ExitInfo | None = None
    version_digest: Sha256 | None = None
    message: PlainText = Field(default="", max_length=1000)


class SnapshotProgress(WireModel):
    """Download / verification progress of one weight snapshot."""

    digest: Sha256
    state: Literal["downloading", "verifying", "ready", "failed"]
    bytes_done: int = Field(default=0, ge=0, le=BYTES_MAX)
    bytes_total: int = Field(default=0, ge=0, le=BYTES_MAX)
    bytes_per_s: float = Field(default=0.0, ge=0)
    error: str = Field(default="", max_length=1000)

    def percent(self) -> float:
        """Progress in percent (100 when there is nothing to fetch)."""
        return 100.0 if self.bytes_total == 0 else 100.0 * self.bytes_done / self.bytes_total


class HistogramDelta(WireModel):
    """Change of one histogram since the last heartbeat: cumulative buckets keyed by `le`."""

    buckets: dict[str, float] = Field(default_factory=dict, max_length=64)
    sum: float = 0.0
    count: float = Field(default=0.0, ge=0)


class InstanceMetrics(WireModel):
    """Engine `/metrics` of one instance: counter and histogram deltas, gauges as last seen."""

    instance_id: int = Field(ge=1, le=INT32_MAX)
    counters: dict[str, float] = Field(default_factory=dict, max_length=256)
    histograms: dict[str, HistogramDelta] = Field(default_factory=dict, max_length=64)
    gauges: dict[str, float] = Field(default_factory=dict, max_length=256)


class Heartbeat(WireModel):
    """Sent every `heartbeat_interval_s` with an agent token; the host comes from the token."""

    sent_at: datetime | None = None
    applied_generation: int = Field(
        default=0, ge=0, le=INT32_MAX, description="last desired state applied"
    )
    facts: HostFacts = Field(default_factory=HostFacts)
    advertise_address: Address | None = None
    gpus: list[GpuStatus] = Field(default_factory=list, max_length=64)
    instances: list[ObservedInstance] = Field(default_factory=list, max_length=256)
    snapshots: list[SnapshotProgress] = Field(default_factory=list, max_length=64)
    metrics: list[InstanceMetrics] = Field(default_factory=list, max_length=256)
    # The next log lines of its engines and its own (`protocol.logs`); None: none to ship.
    logs: LogBatch | None = None


# --- heartbeat reply: the desired state --------------------------------------------------------


class ModelVersionRef(WireModel):
    """Everything an agent needs to fetch and verify a model version's weights."""

    name: str
    version: str
    digest: Sha256
    line: VersionLine = "base"
    manifest: Manifest
    source_uri: str = Field(description="where the weights live: a local path or file:// URI")
    files_url: str | None = Field(
        default=None,
        description="path on the control plane serving the files (append the manifest path), "
        "joined to the agent's configured control-plane URL; authenticate with the agent token; "
        "supports Range",
    )
    memory_plan: MemoryPlan | None = None


class DesiredInstance(WireModel):
    """One instance the host should run (or stop)."""

    instance_id: int
    deployment: str
    model: ModelVersionRef
    port: Port
    engine_config: dict[str, Any] = Field(default_factory=dict)
    desired_state: DesiredInstanceState = DesiredInstanceState.RUNNING
    gpu_indices: list[int] = Field(default_factory=list, description="empty: all GPUs")
    bind_address: str = Field(
        default="127.0.0.1", description="address the engine listens on: the host's advertise one"
    )
    api_key: str | None = Field(
        default=None,
        description="the engine's API key; pass it through a 0600 file, never a command line",
        repr=False,
    )


class HeartbeatReply(WireModel):
    """The host's desired state; `generation` grows whenever that desired state changes."""

    generation: int = Field(ge=0)
    host_id: int
    host_state: HostState = HostState.READY
    draining: bool = False
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    server_time: datetime
    instances: list[DesiredInstance] = Field(default_factory=list)
    # Snapshots the agent must not prune even when no instance runs them now: the stable
    # versions, rollback targets and canaries of the deployments on this host.
    keep_digests: list[str] = Field(default_factory=list, max_length=1024)
    # Snapshots to fetch and verify ahead of time (a rollout's pre-staging), run by nothing yet.
    prefetch: list[ModelVersionRef] = Field(default_factory=list, max_length=64)


RegisterRequest.model_rebuild()
