"""What to provision: one `HostSpec` per host, from the command line or a hosts file.

A hosts file is YAML: a list of entries, or `{defaults: {...}, hosts: [...]}`. An entry has the
command line's per-host fields (`host` is the USER@HOST[:PORT] target; `set` the agent settings
of `--set`); the command line's flags are the defaults of every entry, `defaults` come next.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from provision.errors import InventoryError
from provision.target import SshTarget

DEFAULT_EXTRAS = ("engine", "gpu")
# The extras of dctl a host may be given (pyproject.toml's optional dependencies that make
# sense on a GPU host: the TUI and the dev tools do not).
HOST_EXTRAS = ("engine", "gpu", "postgres")


@dataclass(frozen=True)
class HostSpec:
    """One host to provision and how."""

    target: SshTarget
    name: str | None = None  # fleet name; default: the host's own `hostname -s`
    key_file: Path | None = None
    known_hosts: Path | None = None
    accept_new_host_key: bool = False
    sudo: bool = False
    prefix: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    python: str | None = None
    extras: tuple[str, ...] = DEFAULT_EXTRAS
    settings: Mapping[str, Any] = field(default_factory=dict)


def parse_labels(text: str, where: str = "--labels") -> dict[str, str]:
    """`k=v,k2=v2` -> dict; anything else names WHERE."""
    labels: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InventoryError(f"{where}: {item!r} is not KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def parse_extras(text: str, where: str = "--extras") -> tuple[str, ...]:
    """`engine,gpu` -> ('engine', 'gpu'); an empty text is no extras; unknown ones are named."""
    extras = tuple(e.strip() for e in text.split(",") if e.strip())
    unknown = [e for e in extras if e not in HOST_EXTRAS]
    if unknown:
        raise InventoryError(f"{where}: unknown extra {unknown[0]!r}; choose from {HOST_EXTRAS}")
    return extras


def parse_setting(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--set`: the value as TOML reads it (0 is an int, true a bool, [..] a
    list), else as a string, so `--set gpu_backend=fake` needs no quotes."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise InventoryError(f"--set {text!r}: write KEY=VALUE, e.g. --set metrics_port=9401")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().replace("-", "_"), value


_FIELDS = {
    "host", "name", "key", "known_hosts", "accept_new_host_key", "sudo", "prefix", "labels",
    "python", "extras", "set",
}  # fmt: skip


def load_hosts(path: Path, defaults: HostSpec) -> list[HostSpec]:
    """The hosts of a hosts file, each on top of DEFAULTS (the command line's flags)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InventoryError(f"-f {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"-f {path}: not valid YAML ({exc})") from None
    base = defaults
    if isinstance(data, dict):
        unknown = set(data) - {"defaults", "hosts"}
        if unknown:
            raise InventoryError(f"{path}: unknown key {sorted(unknown)[0]!r} (defaults, hosts)")
        if data.get("defaults") is not None:
            base = _entry(data["defaults"], base, f"{path}: defaults", needs_host=False)
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise InventoryError(f"{path}: expected a list of hosts (each with `host: USER@HOST`)")
    specs = [_entry(item, base, f"{path}: host {i + 1}") for i, item in enumerate(data)]
    names = [s.name or s.target.host for s in specs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InventoryError(f"{path}: host {duplicate!r} is listed twice; give each a `name`")
    return specs


def _entry(item: Any, base: HostSpec, where: str, *, needs_host: bool = True) -> HostSpec:
    if isinstance(item, str):
        item = {"host": item}
    if not isinstance(item, dict):
        raise InventoryError(f"{where}: expected a mapping like {{host: user@gpu-01}}")
    unknown = set(item) - _FIELDS
    if unknown:
        raise InventoryError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    changes: dict[str, Any] = {}
    if "host" in item:
        try:
            changes["target"] = SshTarget.parse(str(item["host"]))
        except ValueError as exc:
            raise InventoryError(f"{where}: host: {exc}") from None
    elif needs_host:
        raise InventoryError(f"{where}: `host: USER@HOST[:PORT]` is missing")
    for key, attr in (("name", "name"), ("prefix", "prefix"), ("python", "python")):
        if item.get(key) is not None:
            changes[attr] = str(item[key])
    for key, attr in (("key", "key_file"), ("known_hosts", "known_hosts")):
        if item.get(key) is not None:
            changes[attr] = Path(str(item[key])).expanduser()
    for key in ("sudo", "accept_new_host_key"):
        if key in item:
            if not isinstance(item[key], bool):
                raise InventoryError(f"{where}: {key}: write true or false")
            changes[key] = item[key]
    if "labels" in item:
        labels = item["labels"]
        changes["labels"] = (
            parse_labels(labels, f"{where}: labels")
            if isinstance(labels, str)
            else {str(k): str(v) for k, v in (labels or {}).items()}
        )
    if "extras" in item:
        extras = item["extras"]
        text = extras if isinstance(extras, str) else ",".join(map(str, extras or []))
        changes["extras"] = parse_extras(text, f"{where}: extras")
    if "set" in item:
        if not isinstance(item["set"], dict):
            raise InventoryError(f"{where}: set: expected a mapping of agent settings")
        changes["settings"] = {**base.settings, **item["set"]}
    return replace(base, **changes)
