"""The agent's side of the wire: register once, heartbeat, and keep the agent token safe.

The agent token goes to one place only: the control plane it was issued by. The identity file
records that URL; an agent started with `--control-plane` pointing elsewhere refuses to start
(`UnusableIdentity`) instead of handing the token over, and a snapshot `files_url` (a path the
agent joins to its control-plane URL, or an absolute URL) is fetched with the token only when it
lies on the control plane's own origin (`files_url_on`).

A heartbeat reply is read instance by instance (`DesiredState`): a desired instance the agent
cannot read is set aside, with the reason, instead of costing it the whole desired state.
"""

from __future__ import annotations

import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import PrivateAttr, ValidationError

from agent.errors import (
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    ForeignUrl,
    PrivateFileError,
    UnusableIdentity,
)
from agent.http_bodies import ERROR_BODY_LIMIT, read_capped
from agent.private_files import read_private, write_private
from protocol.wire import (
    HEARTBEAT_PATH,
    INT32_MAX,
    REGISTER_PATH,
    DesiredInstance,
    Heartbeat,
    HeartbeatReply,
    RegisterRequest,
    RegisterResponse,
)
from runtime.tls import client_context, verification_failure

log = logging.getLogger("dctl.agent")
# A desired state is a few KiB per instance (manifests included); far more is not a reply.
REPLY_LIMIT = 64 * 1024 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) as httpx (which makes the requests) reads URL; ValueError if none."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parsed.scheme not in _DEFAULT_PORTS or not parsed.host:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    return parsed.scheme, parsed.host, parsed.port or _DEFAULT_PORTS[parsed.scheme]


def _describe_origin(url: str) -> str:
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}"


def same_control_plane(a: str, b: str) -> bool:
    """True when URLs A and B name the same control plane: same origin and path (letter case,
    an explicit default port and a trailing slash aside)."""
    try:
        paths = {httpx.URL(url).path.rstrip("/") for url in (a, b)}
        return _origin(a) == _origin(b) and len(paths) == 1
    except (ValueError, httpx.InvalidURL):
        return False


def files_url_on(control_plane: str, files_url: str) -> str:
    """FILES_URL as an absolute URL on CONTROL_PLANE, which the agent may send its token to.

    A path (`/api/v1/models/...`, what the control plane sends) is joined to CONTROL_PLANE, the
    URL the agent was configured with: a reply cannot point it anywhere else. An absolute URL
    (what older control planes built from the request's Host header) is accepted only on
    CONTROL_PLANE's origin (scheme, host and port) and without credentials in it; anything else
    raises `ForeignUrl`. URLs are read by httpx, the parser that makes the request, so the check
    and the request cannot disagree about the host.
    """
    refused = ForeignUrl(
        f"files_url {files_url!r} is not on the control plane "
        f"{_describe_origin(control_plane)} the agent token was issued for: the token is sent "
        "nowhere else, so the snapshot is not fetched from there (a control plane behind a "
        "proxy must send files_url as a path, /api/v1/...)"
    )
    try:
        parsed = httpx.URL(files_url)
    except httpx.InvalidURL:
        raise refused from None
    if parsed.scheme or parsed.host:  # absolute, or scheme-relative (//host/...)
        url = files_url
    elif files_url.startswith("/"):
        url = control_plane.rstrip("/") + files_url
    else:
        raise refused
    try:
        trusted = _origin(url) == _origin(control_plane) and not httpx.URL(url).userinfo
    except (ValueError, httpx.InvalidURL):
        trusted = False
    if not trusted:
        raise refused
    return url


@dataclass(frozen=True)
class AgentIdentity:
    """What registration gave this host: its id and name, and the agent token (a secret)."""

    host_id: int
    host_name: str
    control_plane: str
    token: str


class IdentityStore:
    """`identity.json` (with the control-plane URL the token belongs to) plus the token in
    `agent-token`, both 0600 and never read or written through a symlink."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.token_file = directory / "agent-token"
        self.identity_file = directory / "identity.json"

    def _remove_hint(self) -> str:
        return f"remove {self.identity_file} and {self.token_file}"

    def load(self, control_plane: str) -> AgentIdentity | None:
        """The saved identity, or None before the first registration.

        Raises `UnusableIdentity` when it was issued by another control plane than
        CONTROL_PLANE (the token must not go there) or its files are not plain private files.
        """
        try:
            # The token first: without one there is nothing to send, and registering replaces
            # whatever lies at both paths.
            token = read_private(self.token_file).strip()
            data = json.loads(read_private(self.identity_file))
        except FileNotFoundError:
            return None
        except PrivateFileError as exc:
            raise UnusableIdentity(f"{exc} ({self._remove_hint()})") from None
        except ValueError:
            raise UnusableIdentity(
                f"{self.identity_file} is not valid JSON: {self._remove_hint()} and register again"
            ) from None
        if not isinstance(data, dict) or not {"host_id", "host_name", "control_plane"} <= set(data):
            raise UnusableIdentity(
                f"{self.identity_file} lacks host_id, host_name or control_plane: "
                f"{self._remove_hint()} and register again"
            )
        issued_by = str(data["control_plane"])
        if not same_control_plane(issued_by, control_plane):
            raise UnusableIdentity(
                f"the agent token in {self.token_file} was issued by the control plane "
                f"{issued_by}, not {control_plane}, and is sent only where it came from: to move "
                f"this host, {self._remove_hint()} and start the agent with a bootstrap token of "
                f"{control_plane} (to stay, start it with --control-plane {issued_by})"
            )
        return AgentIdentity(
            host_id=int(data["host_id"]),
            host_name=str(data["host_name"]),
            control_plane=issued_by,
            token=token,
        )

    def save(self, identity: AgentIdentity) -> None:
        """Write the token and the identity 0600 from the first byte (never world-readable, not
        even briefly), replacing (not following) whatever was planted at their paths."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(self.token_file, identity.token + "\n")
        write_private(
            self.identity_file,
            json.dumps(
                {
                    "host_id": identity.host_id,
                    "host_name": identity.host_name,
                    "control_plane": identity.control_plane,
                }
            ),
        )

    def clear(self) -> None:
        """Forget the identity (the token was revoked or the host removed)."""
        self.token_file.unlink(missing_ok=True)
        self.identity_file.unlink(missing_ok=True)


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))[:300]
        return str(data.get("message") or data.get("detail") or data)[:300]
    return str(data)[:300]


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "instance"
    return f"{where}: {error['msg']}"


