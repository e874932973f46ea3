"""The store: SQLModel tables of the control plane (one source of truth for the fleet).

Times are stored as naive UTC and read back timezone-aware (`UTCDateTime`), so SQLite and
PostgreSQL behave the same. JSON columns hold documents that are only ever read whole
(manifests, engine configs, facts, latest GPU samples).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.engine import Dialect
from sqlmodel import Field, SQLModel

from controlplane.autoscaler.state import AutoscaleState
from controlplane.rollouts.progress import RolloutProgress, RolloutSettings
from protocol.autoscale import AutoscalePolicy
from protocol.rollout_states import RolloutKind, RolloutPhase, RolloutState


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """A timestamp stored as naive UTC and always returned timezone-aware (UTC)."""

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Normalise to naive UTC before writing."""
        if value is None:
            return None
        if value.tzinfo is None:
            return value
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Attach UTC to what the database returns."""
        return None if value is None else value.replace(tzinfo=UTC)


E = TypeVar("E", bound=StrEnum)


class EnumText(sa.types.TypeDecorator[E]):
    """A `StrEnum` stored as its value in a plain VARCHAR (no database enum type, so adding a
    member needs no migration) and read back as the member."""

    impl = sa.String
    cache_ok = True

    def __init__(self, enum: type[E], length: int) -> None:
        super().__init__(length)
        self.enum = enum

    def process_bind_param(self, value: E | str | None, dialect: Dialect) -> str | None:
        """Write the value (a misspelt one fails here, not in a reader)."""
        return None if value is None else self.enum(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> E | None:
        """Read the member."""
        return None if value is None else self.enum(value)


M = TypeVar("M", bound=BaseModel)


class ModelJSON(sa.types.TypeDecorator[M]):
    """A pydantic model stored as a JSON document and read back as the model, so a row's
    structured field is typed (and checked) on the way in and out."""

    impl = sa.JSON
    cache_ok = True

    def __init__(self, model: type[M]) -> None:
        super().__init__()
        self.model = model

    def process_bind_param(self, value: M | None, dialect: Dialect) -> Any:
        """The document: fields left at None are left out."""
        if value is None:
            return None
        return self.model.model_validate(value).model_dump(mode="json", exclude_none=True)

    def process_result_value(self, value: Any, dialect: Dialect) -> M | None:
        """The model (an empty document: its defaults)."""
        return None if value is None else self.model.model_validate(value)


def model_column(model: type[BaseModel]) -> Any:
    """A `ModelJSON` column (a fresh Column object per field)."""
    return sa.Column(ModelJSON(model), nullable=False)


def enum_column(enum: type[StrEnum], length: int = 16, index: bool = False) -> Any:
    """An `EnumText` column (a fresh Column object per field)."""
    return sa.Column(EnumText(enum, length), nullable=False, index=index)


def utc_column(nullable: bool = True, index: bool = False) -> Any:
    """A `UTCDateTime` column (SQLModel needs a fresh Column object per field)."""
    return sa.Column(UTCDateTime(), nullable=nullable, index=index)


def json_column(nullable: bool = True) -> Any:
    """A JSON column (a fresh Column object per field)."""
    return sa.Column(sa.JSON(), nullable=nullable)


def fk(target: str, ondelete: str, nullable: bool = False, index: bool = True) -> Any:
    """A foreign-key integer column with an explicit ON DELETE rule."""
    return sa.Column(
        sa.Integer(), sa.ForeignKey(target, ondelete=ondelete), nullable=nullable, index=index
    )


class Host(SQLModel, table=True):
    """A GPU host running an agent."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True)
    # The operator's labels (`dctl host label`, or stamped by the bootstrap token): the only ones
    # placement reads. What the agent reports is kept apart until an operator adopts it.
    labels: dict[str, str] = Field(default_factory=dict, sa_column=json_column(False))
    reported_labels: dict[str, str] = Field(default_factory=dict, sa_column=json_column(False))
    # Where engines on this host listen and the agent's probes reach them (IP or DNS name).
    advertise_address: str | None = Field(default=None, max_length=255)
    state: str = Field(default="ready", max_length=16, index=True)
    draining: bool = False
    registered_at: datetime = Field(sa_column=utc_column(False))
    last_seen_at: datetime | None = Field(default=None, sa_column=utc_column())
    heartbeat_interval_s: float = 5.0
    port_range_start: int = 18000
    port_range_end: int = 18099
    facts: dict[str, Any] = Field(default_factory=dict, sa_column=json_column(False))
    gpu_samples: list[dict[str, Any]] = Field(default_factory=list, sa_column=json_column(False))
    # Grows whenever this host's desired state changes; the agent echoes what it applied.
    desired_generation: int = 1
    applied_generation: int = 0
    # Grows with every write of observed state (heartbeat, registration), whichever replica
    # made it: a replica whose last write was not the one before knows its caches are stale.
    heartbeat_seq: int = 0


