"""`dctl host provision` / `dctl host deprovision`: bare hosts into fleet members over SSH.

The work is in `provision`; this module parses flags, runs hosts in parallel (one at a time
with --upgrade: each is drained while it is replaced), prints the table and sets the exit code.
Every remote command goes to a log file (secrets masked) whose path is printed at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import USAGE, fail
from cli.options import duration_option
from cli.output import Column, print_table
from cli.remote import connect
from runtime import paths

if TYPE_CHECKING:
    from provision.inventory import HostSpec
    from provision.provisioner import Outcome, RunOptions

OUTCOME_COLUMNS: list[Column] = [
    ("HOST", "host"),
    ("RESULT", "result"),
    ("AGENT", "agent_version"),
    ("REGISTERED AS", "name"),
    ("PREFLIGHT", "preflight"),
    ("TIME", "time"),
]


def provision(
    target: str = typer.Argument(None, metavar="USER@HOST[:PORT]", help="The host to provision."),
    hosts_file: Path = typer.Option(None, "-f", "--file", help="YAML list of hosts (see docs)."),
    name: str = typer.Option(None, "--name", help="Fleet name (default: the host's hostname)."),
    key: Path = typer.Option(None, "--key", help="SSH private key file."),
    ask_password: bool = typer.Option(False, "--ask-password", help="Prompt for an SSH password."),
    known_hosts: Path = typer.Option(
        None, "--known-hosts", help="Known-hosts file [~/.ssh/known_hosts]."
    ),
    accept_new_host_key: bool = typer.Option(
        False, "--accept-new-host-key", help="Trust and record an unknown host key."
    ),
    sudo: bool = typer.Option(False, "--sudo", help="Install system-wide as a `dctl` user."),
    prefix: str = typer.Option(None, "--prefix", help="Install directory on the host."),
    labels: str = typer.Option(None, "--labels", help="Host labels, k=v,k2=v2."),
    python: str = typer.Option(None, "--python", help="Python >= 3.11 on the host."),
    extras: str = typer.Option("engine,gpu", "--extras", help="dctl extras to install."),
    wheelhouse: Path = typer.Option(
        None, "--wheelhouse", help="Local dir of wheels: hosts install with --no-index."
    ),
    control_plane: str = typer.Option(
        None, "--control-plane", help="URL the agents reach (default: the context's)."
    ),
    settings: list[str] = typer.Option(
        [], "--set", help="Agent setting KEY=VALUE for agent.toml (repeatable)."
    ),
    parallel: int = typer.Option(8, "--parallel", min=1, help="Hosts provisioned at once."),
    upgrade: bool = typer.Option(
        False, "--upgrade", help="Replace another dctl version (drain, replace, undrain)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the remote commands only."),
    timeout: str = typer.Option("3m", "--timeout", help="How long to wait for registration."),
) -> None:
    """Provision hosts over SSH: install dctl, configure and start the agent, wait until it
    registers, print each host's preflight verdict (admin)."""
    from client.credentials import CredentialsError, resolve
    from provision.errors import InventoryError
    from provision.provisioner import RunOptions
    from provision.ssh import ProvisionError
    from provision.wheel import running_wheel, wheelhouse_files

    if (target is None) == (hosts_file is None):
        fail("give one USER@HOST[:PORT] or -f HOSTS.yaml", USAGE)
    wait_s = duration_option(timeout, "--timeout")
    try:
        specs = _specs(target, hosts_file, name, key, known_hosts, accept_new_host_key, sudo,
                       prefix, labels, python, extras, settings)  # fmt: skip
    except (InventoryError, ValueError) as exc:
        fail(str(exc), USAGE)
    try:
        context = resolve()
    except CredentialsError as exc:
        fail(str(exc))
    url = control_plane or context.url
    ca_pem = None
    if context.ca_file:
        try:
            ca_pem = Path(context.ca_file).read_bytes()
        except OSError as exc:
            fail(f"the context's CA file {context.ca_file}: {exc.strerror or exc}")
    try:
        wheel = running_wheel(wheelhouse=wheelhouse)
        house = tuple(wheelhouse_files(wheelhouse)) if wheelhouse else ()
    except ProvisionError as exc:
        fail(str(exc))
    house = tuple(p for p in house if p.name != wheel.path.name)
    password = None
    if ask_password:
        password = typer.prompt("SSH password", hide_input=True) or None
    options = RunOptions(
        control_plane=url,
        wheel=wheel,
        wheelhouse=house,
        password=password,
        upgrade=upgrade,
        dry_run=dry_run,
        register_timeout_s=float(wait_s),
        ca_pem=ca_pem,
    )
    # One call before any host: an unreachable control plane or a token that may not mint
    # bootstrap tokens fails here, once, rather than on every host after its install.
    with connect() as api:
        api.list_tokens()
    log, log_path = _logger()
    print(f"dctl {wheel.version} ({wheel.digest[:12]}) -> {len(specs)} host(s), log: {log_path}",
          file=sys.stderr)  # fmt: skip
    workers = 1 if upgrade else min(parallel, len(specs))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(lambda spec: _provision_one(spec, options, log), specs))
    _report(outcomes, options, specs, context.url)


