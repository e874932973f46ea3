"""Control-plane settings: defaults < config file section < `DCTL_*` env vars < CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from protocol.monitoring import host_port, is_wildcard
from runtime import paths
from runtime.settings import (
    FileBackedSettings,
    LogFormat,
    LogLevel,
    ModelRoots,
    SettingsError,
    http_url,
)

__all__ = ["ControlPlaneSettings", "SettingsError", "load_controlplane_settings"]


class ControlPlaneSettings(FileBackedSettings):
    """Settings of `dctl server` and the CLI's view of the data directory."""

    config_section: ClassVar[str] = "controlplane"
    model_config = SettingsConfigDict(env_prefix="DCTL_", extra="forbid")

    data_dir: Path = Field(default_factory=paths.data_dir)
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8700, ge=1, le=65535)
    heartbeat_interval_s: float = Field(default=5.0, gt=0, le=300)
    # Heartbeats a host may send per interval on average (bursts of 60 pass); faster is
    # answered 429 before it reaches the writer. Agents send one (and one per state change).
    heartbeat_max_per_interval: float = Field(default=4.0, gt=0)
    # How long the replica running the controllers holds their lease per renewal: another
    # replica takes over within about this long after the holder dies.
    lease_s: float = Field(default=5.0, ge=0.5, le=300)
    log_level: LogLevel = "info"
    log_format: LogFormat = "kv"
    # Serve HTTPS with this certificate (PEM, chain included) and key; both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Where other machines reach this control plane (`https://cp.example:8700`): its own scrape
    # target. Never the Host header of whoever asks, which anyone can set to any address.
    # Default: the bind (`host`, `port`; loopback for a wildcard bind).
    public_url: str | None = Field(default=None, max_length=512)
    # Directories local model sources must lie in (empty: anywhere). The file route serves only
    # files whose content matches the manifest either way; the roots also bound *where* from.
    model_roots: ModelRoots = ()
    # Rollout webhooks (`notify`) may go to loopback, link-local, private and unique-local
    # addresses: off, since the control plane would send them from inside the network (cloud
    # metadata at 169.254.169.254, admin ports on 127.0.0.1) on an operator's word.
    notify_allow_private: bool = False
    # Logs (`controlplane.logs`): agents' shipped lines kept this long and at most this many
    # per instance (and per host for an agent's own); gateways' request summaries this long and
    # at most this many in all; per-token use for the access audit this long.
    log_retention_s: float = Field(default=86_400.0, ge=60, le=90 * 86_400)
    log_max_lines_per_instance: int = Field(default=100_000, ge=100, le=100_000_000)
    request_retention_s: float = Field(default=86_400.0, ge=60, le=90 * 86_400)
    request_max_rows: int = Field(default=1_000_000, ge=1000, le=1_000_000_000)
    audit_retention_s: float = Field(default=8 * 86_400.0, ge=86_400, le=400 * 86_400)

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        value = http_url(value)
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number or out of range
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from None
        if parts.path or parts.query or parts.fragment or parts.username:
            raise ValueError(f"{value!r}: write only http(s)://HOST[:PORT], e.g. https://cp:8700")
        return value

    def resolved_public_url(self) -> str:
        """`public_url`, or the bind as other machines on it reach it (`http(s)://HOST:PORT`)."""
        if self.public_url is not None:
            return self.public_url
        scheme = "https" if self.tls_cert is not None else "http"
        address = "127.0.0.1" if is_wildcard(self.host) else self.host
        return f"{scheme}://{host_port(address, self.port)}"

    def resolved_database_url(self) -> str:
        """The database URL; by default a SQLite file under the data directory."""
        return self.database_url or f"sqlite:///{self.data_dir / 'dctl.db'}"


def load_controlplane_settings(
    config_file: Path | None = None, **overrides: Any
) -> ControlPlaneSettings:
    """Load settings; flags come as OVERRIDES (None: not given). Raises `SettingsError`.

    CONFIG_FILE (from `--config`) replaces the default file; unlike the default, it must exist.
    """
    return ControlPlaneSettings.load(config_file, **overrides)
