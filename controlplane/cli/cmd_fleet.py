"""`dctl status|events|host|token|context`: the fleet as the control plane sees it."""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import typer

from controlplane.cli.exits import USAGE, fail
from controlplane.cli.output import JSON_OPTION, Column, emit, print_json, print_table
from controlplane.cli.remote import connect

host_app = typer.Typer(help="Hosts: list, show, drain, undrain, remove.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens with roles.", no_args_is_help=True)
context_app = typer.Typer(
    help="Control planes the CLI knows (the credentials file).", no_args_is_help=True
)


class Role(StrEnum):
    """Roles a token may have."""

    viewer = "viewer"
    operator = "operator"
    admin = "admin"
    bootstrap = "bootstrap"


def _gpu_count(host: Mapping[str, Any]) -> Any:
    gpus = host.get("gpus")
    return len(gpus) if isinstance(gpus, list) else host.get("gpu_count")


HOST_COLUMNS: list[Column] = [
    ("name", "name"),
    ("state", "state"),
    ("draining", "draining"),
    ("gpus", _gpu_count),
    ("last seen", "last_seen"),
    ("labels", "labels"),
]
GPU_COLUMNS: list[Column] = [
    ("index", "index"),
    ("name", "name"),
    ("mem used", lambda g: _gib(g.get("memory_used_bytes"))),
    ("mem total", lambda g: _gib(g.get("memory_total_bytes"))),
    ("util %", "utilization_percent"),
    ("temp C", "temperature_c"),
    ("power W", "power_w"),
]
EVENT_COLUMNS: list[Column] = [
    ("time", "time"),
    ("kind", "kind"),
    ("subject", "subject"),
    ("actor", "actor"),
    ("message", "message"),
]
TOKEN_COLUMNS: list[Column] = [
    ("name", "name"),
    ("role", "role"),
    ("host", "host"),
    ("expires", "expires_at"),
    ("uses left", "uses_left"),
    ("last used", "last_used"),
    ("revoked", "revoked_at"),
]


def _gib(value: Any) -> str | None:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, int | float) else None


# status and events -------------------------------------------------------------------------


def status(as_json: bool = JSON_OPTION) -> None:
    """Fleet summary: hosts by state, GPUs, deployments, instances by state."""
    with connect() as api:
        hosts = api.list_hosts()
        deployments = api.list_deployments()
    instances = [i for d in deployments for i in d.get("instances") or []]
    summary = {
        "hosts": len(hosts),
        "hosts_by_state": dict(Counter(str(h.get("state")) for h in hosts)),
        "hosts_draining": sum(1 for h in hosts if h.get("draining")),
        "gpus": sum(_gpu_count(h) or 0 for h in hosts),
        "deployments": len(deployments),
        "instances": len(instances),
        "instances_by_state": dict(
            Counter(str(i.get("observed_state") or "unknown") for i in instances)
        ),
    }
    if as_json:
        print_json(summary)
        return
    rows = [
        {"what": "hosts", "count": summary["hosts"], "detail": summary["hosts_by_state"]},
        {"what": "draining", "count": summary["hosts_draining"], "detail": None},
        {"what": "gpus", "count": summary["gpus"], "detail": None},
        {"what": "deployments", "count": summary["deployments"], "detail": None},
        {
            "what": "instances",
            "count": summary["instances"],
            "detail": summary["instances_by_state"],
        },
    ]
    print_table(rows, [("", "what"), ("count", "count"), ("by state", "detail")])


