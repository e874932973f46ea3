"""Provision one host over SSH: facts, layout, install, configure, start, wait for it to register.

    connect -> facts -> (unchanged? stop here) -> prefix -> wheels -> venv -> config + token
            -> start -> registered with a preflight verdict -> manifest

Every change is journalled with its undo; a failure at any step undoes what this run changed
(nothing is left half-installed) and reports the step, the remote command (secrets masked) and
its stderr. The manifest (`provisioned.json` under the prefix) is written last: it is what makes
a second run "unchanged", and it exists only when a run completed.

Venvs live in `venvs/<wheel digest>` behind a `venv` symlink, so an upgrade installs beside the
running version and switches the link, and undoing it switches back.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from provision.errors import ProvisionError, StepFailed
from provision.facts import hard_failures, run_facts
from provision.fleet import BootstrapToken, Fleet, drain_and_wait
from provision.install import DryRun, Installer
from provision.inventory import HostSpec
from provision.journal import Journal
from provision.layout import (
    SERVICE_USER,
    SYSTEM_PREFIX,
    USER_PREFIX,
    Layout,
    agent_config,
    choose_layout,
    running_command,
    systemd_unit,
)
from provision.ssh import Remote, SshOptions
from provision.wheel import DctlWheel

q = shlex.quote
# Free disk the prefix needs: torch and its CUDA libraries dwarf everything else.
NEEDS_BYTES = {"engine": 4 << 30, None: 512 << 20}
POLL_S = 0.5


@dataclass(frozen=True)
class RunOptions:
    """What every host of one `dctl host provision` run shares."""

    control_plane: str
    wheel: DctlWheel
    wheelhouse: tuple[Path, ...] = ()
    password: str | None = None
    upgrade: bool = False
    dry_run: bool = False
    register_timeout_s: float = 180.0
    # The CA the CLI verifies the control plane with: agents need it too (a private CA).
    ca_pem: bytes | None = None
    drain_timeout_s: float = 600.0


@dataclass
class Outcome:
    """One host's result: a row of the table at the end."""

    host: str
    name: str | None = None
    result: str = "failed"  # provisioned, unchanged, upgraded, restarted, planned, failed
    agent_version: str | None = None
    preflight: str | None = None
    seconds: float = 0.0
    step: str | None = None
    error: str | None = None
    plan: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prefix: str | None = None  # where it is installed, as the host resolved it

    @property
    def ok(self) -> bool:
        """Anything but a failure (a failing preflight is reported, not a failure)."""
        return self.result != "failed"


def preflight_verdict(checks: list[Any]) -> str:
    """`pass`, `pass (warn: a, b)` or `fail: a, b` from a host's preflight checks (a warning,
    such as fake GPUs, does not keep engines off the host; a failure does)."""
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if failed:
        return "fail: " + ", ".join(failed)
    return f"pass (warn: {', '.join(warned)})" if warned else "pass"


def desired_manifest(
    wheel: DctlWheel,
    spec: HostSpec,
    layout: Layout,
    name: str,
    config: str,
    unit: str | None,
    ca: bytes | None = None,
) -> dict[str, Any]:
    """What a completed run leaves in `provisioned.json` (compared without `provisioned_at`)."""
    import hashlib

    digest = hashlib.sha256(
        (config + "\0" + (unit or "")).encode() + b"\0" + (ca or b"")
    ).hexdigest()
    return {
        "dctl_version": wheel.version,
        "wheel_digest": wheel.digest,
        "extras": sorted(spec.extras),
        "name": name,
        "mode": layout.mode,
        "files_sha256": digest,
    }


