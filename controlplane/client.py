"""A typed HTTP client of the control plane's REST API, used by the CLI and the TUI.

One `ControlPlaneClient` holds the base URL and the bearer token. Every failure — the server
said no, the server is unreachable, the answer is not JSON — becomes one `ClientError` that
carries the server's own message and the HTTP status, so callers print one line and pick an
exit code without knowing anything about httpx. Tests inject an `httpx.BaseTransport`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx

from controlplane.credentials import Context
from controlplane.wire import Manifest, MemoryPlan

API = "/api/v1"
JsonObject = dict[str, Any]


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

    def _object(self, method: str, path: str, **kwargs: Any) -> JsonObject:
        body = self.request(method, path, **kwargs)
        if not isinstance(body, dict):
            raise ClientError(f"{method} {path}: expected a JSON object from the control plane")
        return body

    def _list(self, path: str, key: str, **kwargs: Any) -> list[JsonObject]:
        # Collections may come back bare or wrapped ({"items": [...]}); accept both.
        body = self.request("GET", path, **kwargs)
        if isinstance(body, dict):
            body = body.get(key, body.get("items"))
        if not isinstance(body, list):
            raise ClientError(f"GET {path}: expected a list from the control plane")
        return body

    # Health ----------------------------------------------------------------------------------

    def healthz(self) -> JsonObject:
        """`GET /healthz`: the process is up."""
        return self._object("GET", "/healthz")

    # Hosts -----------------------------------------------------------------------------------

    def list_hosts(self) -> list[JsonObject]:
        """Every host with its state and GPUs."""
        return self._list(f"{API}/hosts", "hosts")

    def get_host(self, name: str) -> JsonObject:
        """One host with its GPUs, latest samples and instances."""
        return self._object("GET", f"{API}/hosts/{_segment(name)}")

    def drain_host(self, name: str) -> JsonObject:
        """Stop scheduling onto host NAME and stop its instances."""
        return self._object("POST", f"{API}/hosts/{_segment(name)}/drain")

    def undrain_host(self, name: str) -> JsonObject:
        """Let host NAME take instances again."""
        return self._object("POST", f"{API}/hosts/{_segment(name)}/undrain")

    def remove_host(self, name: str) -> None:
        """Forget host NAME (admin)."""
        self.request("DELETE", f"{API}/hosts/{_segment(name)}")

    # Models ----------------------------------------------------------------------------------

    def list_models(self) -> list[JsonObject]:
        """Every model with its versions."""
        return self._list(f"{API}/models", "models")

    def get_model(self, name: str) -> JsonObject:
        """One model with its versions."""
        return self._object("GET", f"{API}/models/{_segment(name)}")

    def get_version(self, name: str, version: str) -> JsonObject:
        """One model version with its manifest and memory plan."""
        return self._object("GET", f"{API}/models/{_segment(name)}/versions/{_segment(version)}")

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
    ) -> JsonObject:
        """Register NAME:VERSION; the same manifest again is a no-op, a different one a 409."""
        body: JsonObject = {
            "version": version,
            "manifest": manifest.model_dump(mode="json"),
            "digest": manifest.digest(),
            "source_uri": source_uri,
            "line": line,
            "parent": parent,
            "notes": notes,
            "memory_plan": memory_plan.model_dump(mode="json") if memory_plan else None,
        }
        return self._object("POST", f"{API}/models/{_segment(name)}/versions", json=body)

    def deprecate_version(self, name: str, version: str) -> JsonObject:
        """Mark NAME:VERSION deprecated: kept, but new deployments may not use it."""
        path = f"{API}/models/{_segment(name)}/versions/{_segment(version)}/deprecate"
        return self._object("POST", path)

    # Deployments -----------------------------------------------------------------------------

    def list_deployments(self) -> list[JsonObject]:
        """Every deployment."""
        return self._list(f"{API}/deployments", "deployments")

    def get_deployment(self, name: str) -> JsonObject:
        """One deployment with its instances."""
        return self._object("GET", f"{API}/deployments/{_segment(name)}")

    def create_deployment(
        self,
        name: str,
        model: str,
        version: str,
        hosts: list[str],
        *,
        instances_per_host: int = 1,
        engine_config: JsonObject | None = None,
    ) -> JsonObject:
        """Place MODEL:VERSION on HOSTS as deployment NAME."""
        body: JsonObject = {
            "name": name,
            "model": model,
            "version": version,
            "hosts": hosts,
            "instances_per_host": instances_per_host,
            "engine_config": engine_config or {},
        }
        return self._object("POST", f"{API}/deployments", json=body)

    def update_deployment(
        self,
        name: str,
        *,
        instances_per_host: int | None = None,
        engine_config: JsonObject | None = None,
    ) -> JsonObject:
        """Change the instance count per host and/or the engine config of deployment NAME."""
        body = {
            k: v
            for k, v in {
                "instances_per_host": instances_per_host,
                "engine_config": engine_config,
            }.items()
            if v is not None
        }
        return self._object("PATCH", f"{API}/deployments/{_segment(name)}", json=body)

    def delete_deployment(self, name: str) -> None:
        """Delete deployment NAME; its instances are stopped by their agents."""
        self.request("DELETE", f"{API}/deployments/{_segment(name)}")

    # Events ----------------------------------------------------------------------------------

    def list_events(
        self,
        *,
        after: int | str | None = None,
        limit: int | None = None,
        kind: str | None = None,
        subject: str | None = None,
    ) -> JsonObject:
        """One page of the audit log, oldest first, after cursor AFTER: `{items, next_cursor}`."""
        params = {"after": after, "limit": limit, "kind": kind, "subject": subject}
        body = self.request("GET", f"{API}/events", params=params)
        if isinstance(body, list):
            return {"items": body, "next_cursor": None}
        if not isinstance(body, dict):
            raise ClientError(f"GET {API}/events: expected a JSON object from the control plane")
        return body

    # Tokens ----------------------------------------------------------------------------------

    def create_token(
        self,
        name: str,
        role: str,
        *,
        expires_in_s: int | None = None,
        uses: int | None = None,
    ) -> JsonObject:
        """Create an API token; the answer holds the secret, which is never shown again."""
        body: JsonObject = {
            "name": name,
            "role": role,
            "expires_in_s": expires_in_s,
            "uses": uses,
        }
        return self._object("POST", f"{API}/tokens", json=body)

    def list_tokens(self) -> list[JsonObject]:
        """Every token, never its secret."""
        return self._list(f"{API}/tokens", "tokens")

    def revoke_token(self, name: str) -> JsonObject | None:
        """Revoke token NAME."""
        body = self.request("POST", f"{API}/tokens/{_segment(name)}/revoke")
        return body if isinstance(body, dict) else None
