"""Agent settings: defaults < the config file's `[agent]` table < `DCTL_AGENT_*` env < flags.

The file is the one every part reads (`~/.config/dctl/config.toml`, or what `DCTL_CONFIG` or
`dctl agent --config FILE` names). Env vars carry the prefix `DCTL_AGENT_` (e.g.
`DCTL_AGENT_PORTS=18000-18099`) so that an agent and a control plane on one machine never read
each other's `DCTL_PORT`, `DCTL_HOST` or `DCTL_DATA_DIR`. Two older names still work and count
as flags: `DCTL_CONTROL_PLANE` and `DCTL_BOOTSTRAP_TOKEN` (the CLI reads them).

The bootstrap token is best given as a file (`bootstrap_token_file`, 0600): a value on the
command line is visible to every user of the host in `ps`.

Weights: a version whose source is a local path is copied from this host's disk only when the
path lies in one of `model_roots` (and no file of it leads out by symlink); otherwise every file
comes from the control plane, which serves a file only once it has hashed it and found the
manifest's size and sha256. The default is no roots: a manifest's author could otherwise name
any directory the agent can read and learn from the failure report whether a file there has
the size and digest they guessed.

Logs: each engine's log file is bounded (`engine_log_max_bytes` x `engine_log_keep` rotated
files), and with `ship_logs` its lines and the agent's own go to the control plane in heartbeats,
redacted on this host first (`agent.log_shipping`).

TLS: `ca_file` is what the control plane's certificate is verified with (default: the system
trust store); `metrics_tls_cert`/`metrics_tls_key` make the agent's `/metrics` HTTPS, and
`engine_tls_cert`/`engine_tls_key` go into every engine's config so engines serve HTTPS (the
agent then probes them over HTTPS, trusting that certificate). `check_tls()` checks them.
"""

from __future__ import annotations

import logging
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from agent.gpu import FakeBackend, parse_spec
from protocol.logs import MAX_BATCH_BYTES, MAX_BATCH_LINES
from protocol.wire import DEFAULT_PORT_RANGE, Address, Name, Port, RegisterRequest
from runtime import paths
from runtime.settings import (
    FileBackedSettings,
    LogFormat,
    LogLevel,
    ModelRoots,
    SettingsError,
    absolute_path,
    http_url,
)
from runtime.tls import TlsError, check_server_files, client_context

__all__ = [
    "ENV_PREFIX",
    "AgentSettings",
    "SettingsError",
    "check_agent_config",
    "load_agent_settings",
]

log = logging.getLogger("dctl.agent")
ENV_PREFIX = "DCTL_AGENT_"
# Addresses that mean "every interface": an engine may listen there, nobody can connect there.
_WILDCARDS = {"0.0.0.0", "::", "[::]"}
# Settings whose flag is not simply --NAME-WITH-DASHES.
_FLAG_NAMES = {"labels": "--label", "model_roots": "--model-root"}


class AgentSettings(FileBackedSettings):
    """Settings of `dctl agent` (and of `dctl agent preflight` / `verify`)."""

    config_section: ClassVar[str] = "agent"

    @classmethod
    def describe_error(cls, exc: ValidationError) -> str:
        """The bad setting with its flag and `DCTL_AGENT_` env var, or the unknown key."""
        return describe_agent_error(exc)

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    control_plane: str | None = Field(default=None, description="control-plane URL")
    bootstrap_token: SecretStr | None = None
    bootstrap_token_file: Path | None = None
    data_dir: Path = Field(default_factory=paths.data_dir)
    name: Name | None = Field(default=None, description="host name (default: the hostname)")
    labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    ports: Annotated[tuple[Port, Port], NoDecode] = DEFAULT_PORT_RANGE
    advertise_address: Address | None = Field(
        default=None, description="default: the local address that routes to the control plane"
    )
    gpu_backend: Literal["auto", "nvml", "fake"] = "auto"
    fake_gpus: str = "2xH200"
    fake_faults: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9401, ge=0, le=65535)
    startup_grace_s: float = Field(default=600.0, gt=0)
    expected_gpus: int | None = Field(default=None, ge=0)
    min_driver: str = "535.0"
    stop_engines_on_exit: bool = False
    allow_root: bool = False
    log_level: LogLevel = "info"
    log_format: LogFormat = "kv"
    ca_file: Path | None = Field(default=None, description="CA of the control plane's certificate")
    metrics_tls_cert: Path | None = None
    metrics_tls_key: Path | None = None
    engine_tls_cert: Path | None = None
    engine_tls_key: Path | None = None
    # Directories local weight sources may be copied from (empty: none, all from the control
    # plane); env DCTL_AGENT_MODEL_ROOTS=/srv/models:/data/ckpt.
    model_roots: ModelRoots = ()
    # Each engine's log (data_dir/agent/run/logs/instance-N.log) is rotated at every start and
    # copy-truncated past the size while it runs; this many rotated files are kept beside it.
    engine_log_max_bytes: int = Field(default=10 << 20, ge=64 << 10)
    engine_log_keep: int = Field(default=3, ge=1, le=100)
    # Engine and agent log lines go to the control plane in heartbeats, through a buffer of at
    # most these many lines and bytes; past the bound the newest are dropped, and counted.
    ship_logs: bool = True
    log_buffer_lines: int = Field(default=20_000, ge=MAX_BATCH_LINES)
    log_buffer_bytes: int = Field(default=8 << 20, ge=MAX_BATCH_BYTES)

    @field_validator("control_plane")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return http_url(value)

    @field_validator(
        "data_dir", "bootstrap_token_file", "ca_file", "metrics_tls_cert", "metrics_tls_key",
        "engine_tls_cert", "engine_tls_key",
    )  # fmt: skip
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return absolute_path(value)

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_from_text(cls, value: Any) -> Any:
        # A flag gives KEY=VALUE items, an env var one "KEY=VALUE,KEY=VALUE" line, the file a table.
        if isinstance(value, str):
            value = [item for item in value.split(",") if item.strip()]
        if isinstance(value, list | tuple):
            labels = {}
            for item in value:
                key, sep, val = str(item).partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{item!r}: write KEY=VALUE")
                labels[key.strip()] = val.strip()
            return labels
        return value

    @field_validator("labels")
    @classmethod
    def _labels_the_wire_accepts(cls, value: dict[str, str]) -> dict[str, str]:
        # One rule for label names: the one registration applies.
        try:
            RegisterRequest(name="probe", labels=value)
        except ValidationError as exc:
            raise ValueError(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None
        return value

    @field_validator("ports", mode="before")
    @classmethod
    def _ports_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            first, sep, last = value.strip().partition("-")
            if not (sep and first.isdigit() and last.isdigit()):
                raise ValueError(f"{value!r}: write FIRST-LAST, e.g. 18000-18099")
            return (int(first), int(last))
        return value

    @field_validator("ports")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError(f"{value[0]}-{value[1]}: the first port is above the last")
        return value

    @field_validator("advertise_address")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value in _WILDCARDS:
            raise ValueError(
                f"{value} means every interface; give the address other machines reach this "
                "host at (or leave it unset to use the one that routes to the control plane)"
            )
        return value

    @field_validator("fake_gpus")
    @classmethod
    def _fake_spec(cls, value: str) -> str:
        parse_spec(value)
        return value

    @field_validator("fake_faults")
    @classmethod
    def _fake_faults(cls, value: str) -> str:
        # The one parser of fault texts, on a fake that is thrown away.
        FakeBackend("1xH200").inject(value)
        return value

    def check_tls(self) -> list[str]:
        """Check the TLS settings: pairs complete, certificates and keys loadable, keys not
        readable by every user, the CA file usable. Returns warnings; raises `SettingsError`."""
        warnings: list[str] = []
        for pair in ("metrics_tls", "engine_tls"):
            cert, key = getattr(self, f"{pair}_cert"), getattr(self, f"{pair}_key")
            if cert is None and key is None:
                continue
            if cert is None or key is None:
                missing, given = ("cert", "key") if cert is None else ("key", "cert")
                raise SettingsError(
                    _invalid(f"{pair}_{missing}", f"{pair}_{given} is set: give both")
                )
            try:
                warnings += check_server_files(cert, key)
            except TlsError as exc:
                raise SettingsError(_invalid(f"{pair}_cert", str(exc))) from None
        if self.ca_file is not None:
            try:
                client_context(self.ca_file)
            except TlsError as exc:
                raise SettingsError(_invalid("ca_file", str(exc))) from None
        return warnings

    def read_bootstrap_token(self) -> str | None:
        """The bootstrap token: the value if one was given, else the file's content.

        A missing file is not an error (once registered, the agent needs no bootstrap token, and
        a used one may well be deleted); an unreadable or empty one is.
        """
        if self.bootstrap_token is not None:
            return self.bootstrap_token.get_secret_value()
        path = self.bootstrap_token_file
        if path is None:
            return None
        if not path.exists():
            log.warning("bootstrap token file %s does not exist (fine once registered)", path)
            return None
        try:
            token = path.read_text().strip()
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError as exc:
            raise SettingsError(
                f"invalid setting bootstrap_token_file: cannot read {path}: {exc.strerror}"
            ) from None
        if not token:
            raise SettingsError(f"invalid setting bootstrap_token_file: {path} is empty")
        if mode & 0o077:
            log.warning("bootstrap token file %s is readable by others (mode %o): chmod 600 it",
                        path, mode)  # fmt: skip
        return token


def check_agent_config(text: str) -> None:
    """Check TEXT is a config file the agent accepts; ValueError naming the bad key if not.

    Only the text counts: unlike `dctl agent`, this reads no env var and no other file (provisioning
    checks the agent.toml it writes for another host with it).
    """
    try:
        table = tomllib.loads(text).get("agent")
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"agent config is not valid TOML: {exc}") from None
    if not isinstance(table, dict):
        raise ValueError("agent config has no [agent] table")
    try:
        _TextOnlySettings(**table)
    except ValidationError as exc:
        raise ValueError(describe_agent_error(exc)) from None


class _TextOnlySettings(AgentSettings):
    """AgentSettings that read only their arguments: the env and config file of this machine
    say nothing about the remote host's."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def describe_agent_error(exc: ValidationError) -> str:
    """One line naming the bad setting, where it can be set, and what is allowed."""
    err = exc.errors()[0]
    name = str(err["loc"][0]) if err["loc"] else "settings"
    if err["type"] == "extra_forbidden":
        known = ", ".join(AgentSettings.model_fields)
        return f"unknown setting {name!r} in the [agent] table (known: {known})"
    return _invalid(name, str(err["msg"]).removeprefix("Value error, "))


def _invalid(name: str, message: str) -> str:
    """`invalid setting NAME (--FLAG, env DCTL_AGENT_NAME): MESSAGE`."""
    flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    return f"invalid setting {name} ({flag}, env {ENV_PREFIX}{name.upper()}): {message}"


def load_agent_settings(config_file: Path | None = None, **overrides: Any) -> AgentSettings:
    """Load the settings; flags come as OVERRIDES (None: not given). Raises `SettingsError`.

    CONFIG_FILE (from `--config`) replaces the default file; unlike the default, it must exist.
    """
    return AgentSettings.load(config_file, **overrides)