class HostProvisioner:
    """Provisions one host; `run()` never raises, it returns the host's `Outcome`."""

    def __init__(
        self,
        spec: HostSpec,
        options: RunOptions,
        fleet: Fleet,
        log: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.spec, self.options, self.fleet, self.log = spec, options, fleet, log
        self.clock, self.sleep = clock, sleep
        self.outcome = Outcome(host=str(spec.target), name=spec.name)
        self.journal = Journal()
        self.installer = Installer(
            options.wheel,
            options.wheelhouse,
            spec.extras,
            self.journal,
            self._mint_token,
            self._note_last_heartbeat,
        )
        # The host's last heartbeat (the control plane's clock) while no agent of it ran: a
        # later one comes from the agent this run started. No clock of ours is compared.
        self.last_heartbeat: datetime | None = None
        self.installer.ca_pem = options.ca_pem if "ca_file" not in spec.settings else None
        self.token: BootstrapToken | None = None

    def run(self) -> Outcome:
        """Provision the host (or plan it with `dry_run`) and say how it went."""
        started = self.clock()
        step = ["connect"]
        try:
            ssh = SshOptions(
                key_file=self.spec.key_file,
                password=self.options.password,
                known_hosts=self.spec.known_hosts,
                accept_new_host_key=self.spec.accept_new_host_key,
            )
            with Remote(self.spec.target, ssh, log=self.log) as remote:
                self._provision(remote, step)
        except ProvisionError as exc:
            self.outcome.result = "failed"
            self.outcome.step = getattr(exc, "step", step[0])
            self.outcome.error = str(exc)
        except Exception as exc:  # a bug or a dropped link: still one row, with the cause
            self.log.exception("provisioning %s failed", self.spec.target)
            self.outcome.result, self.outcome.step = "failed", step[0]
            self.outcome.error = f"{type(exc).__name__}: {exc}"
        self.outcome.seconds = round(self.clock() - started, 1)
        return self.outcome

    # --- the flow ------------------------------------------------------------------------------

    def _provision(self, remote: Remote, step: list[str]) -> None:
        spec, options = self.spec, self.options
        step[0] = "facts"
        guess = spec.prefix or (SYSTEM_PREFIX if spec.sudo else f"~/{USER_PREFIX}")
        facts = run_facts(remote, guess, spec.python)
        need = NEEDS_BYTES["engine" if "engine" in spec.extras else None]
        failures = hard_failures(facts, want_root=spec.sudo, min_free_bytes=need)
        if failures:
            raise StepFailed("facts", "; ".join(failures) + " (nothing was installed)")
        layout = choose_layout(facts, sudo=spec.sudo, prefix=spec.prefix)
        self.outcome.prefix = layout.prefix
        if layout.run_as != facts.user:
            self._check_service_user_reaches(remote, facts.python)
        name = spec.name or self._hostname(remote)
        self.outcome.name = name
        # A CA the user placed on the host (`--set ca_file=...`) wins over the CLI's own.
        ca_file = None
        if options.ca_pem is not None and "ca_file" not in spec.settings:
            ca_file = layout.ca_file
        config = agent_config(
            control_plane=options.control_plane,
            name=name,
            layout=layout,
            labels=spec.labels,
            settings=spec.settings,
            ca_file=ca_file,
        )
        unit = systemd_unit(layout) if layout.systemd else None
        desired = desired_manifest(
            options.wheel, spec, layout, name, config, unit, self.installer.ca_pem
        )
        current = self._manifest(remote, layout)
        known = self.fleet.host(name)
        running = remote.run(running_command(layout), check=False).ok
        has_identity = remote.run(
            f"{layout.sudo}test -s {q(layout.data_dir + '/agent/agent-token')}", check=False
        ).ok
        if current is not None and _same(current, desired) and running and known is not None:
            self.outcome.result = "unchanged"
            self.outcome.agent_version = known.facts.agent_version if known.facts else None
            self.outcome.preflight = preflight_verdict(known.facts.preflight if known.facts else [])
            return
        installed = current or {}
        upgrading = current is not None and installed.get("wheel_digest") != desired["wheel_digest"]
        if upgrading and not options.upgrade:
            raise StepFailed(
                "facts",
                f"{layout.prefix} holds dctl {installed.get('dctl_version')} "
                f"({str(installed.get('wheel_digest'))[:12]}), "
                f"this is dctl {options.wheel.version} "
                f"({options.wheel.digest[:12]}): run again with --upgrade to drain the host, "
                "replace the agent and undrain it",
            )
        if known is not None and not has_identity:
            raise StepFailed(
                "facts",
                f"a host named {name!r} is already registered and this machine has no agent "
                f"identity under {layout.data_dir}: give this one another --name, or run "
                f"`dctl host remove {name}` first if it is the same machine reinstalled",
            )
        if options.dry_run:
            planner = DryRun()
            self.installer.install(planner, remote, facts, layout, config, unit, known is None)
            self.outcome.result, self.outcome.plan = "planned", planner.plan
            return
        drained = upgrading and known is not None
        if drained:
            step[0] = "drain"
            self._drain(name)
        try:
            step[0] = "install"
            token_needed = known is None
            self.installer.install(remote, remote, facts, layout, config, unit, token_needed, step)
            step[0] = "register"
            host = self._wait_registered(remote, layout, name)
        except BaseException:
            left = self.journal.rollback(remote, self.log)
            if self.token is not None:
                self._revoke_unused()
            if drained and not left:
                self.fleet.undrain(name)
            elif drained:
                self.log.warning(
                    "host %s left drained: `dctl host undrain %s` once fixed", name, name
                )
            raise
        step[0] = "finish"
        self._finish(remote, layout, desired)
        if drained:
            self.fleet.undrain(name)
        self.outcome.result = (
            "upgraded" if upgrading else "provisioned" if current is None else "restarted"
        )
        if not layout.systemd:
            self.outcome.notes.append(
                f"no systemd: the agent runs detached (pid in {layout.pid_file}, log in "
                f"{layout.log_file}) and will not survive a reboot"
            )
        self.outcome.agent_version = host.facts.agent_version if host.facts else None
        self.outcome.preflight = preflight_verdict(host.facts.preflight if host.facts else [])
        if known is not None and spec.labels and dict(host.labels) != dict(spec.labels):
            # Only a new host's bootstrap token stamps labels; a known host keeps the operator's.
            wanted = " ".join(f"{k}={v}" for k, v in spec.labels.items())
            self.outcome.notes.append(
                f"labels unchanged on the control plane (placement reads those): "
                f"`dctl host label {name} {wanted}` sets them"
            )

    def _manifest(self, remote: Remote, layout: Layout) -> dict[str, Any] | None:
        found = remote.run(f"{layout.sudo}cat {q(layout.manifest_file)}", check=False)
        if not found.ok:
            return None
        try:
            data = json.loads(found.stdout)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def _finish(self, remote: Remote, layout: Layout, desired: dict[str, Any]) -> None:
        """The manifest (the run is complete), then what the previous version left behind."""
        s = layout.sudo
        manifest = {**desired, "provisioned_at": datetime.now(UTC).isoformat(timespec="seconds")}
        with self.installer.staging(remote, remote) as staging:
            staged = f"{staging}/provisioned.json"
            remote.put_bytes(json.dumps(manifest, indent=2).encode(), staged, 0o644)
            remote.run(f"{s}install -m 0644 {q(staged)} {q(layout.manifest_file)}")
        keep = f"{layout.prefix}/venvs/{self.options.wheel.digest[:16]}"
        remote.run(
            f"{s}find {q(layout.prefix + '/venvs')} -mindepth 1 -maxdepth 1 ! -path {q(keep)} "
            f"-exec rm -rf {{}} + ; {s}rm -f {q(layout.prefix)}/*.prev",
            check=False,
        )
        self.journal.entries.clear()

    def _check_service_user_reaches(self, remote: Remote, python: str) -> None:
        """The service user runs the venv's Python: refuse one it cannot reach (a pyenv shim
        under root's 0700 home, say) before anything is installed."""
        # The first folder on the way that others may not enter, or the file others cannot run.
        script = (
            f"p=$(readlink -f {q(python)}) || exit 0; d=$p; "
            'while [ "$d" != / ]; do case $(stat -c %a "$d") in *[1357]) ;; '
            '*) echo "$d"; exit 1;; esac; d=$(dirname "$d"); done'
        )
        found = remote.run(script, check=False)
        if not found.ok:
            raise StepFailed(
                "facts",
                f"the service user {SERVICE_USER} cannot run {python}: "
                f"{found.stdout.strip()} is closed to other users; pass --python with a "
                "system-wide Python >= 3.11 (e.g. /usr/bin/python3.11); nothing was installed",
            )

    def _hostname(self, remote: Remote) -> str:
        from pydantic import TypeAdapter, ValidationError

        from protocol.wire import Name

        name = remote.run("hostname -s 2>/dev/null || hostname").stdout.strip().lower()
        try:
            return str(TypeAdapter(Name).validate_python(name))
        except ValidationError:
            raise StepFailed(
                "facts", f"the host calls itself {name!r}, not a valid fleet name: pass --name"
            ) from None

    def _drain(self, name: str) -> None:
        """Drain the host and wait until its engines have stopped; undrain if they do not."""
        try:
            drain_and_wait(
                self.fleet, name, self.options.drain_timeout_s, clock=self.clock, sleep=self.sleep
            )
        except ProvisionError as exc:
            self.fleet.undrain(name)
            raise StepFailed("drain", f"{exc}; undrained, nothing was changed") from None

    def _note_last_heartbeat(self) -> None:
        host = self.fleet.host(self.outcome.name or "")
        self.last_heartbeat = host.last_seen_at if host is not None else None

    def _wait_registered(self, remote: Remote, layout: Layout, name: str) -> Any:
        """The host once the agent this run started has heartbeated with a preflight report."""
        deadline = self.clock() + self.options.register_timeout_s
        while True:
            host = self.fleet.host(name)
            seen = host.last_seen_at if host is not None else None
            fresh = seen is not None and (self.last_heartbeat is None or seen > self.last_heartbeat)
            if host and fresh and host.facts and host.facts.preflight:
                self.token = None  # used: nothing to revoke
                return host
            if self.clock() > deadline:
                raise StepFailed(
                    "register",
                    f"the agent did not register within {self.options.register_timeout_s:.0f} s; "
                    f"its last log lines:\n{self._agent_log(remote, layout)}",
                )
            if not remote.run(running_command(layout), check=False).ok:
                raise StepFailed(
                    "register",
                    f"the agent exited; its last log lines:\n{self._agent_log(remote, layout)}",
                )
            self.sleep(POLL_S)

    def _agent_log(self, remote: Remote, layout: Layout) -> str:
        if layout.systemd:
            command = f"{layout.sudo}journalctl {'--user ' if layout.mode == 'user' else ''}"
            command += "-u dctl-agent -n 20 --no-pager"
        else:
            command = f"{layout.sudo}tail -n 20 {q(layout.log_file)}"
        return remote.run(command, check=False).stdout.strip() or "(no log)"

    def _mint_token(self) -> str:
        """A one-use bootstrap token for this host, remembered so a failure revokes it."""
        self.token = self.fleet.bootstrap_token(self.outcome.name or "", self.spec.labels)
        return self.token.secret

    def _revoke_unused(self) -> None:
        try:
            if self.token is not None:
                self.fleet.revoke(self.token)
        except Exception as exc:
            self.log.warning("could not revoke the unused bootstrap token: %s", exc)
        self.token = None


def _same(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    return {k: v for k, v in current.items() if k != "provisioned_at"} == desired
