"""`[tui]` settings: the colour thresholds of `tui.health`, from the config file or `DCTL_TUI_*`."""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from runtime.settings import FileBackedSettings
from tui.health import Thresholds

_DEFAULTS = Thresholds()


class TuiSettings(FileBackedSettings):
    """Settings of `dctl tui`; every field is a `Thresholds` field of the same name."""

    config_section: ClassVar[str] = "tui"
    model_config = SettingsConfigDict(env_prefix="DCTL_TUI_", extra="forbid")

    gpu_memory_warn: float = _DEFAULTS.gpu_memory_warn
    gpu_memory_bad: float = _DEFAULTS.gpu_memory_bad
    gpu_temp_warn_c: float = _DEFAULTS.gpu_temp_warn_c
    gpu_temp_bad_c: float = _DEFAULTS.gpu_temp_bad_c
    error_rate_warn: float = _DEFAULTS.error_rate_warn
    error_rate_bad: float = _DEFAULTS.error_rate_bad
    p95_warn_s: float = _DEFAULTS.p95_warn_s
    p95_bad_s: float = _DEFAULTS.p95_bad_s
    heartbeat_warn_intervals: float = _DEFAULTS.heartbeat_warn_intervals
    heartbeat_bad_intervals: float = _DEFAULTS.heartbeat_bad_intervals

    def thresholds(self) -> Thresholds:
        """The thresholds these settings give."""
        return Thresholds(**{f.name: getattr(self, f.name) for f in fields(Thresholds)})
