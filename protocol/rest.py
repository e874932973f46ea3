"""Request and response bodies of the REST API (`/api/v1`), shared by the CLI and the TUI."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from protocol.api_model import ApiModel
from protocol.autoscale import AutoscalePolicy, AutoscaleStatus
from protocol.rollout_policy import RolloutPolicy
from protocol.version_ref import VersionRef
from protocol.vocabulary import ROLLOUT_SUBCOMMANDS, CreatableRole
from protocol.wire import (
    ExitInfo,
    GpuStatus,
    HostFacts,
    LabelKey,
    Labels,
    Manifest,
    MemoryPlan,
    Name,
    PlainText,
    VersionLine,
    VersionTag,
)

MAX_INSTANCES_PER_HOST = 16
MAX_GPUS_PER_INSTANCE = 64
MAX_ENGINE_CONFIG_BYTES = 64 * 1024


class ErrorBody(ApiModel):
    """Every error response: a machine-readable code and a message saying what to fix."""

    error: str
    message: str
    details: list[dict[str, Any]] = Field(default_factory=list)


# --- hosts -------------------------------------------------------------------------------------


class InstanceOut(ApiModel):
    """An instance with its desired and observed state."""

    id: int
    deployment: str
    host: str
    version: str
    port: int
    gpu_indices: list[int] = Field(default_factory=list, description="empty: all GPUs of the host")
    desired_state: str
    observed_state: str
    pid: int | None
    restart_count: int
    last_exit: ExitInfo | None
    message: str
    observed_at: datetime | None
    observed_digest: str | None = Field(default=None, description="the snapshot it reports")
    on_version: bool = Field(
        default=False, description="it reports its version's digest: it runs what it should"
    )
    standby: bool = Field(
        default=False, description="kept loaded but out of the gateway's pools (autoscaling)"
    )
    retiring: bool = Field(
        default=False, description="out of the pools, finishing its requests before it stops"
    )
    requests_running: int | None = Field(default=None, description="as its engine last said")
    requests_waiting: int | None = Field(default=None, description="as its engine last said")


class HostOut(ApiModel):
    """A host: health, facts, GPUs with their latest samples; instances on `GET /hosts/{name}`."""

    id: int
    name: str
    state: str
    draining: bool
    labels: dict[str, str] = Field(description="the operator's: the only ones placement reads")
    reported_labels: dict[str, str] = Field(
        default_factory=dict, description="what its agent reports: count for nothing until adopted"
    )
    advertise_address: str | None = Field(
        default=None, description="where other machines reach the host's engines"
    )
    agent_token: bool | None = Field(
        default=None,
        description="on GET /hosts/{name}: it has a working agent token, which the gateway "
        "needs before it sends anything to its address",
    )
    registered_at: datetime
    last_seen_at: datetime | None
    heartbeat_interval_s: float
    port_range: tuple[int, int]
    facts: HostFacts | None
    gpus: list[GpuStatus]
    desired_generation: int
    applied_generation: int
    instances: list[InstanceOut] | None = None


class HostLabelChange(ApiModel):
    """`PATCH /api/v1/hosts/{name}/labels` (operator): change the labels placement reads."""

    adopt: bool = Field(default=False, description="first take every label its agent reports")
    labels: Labels = Field(default_factory=dict, description="then set these")
    remove: list[LabelKey] = Field(default_factory=list, max_length=64, description="then drop")

    @model_validator(mode="after")
    def _a_change(self) -> HostLabelChange:
        if not (self.adopt or self.labels or self.remove):
            raise ValueError("name labels to set, keys to remove, or adopt the reported labels")
        both = sorted(set(self.labels) & set(self.remove))
        if both:
            raise ValueError(f"label(s) {', '.join(both)}: both set and removed; choose one")
        return self


class SeriesOut(ApiModel):
    """One downsampled metric series of a host (`instance_id` None) or one of its instances."""

    name: str
    instance_id: int | None
    points: list[tuple[datetime, float]]


# --- models ------------------------------------------------------------------------------------


class RegisterVersionRequest(ApiModel):
    """`POST /api/v1/models/{name}/versions`: register an immutable weight snapshot."""

    version: VersionTag
    manifest: Manifest
    memory_plan: MemoryPlan | None = None
    line: VersionLine = "base"
    parent: str | None = Field(default=None, description="NAME:VERSION of the parent version")
    source_uri: str = Field(min_length=1, max_length=2048, description="absolute path or file://")
    notes: str = Field(default="", max_length=4000)
    digest: str | None = Field(
        default=None, description="optional: checked against the manifest's digest"
    )

    @field_validator("parent")
    @classmethod
    def _parent_ref(cls, value: str | None) -> str | None:
        if value is not None:
            VersionRef.parse(value)
        return value


class VersionOut(ApiModel):
    """A model version (manifest included on `GET .../versions/{version}`)."""

    model: str
    version: str
    line: str
    parent: str | None
    digest: str
    total_bytes: int
    file_count: int
    memory_plan: MemoryPlan | None
    source_uri: str
    notes: str
    deprecated: bool
    created_at: datetime
    manifest: Manifest | None = None


class ModelOut(ApiModel):
    """A model and its versions, oldest first."""

    name: str
    created_at: datetime
    versions: list[VersionOut]


# --- deployments -------------------------------------------------------------------------------


def _check_engine_config(value: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(value)) > MAX_ENGINE_CONFIG_BYTES:
        raise ValueError(f"engine_config is larger than {MAX_ENGINE_CONFIG_BYTES} bytes")
    return value


class Placement(ApiModel):
    """Where a deployment runs: named hosts and/or every host carrying all these labels."""

    hosts: list[Name] = Field(default_factory=list, max_length=1000)
    labels: dict[PlainText, PlainText] = Field(default_factory=dict, max_length=32)


class DeploymentCreate(ApiModel):
    """`POST /api/v1/deployments`."""

    name: Name
    model: Name
    version: VersionTag
    placement: Placement
    instances_per_host: int = Field(default=1, ge=0, le=MAX_INSTANCES_PER_HOST)
    gpus_per_instance: int | None = Field(
        default=None,
        ge=0,
        le=MAX_GPUS_PER_INSTANCE,
        description="GPUs each instance gets, its own on its host; omitted or 0: all GPUs",
    )
    engine_config: dict[str, Any] = Field(default_factory=dict)
    autoscale: AutoscalePolicy | None = Field(
        default=None, description="scale on load between min and max (instances_per_host unused)"
    )

    _engine_config = field_validator("engine_config")(_check_engine_config)

    @field_validator("name")
    @classmethod
    def _not_a_rollout_subcommand(cls, value: str) -> str:
        if value in ROLLOUT_SUBCOMMANDS:
            raise ValueError(
                f"{value!r} is a `dctl rollout` subcommand ({', '.join(ROLLOUT_SUBCOMMANDS)}); "
                "choose another deployment name"
            )
        return value


class DeploymentUpdate(ApiModel):
    """`PATCH /api/v1/deployments/{name}`: change any of these; omitted fields stay."""

    instances_per_host: int | None = Field(default=None, ge=0, le=MAX_INSTANCES_PER_HOST)
    gpus_per_instance: int | None = Field(
        default=None, ge=0, le=MAX_GPUS_PER_INSTANCE, description="0: all GPUs of the host"
    )
    engine_config: dict[str, Any] | None = None
    version: VersionTag | None = Field(default=None, description="switch the stable version")
    placement: Placement | None = None
    rollout_policy: RolloutPolicy | None = Field(
        default=None, description="the deployment's rollout thresholds (replaces the old ones)"
    )

    _engine_config = field_validator("engine_config")(
        lambda v: None if v is None else _check_engine_config(v)
    )


class DeploymentOut(ApiModel):
    """A deployment and its instances."""

    id: int
    name: str
    model: str
    version: str
    placement: Placement
    instances_per_host: int
    gpus_per_instance: int | None = Field(default=None, description="None: all GPUs of the host")
    engine_config: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    instances: list[InstanceOut]
    canary_version: str | None = Field(default=None, description="VERSION of an active canary")
    canary_weight: int = Field(default=0, description="percent of gateway requests to it")
    rollback_version: str | None = Field(
        default=None,
        description="VERSION `dctl rollback` goes back to without --to (None: nothing to go to)",
    )
    rollout_policy: RolloutPolicy = Field(
        default_factory=lambda: RolloutPolicy(), description="the deployment's own thresholds"
    )
    autoscale: AutoscalePolicy | None = Field(default=None, description="None: fixed count")
    autoscale_status: AutoscaleStatus | None = None


# --- events ------------------------------------------------------------------------------------


class EventOut(ApiModel):
    """One audit-log entry."""

    id: int
    time: datetime
    actor: str
    kind: str
    subject: str
    message: str
    data: dict[str, Any]


class EventPage(ApiModel):
    """A page of events, oldest first; pass `next_cursor` as `after` to get newer ones."""

    items: list[EventOut]
    next_cursor: int


# --- tokens ------------------------------------------------------------------------------------


class TokenCreate(ApiModel):
    """`POST /api/v1/tokens` (admin). Agent tokens come only from agent registration."""

    name: Name
    role: CreatableRole
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)
    uses: int | None = Field(default=None, ge=1, le=1_000_000)
    deployments: list[Name] | None = Field(
        default=None,
        max_length=256,
        description="client tokens only: the deployments it may call (None: all of them)",
    )
    labels: Labels | None = Field(
        default=None, description="bootstrap tokens only: labels stamped on the hosts it registers"
    )
    allow_pool_pin: bool = Field(
        default=False,
        description="client tokens only: may pin a request to the stable or canary pool with "
        "`x-dctl-pool` (pinned requests count in no rollout analysis)",
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="client tokens only: requests in flight at once through one gateway "
        "(None: the gateway's max_concurrency_per_token)",
    )

    @field_validator("labels")
    @classmethod
    def _labels_for_bootstrap(cls, value: Labels | None, info: ValidationInfo) -> Labels | None:
        # Field-level, so the 422 names `labels`; `role` is validated first (declared first).
        if value is not None and info.data.get("role") != "bootstrap":
            raise ValueError("labels applies to bootstrap tokens only (role bootstrap)")
        return value

    @field_validator("allow_pool_pin", "max_concurrency")
    @classmethod
    def _gateway_grants_for_clients(cls, value: Any, info: ValidationInfo) -> Any:
        # Field-level, so the 422 names the field; only client tokens reach the gateway.
        if value not in (None, False) and info.data.get("role") != "client":
            raise ValueError(f"{info.field_name} applies to client tokens only (role client)")
        return value

    @model_validator(mode="after")
    def _deployments_for_clients(self) -> TokenCreate:
        if self.deployments is not None and self.role != "client":
            raise ValueError("deployments applies to client tokens only (role client)")
        if self.deployments is not None and not self.deployments:
            raise ValueError("deployments must name at least one deployment (omit it for all)")
        if self.uses is not None and self.role == "client":
            # Gateways check client tokens against the routing table's hashes: none counts uses.
            raise ValueError("uses does not apply to client tokens: give expires_in_s instead")
        return self


class TokenOut(ApiModel):
    """A token as listed: never its secret."""

    id: str
    name: str
    role: str
    host: str | None
    expires_at: datetime | None
    uses_left: int | None
    created_at: datetime
    created_by: str
    last_used_at: datetime | None
    revoked_at: datetime | None
    deployments: list[str] | None = None
    labels: dict[str, str] | None = Field(default=None, description="stamped on hosts it registers")
    allow_pool_pin: bool = False
    max_concurrency: int | None = None


class TokenCreated(TokenOut):
    """The one response that carries a token's secret."""

    secret: str


# --- status ------------------------------------------------------------------------------------


class FleetStatus(ApiModel):
    """`GET /api/v1/status`: counts for a fleet summary."""

    hosts_by_state: dict[str, int]
    hosts_draining: int
    gpus: int
    models: int
    versions: int
    deployments: int
    instances_by_state: dict[str, int]