def _specs(
    target: str | None,
    hosts_file: Path | None,
    name: str | None,
    key: Path | None,
    known_hosts: Path | None,
    accept_new_host_key: bool,
    sudo: bool,
    prefix: str | None,
    labels: str | None,
    python: str | None,
    extras: str,
    settings: list[str],
) -> list[HostSpec]:
    from agent.settings import check_agent_config
    from provision.inventory import (
        HostSpec,
        load_hosts,
        parse_extras,
        parse_labels,
        parse_setting,
    )
    from provision.target import SshTarget

    base = HostSpec(
        target=SshTarget.parse(target) if target else SshTarget("root", "placeholder"),
        name=name,
        key_file=key,
        known_hosts=known_hosts,
        accept_new_host_key=accept_new_host_key,
        sudo=sudo,
        prefix=prefix,
        labels=parse_labels(labels) if labels else {},
        python=python,
        extras=parse_extras(extras),
        settings=dict(parse_setting(s) for s in settings),
    )
    specs = load_hosts(hosts_file, base) if hosts_file else [base]
    from provision.layout import Layout, agent_config

    for spec in specs:
        # Every host's agent.toml is checked here, before anything connects anywhere.
        probe = Layout("user", "/check", "check", sudo="", systemd=False, home="/check")
        check_agent_config(
            agent_config(
                control_plane="http://127.0.0.1:1",
                name=spec.name or "check",
                layout=probe,
                labels=spec.labels,
                settings=spec.settings,
            )
        )
    return specs


def _provision_one(spec: HostSpec, options: RunOptions, log: logging.Logger) -> Outcome:
    from client.credentials import resolve
    from client.errors import ClientError
    from client.http import ControlPlaneClient
    from provision.fleet import ApiFleet
    from provision.provisioner import HostProvisioner, Outcome

    # One client per thread: each host waits on the control plane on its own.
    try:
        with ControlPlaneClient.from_context(resolve(), timeout=30.0) as client:
            return HostProvisioner(spec, options, ApiFleet(client), log).run()
    except ClientError as exc:
        return Outcome(host=str(spec.target), name=spec.name, step="connect", error=str(exc))


def _report(
    outcomes: list[Outcome], options: RunOptions, specs: list[HostSpec], context_url: str
) -> None:
    from provision.registry import ProvisionedHost, Registry

    registry = Registry()
    for outcome, spec in zip(outcomes, specs, strict=True):
        if options.dry_run:
            print(
                f"# {outcome.host}: {outcome.result}"
                + (f" ({outcome.error})" if outcome.error else "")
            )
            for line in outcome.plan:
                print(f"  {line}")
            continue
        if outcome.ok and outcome.name:
            registry.put(
                context_url,
                ProvisionedHost(
                    name=outcome.name,
                    target=str(spec.target),
                    prefix=outcome.prefix or spec.prefix or "",
                    sudo=spec.sudo,
                    key_file=str(spec.key_file) if spec.key_file else None,
                    known_hosts=str(spec.known_hosts) if spec.known_hosts else None,
                ),
            )
    rows: list[dict[str, Any]] = [
        {**vars(o), "time": f"{o.seconds:.1f}s", "name": o.name or "-"} for o in outcomes
    ]
    if not options.dry_run:
        print_table(rows, OUTCOME_COLUMNS)
    for outcome in outcomes:
        for note in outcome.notes:
            print(f"note: {outcome.name or outcome.host}: {note}", file=sys.stderr)
    failed = [o for o in outcomes if not o.ok]
    for outcome in failed:
        print(f"error: {outcome.host}: failed at {outcome.step}: {outcome.error}", file=sys.stderr)
    if failed:
        raise typer.Exit(1)


def deprovision(
    name: str = typer.Argument(..., help="The host's fleet name."),
    key: Path = typer.Option(None, "--key", help="SSH private key file."),
    known_hosts: Path = typer.Option(None, "--known-hosts", help="Known-hosts file."),
    purge: bool = typer.Option(False, "--purge", help="Also remove weight snapshots."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Stop host NAME's agent, remove what provisioning installed (weight snapshots stay
    unless --purge) and remove the host from the control plane (admin)."""
    from client.credentials import CredentialsError, resolve
    from client.http import ControlPlaneClient
    from provision.fleet import ApiFleet
    from provision.registry import Registry
    from provision.removal import deprovision as remove_host
    from provision.ssh import ProvisionError, SshOptions

    try:
        context = resolve()
        remembered = Registry().get(context.url, name)
    except (CredentialsError, ValueError) as exc:
        fail(str(exc))
    if remembered is None:
        fail(
            f"host {name} was not provisioned from here (no SSH target remembered for "
            f"{context.url}); `dctl host remove {name}` removes it from the control plane only"
        )
    what = "everything, weight snapshots too" if purge else "all but the weight snapshots"
    if not yes and not typer.confirm(
        f"deprovision {name} ({remembered.target}, {remembered.prefix}): remove {what}?",
        default=False,
        err=True,
    ):
        fail("not deprovisioned")
    ssh = SshOptions(
        key_file=key or (Path(remembered.key_file) if remembered.key_file else None),
        known_hosts=known_hosts
        or (Path(remembered.known_hosts) if remembered.known_hosts else None),
    )
    log, log_path = _logger()
    with ControlPlaneClient.from_context(context, timeout=30.0) as client:
        try:
            done = remove_host(remembered, ssh, ApiFleet(client), log, purge=purge)
        except ProvisionError as exc:
            fail(f"{name}: {exc} (log: {log_path})")
    Registry().forget(context.url, name)
    for line in done:
        print(line)
    print(f"host {name} deprovisioned")


def _logger() -> tuple[logging.Logger, Path]:
    """A log file of its own for this run (0600: it names hosts and commands, never secrets)."""
    directory = paths.data_dir() / "provision"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = directory / f"{stamp}-{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    handler = logging.StreamHandler(os.fdopen(fd, "a"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(message)s"))
    log = logging.getLogger(f"dctl.provision.{stamp}.{time.monotonic_ns()}")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.propagate = False
    return log, path


def register(host_app: typer.Typer) -> None:
    """Attach `provision` and `deprovision` to `dctl host`."""
    host_app.command("provision")(provision)
    host_app.command("deprovision")(deprovision)
