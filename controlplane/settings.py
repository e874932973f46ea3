"""Control-plane settings: defaults < config file section < `DCTL_*` env vars < CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from protocol import paths
from protocol.settings import (
    FileBackedSettings,
    LogFormat,
    LogLevel,
    SettingsError,
    describe_validation_error,
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
    # How long the replica running the controllers holds their lease per renewal: another
    # replica takes over within about this long after the holder dies.
    lease_s: float = Field(default=5.0, ge=0.5, le=300)
    log_level: LogLevel = "info"
    log_format: LogFormat = "kv"

    def resolved_database_url(self) -> str:
        """The database URL; by default a SQLite file under the data directory."""
        return self.database_url or f"sqlite:///{self.data_dir / 'dctl.db'}"


def load_controlplane_settings(**overrides: Any) -> ControlPlaneSettings:
    """Load settings, turning validation errors into a `SettingsError` with one clear line."""
    try:
        return ControlPlaneSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc
