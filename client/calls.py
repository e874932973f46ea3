"""The control plane's REST API as data: one function per endpoint, returning the `Call` to make.

A `Call` says everything about one request — method, path, query, JSON body, extra headers — and
how to read the answer into its response model. Nothing here sends anything:
`ControlPlaneClient` and `AsyncControlPlaneClient` execute the same calls, so each endpoint is
written once and the two clients cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache, partial
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, TypeAdapter

from protocol.autoscale import AutoscalePolicy
from protocol.gateway import (
    CanaryOut,
    CanarySet,
    DeploymentTraffic,
    RouteTable,
    TrafficAccepted,
    TrafficReport,
)
from protocol.logs import AuditReport, LogPage, RequestOut
from protocol.monitoring import (
    GATEWAY_HEARTBEAT_PATH,
    GATEWAYS_PATH,
    TARGETS_PATH,
    GatewayHeartbeat,
    GatewayOut,
    ScrapeTargetGroup,
)
from protocol.rest import (
    DeploymentCreate,
    DeploymentOut,
    DeploymentUpdate,
    EventPage,
    FleetStatus,
    HostLabelChange,
    HostOut,
    ModelOut,
    SeriesOut,
    TokenCreate,
    TokenCreated,
    TokenOut,
    VersionOut,
)
from protocol.rollouts import (
    RestartCreate,
    RollbackCreate,
    RolloutAction,
    RolloutCreate,
    RolloutOut,
)
from protocol.wire import STORED, Manifest, MemoryPlan, VersionLine

API = "/api/v1"
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer; `read` raises `ValidationError` on a bad shape.

    Query parameters that are None are left out, so optional filters need no special casing;
    datetimes go out in ISO 8601. `headers` are sent besides the client's own. With
    `not_modified_is_none`, a 304 answer (to a conditional request) reads as None.
    """

    method: str
    path: str
    read: Callable[[Any], T]
    params: Mapping[str, Any] = field(default_factory=dict)
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    not_modified_is_none: bool = False

    def query(self) -> dict[str, Any] | None:
        """The query parameters to send (None values dropped), or None for no query string."""
        clean = {k: _query_value(v) for k, v in self.params.items() if v is not None}
        return clean or None


def _query_value(value: Any) -> Any:
    """A query value as sent: datetimes in ISO 8601 (UTC as `Z`), anything else as it is."""
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            return value.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"
        return value.isoformat()
    return value


def segment(value: str) -> str:
    """One path segment from user input: a '/' or '?' in a name must not change the route."""
    return quote(value, safe="")


# How answers are read: a model, a list of models, nothing, or the JSON as it is. An answer may
# quote rows stored before the API refused control characters: read as they are (the CLI and the
# TUI strip them before printing), not refused.


def one(model: type[M]) -> Callable[[Any], M]:
    """Read the body as one MODEL."""
    return partial(model.model_validate, context=STORED)


def many(model: type[M]) -> Callable[[Any], list[M]]:
    """Read the body as a list of MODEL."""
    return partial(_list_adapter(model).validate_python, context=STORED)


@cache
def _list_adapter(model: type[M]) -> TypeAdapter[list[M]]:
    # Building an adapter compiles a validator: once per model, not once per call.
    return TypeAdapter(list[model])  # type: ignore[valid-type]


def nothing(body: Any) -> None:
    """Ignore the body (DELETE answers 204, or an echo nobody needs)."""
    return None


def as_is(body: Any) -> Any:
    """The decoded JSON as it came, None for an empty body."""
    return body


# Any request ---------------------------------------------------------------------------------


def request(
    method: str, path: str, *, json: Any = None, params: Mapping[str, Any] | None = None
) -> Call[Any]:
    """Any request; the answer is the decoded JSON (None for an empty body)."""
    return Call(method, path, as_is, params or {}, json)


# Health and fleet summary --------------------------------------------------------------------


def healthz() -> Call[Any]:
    """`GET /healthz`: the process is up."""
    return Call("GET", "/healthz", as_is)


def status() -> Call[FleetStatus]:
    """Counts for a fleet summary: hosts by state, GPUs, models, deployments, instances."""
    return Call("GET", f"{API}/status", one(FleetStatus))


# Hosts ---------------------------------------------------------------------------------------


def list_hosts() -> Call[list[HostOut]]:
    """Every host with its state, GPUs and latest samples."""
    return Call("GET", f"{API}/hosts", many(HostOut))


def get_host(name: str) -> Call[HostOut]:
    """One host with its GPUs, latest samples and instances."""
    return Call("GET", f"{API}/hosts/{segment(name)}", one(HostOut))


