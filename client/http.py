"""Typed clients of the control plane's REST API, used by the CLI and the TUI: sync and async.

Like httpx's own `Client` and `AsyncClient`, the two share everything but the sending: every
endpoint is declared once on `_BaseClient` as an `Endpoint` of a `client.calls` function, and
reading it from a `ControlPlaneClient` gives a method that returns the answer, from an
`AsyncControlPlaneClient` one that returns an awaitable of it. Each client has one `send()`,
and both map every failure through `client.errors` to one `ClientError`. Tests inject an
`httpx.BaseTransport` / `httpx.AsyncBaseTransport` (`httpx.MockTransport` is both).

An https:// control plane is verified against the context's CA file, else the system trust store
(`runtime.tls.client_context`); verification cannot be turned off.
"""

from __future__ import annotations

import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from functools import update_wrapper
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, ParamSpec, Self, TypeVar, overload

import httpx

from client import calls
from client.calls import Call
from client.credentials import Context
from client.errors import ClientError, answer, transport_errors
from runtime.tls import TlsError, client_context

__all__ = ["AsyncControlPlaneClient", "ClientError", "ControlPlaneClient", "Endpoint"]

P = ParamSpec("P")
T = TypeVar("T")


class Endpoint(Generic[P, T]):
    """One REST endpoint on both clients: its `Call` built once, sent by the client it is read from.

    A descriptor: `ControlPlaneClient().status` is a `() -> FleetStatus`, and
    `AsyncControlPlaneClient().status` a `() -> Coroutine[..., FleetStatus]`, both from the
    same `calls.status`. mypy picks the signature by the client's type.
    """

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__  # so `help(ControlPlaneClient)` documents every endpoint

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(
        self, client: AsyncControlPlaneClient, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    @overload
    def __get__(self, client: ControlPlaneClient, owner: type[Any]) -> Callable[P, T]: ...

    def __get__(self, client: _BaseClient | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        build, send = self.build, client.send

        def method(*args: P.args, **kwargs: P.kwargs) -> Any:
            # The sync client's send returns the answer, the async one's a coroutine of it.
            return send(build(*args, **kwargs))

        return update_wrapper(method, build)


class _BaseClient(ABC):
    """What both clients share: the connection settings and every endpoint of `/api/v1`."""

    def __init__(self, base_url: str, token: str | None, ca_file: str | Path | None) -> None:
        self.base_url = _checked_url(base_url)
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._tls = _tls_context(ca_file)

    @classmethod
    def from_context(cls, context: Context, **kwargs: Any) -> Self:
        """A client for a credentials context (URL, token, CA file)."""
        return cls(context.url, context.token, ca_file=context.ca_file, **kwargs)

    @abstractmethod
    def send(self, call: Call[Any]) -> Any:
        """Make CALL; each client implements it over its own httpx client."""

    request = Endpoint(calls.request)
    healthz = Endpoint(calls.healthz)
    status = Endpoint(calls.status)
    list_hosts = Endpoint(calls.list_hosts)
    get_host = Endpoint(calls.get_host)
    label_host = Endpoint(calls.label_host)
    drain_host = Endpoint(calls.drain_host)
    undrain_host = Endpoint(calls.undrain_host)
    rekey_host = Endpoint(calls.rekey_host)
    remove_host = Endpoint(calls.remove_host)
    list_models = Endpoint(calls.list_models)
    get_model = Endpoint(calls.get_model)
    get_version = Endpoint(calls.get_version)
    register_version = Endpoint(calls.register_version)
    deprecate_version = Endpoint(calls.deprecate_version)
    list_deployments = Endpoint(calls.list_deployments)
    get_deployment = Endpoint(calls.get_deployment)
    create_deployment = Endpoint(calls.create_deployment)
    update_deployment = Endpoint(calls.update_deployment)
    delete_deployment = Endpoint(calls.delete_deployment)
    set_canary = Endpoint(calls.set_canary)
    clear_canary = Endpoint(calls.clear_canary)
    set_autoscale = Endpoint(calls.set_autoscale)
    clear_autoscale = Endpoint(calls.clear_autoscale)
    wake_deployment = Endpoint(calls.wake_deployment)
    deployment_traffic = Endpoint(calls.deployment_traffic)
    start_rollout = Endpoint(calls.start_rollout)
    get_rollout = Endpoint(calls.get_rollout)
    rollout_by_id = Endpoint(calls.rollout_by_id)
    rollout_history = Endpoint(calls.rollout_history)
    rollout_action = Endpoint(calls.rollout_action)
    rollback = Endpoint(calls.rollback)
    restart = Endpoint(calls.restart)
    routes = Endpoint(calls.routes)
    report_traffic = Endpoint(calls.report_traffic)
    gateway_heartbeat = Endpoint(calls.gateway_heartbeat)
    list_gateways = Endpoint(calls.list_gateways)
    metrics_targets = Endpoint(calls.metrics_targets)
    list_events = Endpoint(calls.list_events)
    deployment_logs = Endpoint(calls.deployment_logs)
    deployment_requests = Endpoint(calls.deployment_requests)
    access_audit = Endpoint(calls.access_audit)
    create_token = Endpoint(calls.create_token)
    list_tokens = Endpoint(calls.list_tokens)
    revoke_token = Endpoint(calls.revoke_token)


def _tls_context(ca_file: str | Path | None) -> ssl.SSLContext:
    try:
        return client_context(ca_file)
    except TlsError as exc:
        raise ClientError(f"{exc} (the context's ca_file, --ca-file or DCTL_CA_FILE)") from None


def _checked_url(url: str) -> str:
    # Caught here rather than on the first request, where httpx would name its own internals.
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ClientError(f"control plane URL {url!r} is not valid: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ClientError(
            f"control plane URL {url!r} must be http://HOST[:PORT] or https://HOST[:PORT]"
        )
    return url.rstrip("/")


class ControlPlaneClient(_BaseClient):
    """The control plane's `/api/v1` as blocking methods; one instance per base URL and token."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        ca_file: str | Path | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, ca_file)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=self._headers,
            timeout=timeout,
            transport=transport,
            verify=self._tls,
        )

    def send(self, call: Call[T]) -> T:
        """Make CALL and return its answer; every failure is a `ClientError`."""
        with transport_errors(self.base_url):
            request = self._http.build_request(
                call.method, call.path, params=call.query(), json=call.json, headers=call.headers
            )
            response = self._http.send(request)
        return answer(self.base_url, call, response)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncControlPlaneClient(_BaseClient):
    """The control plane's `/api/v1` as coroutines (for the TUI's workers and async services)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        ca_file: str | Path | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, ca_file)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=timeout,
            transport=transport,
            verify=self._tls,
        )

    async def send(self, call: Call[T]) -> T:
        """Make CALL and return its answer; every failure is a `ClientError`."""
        with transport_errors(self.base_url):
            request = self._http.build_request(
                call.method, call.path, params=call.query(), json=call.json, headers=call.headers
            )
            response = await self._http.send(request)
        return answer(self.base_url, call, response)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
