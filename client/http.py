"""A typed HTTP client of the control plane's REST API, used by the CLI and the TUI.

One `ControlPlaneClient` holds the base URL and the bearer token. Every failure — the server
said no, the server is unreachable, the answer is not JSON — becomes one `ClientError` that
carries the server's own message and the HTTP status, so callers print one line and pick an
exit code without knowing anything about httpx. Tests inject an `httpx.BaseTransport`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from client.credentials import Context
from protocol.rest import (
    DeploymentCreate,
    DeploymentOut,
    DeploymentUpdate,
    EventPage,
    FleetStatus,
    HostOut,
    ModelOut,
    TokenCreate,
    TokenCreated,
    TokenOut,
    VersionOut,
)
from protocol.wire import Manifest, MemoryPlan

API = "/api/v1"
M = TypeVar("M", bound=BaseModel)


class ClientError(Exception):
    """A request failed; `message` is what the server (or the network) said, `status` its code.

    `status` is None when no HTTP answer came back (connection refused, timeout).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.message} (HTTP {self.status})"


def _segment(value: str) -> str:
    # Names come from the user; a '/' or '?' must not change which route is hit.
    return quote(value, safe="")


def error_message(response: httpx.Response) -> str:
    """The human message of an error response: FastAPI `detail`, our `message`, or the text."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text.splitlines()[0][:300] if text else response.reason_phrase
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return value
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                return str(value["message"])
            if isinstance(value, list) and value and isinstance(value[0], dict):
                # FastAPI validation errors: name the field and what is wrong with it.
                first = value[0]
                where = ".".join(str(p) for p in first.get("loc", []) if p != "body")
                msg = str(first.get("msg", "invalid input"))
                return f"{where}: {msg}" if where else msg
    return response.reason_phrase


class ControlPlaneClient:
    """The control plane's `/api/v1` as Python methods; one instance per base URL and token."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    @classmethod
    def from_context(cls, context: Context, **kwargs: Any) -> ControlPlaneClient:
        """A client for a credentials context (URL + token)."""
        return cls(context.url, context.token, **kwargs)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # The one place requests are sent and errors mapped ---------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON (None for an empty body) or raise."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, json=json, params=clean or None)
        except httpx.TimeoutException as exc:
            raise ClientError(f"control plane at {self.base_url} did not answer in time") from exc
        except httpx.TransportError as exc:
            raise ClientError(f"cannot reach the control plane at {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ClientError(error_message(response), response.status_code)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise ClientError(
                f"control plane at {self.base_url} answered {method} {path} with non-JSON",
                response.status_code,
            ) from exc

    def _typed(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        body = self.request(method, path, **kwargs)
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise ClientError(self._mismatch(method, path, exc)) from exc

    def _typed_list(self, model: type[M], path: str, **kwargs: Any) -> list[M]:
        body = self.request("GET", path, **kwargs)
        try:
            return TypeAdapter(list[model]).validate_python(body)  # type: ignore[valid-type]
        except ValidationError as exc:
            raise ClientError(self._mismatch("GET", path, exc)) from exc

    def _mismatch(self, method: str, path: str, exc: ValidationError) -> str:
        # Client and server ship together; a mismatch means two different dctl versions.
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        return (
            f"{method} {path}: the control plane at {self.base_url} answered in a form this dctl "
            f"does not understand ({where}: {err['msg']}); are both the same dctl version?"
        )

    # Health and fleet summary ----------------------------------------------------------------

    def healthz(self) -> Any:
        """`GET /healthz`: the process is up."""
        return self.request("GET", "/healthz")

    def status(self) -> FleetStatus:
        """Counts for a fleet summary: hosts by state, GPUs, models, deployments, instances."""
        return self._typed(FleetStatus, "GET", f"{API}/status")

    # Hosts -----------------------------------------------------------------------------------

    def list_hosts(self) -> list[HostOut]:
        """Every host with its state, GPUs and latest samples."""
        return self._typed_list(HostOut, f"{API}/hosts")

    def get_host(self, name: str) -> HostOut:
        """One host with its GPUs, latest samples and instances."""
        return self._typed(HostOut, "GET", f"{API}/hosts/{_segment(name)}")

    def drain_host(self, name: str) -> HostOut:
        """Stop scheduling onto host NAME and stop its instances (operator)."""
        return self._typed(HostOut, "POST", f"{API}/hosts/{_segment(name)}/drain")

    def undrain_host(self, name: str) -> HostOut:
        """Let host NAME take instances again (operator)."""
        return self._typed(HostOut, "POST", f"{API}/hosts/{_segment(name)}/undrain")

    def remove_host(self, name: str) -> None:
        """Forget host NAME and revoke its agent token (admin)."""
        self.request("DELETE", f"{API}/hosts/{_segment(name)}")

    # Models ----------------------------------------------------------------------------------

    def list_models(self) -> list[ModelOut]:
        """Every model with its versions."""
        return self._typed_list(ModelOut, f"{API}/models")

    def get_model(self, name: str) -> ModelOut:
        """One model with its versions."""
        return self._typed(ModelOut, "GET", f"{API}/models/{_segment(name)}")

    def get_version(self, name: str, version: str) -> VersionOut:
        """One model version with its manifest and memory plan."""
        path = f"{API}/models/{_segment(name)}/versions/{_segment(version)}"
        return self._typed(VersionOut, "GET", path)

    def register_version(
        self,
        name: str,
        version: str,
        manifest: Manifest,
        *,
        source_uri: str,
        line: str = "base",
        parent: str | None = None,
        memory_plan: MemoryPlan | None = None,
        notes: str = "",
    ) -> VersionOut:
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
        path = f"{API}/models/{_segment(name)}/versions"
        return self._typed(VersionOut, "POST", path, json=body)

    def deprecate_version(self, name: str, version: str) -> VersionOut:
        """Mark NAME:VERSION deprecated: kept, but new deployments may not use it (operator)."""
        path = f"{API}/models/{_segment(name)}/versions/{_segment(version)}/deprecate"
        return self._typed(VersionOut, "POST", path)

    # Deployments -----------------------------------------------------------------------------

    def list_deployments(self) -> list[DeploymentOut]:
        """Every deployment with its instances."""
        return self._typed_list(DeploymentOut, f"{API}/deployments")

    def get_deployment(self, name: str) -> DeploymentOut:
        """One deployment with its instances."""
        return self._typed(DeploymentOut, "GET", f"{API}/deployments/{_segment(name)}")

    def create_deployment(self, spec: DeploymentCreate) -> DeploymentOut:
        """Create a deployment; its instances are derived per host (operator)."""
        body = spec.model_dump(mode="json")
        return self._typed(DeploymentOut, "POST", f"{API}/deployments", json=body)

    def update_deployment(self, name: str, change: DeploymentUpdate) -> DeploymentOut:
        """Change instances per host, engine config, version or placement (operator)."""
        body = change.model_dump(mode="json", exclude_none=True)
        path = f"{API}/deployments/{_segment(name)}"
        return self._typed(DeploymentOut, "PATCH", path, json=body)

    def delete_deployment(self, name: str) -> None:
        """Delete a deployment; its agents stop its instances (operator)."""
        self.request("DELETE", f"{API}/deployments/{_segment(name)}")

    # Events ----------------------------------------------------------------------------------

    def list_events(
        self,
        *,
        after: int | None = None,
        limit: int | None = None,
        kind: str | None = None,
        subject: str | None = None,
    ) -> EventPage:
        """Events after cursor AFTER, oldest first; without AFTER the newest LIMIT events."""
        params = {"after": after, "limit": limit, "kind": kind, "subject": subject}
        return self._typed(EventPage, "GET", f"{API}/events", params=params)

    # Tokens ----------------------------------------------------------------------------------

    def create_token(self, spec: TokenCreate) -> TokenCreated:
        """Create an API token (admin); the answer holds the secret, never shown again."""
        body = spec.model_dump(mode="json")
        return self._typed(TokenCreated, "POST", f"{API}/tokens", json=body)

    def list_tokens(self, *, include_revoked: bool = False) -> list[TokenOut]:
        """Every active token (and revoked ones when asked), never a secret (admin)."""
        params = {"include_revoked": "true"} if include_revoked else None
        return self._typed_list(TokenOut, f"{API}/tokens", params=params)

    def revoke_token(self, ref: str) -> TokenOut:
        """Revoke a token by id, or by name when one active token has it (admin)."""
        return self._typed(TokenOut, "DELETE", f"{API}/tokens/{_segment(ref)}")