def events(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    kind: str | None = typer.Option(None, "--kind", help="Only events of this kind."),
    subject: str | None = typer.Option(None, "--subject", help="Only events about this subject."),
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="Events per page."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between polls."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The audit log, oldest first; `--follow` keeps polling (JSON Lines with --json)."""
    cursor: Any = None
    shown: list[dict[str, Any]] = []
    try:
        with connect() as api:
            while True:
                page = api.list_events(after=cursor, limit=limit, kind=kind, subject=subject)
                items = page.get("items") or []
                cursor = page.get("next_cursor") or (items[-1].get("id") if items else cursor)
                if follow:
                    for item in items:
                        _print_event_line(item, as_json)
                else:
                    shown.extend(items)
                    if not page.get("next_cursor") or not items:
                        break
                    continue
                if not items or len(items) < limit:
                    time.sleep(interval)
    except KeyboardInterrupt:
        return
    emit(shown, as_json=as_json, columns=EVENT_COLUMNS, empty="no events")


def _print_event_line(event: Mapping[str, Any], as_json: bool) -> None:
    import json

    from controlplane.cli.output import cell

    if as_json:
        sys.stdout.write(json.dumps(event, default=str) + "\n")
    else:
        fields = (cell(event.get(key)) for key in ("time", "kind", "subject", "actor", "message"))
        sys.stdout.write("  ".join(fields) + "\n")
    sys.stdout.flush()


# hosts -------------------------------------------------------------------------------------


@host_app.command("list")
def host_list(as_json: bool = JSON_OPTION) -> None:
    """List hosts with their state and GPU count."""
    with connect() as api:
        hosts = api.list_hosts()
    emit(hosts, as_json=as_json, columns=HOST_COLUMNS, empty="no hosts registered")


@host_app.command("show")
def host_show(name: str, as_json: bool = JSON_OPTION) -> None:
    """Show host NAME with its GPUs and latest samples."""
    with connect() as api:
        host = api.get_host(name)
    if as_json:
        print_json(host)
        return
    emit(host, as_json=False, fields=[*HOST_COLUMNS, ("facts", "facts")])
    print()
    print_table(host.get("gpus") or [], GPU_COLUMNS, empty="no GPUs reported")


@host_app.command("drain")
def host_drain(name: str, as_json: bool = JSON_OPTION) -> None:
    """Drain host NAME: no new instances; its instances are stopped (operator)."""
    with connect() as api:
        host = api.drain_host(name)
    if as_json:
        print_json(host)
    else:
        print(f"host {name} draining")


@host_app.command("undrain")
def host_undrain(name: str, as_json: bool = JSON_OPTION) -> None:
    """Let host NAME take instances again (operator)."""
    with connect() as api:
        host = api.undrain_host(name)
    if as_json:
        print_json(host)
    else:
        print(f"host {name} schedulable")


@host_app.command("remove")
def host_remove(
    name: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Remove host NAME from the fleet; its agent token stops working (admin)."""
    if not yes and not typer.confirm(f"remove host {name}?", default=False, err=True):
        fail("not removed", USAGE)
    with connect() as api:
        api.remove_host(name)
    print(f"host {name} removed")


# tokens ------------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """`90s`, `30m`, `24h`, `7d` -> seconds; anything else is a usage error (exit 2)."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        fail(f"--expires {text!r}: write a positive duration like 30m, 24h or 7d", USAGE)
    return int(match.group(1)) * _SECONDS[match.group(2)]


@token_app.command("create")
def token_create(
    name: str,
    role: Role = typer.Option(..., "--role", help="viewer, operator, admin or bootstrap."),
    expires: str | None = typer.Option(None, "--expires", help="Lifetime, e.g. 30m, 24h, 7d."),
    uses: int | None = typer.Option(None, "--uses", min=1, help="Uses before it stops working."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Create token NAME (admin); the secret is printed once and never again."""
    expires_s = parse_duration(expires) if expires else None
    with connect() as api:
        token = api.create_token(name, role.value, expires_in_s=expires_s, uses=uses)
    if as_json:
        print_json(token)
        return
    print(
        f"token {name} ({role.value}) created. Its secret, shown only this once:", file=sys.stderr
    )
    print(token.get("secret") or token.get("token"))


@token_app.command("list")
def token_list(as_json: bool = JSON_OPTION) -> None:
    """List tokens (never their secrets) (admin)."""
    with connect() as api:
        tokens = api.list_tokens()
    emit(tokens, as_json=as_json, columns=TOKEN_COLUMNS, empty="no tokens")


@token_app.command("revoke")
def token_revoke(name: str) -> None:
    """Revoke token NAME (admin)."""
    with connect() as api:
        api.revoke_token(name)
    print(f"token {name} revoked")


# contexts ----------------------------------------------------------------------------------


@context_app.command("list")
def context_list(as_json: bool = JSON_OPTION) -> None:
    """List the contexts of the credentials file (tokens are never shown)."""
    from controlplane.credentials import CredentialsError, CredentialsFile

    store = CredentialsFile()
    try:
        current, contexts = store.load()
    except CredentialsError as exc:
        fail(str(exc))
    rows = [
        {"name": c.name, "url": c.url, "current": c.name == current, "token": c.token is not None}
        for c in contexts.values()
    ]
    columns: list[Column] = [
        ("current", lambda r: "*" if r["current"] else ""),
        ("name", "name"),
        ("url", "url"),
        ("token", lambda r: "set" if r["token"] else "none"),
    ]
    emit(rows, as_json=as_json, columns=columns, empty=f"no contexts in {store.path}")


@context_app.command("use")
def context_use(name: str) -> None:
    """Make context NAME the current one."""
    from controlplane.credentials import CredentialsError, CredentialsFile

    try:
        context = CredentialsFile().use(name)
    except CredentialsError as exc:
        fail(str(exc))
    print(f"current context: {context.name} ({context.url})")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.command("status")(status)
    app.command("events")(events)
    app.add_typer(host_app, name="host")
    app.add_typer(token_app, name="token")
    app.add_typer(context_app, name="context")