class GatewayProcess(SQLModel, table=True):
    """A gateway process that heartbeats (`POST /api/v1/gateways/heartbeat`): where it serves and
    where its /metrics answers. Live while its heartbeats come; silent rows are pruned like
    samples."""

    id: int | None = Field(default=None, primary_key=True)
    # The gateway's own id (hostname-pid-random), as in its traffic reports.
    name: str = Field(max_length=128, unique=True)
    address: str = Field(max_length=255)
    port: int
    scheme: str = Field(default="http", max_length=8)
    version: str = Field(default="", max_length=64)
    metrics_url: str | None = Field(default=None, max_length=512)
    interval_s: float = 5.0
    # The name of the gateway token it heartbeats with (which credential to revoke).
    token_name: str = Field(default="", max_length=63)
    first_seen_at: datetime = Field(sa_column=utc_column(False))
    last_seen_at: datetime = Field(sa_column=utc_column(False, index=True))


class Gpu(SQLModel, table=True):
    """Identity of one GPU of a host (its samples live on Host.gpu_samples and MetricSample)."""

    __table_args__ = (sa.UniqueConstraint("host_id", "index", name="uq_gpu_host_index"),)

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(sa_column=fk("host.id", "CASCADE"))
    index: int
    uuid: str = Field(max_length=128)
    name: str = Field(default="", max_length=128)
    memory_total_bytes: int = Field(default=0, sa_type=sa.BigInteger)
    compute_capability: str | None = Field(default=None, max_length=16)


class Model(SQLModel, table=True):
    """A model: a name under which weight snapshots (versions) are registered."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True)
    created_at: datetime = Field(sa_column=utc_column(False))


class ModelVersion(SQLModel, table=True):
    """An immutable weight snapshot: manifest (path/size/sha256), its digest, line and parent."""

    __table_args__ = (sa.UniqueConstraint("model_id", "version", name="uq_modelversion_tag"),)

    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(sa_column=fk("model.id", "CASCADE"))
    version: str = Field(max_length=64)
    line: str = Field(default="base", max_length=16)
    parent_id: int | None = Field(
        default=None, sa_column=fk("modelversion.id", "RESTRICT", nullable=True)
    )
    digest: str = Field(max_length=64, index=True)
    manifest: list[dict[str, Any]] = Field(sa_column=json_column(False))
    total_bytes: int = Field(default=0, sa_type=sa.BigInteger)
    memory_plan: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    source_uri: str = Field(max_length=2048)
    notes: str = Field(default="", max_length=4000)
    deprecated: bool = False
    created_at: datetime = Field(sa_column=utc_column(False))


class Deployment(SQLModel, table=True):
    """A model version served on a set of hosts, N instances per host."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True)
    model_id: int = Field(sa_column=fk("model.id", "RESTRICT"))
    stable_version_id: int = Field(sa_column=fk("modelversion.id", "RESTRICT"))
    engine_config: dict[str, Any] = Field(default_factory=dict, sa_column=json_column(False))
    placement_hosts: list[str] = Field(default_factory=list, sa_column=json_column(False))
    placement_labels: dict[str, str] = Field(default_factory=dict, sa_column=json_column(False))
    instances_per_host: int = 1
    # GPUs each instance gets (disjoint indices on its host); None: all GPUs of the host.
    gpus_per_instance: int | None = None
    # RolloutPolicy fields this deployment sets (the rest are the built-in defaults).
    rollout_policy: dict[str, Any] = Field(default_factory=dict, sa_column=json_column(False))
    # What `dctl rollback` returns to: the stable pair before the last promotion (no foreign
    # key: see migration 0004; a version deleted since is reported at rollback).
    rollback_version_id: int | None = None
    rollback_engine_config: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    # Autoscaling (`protocol.autoscale`): with a policy, `replicas` serving instances (the
    # autoscaler's to choose) plus the policy's standby ones are spread over the placement's
    # hosts instead of `instances_per_host` on each. `replicas` without a policy: a fixed count
    # (autoscaling turned off keeps what it had).
    autoscale: AutoscalePolicy | None = Field(
        default=None, sa_column=sa.Column(ModelJSON(AutoscalePolicy), nullable=True)
    )
    replicas: int | None = None
    autoscale_state: AutoscaleState = Field(
        default_factory=AutoscaleState, sa_column=model_column(AutoscaleState)
    )
    # A gateway holds a request for this deployment (scaled to zero) since then.
    wake_requested_at: datetime | None = Field(default=None, sa_column=utc_column())
    created_at: datetime = Field(sa_column=utc_column(False))
    updated_at: datetime = Field(sa_column=utc_column(False))


