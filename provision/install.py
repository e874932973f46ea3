"""The changes provisioning makes on a host, each journalled with its undo.

`Installer.install` runs them through R (a `Remote`, or `DryRun`, which only records them for
`--dry-run`) and asks read-only questions through PROBE (always the real remote). Files reach
the host through a private staging folder (SFTP writes as the SSH user) and are moved into place
with their mode and owner by `install`; secrets go only through files, never command lines.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from provision.facts import HostFacts
from provision.journal import Journal
from provision.layout import (
    SERVICE_USER,
    Layout,
    running_command,
    start_detached_command,
    stop_command,
)
from provision.ssh import CommandResult, Remote
from provision.wheel import DctlWheel

q = shlex.quote


class DryRun:
    """Stands in for the remote while planning: records every change, runs nothing."""

    def __init__(self) -> None:
        self.plan: list[str] = []

    def run(
        self, command: str, *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult:
        """Record COMMAND; it 'succeeds' with no output."""
        self.plan.append(f"$ {command}")
        return CommandResult(command, 0, "", "")

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        """Record an upload (never its content: it may be the token)."""
        self.plan.append(f"upload {len(data)} bytes -> {remote_path} (mode {mode:o})")

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        """Record an upload of LOCAL."""
        self.plan.append(f"upload {local.name} -> {remote_path} (mode {mode:o})")


def start_command(layout: Layout, unit: str | None) -> str:
    """How the agent starts: its systemd unit, or detached with a pid file."""
    if unit is None:
        return start_detached_command(layout)
    ctl = layout.systemctl
    return f"{ctl} daemon-reload && {ctl} enable dctl-agent && {ctl} restart dctl-agent"


def as_service(layout: Layout, facts: HostFacts, command: str) -> str:
    """COMMAND as the user the agent runs as (HOME at the prefix, so pip's caches stay there)."""
    inner = f"cd {q(layout.prefix)} && HOME={q(layout.prefix)} {command}"
    if layout.mode == "user" or facts.user == layout.run_as:
        return inner
    if facts.uid == 0:
        return f"runuser -u {layout.run_as} -- sh -c {q(inner)}"
    return f"sudo -n -u {layout.run_as} sh -c {q(inner)}"


class Installer:
    """Puts one dctl wheel (and a wheelhouse) on a host and starts its agent."""

    def __init__(
        self,
        wheel: DctlWheel,
        wheelhouse: tuple[Path, ...],
        extras: tuple[str, ...],
        journal: Journal,
        mint_token: Callable[[], str],
        agent_stopped: Callable[[], None] = lambda: None,
    ) -> None:
        self.wheel, self.wheelhouse, self.extras = wheel, wheelhouse, extras
        self.journal, self.mint_token = journal, mint_token
        # Called once no agent of this host runs any more (just before the new one starts).
        self.agent_stopped = agent_stopped
        self.ca_pem: bytes | None = None  # written beside the config when set

    def install(
        self,
        r: Any,
        probe: Remote,
        facts: HostFacts,
        layout: Layout,
        config: str,
        unit: str | None,
        token_needed: bool,
        step: list[str] | None = None,
    ) -> None:
        """Every change, each journalled; R runs them (the remote, or the dry run's recorder),
        PROBE answers the read-only questions."""
        s, prefix = layout.sudo, layout.prefix
        owner = f"-o {layout.run_as} -g {layout.run_as} " if layout.mode == "system" else ""

        def at(name: str) -> None:
            if step is not None:
                step[0] = name

        at("prefix")
        if not probe.run(f"{s}test -d {q(prefix)}", check=False).ok:
            r.run(f"{s}mkdir -p {q(prefix)}")
            self.journal.record("prefix", f"{s}rm -rf {q(prefix)}")
        if layout.mode == "system" and not probe.run(f"id -u {SERVICE_USER}", check=False).ok:
            # `|| id`: another run on this host may have created it meanwhile.
            r.run(
                f"{s}useradd --system --user-group --no-create-home --home-dir {q(prefix)} "
                f"--shell /usr/sbin/nologin {SERVICE_USER} || id -u {SERVICE_USER} >/dev/null"
            )
            self.journal.record("service user", f"{s}userdel {SERVICE_USER}")
        dirs = " ".join(q(d) for d in (layout.wheels, layout.data_dir, f"{prefix}/venvs"))
        r.run(
            f"{s}mkdir -p {dirs} && {s}chmod 0755 {q(prefix)} && {s}chmod 0700 {q(layout.data_dir)}"
        )
        if layout.mode == "system":
            r.run(f"{s}chown -R {layout.run_as}:{layout.run_as} {q(prefix)}")

        with self.staging(r, probe) as staging:
            at("upload")
            present = self._present_wheels(probe, layout)
            sent = []
            for local in (self.wheel.path, *self.wheelhouse):
                if present.get(local.name) != local.stat().st_size:
                    r.put_file(local, f"{staging}/{local.name}")
                    sent.append(q(f"{staging}/{local.name}"))
            if sent:
                # One command for all: each round trip costs about as much as a small upload.
                r.run(f"{s}install -m 0644 {owner}{' '.join(sent)} {q(layout.wheels)}/")

            at("venv")
            venv = f"{prefix}/venvs/{self.wheel.digest[:16]}"
            if not probe.run(f"test -x {q(venv + '/bin/python')}", check=False).ok:
                r.run(as_service(layout, facts, f"{q(facts.python)} -m venv {q(venv)}"))
                self.journal.record("venv", f"{s}rm -rf {q(venv)}")
            at("install")
            extras = f"[{','.join(self.extras)}]" if self.extras else ""
            wheel = f"{layout.wheels}/{self.wheel.path.name}"
            index = "--no-index " if self.wheelhouse else ""
            r.run(
                as_service(
                    layout,
                    facts,
                    f"{q(venv + '/bin/python')} -m pip install --quiet --disable-pip-version-check "
                    f"--no-input --no-cache-dir {index}--find-links {q(layout.wheels)} "
                    f"{q(wheel + extras)}",
                ),
                timeout_s=1800,
            )

            at("stop")
            if probe.run(running_command(layout), check=False).ok:
                r.run(stop_command(layout))
                self.journal.record("agent stopped", start_command(layout, unit))
            at("configure")
            link = f"{prefix}/venv"
            old = probe.run(f"readlink {q(link)}", check=False).stdout.strip()
            r.run(
                f"{s}ln -sfn {q(venv)} {q(link + '.new')} && {s}mv -Tf {q(link + '.new')} {q(link)}"
            )
            self.journal.record(
                "venv link",
                f"{s}ln -sfn {q(old)} {q(link)}" if old else f"{s}rm -f {q(link)}",
            )
            if self.ca_pem is not None:
                self._put(r, probe, staging, layout, self.ca_pem, layout.ca_file, 0o644)
            self._put(r, probe, staging, layout, config.encode(), layout.config_file, 0o644)
            if token_needed:
                if isinstance(r, DryRun):
                    secret = b"<one-use bootstrap token>"
                else:
                    token = self.mint_token()
                    probe.add_secret(token)
                    secret = token.encode()
                self._put(r, probe, staging, layout, secret, layout.token_file, 0o600)
            if unit is not None:
                self._put(r, probe, staging, layout, unit.encode(), layout.unit_path, 0o644,
                          owned=False)  # fmt: skip
            at("start")
            if not isinstance(r, DryRun):
                self.agent_stopped()
            if unit is not None and layout.mode == "user":
                # A user's units stop when its last session ends unless it lingers; best
                # effort (some hosts reserve it for root): the run still starts the agent.
                r.run('loginctl enable-linger "$(id -un)"', check=False)
            r.run(start_command(layout, unit))
            self.journal.record("agent started", stop_command(layout))

    def _put(
        self,
        r: Any,
        probe: Remote,
        staging: str,
        layout: Layout,
        data: bytes,
        path: str,
        mode: int,
        *,
        owned: bool = True,
    ) -> None:
        """Write DATA to PATH through the staging directory (SFTP writes as the SSH user), with
        MODE and the service user as owner; the previous file is restored on undo."""
        s = layout.sudo
        owner = (
            f"-o {layout.run_as} -g {layout.run_as} " if owned and layout.mode == "system" else ""
        )
        staged = f"{staging}/{Path(path).name}"
        r.put_bytes(data, staged, mode)
        if probe.run(f"{s}test -e {q(path)}", check=False).ok:
            r.run(f"{s}cp -p {q(path)} {q(path + '.prev')}")
            self.journal.record(path, f"{s}mv -f {q(path + '.prev')} {q(path)}")
        else:
            self.journal.record(path, f"{s}rm -f {q(path)}")
        parent = q(str(Path(path).parent))
        r.run(f"{s}mkdir -p {parent} && {s}install -m {mode:04o} {owner}{q(staged)} {q(path)}")

    @contextmanager
    def staging(self, r: Any, probe: Remote) -> Iterator[str]:
        """A private temporary directory on the host, removed whatever happens."""
        if isinstance(r, DryRun):
            yield "$STAGING"
            return
        staging = probe.run("mktemp -d /tmp/dctl-provision.XXXXXX").stdout.strip()
        try:
            yield staging
        finally:
            probe.run(f"rm -rf {q(staging)}", check=False)

    def _present_wheels(self, probe: Remote, layout: Layout) -> dict[str, int]:
        listing = probe.run(
            f"{layout.sudo}find {q(layout.wheels)} -maxdepth 1 -type f -printf '%f %s\\n'",
            check=False,
        )
        present: dict[str, int] = {}
        for line in listing.stdout.splitlines():
            file, _, size = line.rpartition(" ")
            if size.isdigit():
                present[file] = int(size)
        return present
