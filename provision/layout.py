"""Where dctl goes on a provisioned host, and the files and commands that put the agent there.

Two layouts. `system` (the SSH user is root, or --sudo): a `dctl` service user owns the prefix
(default /opt/dctl) and a system unit runs the agent. `user`: everything belongs to the SSH user
under its home (default ~/.local/share/dctl-agent) and a `systemctl --user` unit runs it. Without
systemd the agent is started detached, with a pid file.

Everything here is text: the caller runs the commands and uploads the files.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

from provision.facts import HostFacts

Mode = Literal["system", "user"]
SERVICE_USER = "dctl"
UNIT_NAME = "dctl-agent.service"
SYSTEM_PREFIX = "/opt/dctl"
USER_PREFIX = ".local/share/dctl-agent"  # under the SSH user's home
# Characters a prefix may hold: it lands unquoted in unit files (where `%` and blanks mean
# something) and in messages; every shell command quotes it anyway.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/+@,=-]*$")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# Settings provisioning writes itself: each has its own flag, or is a secret kept off the file.
_MANAGED = {
    "control_plane": "--control-plane",
    "name": "--name",
    "labels": "--labels",
    "data_dir": "--prefix",
    "bootstrap_token_file": "(written by provisioning)",
    "bootstrap_token": "(written by provisioning to bootstrap_token_file)",
}


@dataclass(frozen=True)
class Layout:
    """Where dctl lives on one host, and as whom it runs."""

    mode: Mode
    prefix: str  # absolute, no trailing slash
    run_as: str  # SERVICE_USER or the SSH user
    sudo: str  # "" when the SSH user is root or mode is user, else "sudo -n "
    systemd: bool
    home: str  # the SSH user's home: user units live below it

    @property
    def venv(self) -> str:
        """The virtual environment dctl is installed in."""
        return f"{self.prefix}/venv"

    @property
    def wheels(self) -> str:
        """Where the uploaded wheels are kept."""
        return f"{self.prefix}/wheels"

    @property
    def data_dir(self) -> str:
        """The agent's data_dir: weight snapshots live below it."""
        return f"{self.prefix}/data"

    @property
    def config_file(self) -> str:
        """The agent's config file (`dctl agent --config`)."""
        return f"{self.prefix}/agent.toml"

    @property
    def token_file(self) -> str:
        """The one-use bootstrap token (0600)."""
        return f"{self.prefix}/bootstrap-token"

    @property
    def ca_file(self) -> str:
        """The CA of the control plane's certificate, copied from the CLI's context."""
        return f"{self.prefix}/control-plane-ca.pem"

    @property
    def manifest_file(self) -> str:
        """What provisioning installed, for idempotence and deprovision."""
        return f"{self.prefix}/provisioned.json"

    @property
    def pid_file(self) -> str:
        """The detached agent's pid (hosts without systemd)."""
        return f"{self.prefix}/agent.pid"

    @property
    def log_file(self) -> str:
        """The detached agent's output (hosts without systemd)."""
        return f"{self.prefix}/agent.log"

    @property
    def dctl(self) -> str:
        """The dctl executable in the venv."""
        return f"{self.venv}/bin/dctl"

    @property
    def unit_path(self) -> str:
        """Where the systemd unit goes."""
        if self.mode == "system":
            return f"/etc/systemd/system/{UNIT_NAME}"
        return f"{self.home}/.config/systemd/user/{UNIT_NAME}"

    @property
    def systemctl(self) -> str:
        """The systemctl command for this layout's unit (sudo or --user as needed)."""
        return f"{self.sudo}systemctl" if self.mode == "system" else "systemctl --user"


def choose_layout(facts: HostFacts, *, sudo: bool, prefix: str | None) -> Layout:
    """The layout for a host: system when root or SUDO, else user. PREFIX None: the default.

    A prefix must be absolute (or start with `~/`); one that is not is a ValueError.
    """
    mode: Mode = "system" if facts.uid == 0 or sudo else "user"
    if prefix is None:
        prefix = SYSTEM_PREFIX if mode == "system" else f"{facts.home}/{USER_PREFIX}"
    elif prefix == "~" or prefix.startswith("~/"):
        prefix = facts.home + prefix[1:]
    if not prefix.startswith("/"):
        raise ValueError(f"--prefix {prefix}: give an absolute path (or one starting with ~/)")
    prefix = posixpath.normpath(prefix)
    if prefix == "/" or not _SAFE_PATH.match(prefix):
        raise ValueError(
            f"prefix {prefix!r}: use a directory below / made of letters, digits and ._+@,=- "
            "(pass --prefix DIR)"
        )
    return Layout(
        mode=mode,
        prefix=prefix,
        run_as=SERVICE_USER if mode == "system" else facts.user,
        sudo="" if facts.uid == 0 or mode == "user" else "sudo -n ",
        systemd=facts.systemd,
        home=facts.home,
    )


# The agent config ------------------------------------------------------------------------------


def agent_config(
    *,
    control_plane: str,
    name: str,
    layout: Layout,
    labels: Mapping[str, str],
    settings: Mapping[str, object],
    ca_file: str | None = None,
) -> str:
    """The TOML text of the agent's config file: one `[agent]` table, keys sorted.

    SETTINGS are the extra agent settings from `--set KEY=VALUE`, already typed; the ones
    provisioning writes itself are refused (ValueError naming the flag to use instead).
    """
    for key in settings:
        if key in _MANAGED:
            raise ValueError(f"--set {key}: provisioning sets it; use {_MANAGED[key]}")
    table: dict[str, object] = {
        **{key: value for key, value in settings.items() if value is not None},
        "control_plane": control_plane,
        "name": name,
        "data_dir": layout.data_dir,
        "bootstrap_token_file": layout.token_file,
        "labels": dict(labels),
    }
    if ca_file is not None:
        table["ca_file"] = ca_file
    lines = [
        "# Written by `dctl host provision`; a new provisioning run replaces it.",
        "[agent]",
    ]
    lines += [f"{_toml_key(key)} = {_toml_value(table[key])}" for key in sorted(table)]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too; non-ASCII
    # stays as is because JSON's \ud83d-style surrogate pairs are not valid TOML.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: object) -> str:
    """VALUE as TOML: str, bool, int, float, path, list/tuple and dict (an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | PurePath):
        return _toml_string(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        items = [f"{_toml_key(str(k))} = {_toml_value(value[k])}" for k in sorted(value)]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ValueError(f"{value!r}: a setting must be text, a number, true/false, a list or table")


# The unit and the commands ----------------------------------------------------------------------


def systemd_unit(layout: Layout) -> str:
    """The systemd unit that runs the agent (system or `--user`, as the layout says)."""
    system = layout.mode == "system"
    service = [
        "[Service]",
        "Type=simple",
        f"ExecStart={layout.dctl} agent --config {layout.config_file}",
        *([f"User={layout.run_as}"] if system else []),
        f"WorkingDirectory={layout.prefix}",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        "RestartSec=5",
        # Engines outlive an agent restart (the new agent adopts them), as they do without
        # systemd; the default would kill the whole cgroup with the agent.
        "KillMode=process",
        "NoNewPrivileges=yes",
    ]
    if system:
        # User units get these only with unprivileged user namespaces; without them the
        # unit would not start at all, so they are kept to system units.
        service += ["PrivateTmp=yes", "ProtectSystem=full", f"ReadWritePaths={layout.prefix}"]
    lines = [
        "# Written by `dctl host provision`; a new provisioning run replaces it.",
        "[Unit]",
        "Description=dctl agent",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        *service,
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


# Alive means: the pid file names a live process whose command line holds our config file, so
# a pid reused by something else after a reboot is never taken for the agent, nor killed.
_ALIVE = r"""pid=
alive() {
    [ -s "$pidfile" ] || return 1
    pid=$(cat "$pidfile" 2>/dev/null)
    case "$pid" in '' | *[!0-9]*) return 1 ;; esac
    kill -0 "$pid" 2>/dev/null || return 1
    [ -r "/proc/$pid/cmdline" ] || return 0
    tr '\000' '\n' < "/proc/$pid/cmdline" | grep -qxF -- "$config"
}
"""

_START = r"""if alive; then echo "dctl agent already running (pid $pid)"; exit 0; fi
cd "$prefix" || exit 1
detach=; command -v setsid >/dev/null 2>&1 && detach=setsid
$detach nohup "$dctl" agent --config "$config" >> "$logfile" 2>&1 < /dev/null &
echo "$!" > "$pidfile.tmp" && mv -f "$pidfile.tmp" "$pidfile" || exit 1
sleep 1
if ! alive; then
    echo "dctl agent exited at once; the end of $logfile:" >&2
    tail -n 20 "$logfile" >&2
    exit 1
fi
echo "dctl agent started (pid $pid)"
"""

_STOP = r"""if alive; then
    kill -TERM "$pid" 2>/dev/null
    i=0
    while [ "$i" -lt 100 ] && alive; do
        sleep 0.1 2>/dev/null || sleep 1
        i=$((i + 1))
    done
    if alive; then kill -KILL "$pid" 2>/dev/null; fi
fi
rm -f "$pidfile"
exit 0
"""


def _pid_script(layout: Layout, body: str) -> str:
    """BODY (an sh script using `alive`) run as the layout's user, so that it may signal it."""
    variables = {
        "prefix": layout.prefix,
        "pidfile": layout.pid_file,
        "config": layout.config_file,
        "logfile": layout.log_file,
        "dctl": layout.dctl,
    }
    script = "".join(f"{k}={shlex.quote(v)}\n" for k, v in variables.items()) + _ALIVE + body
    if layout.mode == "user":
        as_user = "sh -c"
    elif layout.sudo:
        as_user = f"{layout.sudo}-u {shlex.quote(layout.run_as)} sh -c"
    else:  # root: runuser needs no password and no sudo package
        as_user = f"runuser -u {shlex.quote(layout.run_as)} -- sh -c"
    return f"{as_user} {shlex.quote(script)}"


def start_detached_command(layout: Layout) -> str:
    """An sh command that starts the agent without systemd, as the layout's user, with a pid
    file; a no-op when it already runs, a failure when it exits at once."""
    return _pid_script(layout, _START)


def stop_command(layout: Layout) -> str:
    """An sh command that stops the agent (the unit, or the pid file's process: TERM, up to
    10 s, then KILL); it succeeds when nothing runs, already stopped or never installed."""
    if layout.systemd:
        ctl, unit = layout.systemctl, UNIT_NAME
        return (
            f"{{ {ctl} stop {unit}; {ctl} disable {unit}; }} >/dev/null 2>&1; "
            f"! {ctl} is-active --quiet {unit}"
        )
    detached = _pid_script(layout, _STOP)
    if layout.mode == "user":
        return detached
    # No service user (a run that failed before creating it): nothing of ours can run.
    return f"! id -u {shlex.quote(layout.run_as)} >/dev/null 2>&1 || {detached}"


def running_command(layout: Layout) -> str:
    """An sh command that exits 0 if and only if the agent runs."""
    if layout.systemd:
        return f"{layout.systemctl} is-active --quiet {UNIT_NAME}"
    return _pid_script(layout, "alive\n")