def host_samples(
    name: str, *, minutes: int | None = None, series: str | None = None
) -> Call[list[SeriesOut]]:
    """Host NAME's downsampled GPU and instance series over the last MINUTES, oldest first;
    SERIES is an exact name or a `prefix.*`."""
    params = {"minutes": minutes, "series": series}
    return Call("GET", f"{API}/hosts/{segment(name)}/samples", many(SeriesOut), params)


def label_host(name: str, change: HostLabelChange) -> Call[HostOut]:
    """Change host NAME's labels, the ones placement reads (operator)."""
    body = change.model_dump(mode="json")
    return Call("PATCH", f"{API}/hosts/{segment(name)}/labels", one(HostOut), json=body)


def drain_host(name: str) -> Call[HostOut]:
    """Stop scheduling onto host NAME and stop its instances (operator)."""
    return Call("POST", f"{API}/hosts/{segment(name)}/drain", one(HostOut))


def undrain_host(name: str) -> Call[HostOut]:
    """Let host NAME take instances again (operator)."""
    return Call("POST", f"{API}/hosts/{segment(name)}/undrain", one(HostOut))


def rekey_host(name: str) -> Call[TokenCreated]:
    """A one-use bootstrap token that registers host NAME again, and only it (admin)."""
    return Call("POST", f"{API}/hosts/{segment(name)}/rekey", one(TokenCreated))


def remove_host(name: str) -> Call[None]:
    """Forget host NAME and revoke its agent token (admin)."""
    return Call("DELETE", f"{API}/hosts/{segment(name)}", nothing)


# Models --------------------------------------------------------------------------------------


def list_models() -> Call[list[ModelOut]]:
    """Every model with its versions."""
    return Call("GET", f"{API}/models", many(ModelOut))


def get_model(name: str) -> Call[ModelOut]:
    """One model with its versions."""
    return Call("GET", f"{API}/models/{segment(name)}", one(ModelOut))


def get_version(name: str, version: str) -> Call[VersionOut]:
    """One model version with its manifest and memory plan."""
    return Call("GET", f"{API}/models/{segment(name)}/versions/{segment(version)}", one(VersionOut))


def register_version(
    name: str,
    version: str,
    manifest: Manifest,
    *,
    source_uri: str,
    line: VersionLine = "base",
    parent: str | None = None,
    memory_plan: MemoryPlan | None = None,
    notes: str = "",
) -> Call[VersionOut]:
    """Register NAME:VERSION; the same manifest again is a no-op, a different one a 409."""
    body: dict[str, Any] = {
        "version": version,
        "manifest": manifest.model_dump(mode="json"),
        "digest": manifest.digest(),
        "source_uri": source_uri,
        "line": line,
        "parent": parent,
        "notes": notes,
        "memory_plan": memory_plan.model_dump(mode="json") if memory_plan else None,
    }
    return Call("POST", f"{API}/models/{segment(name)}/versions", one(VersionOut), json=body)


def deprecate_version(name: str, version: str) -> Call[VersionOut]:
    """Mark NAME:VERSION deprecated: kept, but new deployments may not use it (operator)."""
    path = f"{API}/models/{segment(name)}/versions/{segment(version)}/deprecate"
    return Call("POST", path, one(VersionOut))


# Deployments ---------------------------------------------------------------------------------


def list_deployments() -> Call[list[DeploymentOut]]:
    """Every deployment with its instances."""
    return Call("GET", f"{API}/deployments", many(DeploymentOut))


def get_deployment(name: str) -> Call[DeploymentOut]:
    """One deployment with its instances."""
    return Call("GET", f"{API}/deployments/{segment(name)}", one(DeploymentOut))


def create_deployment(spec: DeploymentCreate) -> Call[DeploymentOut]:
    """Create a deployment; its instances are derived per host (operator)."""
    body = spec.model_dump(mode="json")
    return Call("POST", f"{API}/deployments", one(DeploymentOut), json=body)


def update_deployment(name: str, change: DeploymentUpdate) -> Call[DeploymentOut]:
    """Change instances per host, engine config, version or placement (operator)."""
    body = change.model_dump(mode="json", exclude_none=True)
    return Call("PATCH", f"{API}/deployments/{segment(name)}", one(DeploymentOut), json=body)


def delete_deployment(name: str) -> Call[None]:
    """Delete a deployment; its agents stop its instances (operator)."""
    return Call("DELETE", f"{API}/deployments/{segment(name)}", nothing)


