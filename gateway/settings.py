"""Gateway settings: defaults < the config file's `[gateway]` table < `DCTL_GATEWAY_*` env < flags.

The gateway reads its routes from one of two places, never both: a control plane
(`control_plane` + a `gateway` role token, polled every `routes_poll_s`, traffic reported back
and a heartbeat sent every `report_interval_s`) or a static `routes_file` (a `RouteTable` as
JSON or YAML, read once: for a fleet without a control plane, and for benchmarks; no traffic
reports or heartbeats then).

The token is best given as a file (`token_file`, 0600): a value on the command line is visible to
every user of the host in `ps`.
"""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import SettingsConfigDict

from protocol.gateway import RouteTable
from runtime.settings import (
    FileBackedSettings,
    LogFormat,
    LogLevel,
    SettingsError,
    absolute_path,
    http_url,
)
from runtime.tls import TlsError, check_server_files, client_context

__all__ = ["ENV_PREFIX", "GatewaySettings", "SettingsError", "load_gateway_settings"]

log = logging.getLogger("dctl.gateway")
ENV_PREFIX = "DCTL_GATEWAY_"
# Settings whose flag is not simply --NAME-WITH-DASHES.
_FLAG_NAMES = {"pool_header": "--no-pool-header"}


class GatewaySettings(FileBackedSettings):
    """Settings of `dctl gateway`."""

    config_section: ClassVar[str] = "gateway"
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    # Where routes come from: exactly one of these two.
    control_plane: str | None = Field(default=None, description="control-plane URL")
    routes_file: Path | None = Field(default=None, description="static RouteTable, JSON or YAML")
    token: SecretStr | None = Field(default=None, description="a token of role gateway")
    token_file: Path | None = None
    ca_file: Path | None = Field(default=None, description="CA of the control plane's certificate")
    # Where clients reach the gateway.
    host: str = "127.0.0.1"
    port: int = Field(default=8800, ge=0, le=65535, description="0: any free port")
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # How engines are reached: their certificates are verified with this CA file (default:
    # the system trust store) when the routing table says https.
    engine_ca_file: Path | None = None
    # Whether `x-dctl-pool: stable|canary` may pin the pool, for client tokens granted it
    # (`--no-pool-header` ignores the header for every token).
    pool_header: bool = True
    # Limits.
    max_body_bytes: int = Field(default=8 * 2**20, ge=1)
    max_inflight: int = Field(default=1024, ge=1)
    max_concurrency_per_token: int = Field(
        default=64, ge=1, description="in flight per client token, unless the token sets its own"
    )
    max_connections: int = Field(
        default=4096, ge=1, description="open client connections (uvicorn's limit_concurrency)"
    )
    rate_limit_rps: float = Field(default=50.0, ge=0, description="per client token; 0: none")
    rate_limit_burst: int = Field(default=100, ge=1)
    # Timing. A client connection gets head_timeout_s from a request's first byte to the end of
    # its headers and body_timeout_s from there to the end of its body (else 408 and closed), and
    # is closed after idle_timeout_s between requests (a new one: the shorter of that and
    # head_timeout_s before its first byte). The idle default outlasts the keep-alive of the
    # clients in front of us (httpx and the OpenAI SDK drop an idle connection after 5 s,
    # aiohttp after 15 s): a client then always closes first, never reusing a connection the
    # gateway is closing under it, which the client sees as a reset POST it cannot retry.
    head_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    idle_timeout_s: float = Field(default=20.0, gt=0, description="keep-alive between requests")
    routes_poll_s: float = Field(default=1.0, gt=0, le=60)
    report_interval_s: float = Field(default=5.0, gt=0, le=3600)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0, description="a whole exchange")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="for in-flight requests")
    log_level: LogLevel = "info"
    log_format: LogFormat = "kv"
    # The request log: one JSON line per request (`gateway.request_log`), off unless a file is
    # named. The summaries reach the control plane in the traffic reports either way; the file
    # is for a log shipper on the host. Off by default because the gateway is stateless: it may
    # run several times on a host, or in a container with a read-only root.
    request_log_file: Path | None = Field(default=None, description="JSONL, one line a request")
    request_log_max_bytes: int = Field(
        default=100 * 2**20, ge=4096, description="size at which the file is rotated"
    )
    request_log_max_files: int = Field(
        default=5, ge=1, description="files kept: the current one and FILE.1 ... FILE.<n-1>"
    )
    # Request summaries in each traffic report: all of them up to this rate, above it a uniform
    # sample of that many (answers >= 500 always kept); 0: only those.
    summary_sample_rps: float = Field(default=20.0, ge=0)

    @classmethod
    def describe_error(cls, exc: ValidationError) -> str:
        """The bad setting with its flag and `DCTL_GATEWAY_` env var, or the unknown key."""
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "settings"
        if err["type"] == "extra_forbidden":
            known = ", ".join(cls.model_fields)
            return f"unknown setting {name!r} in the [gateway] table (known: {known})"
        return _invalid(name, str(err["msg"]).removeprefix("Value error, "))

    @field_validator("control_plane")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return http_url(value)

    @field_validator(
        "routes_file",
        "token_file",
        "ca_file",
        "tls_cert",
        "tls_key",
        "engine_ca_file",
        "request_log_file",
    )
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return absolute_path(value)

    def check(self) -> list[str]:
        """Check what one field alone cannot: one source of routes, a token for the control
        plane, TLS pairs and CA files usable. Returns warnings; raises `SettingsError`."""
        if (self.control_plane is None) == (self.routes_file is None):
            raise SettingsError(
                _invalid(
                    "control_plane",
                    "give exactly one of control_plane (routes from a control plane) and "
                    "routes_file (a static routing table)",
                )
            )
        if self.control_plane is not None and self.token is None and self.token_file is None:
            raise SettingsError(
                _invalid("token_file", "a control plane needs a token of role gateway")
            )
        warnings: list[str] = []
        if (self.tls_cert is None) != (self.tls_key is None):
            missing, given = (
                ("tls_cert", "tls_key") if self.tls_cert is None else ("tls_key", "tls_cert")
            )
            raise SettingsError(_invalid(missing, f"{given} is set: give both"))
        if self.tls_cert is not None and self.tls_key is not None:
            try:
                warnings += check_server_files(self.tls_cert, self.tls_key)
            except TlsError as exc:
                raise SettingsError(_invalid("tls_cert", str(exc))) from None
        for name in ("ca_file", "engine_ca_file"):
            path = getattr(self, name)
            if path is not None:
                try:
                    client_context(path)
                except TlsError as exc:
                    raise SettingsError(_invalid(name, str(exc))) from None
        return warnings

    def read_token(self) -> str | None:
        """The control-plane token: the value if one was given, else the file's content."""
        if self.token is not None:
            return self.token.get_secret_value()
        path = self.token_file
        if path is None:
            return None
        try:
            token = path.read_text().strip()
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError as exc:
            raise SettingsError(
                _invalid("token_file", f"cannot read {path}: {exc.strerror}")
            ) from None
        if not token:
            raise SettingsError(_invalid("token_file", f"{path} is empty"))
        if mode & 0o077:
            log.warning("token file %s is readable by others (mode %o): chmod 600 it", path, mode)
        return token

    def read_routes_file(self) -> RouteTable:
        """The static routing table of `routes_file`; a missing `etag` defaults to the file name."""
        path = self.routes_file
        if path is None:
            raise SettingsError(_invalid("routes_file", "not set"))
        try:
            text = path.read_text()
            data: Any = (
                yaml.safe_load(text) if path.suffix in {".yaml", ".yml"} else json.loads(text)
            )
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise SettingsError(_invalid("routes_file", f"cannot read {path}: {exc}")) from None
        if isinstance(data, dict):
            data.setdefault("etag", f"file:{path.name}")
        try:
            return RouteTable.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "the table"
            raise SettingsError(_invalid("routes_file", f"{path}: {where}: {err['msg']}")) from None


def _invalid(name: str, message: str) -> str:
    """`invalid setting NAME (--FLAG, env DCTL_GATEWAY_NAME): MESSAGE`."""
    flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    return f"invalid setting {name} ({flag}, env {ENV_PREFIX}{name.upper()}): {message}"


def load_gateway_settings(config_file: Path | None = None, **flags: Any) -> GatewaySettings:
    """Load and check the settings; flags come as FLAGS (None: not given). Raises `SettingsError`
    with one line naming the bad setting.

    CONFIG_FILE (from `--config`) replaces the default file; unlike the default, it must exist.
    """
    settings = GatewaySettings.load(config_file, **flags)
    for warning in settings.check():
        log.warning(warning)
    return settings
