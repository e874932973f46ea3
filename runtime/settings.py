"""Settings shared by every part: defaults < config file section < `DCTL_*` env < flags.

One config file (`~/.config/dctl/config.toml`, or the TOML/YAML file `DCTL_CONFIG` names) with one
table per part (`[controlplane]`, `[agent]`, `[gateway]`, ...).
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource
from pydantic_settings import SettingsError as SourceError

from runtime import paths

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "kv"]


class SettingsError(ValueError):
    """A setting has a value that is not allowed; the message names it and what is allowed."""


# The file a `--config FILE` flag names, for the duration of one `FileBackedSettings.load`.
_named_file: ContextVar[Path | None] = ContextVar("dctl_named_config_file", default=None)


class ConfigFileSource(PydanticBaseSettingsSource):
    """Reads one section (`[controlplane]`, `[tui]`, ...) of the TOML or YAML settings file."""

    def __init__(self, settings_cls: type[BaseSettings], section: str) -> None:
        super().__init__(settings_cls)
        self._values = self._load(_named_file.get() or paths.config_file(), section)

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

    @classmethod
    def load(cls, config_file: Path | None = None, **flags: Any) -> Self:
        """Settings from FLAGS (None: not given), env, and CONFIG_FILE or the default file.

        CONFIG_FILE comes from a `--config` flag; unlike the default file, it must exist. Any
        bad value is a `SettingsError` with one line naming it (`describe_error`).
        """
        if config_file is not None and not config_file.is_file():
            raise SettingsError(f"config file {config_file} does not exist")
        given = {key: value for key, value in flags.items() if value is not None}
        token = _named_file.set(config_file)
        try:
            return cls(**given)
        except ValidationError as exc:
            raise SettingsError(cls.describe_error(exc)) from None
        except SourceError as exc:  # e.g. an env value pydantic-settings could not decode
            raise SettingsError(f"invalid settings: {exc}") from None
        finally:
            _named_file.reset(token)

    @classmethod
    def describe_error(cls, exc: ValidationError) -> str:
        """One line for the first bad setting; parts override it to name their flags."""
        return describe_validation_error(exc)


def describe_validation_error(exc: ValidationError, prefix: str = "DCTL_") -> str:
    """One line naming the first bad setting, its env var and what is allowed."""
    err = exc.errors()[0]
    name = ".".join(str(p) for p in err["loc"]) or "settings"
    return f"invalid setting {name} (env {prefix}{name.upper()}): {err['msg']}"


def http_url(value: str | None) -> str | None:
    """A control-plane URL setting: http(s) with a host, trailing slash dropped (ValueError)."""
    if value is None:
        return None
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL; write e.g. http://cp:8700")
    return value.strip().rstrip("/")


def absolute_path(value: Path | None) -> Path | None:
    """A path setting made absolute (`~` expanded), so a later chdir cannot change its meaning."""
    return None if value is None else value.expanduser().resolve()


def _roots_from_text(value: Any) -> Any:
    # An env var is a PATH-style list (`DCTL_MODEL_ROOTS=/srv/models:/data/ckpt`).
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(os.pathsep) if item.strip())
    return value


def _absolute_roots(value: tuple[Path, ...]) -> tuple[Path, ...]:
    for root in value:
        if not root.is_absolute():
            raise ValueError(f"{str(root)!r} is not an absolute directory")
    # Canonical, so that the resolved paths `dctl model register` sends match them.
    return tuple(root.resolve() for root in value)


# Directories local model sources must lie in (`model_roots` of the control plane and of the
# agent): a list in the file, a PATH-style list in an env var.
ModelRoots = Annotated[
    tuple[Path, ...], NoDecode, BeforeValidator(_roots_from_text), AfterValidator(_absolute_roots)
]