def set_autoscale(name: str, policy: AutoscalePolicy) -> Call[DeploymentOut]:
    """Scale deployment NAME on load within POLICY (again to change it) (operator)."""
    body = policy.model_dump(mode="json")
    path = f"{API}/deployments/{segment(name)}/autoscale"
    return Call("PUT", path, one(DeploymentOut), json=body)


def clear_autoscale(name: str) -> Call[DeploymentOut]:
    """Stop autoscaling deployment NAME: it keeps the serving instances it has now (operator)."""
    return Call("DELETE", f"{API}/deployments/{segment(name)}/autoscale", one(DeploymentOut))


def wake_deployment(name: str) -> Call[None]:
    """Ask for an instance of deployment NAME, scaled to zero, because a request waits for it
    (gateway; a no-op for a deployment that has instances)."""
    return Call("POST", f"{API}/deployments/{segment(name)}/wake", nothing)


def set_canary(name: str, spec: CanarySet) -> Call[CanaryOut]:
    """Run SPEC.version on SPEC.instances instances of deployment NAME and send it SPEC.weight
    percent of the gateway's requests; again to change weight or instances (operator)."""
    body = spec.model_dump(mode="json")
    return Call("PUT", f"{API}/deployments/{segment(name)}/canary", one(CanaryOut), json=body)


def clear_canary(name: str) -> Call[CanaryOut]:
    """End deployment NAME's canary: its instances run the stable version again (operator)."""
    return Call("DELETE", f"{API}/deployments/{segment(name)}/canary", one(CanaryOut))


def deployment_traffic(
    name: str,
    since: datetime | None = None,
    until: datetime | None = None,
    step_s: int | None = None,
) -> Call[DeploymentTraffic]:
    """What the gateways served deployment NAME per version, merged, over (SINCE, UNTIL]
    (defaults: the last 5 minutes, steps of 10 s), with the engines' diffusion figures."""
    params = {"since": since, "until": until, "step_s": step_s}
    path = f"{API}/deployments/{segment(name)}/traffic"
    return Call("GET", path, one(DeploymentTraffic), params)


# Rollouts, rollbacks and restarts ------------------------------------------------------------

RolloutVerb = Literal["promote", "abort", "pause", "resume"]


def _deployment(name: str) -> str:
    return f"{API}/deployments/{segment(name)}"


def start_rollout(name: str, spec: RolloutCreate) -> Call[RolloutOut]:
    """Start a canary rollout of deployment NAME; a 409 while one is active (operator)."""
    body = spec.model_dump(mode="json")
    return Call("POST", f"{_deployment(name)}/rollout", one(RolloutOut), json=body)


def get_rollout(name: str) -> Call[RolloutOut]:
    """Deployment NAME's active rollout, else its latest; a 404 when it never had one."""
    return Call("GET", f"{_deployment(name)}/rollout", one(RolloutOut))


def rollout_by_id(name: str, rollout_id: int) -> Call[RolloutOut]:
    """One rollout, rollback or restart of deployment NAME, in any state."""
    return Call("GET", f"{_deployment(name)}/rollouts/{rollout_id}", one(RolloutOut))


def rollout_history(name: str, limit: int | None = None) -> Call[list[RolloutOut]]:
    """Deployment NAME's rollouts, rollbacks and restarts, newest first."""
    return Call("GET", f"{_deployment(name)}/rollouts", many(RolloutOut), {"limit": limit})


def rollout_action(name: str, action: RolloutVerb, body: RolloutAction) -> Call[RolloutOut]:
    """Promote, abort, pause or resume deployment NAME's active rollout (operator)."""
    path = f"{_deployment(name)}/rollout/{action}"
    return Call("POST", path, one(RolloutOut), json=body.model_dump(mode="json"))


def rollback(name: str, spec: RollbackCreate) -> Call[RolloutOut]:
    """Move deployment NAME back to an earlier version its hosts still hold (operator)."""
    body = spec.model_dump(mode="json")
    return Call("POST", f"{_deployment(name)}/rollback", one(RolloutOut), json=body)


def restart(name: str, spec: RestartCreate) -> Call[RolloutOut]:
    """Restart deployment NAME's engine instances one at a time, or those SPEC names (operator)."""
    body = spec.model_dump(mode="json")
    return Call("POST", f"{_deployment(name)}/restart", one(RolloutOut), json=body)


# Gateways -------------------------------------------------------------------------------------


def routes(etag: str | None = None) -> Call[RouteTable | None]:
    """The routing table (role gateway); given the ETag of the table in hand, None while it is
    unchanged (the control plane answers 304)."""
    headers = {"If-None-Match": f'"{etag}"'} if etag else {}
    return Call("GET", f"{API}/routes", one(RouteTable), headers=headers, not_modified_is_none=True)


def report_traffic(report: TrafficReport) -> Call[TrafficAccepted]:
    """Post a gateway's traffic windows (role gateway); unknown ones come back as skipped."""
    body = report.model_dump(mode="json")
    return Call("POST", f"{API}/traffic", one(TrafficAccepted), json=body)


def gateway_heartbeat(beat: GatewayHeartbeat) -> Call[GatewayOut]:
    """A gateway's heartbeat (role gateway): where it serves, its version and /metrics."""
    return Call("POST", GATEWAY_HEARTBEAT_PATH, one(GatewayOut), json=beat.model_dump(mode="json"))


def list_gateways() -> Call[list[GatewayOut]]:
    """Every gateway that heartbeated, with whether it is live (role viewer)."""
    return Call("GET", GATEWAYS_PATH, many(GatewayOut))


# Monitoring ----------------------------------------------------------------------------------


def metrics_targets() -> Call[list[ScrapeTargetGroup]]:
    """Prometheus file_sd groups of every live scrape target (role viewer)."""
    return Call("GET", TARGETS_PATH, many(ScrapeTargetGroup))


# Events --------------------------------------------------------------------------------------


def list_events(
    *,
    after: int | None = None,
    limit: int | None = None,
    kind: str | None = None,
    subject: str | None = None,
) -> Call[EventPage]:
    """Events after cursor AFTER, oldest first; without AFTER the newest LIMIT events."""
    params = {"after": after, "limit": limit, "kind": kind, "subject": subject}
    return Call("GET", f"{API}/events", one(EventPage), params)


# Logs, request summaries and the access audit ------------------------------------------------


def deployment_logs(
    name: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    instance: int | None = None,
    host: str | None = None,
    grep: str | None = None,
    request: str | None = None,
    agent: bool = False,
    after: int | None = None,
    limit: int | None = None,
) -> Call[LogPage]:
    """Log lines of deployment NAME's engines (with AGENT, its hosts' agents' too), oldest
    first, filtered; AFTER: the cursor of a previous page (viewer)."""
    params = {"since": since, "until": until, "instance": instance, "host": host,
              "grep": grep, "request": request, "agent": agent or None, "after": after,
              "limit": limit}  # fmt: skip
    return Call("GET", f"{API}/deployments/{segment(name)}/logs", one(LogPage), params)


def follow_logs_path(name: str) -> str:
    """The SSE stream of deployment NAME's new log lines (same filters as `deployment_logs`):
    `event: line` / `data: LogEntry JSON` per line, `: keep-alive` comments between."""
    return f"{API}/deployments/{segment(name)}/logs/follow"


def deployment_requests(
    name: str,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    slowest: int | None = None,
    errors: bool = False,
    request: str | None = None,
    limit: int | None = None,
) -> Call[list[RequestOut]]:
    """The gateways' request summaries of deployment NAME: newest first, or the SLOWEST N; with
    ERRORS only answers >= 500 (or failed); REQUEST: one request id (viewer)."""
    params = {"since": since, "until": until, "slowest": slowest, "errors": errors or None,
              "request": request, "limit": limit}  # fmt: skip
    return Call("GET", f"{API}/deployments/{segment(name)}/requests", many(RequestOut), params)


def access_audit(since: datetime | None = None) -> Call[AuditReport]:
    """Per client token: requests, errors, 429s, deployments, first/last seen, refusals and
    anomalies since SINCE (default: 7 days) (admin)."""
    return Call("GET", f"{API}/audit", one(AuditReport), {"since": since})


# Tokens --------------------------------------------------------------------------------------


def create_token(spec: TokenCreate) -> Call[TokenCreated]:
    """Create an API token (admin); the answer holds the secret, never shown again."""
    # Fields left at their defaults are not sent: a control plane from before a grant existed
    # (`allow_pool_pin`, `labels`) still takes an ordinary token.
    body = spec.model_dump(mode="json", exclude_defaults=True)
    return Call("POST", f"{API}/tokens", one(TokenCreated), json=body)


def list_tokens(*, include_revoked: bool = False) -> Call[list[TokenOut]]:
    """Every active token (and revoked ones when asked), never a secret (admin)."""
    params = {"include_revoked": "true" if include_revoked else None}
    return Call("GET", f"{API}/tokens", many(TokenOut), params)


def revoke_token(ref: str) -> Call[TokenOut]:
    """Revoke a token by id, or by name when one active token has it (admin)."""
    return Call("DELETE", f"{API}/tokens/{segment(ref)}", one(TokenOut))