class Instance(SQLModel, table=True):
    """One engine process of a deployment on a host: desired and observed state."""

    __table_args__ = (sa.UniqueConstraint("host_id", "port", name="uq_instance_host_port"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(sa_column=fk("deployment.id", "CASCADE"))
    host_id: int = Field(sa_column=fk("host.id", "CASCADE"))
    version_id: int = Field(sa_column=fk("modelversion.id", "RESTRICT"))
    ordinal: int = 0
    port: int
    gpu_indices: list[int] = Field(default_factory=list, sa_column=json_column(False))
    # The engine's only API key, generated here; readable by this host's agent and gateways only.
    # Kept in clear (unlike bearer tokens): the gateway must present it to the engine.
    api_key: str = Field(default="", max_length=128)
    desired_state: str = Field(default="running", max_length=16)
    observed_state: str = Field(default="pending", max_length=16)
    pid: int | None = None
    restart_count: int = 0
    last_exit: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    observed_digest: str | None = Field(default=None, max_length=64)
    # The host's desired generation that carried this instance's current version: until the
    # host's agent has applied it, what the instance reports is the engine it is replacing,
    # which may even have the same weights (an engine-config version).
    spec_generation: int = Field(
        default=0, sa_column=sa.Column(sa.Integer, nullable=False, server_default="0")
    )
    message: str = Field(default="", max_length=1000)
    # Autoscaling: loaded and ready, but out of the gateway's pools until promoted.
    standby: bool = Field(
        default=False, sa_column=sa.Column(sa.Boolean, nullable=False, server_default=sa.false())
    )
    # Scaled down: out of the pools since it was set; stopped (deleted) once this time passes,
    # when every gateway has stopped sending to it and its last requests have gone in.
    retire_at: datetime | None = Field(default=None, sa_column=utc_column())
    # Its engine's load as last reported (dllm_requests_running / _waiting): the autoscaler's
    # signal. None: not reported (yet).
    requests_running: int | None = None
    requests_waiting: int | None = None
    created_at: datetime = Field(sa_column=utc_column(False))
    observed_at: datetime | None = Field(default=None, sa_column=utc_column())


class Rollout(SQLModel, table=True):
    """A change of what a deployment runs, of one `kind`:

    - `rollout`: a canary of `to_version_id` (with `engine_config`, if set) on `canary_instances`
      of its instances, getting `canary_weight` percent of the gateway's requests, through the
      plan in `steps`, analysed at each step (`controlplane.rollouts`), then promoted;
    - `rollback`: the same mechanics without analysis, to a version the hosts still hold;
    - `restart`: the deployment's engines replaced one at a time (`progress` holds the queue);
    - `manual`: a canary held where the operator sets it (`dctl deploy canary`), no timed plan.

    At most one is active (`protocol.rollout_states.ACTIVE_STATES`) per deployment.
    """

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(sa_column=fk("deployment.id", "CASCADE"))
    from_version_id: int = Field(sa_column=fk("modelversion.id", "RESTRICT"))
    to_version_id: int = Field(sa_column=fk("modelversion.id", "RESTRICT"))
    state: RolloutState = Field(
        default=RolloutState.PROGRESSING, sa_column=enum_column(RolloutState, index=True)
    )
    step_index: int = 0
    canary_weight: int = 0
    canary_instances: int = 0
    steps: list[dict[str, Any]] = Field(default_factory=list, sa_column=json_column(False))
    analysis: list[dict[str, Any]] = Field(default_factory=list, sa_column=json_column(False))
    message: str = Field(default="", max_length=1000)
    kind: RolloutKind = Field(default=RolloutKind.ROLLOUT, sa_column=enum_column(RolloutKind))
    # Fixed at creation (resolved policy, surge), and how far it has come (restart queue,
    # interval starts, notified state, a pending promote).
    settings: RolloutSettings = Field(
        default_factory=RolloutSettings, sa_column=model_column(RolloutSettings)
    )
    progress: RolloutProgress = Field(
        default_factory=RolloutProgress, sa_column=model_column(RolloutProgress)
    )
    engine_config: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    phase: RolloutPhase = Field(default=RolloutPhase.WAITING, sa_column=enum_column(RolloutPhase))
    # When the current step's clock started (its canary became ready); None: not yet.
    step_started_at: datetime | None = Field(default=None, sa_column=utc_column())
    # Time left in the step when it was paused.
    paused_left_s: float | None = None
    failures: int = 0  # consecutive failed analyses
    actor: str = Field(default="", max_length=128)
    # The controller's last round on it: a gap (no leader) is added to the step's clock.
    ticked_at: datetime | None = Field(default=None, sa_column=utc_column())
    created_at: datetime = Field(sa_column=utc_column(False))
    updated_at: datetime = Field(sa_column=utc_column(False))


class Lease(SQLModel, table=True):
    """A named lease held by one control-plane replica until `expires_at` (controllers' leader)."""

    name: str = Field(primary_key=True, max_length=64)
    holder: str = Field(max_length=128)
    acquired_at: datetime = Field(sa_column=utc_column(False))
    expires_at: datetime = Field(sa_column=utc_column(False))


class Event(SQLModel, table=True):
    """Append-only audit log entry."""

    id: int | None = Field(default=None, primary_key=True)
    time: datetime = Field(sa_column=utc_column(False, index=True))
    actor: str = Field(max_length=128)
    kind: str = Field(max_length=64, index=True)
    subject: str = Field(max_length=200, index=True)
    message: str = Field(default="", max_length=2000)
    data: dict[str, Any] = Field(default_factory=dict, sa_column=json_column(False))


class ApiToken(SQLModel, table=True):
    """A bearer token: only the SHA-256 of the secret is stored."""

    id: int | None = Field(default=None, primary_key=True)
    key_id: str = Field(max_length=32, unique=True)
    name: str = Field(max_length=63, index=True)
    role: str = Field(max_length=16)
    secret_sha256: str = Field(max_length=64)
    host_id: int | None = Field(default=None, sa_column=fk("host.id", "CASCADE", nullable=True))
    expires_at: datetime | None = Field(default=None, sa_column=utc_column())
    uses_left: int | None = None
    created_at: datetime = Field(sa_column=utc_column(False))
    created_by: str = Field(default="", max_length=128)
    last_used_at: datetime | None = Field(default=None, sa_column=utc_column())
    revoked_at: datetime | None = Field(default=None, sa_column=utc_column())
    # Client tokens only: the deployments the token may call through the gateway (None: all).
    deployments: list[str] | None = Field(default=None, sa_column=json_column())
    # Client tokens only: may pin a request to the stable or canary pool (`x-dctl-pool`).
    allow_pool_pin: bool = False
    # Client tokens only: requests in flight at once through one gateway (None: the default).
    max_concurrency: int | None = None
    # Bootstrap tokens only: the labels stamped on every host the token registers.
    labels: dict[str, str] | None = Field(default=None, sa_column=json_column())


class MetricSample(SQLModel, table=True):
    """A downsampled point of a host or instance series (one per series per 10 s)."""

    __table_args__ = (sa.Index("ix_metricsample_series", "host_id", "name", "time"),)

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(sa_column=fk("host.id", "CASCADE", index=False))
    instance_id: int | None = Field(
        default=None, sa_column=fk("instance.id", "CASCADE", nullable=True)
    )
    name: str = Field(max_length=128)
    time: datetime = Field(sa_column=utc_column(False, index=True))
    value: float


class TrafficWindow(SQLModel, table=True):
    """What one gateway served of one (deployment, version, pool) between two times.

    Gateways post these every few seconds; queries add up the rows of every gateway in a range
    (counts and per-bucket histogram counts over `protocol.gateway.LATENCY_BUCKETS_S` add by
    position). Kept as long as MetricSample.
    """

    __table_args__ = (sa.Index("ix_trafficwindow_series", "deployment_id", "ended_at"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(sa_column=fk("deployment.id", "CASCADE", index=False))
    version_id: int = Field(sa_column=fk("modelversion.id", "CASCADE"))
    pool: str = Field(max_length=16)
    gateway: str = Field(max_length=128)
    started_at: datetime = Field(sa_column=utc_column(False))
    ended_at: datetime = Field(sa_column=utc_column(False, index=True))
    requests: int = Field(default=0, sa_type=sa.BigInteger)
    errors_5xx: int = Field(default=0, sa_type=sa.BigInteger)
    errors_timeout: int = Field(default=0, sa_type=sa.BigInteger)
    errors_connect: int = Field(default=0, sa_type=sa.BigInteger)
    client_4xx: int = Field(default=0, sa_type=sa.BigInteger)
    output_tokens: int = Field(default=0, sa_type=sa.BigInteger)
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = Field(default_factory=list, sa_column=json_column(False))
    ttft_sum_s: float = 0.0
    ttft_buckets: list[int] = Field(default_factory=list, sa_column=json_column(False))


class LogLine(SQLModel, table=True):
    """One log line an agent shipped: an engine's (`instance_id`) or the agent's own.

    Kept for `log_retention_s` and at most `log_max_lines_per_instance` per instance (the
    host-health controller's sweep). No foreign key to the instance: an instance scaled away
    keeps its last lines. `dropped`: lines the agent could not keep past its bound (a marker
    line, the count is the news).
    """

    __table_args__ = (
        sa.Index("ix_logline_deployment_time", "deployment_id", "time"),
        sa.Index("ix_logline_instance", "instance_id", "id"),
    )

    id: int | None = Field(default=None, primary_key=True)
    # Few indexes: every one is paid per line shipped, in the heartbeat's transaction. Lines
    # are looked up by deployment and time; a host's cascade and a request id scan those.
    host_id: int = Field(sa_column=fk("host.id", "CASCADE", index=False))
    deployment_id: int | None = Field(
        default=None, sa_column=fk("deployment.id", "CASCADE", nullable=True, index=False)
    )
    instance_id: int | None = None
    source: str = Field(default="engine", max_length=8)
    time: datetime = Field(sa_column=utc_column(False, index=True))
    seq: int = Field(default=0, sa_type=sa.BigInteger)
    line: str = Field(sa_column=sa.Column(sa.Text(), nullable=False))
    request_id: str | None = Field(default=None, max_length=128)
    dropped: int = Field(default=0, sa_type=sa.BigInteger)


class RequestRecord(SQLModel, table=True):
    """A gateway's summary of one request (sampled above its rate): `dctl requests`."""

    __table_args__ = (sa.Index("ix_requestrecord_deployment_time", "deployment_id", "time"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(sa_column=fk("deployment.id", "CASCADE", index=False))
    gateway: str = Field(max_length=128)
    request_id: str = Field(max_length=128, index=True)
    time: datetime = Field(sa_column=utc_column(False, index=True))
    token: str = Field(default="", max_length=63)
    version: str = Field(default="", max_length=200)
    pool: str = Field(default="", max_length=16)
    instance_id: int | None = None
    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    steps_per_block: float | None = None
    tokens_per_forward: float | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    stream: bool = False


class TokenUse(SQLModel, table=True):
    """What one gateway served one client token for one deployment in one report (every
    request), and what it refused of a token (`reason` set, `deployment` empty): the audit."""

    __table_args__ = (sa.Index("ix_tokenuse_token_time", "token", "ended_at"),)

    id: int | None = Field(default=None, primary_key=True)
    gateway: str = Field(max_length=128)
    token: str = Field(default="", max_length=63)
    key_id: str = Field(default="", max_length=32)
    deployment: str = Field(default="", max_length=63)
    reason: str = Field(default="", max_length=16)
    started_at: datetime = Field(sa_column=utc_column(False))
    ended_at: datetime = Field(sa_column=utc_column(False, index=True))
    requests: int = Field(default=0, sa_type=sa.BigInteger)
    errors: int = Field(default=0, sa_type=sa.BigInteger)
    rate_limited: int = Field(default=0, sa_type=sa.BigInteger)
    refused: int = Field(default=0, sa_type=sa.BigInteger)
