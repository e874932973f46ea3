"""Control-plane settings: defaults < config file section < `DCTL_*` env vars < CLI flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from controlplane import paths

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "kv"]


class SettingsError(ValueError):
    """A setting has a value that is not allowed; the message names it and what is allowed."""


class ConfigFileSource(PydanticBaseSettingsSource):
    """Reads one section (`[controlplane]`, `[tui]`, ...) of the TOML or YAML settings file."""

    def __init__(self, settings_cls: type[BaseSettings], section: str) -> None:
        super().__init__(settings_cls)
        self._values = self._load(paths.config_file(), section)

    @staticmethod
    def _load(path: Path, section: str) -> dict[str, Any]:
        if not path.exists():
            return {}
        try:
            text = path.read_text()
            data = yaml.safe_load(text) if path.suffix in {".yaml", ".yml"} else tomllib.loads(text)
        except (OSError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
            raise SettingsError(f"config file {path}: cannot be read: {exc}") from exc
        section_values = (data or {}).get(section, {})
        if not isinstance(section_values, dict):
            raise SettingsError(f"config file {path}: [{section}] must be a table")
        return section_values

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


class FileBackedSettings(BaseSettings):
    """Base for settings that also read a section of the config file."""

    config_section: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (init) beat env vars, which beat the file, which beats defaults.
        return (init_settings, env_settings, ConfigFileSource(settings_cls, cls.config_section))


class ControlPlaneSettings(FileBackedSettings):
    """Settings of `dctl server` and the CLI's view of the data directory."""

    config_section: ClassVar[str] = "controlplane"
    model_config = SettingsConfigDict(env_prefix="DCTL_", extra="forbid")

    data_dir: Path = Field(default_factory=paths.data_dir)
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8700, ge=1, le=65535)
    heartbeat_interval_s: float = Field(default=5.0, gt=0, le=300)
    log_level: LogLevel = "info"
    log_format: LogFormat = "kv"

    def resolved_database_url(self) -> str:
        """The database URL; by default a SQLite file under the data directory."""
        return self.database_url or f"sqlite:///{self.data_dir / 'dctl.db'}"


def describe_validation_error(exc: ValidationError, prefix: str = "DCTL_") -> str:
    """One line naming the first bad setting, its env var and what is allowed."""
    err = exc.errors()[0]
    name = ".".join(str(p) for p in err["loc"]) or "settings"
    return f"invalid setting {name} (env {prefix}{name.upper()}): {err['msg']}"


def load_controlplane_settings(**overrides: Any) -> ControlPlaneSettings:
    """Load settings, turning validation errors into a `SettingsError` with one clear line."""
    try:
        return ControlPlaneSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc
