"""Deprovision a host: stop its agent, remove what provisioning installed, forget the host.

Weight snapshots (the agent's store under `data/snapshots`) stay unless `purge`: they are the
expensive part to fetch again, and a host provisioned anew reuses them.
"""

from __future__ import annotations

import logging
import shlex

from provision.facts import run_facts
from provision.fleet import Fleet, drain_and_wait
from provision.layout import SERVICE_USER, choose_layout, stop_command
from provision.registry import ProvisionedHost
from provision.ssh import Remote, SshOptions
from provision.target import SshTarget

q = shlex.quote
DRAIN_TIMEOUT_S = 120.0
KEPT = ("snapshots",)  # the snapshot store: verified weights, their manifests, partials


def deprovision(
    host: ProvisionedHost, ssh: SshOptions, fleet: Fleet, log: logging.Logger, *, purge: bool
) -> list[str]:
    """Undo a provisioning of HOST; returns what was done, one line each."""
    done: list[str] = []
    with Remote(SshTarget.parse(host.target), ssh, log=log) as remote:
        facts = run_facts(remote, host.prefix, None)
        layout = choose_layout(facts, sudo=host.sudo, prefix=host.prefix)
        s, prefix = layout.sudo, layout.prefix
        # Engines outlive their agent (so a restart adopts them): the agent stops them when
        # the host is drained, before it is stopped itself.
        if fleet.host(host.name) is not None and drain_and_wait(fleet, host.name, DRAIN_TIMEOUT_S):
            done.append("drained: its engines were stopped")
        remote.run(stop_command(layout))
        remote.run(f"{s}pkill -TERM -f -- {q(_own_pattern(prefix + '/venv'))}", check=False)
        done.append("agent stopped")
        if layout.systemd:
            remote.run(
                f"{s}rm -f {q(layout.unit_path)} && {layout.systemctl} daemon-reload", check=False
            )
            done.append(f"removed {layout.unit_path}")
        if purge:
            remote.run(f"{s}rm -rf {q(prefix)}")
            done.append(f"removed {prefix}")
            if layout.mode == "system":
                # Only a user nobody runs as any more: another agent (a second prefix) may.
                gone = remote.run(
                    f"pgrep -u {SERVICE_USER} >/dev/null || {s}userdel {SERVICE_USER}", check=False
                )
                if gone.ok:
                    done.append(f"removed user {SERVICE_USER} (if no process ran as it)")
        else:
            keep = " ".join(f"! -name {name}" for name in KEPT)
            remote.run(
                f"if [ -d {q(prefix)} ]; then "
                f"{s}find {q(prefix)} -mindepth 1 -maxdepth 1 ! -name data -exec rm -rf {{}} + ; "
                f"{s}find {q(layout.data_dir)} -mindepth 1 -maxdepth 1 {keep} "
                "-exec rm -rf {} + ; "
                "fi"
            )
            done.append(f"removed {prefix} except the weight snapshots under {layout.data_dir}")
    if fleet.host(host.name) is not None:
        fleet.remove(host.name)
        done.append(f"host {host.name} removed from the control plane")
    return done


def _own_pattern(path: str) -> str:
    """A `pkill -f` pattern for processes run from PATH that does not match the shell running
    pkill (whose command line holds the pattern itself): the first character goes in brackets."""
    escaped = "".join(f"\\{c}" if c in ".+" else c for c in path[1:])
    return f"[{path[0]}]{escaped}"