class DesiredState(HeartbeatReply):
    """A heartbeat reply read instance by instance.

    `instances` holds the desired instances the agent could read; `unreadable` maps the id of
    each one it could not to the reason, so that instance alone is reported failed while the
    others are applied. (A private attribute: a reply cannot set it.)
    """

    _unreadable: dict[int, str] = PrivateAttr(default_factory=dict)

    @property
    def unreadable(self) -> dict[int, str]:
        """Instance id -> why its desired state could not be read."""
        return self._unreadable

    @classmethod
    def parse(cls, content: bytes) -> DesiredState:
        """Read a reply; raises `ValueError` when the reply itself (not one instance) is bad."""
        data = json.loads(content)
        if not isinstance(data, dict) or not isinstance(data.get("instances", []), list):
            raise ValueError("not an object with a list of instances")
        items = data.pop("instances", [])
        state = cls.model_validate(data)
        for item in items:
            try:
                state.instances.append(DesiredInstance.model_validate(item))
            except ValidationError as exc:
                instance_id = item.get("instance_id") if isinstance(item, dict) else None
                reason = f"desired state refused: {_first_error(exc)}"
                if type(instance_id) is int and 1 <= instance_id <= INT32_MAX:
                    state.unreadable[instance_id] = reason
                else:  # nothing to report it under; the log is all there is
                    log.error("a desired instance without a valid id was ignored: %s", reason)
        return state


class ControlPlane(Protocol):
    """The two calls of the agent protocol (`ControlPlaneLink` over HTTP; fakes in tests)."""

    url: str

    def register(self, request: RegisterRequest, bootstrap_token: str) -> RegisterResponse:
        """Exchange a bootstrap token for an agent token."""
        ...

    def heartbeat(self, beat: Heartbeat, token: str) -> DesiredState:
        """Report observed state, receive desired state."""
        ...


class ControlPlaneLink:
    """The agent's HTTP link to the control plane: register and heartbeat, nothing else.

    Not the operator's REST client (`client.http.ControlPlaneClient`): the agent speaks only the
    wire contract, with its own token, and maps failures to "try later" or "refused". Bodies are
    read with a cap (error pages 4 KiB, replies 64 MiB), and redirects are not followed. An
    https:// control plane is verified with TLS (`runtime.tls.client_context`: the agent's CA
    file, else the system trust store); a certificate it does not trust is "unavailable", so the
    token is never sent to it.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = client or httpx.Client(timeout=timeout_s, verify=tls or client_context())

    def _post(self, path: str, body: str, token: str) -> bytes:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            with self._http.stream("POST", self.url + path, content=body, headers=headers) as r:
                if r.status_code >= 500:
                    message = _error_message(read_capped(r, ERROR_BODY_LIMIT))
                    raise ControlPlaneUnavailable(
                        f"{self.url}{path}: HTTP {r.status_code}: {message}"
                    )
                if r.status_code >= 400:
                    raise ControlPlaneRejected(
                        r.status_code, _error_message(read_capped(r, ERROR_BODY_LIMIT))
                    )
                content = read_capped(r, REPLY_LIMIT + 1)
        except httpx.HTTPError as exc:
            refused = verification_failure(exc)
            if refused is not None:
                raise ControlPlaneUnavailable(
                    f"{self.url}: its TLS certificate is not trusted ({refused.verify_message}); "
                    "if a private CA signed it, pass that CA's certificate with --ca-file "
                    "(setting ca_file, env DCTL_AGENT_CA_FILE)"
                ) from exc
            raise ControlPlaneUnavailable(f"{self.url}: {exc.__class__.__name__}: {exc}") from exc
        if len(content) > REPLY_LIMIT:
            raise ControlPlaneUnavailable(
                f"{self.url}{path}: reply larger than {REPLY_LIMIT} bytes"
            )
        return content

    def register(self, request: RegisterRequest, bootstrap_token: str) -> RegisterResponse:
        """Exchange the bootstrap token for an agent token bound to this host."""
        content = self._post(REGISTER_PATH, request.model_dump_json(), bootstrap_token)
        try:
            return RegisterResponse.model_validate_json(content)
        except ValidationError as exc:
            raise ControlPlaneUnavailable(f"unexpected registration reply: {exc}") from exc

    def heartbeat(self, beat: Heartbeat, token: str) -> DesiredState:
        """Report observed state; the reply is the desired state."""
        content = self._post(HEARTBEAT_PATH, beat.model_dump_json(), token)
        try:
            return DesiredState.parse(content)
        except ValueError as exc:  # ValidationError is one
            raise ControlPlaneUnavailable(f"unexpected heartbeat reply: {exc}") from exc

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
