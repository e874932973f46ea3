"""The agent's side of the wire: register once, heartbeat, and keep the agent token safe."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import ValidationError

from protocol.wire import (
    HEARTBEAT_PATH,
    REGISTER_PATH,
    Heartbeat,
    HeartbeatReply,
    RegisterRequest,
    RegisterResponse,
)


class ControlPlaneUnavailable(Exception):
    """The control plane cannot be reached or answered 5xx: keep serving, try again later."""


class ControlPlaneRejected(Exception):
    """The control plane refused the request (4xx); the message carries its reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class AgentIdentity:
    """What registration gave this host: its id and name, and the agent token (a secret)."""

    host_id: int
    host_name: str
    control_plane: str
    token: str


class IdentityStore:
    """`identity.json` plus the token in `agent-token` (mode 0600) under the agent's data dir."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.token_file = directory / "agent-token"
        self.identity_file = directory / "identity.json"

    def load(self) -> AgentIdentity | None:
        """The saved identity, or None before the first registration."""
        if not (self.token_file.is_file() and self.identity_file.is_file()):
            return None
        data = json.loads(self.identity_file.read_text())
        return AgentIdentity(
            host_id=int(data["host_id"]),
            host_name=str(data["host_name"]),
            control_plane=str(data["control_plane"]),
            token=self.token_file.read_text().strip(),
        )

    def save(self, identity: AgentIdentity) -> None:
        """Write the token 0600 from the first byte (never world-readable, not even briefly)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.token_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(identity.token + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.token_file)
        self.identity_file.write_text(
            json.dumps(
                {
                    "host_id": identity.host_id,
                    "host_name": identity.host_name,
                    "control_plane": identity.control_plane,
                }
            )
        )

    def clear(self) -> None:
        """Forget the identity (the token was revoked or the host removed)."""
        self.token_file.unlink(missing_ok=True)
        self.identity_file.unlink(missing_ok=True)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(body.get("message") or body.get("detail") or body)
    return str(body)[:300]


class ControlPlane(Protocol):
    """The two calls of the agent protocol (`ControlPlaneClient` over HTTP; fakes in tests)."""

    url: str

    def register(self, request: RegisterRequest, bootstrap_token: str) -> RegisterResponse:
        """Exchange a bootstrap token for an agent token."""
        ...

    def heartbeat(self, beat: Heartbeat, token: str) -> HeartbeatReply:
        """Report observed state, receive desired state."""
        ...


class ControlPlaneClient:
    """HTTP calls of the agent protocol."""

    def __init__(
        self, url: str, timeout_s: float = 10.0, client: httpx.Client | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._http = client or httpx.Client(timeout=timeout_s)

    def _post(self, path: str, body: str, token: str) -> httpx.Response:
        try:
            response = self._http.post(
                self.url + path,
                content=body,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{self.url}: {exc.__class__.__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise ControlPlaneUnavailable(
                f"{self.url}{path}: HTTP {response.status_code}: {_error_message(response)}"
            )
        if response.status_code >= 400:
            raise ControlPlaneRejected(response.status_code, _error_message(response))
        return response

    def register(self, request: RegisterRequest, bootstrap_token: str) -> RegisterResponse:
        """Exchange the bootstrap token for an agent token bound to this host."""
        response = self._post(REGISTER_PATH, request.model_dump_json(), bootstrap_token)
        try:
            return RegisterResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise ControlPlaneUnavailable(f"unexpected registration reply: {exc}") from exc

    def heartbeat(self, beat: Heartbeat, token: str) -> HeartbeatReply:
        """Report observed state; the reply is the desired state."""
        response = self._post(HEARTBEAT_PATH, beat.model_dump_json(), token)
        try:
            return HeartbeatReply.model_validate_json(response.content)
        except ValidationError as exc:
            raise ControlPlaneUnavailable(f"unexpected heartbeat reply: {exc}") from exc

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
