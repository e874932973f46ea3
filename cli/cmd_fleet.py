"""`dctl status|events|host|token|context`: the fleet as the control plane sees it."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from cli.columns import INSTANCE_COLUMNS
from cli.exits import USAGE, fail
from cli.options import duration_option, label_option
from cli.output import (
    JSON_OPTION,
    Column,
    cell,
    emit,
    human_bytes,
    plain,
    print_json,
    print_table,
)
from cli.remote import connect, validated
from protocol.vocabulary import CreatableRole

host_app = typer.Typer(
    help="Hosts: list, show, label, drain, undrain, rekey, remove, provision, deprovision.",
    no_args_is_help=True,
)
token_app = typer.Typer(help="API tokens with roles.", no_args_is_help=True)
context_app = typer.Typer(
    help="Control planes the CLI knows (the credentials file).", no_args_is_help=True
)


def _gpu_count(host: Mapping[str, Any]) -> int:
    return len(host.get("gpus") or [])


HOST_COLUMNS: list[Column] = [
    ("name", "name"),
    ("state", "state"),
    ("draining", "draining"),
    ("address", "advertise_address"),
    ("gpus", _gpu_count),
    ("last seen", "last_seen_at"),
    ("labels", "labels"),
]
GPU_COLUMNS: list[Column] = [
    ("index", "index"),
    ("name", "name"),
    ("mem used", lambda g: human_bytes(g.get("memory_used_bytes"))),
    ("mem total", lambda g: human_bytes(g.get("memory_total_bytes"))),
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
    ("id", "id"),
    ("name", "name"),
    ("role", "role"),
    ("host", "host"),
    ("expires", "expires_at"),
    ("uses left", "uses_left"),
    ("grants", "grants"),
    ("last used", "last_used_at"),
    ("revoked", "revoked_at"),
]


# status and events -------------------------------------------------------------------------


def status(as_json: bool = JSON_OPTION) -> None:
    """Fleet summary: hosts by state, GPUs, models, deployments, instances by state."""
    with connect() as api:
        summary = plain(api.status())
    if as_json:
        print_json(summary)
        return
    rows = [
        {"what": "hosts", "count": sum(summary["hosts_by_state"].values()),
         "detail": summary["hosts_by_state"]},
        {"what": "draining", "count": summary["hosts_draining"], "detail": None},
        {"what": "gpus", "count": summary["gpus"], "detail": None},
        {"what": "models", "count": summary["models"],
         "detail": {"versions": summary["versions"]}},
        {"what": "deployments", "count": summary["deployments"], "detail": None},
        {"what": "instances", "count": sum(summary["instances_by_state"].values()),
         "detail": summary["instances_by_state"]},
    ]  # fmt: skip
    print_table(rows, [("", "what"), ("count", "count"), ("detail", "detail")])


def events(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    kind: str | None = typer.Option(None, "--kind", help="Only events of this kind."),
    subject: str | None = typer.Option(None, "--subject", help="Only events about this subject."),
    after: int | None = typer.Option(None, "--after", min=0, help="Every event after this id."),
    limit: int = typer.Option(100, "--limit", min=1, max=1000, help="Events per page."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between polls."),
    as_json: bool = JSON_OPTION,
) -> None:
    """The newest events (or those after --after), oldest first; `--follow` keeps polling."""
    cursor = after
    shown: list[dict[str, Any]] = []
    try:
        with connect() as api:
            while True:
                # Without a cursor the server answers the newest LIMIT events; then we page on.
                page = api.list_events(after=cursor, limit=limit, kind=kind, subject=subject)
                items = [plain(item) for item in page.items]
                first_page = cursor is None
                cursor = page.next_cursor
                if not follow:
                    shown.extend(items)
                    if first_page or len(items) < limit:
                        break
                    continue
                for item in items:
                    _print_event_line(item, as_json)
                if len(items) < limit:
                    time.sleep(interval)
    except KeyboardInterrupt:
        return
    emit(shown, as_json=as_json, columns=EVENT_COLUMNS, empty="no events")


def _print_event_line(event: Mapping[str, Any], as_json: bool) -> None:
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
        hosts = [plain(h) for h in api.list_hosts()]
    emit(hosts, as_json=as_json, columns=HOST_COLUMNS, empty="no hosts registered")


@host_app.command("show")
def host_show(name: str, as_json: bool = JSON_OPTION) -> None:
    """Show host NAME with its GPUs and latest samples."""
    with connect() as api:
        host = plain(api.get_host(name))
    if as_json:
        print_json(host)
        return
    facts = host.get("facts") or {}
    emit(
        host,
        as_json=False,
        fields=[
            *HOST_COLUMNS,
            ("reported labels", _reported_labels),
            ("ports", lambda h: "{}-{}".format(*h["port_range"])),
            ("agent token", _agent_token),
            ("registered", "registered_at"),
            ("driver", lambda h: facts.get("driver_version")),
            ("agent", lambda h: facts.get("agent_version")),
            ("generation", lambda h: f"{h['applied_generation']}/{h['desired_generation']}"),
        ],
    )
    print()
    print_table(host.get("gpus") or [], GPU_COLUMNS, empty="no GPUs reported")
    print()
    print_table(host.get("instances") or [], INSTANCE_COLUMNS, empty="no instances")


def _reported_labels(host: Mapping[str, Any]) -> str:
    """What the agent reports, and whether placement reads it yet."""
    reported, labels = host.get("reported_labels") or {}, host.get("labels") or {}
    pending = any(labels.get(k) != v for k, v in reported.items())
    return cell(reported) + (f" (not adopted: dctl host label {host['name']} --adopt)" * pending)


def _agent_token(host: Mapping[str, Any]) -> str:
    """Whether the gateway may send to the host's address (ports above) at all."""
    if host.get("agent_token"):
        return "valid: the gateway sends to the address and ports above"
    return "none working: the gateway sends nothing to this host"


@host_app.command("label")
def host_label(
    name: str,
    labels: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Labels to set."),
    remove: list[str] = typer.Option([], "--remove", metavar="KEY", help="Drop this label."),
    adopt: bool = typer.Option(
        False, "--adopt", help="First take every label the host's agent reports."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Set, remove or adopt host NAME's labels: the only ones placement reads (operator).

    Deployments placed by label follow at once. What the agent reports counts for nothing
    until adopted: an agent could otherwise label itself into any deployment.
    """
    from protocol.rest import HostLabelChange

    wanted = label_option(labels or [], "KEY=VALUE")
    change = validated(lambda: HostLabelChange(adopt=adopt, labels=wanted, remove=remove))
    with connect() as api:
        host = plain(api.label_host(name, change))
    if as_json:
        print_json(host)
    else:
        print(f"host {name} labels: {cell(host['labels'])}")


@host_app.command("drain")
def host_drain(name: str, as_json: bool = JSON_OPTION) -> None:
    """Drain host NAME: no new instances; its instances are stopped (operator)."""
    with connect() as api:
        host = api.drain_host(name)
    if as_json:
        print_json(plain(host))
    else:
        print(f"host {name} draining")


@host_app.command("undrain")
def host_undrain(name: str, as_json: bool = JSON_OPTION) -> None:
    """Let host NAME take instances again (operator)."""
    with connect() as api:
        host = api.undrain_host(name)
    if as_json:
        print_json(plain(host))
    else:
        print(f"host {name} schedulable")


@host_app.command("rekey")
def host_rekey(name: str, as_json: bool = JSON_OPTION) -> None:
    """Issue a one-use bootstrap token that registers host NAME again (admin).

    For an agent that lost its data directory, or a host whose agent token must change: the
    old agent token keeps working until an agent registers with the new one.
    """
    with connect() as api:
        token = api.rekey_host(name)
    if as_json:
        print_json(plain(token))
        return
    expires = f", expires {token.expires_at:%Y-%m-%d %H:%M} UTC" if token.expires_at else ""
    print(
        f"one-use bootstrap token for host {name}{expires}; shown only this once. Put it in a "
        f"0600 file on {name} and start its agent with --bootstrap-token-file FILE; when it "
        "registers, the host's old agent token stops working:",
        file=sys.stderr,
    )
    print(token.secret)


@host_app.command("remove")
def host_remove(
    name: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Remove host NAME from the fleet; its agent token stops working (admin)."""
    if not yes and not typer.confirm(f"remove host {name}?", default=False, err=True):
        fail("not removed")
    with connect() as api:
        api.remove_host(name)
    print(f"host {name} removed")


# tokens ------------------------------------------------------------------------------------


@token_app.command("create")
def token_create(
    name: str,
    role: CreatableRole = typer.Option(..., "--role", help="What the token may do."),
    expires: str | None = typer.Option(
        None,
        "--expires",
        help="Lifetime, e.g. 30m, 24h, 7d (bootstrap tokens: 24h unless given; others: none).",
    ),
    uses: int | None = typer.Option(
        None, "--uses", min=1, help="Uses before it stops working (bootstrap: --uses 1 per host)."
    ),
    deployments: str | None = typer.Option(
        None,
        "--deployments",
        help="Client tokens: the deployments it may call through the gateway, e.g. a,b "
        "(default: all).",
    ),
    labels: str | None = typer.Option(
        None,
        "--labels",
        metavar="KEY=VALUE,...",
        help="Bootstrap tokens: labels stamped on every host it registers, e.g. tier=prod "
        "(what an agent reports counts for placement only once adopted).",
    ),
    allow_pool_pin: bool = typer.Option(
        False,
        "--allow-pool-pin",
        help="Client tokens: may pin requests to the stable or canary pool (x-dctl-pool), "
        "e.g. for a smoke test or `dctl tune`; pinned requests count in no rollout analysis.",
    ),
    max_concurrency: int | None = typer.Option(
        None,
        "--max-concurrency",
        min=1,
        help="Client tokens: requests in flight at once through one gateway (default: the "
        "gateway's max_concurrency_per_token, 64).",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Create token NAME (admin); the secret is printed once and never again.

    Roles: viewer < operator < admin use the control plane's API; bootstrap registers agents;
    gateway is what `dctl gateway` runs with; client calls the gateway's OpenAI API.
    """
    from protocol.rest import TokenCreate

    expires_s = duration_option(expires, "--expires") if expires else None
    scope = None if deployments is None else [d.strip() for d in deployments.split(",")]
    stamp = None if labels is None else label_option(labels.split(","), "--labels")
    spec = validated(
        lambda: TokenCreate(
            name=name,
            role=role,
            expires_in_s=expires_s,
            uses=uses,
            deployments=scope,
            allow_pool_pin=allow_pool_pin,
            max_concurrency=max_concurrency,
            labels=stamp,
        )
    )
    with connect() as api:
        token = api.create_token(spec)
    if as_json:
        print_json(plain(token))
        return
    if role == "bootstrap" and uses is None:
        # A bootstrap token registers any new host until it expires: say how to narrow it.
        until = f"{token.expires_at:%Y-%m-%d %H:%M} UTC" if token.expires_at else "revoked"
        print(
            f"note: bootstrap token {name} registers any number of new hosts until {until}; "
            f"for one host make it single-use: `dctl token create NAME --role bootstrap --uses 1`",
            file=sys.stderr,
        )
    # The secret alone goes to stdout, so `SECRET=$(dctl token create ...)` just works.
    print(f"token {name} ({role}) created; its secret, shown only this once:", file=sys.stderr)
    print(token.secret)


@token_app.command("list")
def token_list(
    show_all: bool = typer.Option(False, "--all", help="Include revoked tokens."),
    as_json: bool = JSON_OPTION,
) -> None:
    """List tokens, never their secrets (admin)."""
    with connect() as api:
        tokens = [plain(t) for t in api.list_tokens(include_revoked=show_all)]
    if not as_json:
        for token in tokens:
            token["grants"] = _grants(token)
    emit(tokens, as_json=as_json, columns=TOKEN_COLUMNS, empty="no tokens")


def _grants(token: dict[str, Any]) -> str:
    """What a token may do beyond its role, in one cell: `pool-pin, max 8, tier=prod, web,chat`."""
    parts = ["pool-pin"] if token.get("allow_pool_pin") else []
    if token.get("max_concurrency") is not None:
        parts.append(f"max {token['max_concurrency']}")
    parts += [f"{k}={v}" for k, v in sorted((token.get("labels") or {}).items())]
    if token.get("deployments") is not None:
        parts.append(",".join(token["deployments"]) or "no deployments")
    return ", ".join(parts)


@token_app.command("revoke")
def token_revoke(ref: str = typer.Argument(..., metavar="NAME|ID")) -> None:
    """Revoke a token by name or id (admin)."""
    with connect() as api:
        token = api.revoke_token(ref)
    print(f"token {token.name} ({token.id}) revoked")


# contexts ----------------------------------------------------------------------------------


@context_app.command("list")
def context_list(as_json: bool = JSON_OPTION) -> None:
    """List the contexts of the credentials file (tokens are never shown)."""
    from client.credentials import CredentialsError, CredentialsFile

    store = CredentialsFile()
    try:
        current, contexts = store.load()
    except CredentialsError as exc:
        fail(str(exc))
    rows = [
        {
            "name": c.name,
            "url": c.url,
            "current": c.name == current,
            "token": c.token is not None,
            "ca_file": c.ca_file,
        }
        for c in contexts.values()
    ]
    columns: list[Column] = [
        ("current", lambda r: "*" if r["current"] else ""),
        ("name", "name"),
        ("url", "url"),
        ("token", lambda r: "set" if r["token"] else "none"),
        ("ca file", lambda r: r["ca_file"] or "system"),
    ]
    emit(rows, as_json=as_json, columns=columns, empty=f"no contexts in {store.path}")


@context_app.command("add")
def context_add(
    name: str = typer.Argument(..., help="Name of the new context."),
    url: str = typer.Option(..., "--url", help="Control-plane URL, e.g. https://cp:8700."),
    ca_file: Path | None = typer.Option(
        None,
        "--ca-file",
        help="PEM file of the CA that signed the control plane's certificate (default: the "
        "system trust store).",
    ),
    token_file: Path | None = typer.Option(
        None,
        "--token-file",
        help="File holding the API token, '-' for stdin (default: asked for, hidden; empty for "
        "none).",
    ),
    use: bool = typer.Option(False, "--use", help="Make it the current context."),
) -> None:
    """Add a context: a control plane's URL, a token, and the CA its certificate is checked with."""
    from client.credentials import CredentialsError, CredentialsFile
    from client.errors import ClientError
    from client.http import ControlPlaneClient

    try:
        # Builds the client to check the URL and that the CA file loads; sends nothing.
        ControlPlaneClient(url, ca_file=ca_file).close()
    except ClientError as exc:
        fail(str(exc), USAGE)
    token = _read_token(token_file)
    try:
        context = CredentialsFile().add(
            url,
            token,
            name=name,
            make_current=use,
            ca_file=None if ca_file is None else str(ca_file),
        )
    except CredentialsError as exc:
        fail(str(exc))
    trust = context.ca_file or "the system trust store"
    print(f"added context {context.name} ({context.url}, verified with {trust})")


def _read_token(token_file: Path | None) -> str | None:
    """The token from TOKEN_FILE ('-': stdin), else asked for without echo; None when empty."""
    if token_file is None:
        token = typer.prompt("token (empty: none)", default="", hide_input=True, show_default=False)
    elif str(token_file) == "-":
        token = sys.stdin.read()
    else:
        try:
            token = token_file.read_text()
        except OSError as exc:
            fail(f"--token-file {token_file}: {exc.strerror or exc}", USAGE)
    return token.strip() or None


@context_app.command("use")
def context_use(name: str) -> None:
    """Make context NAME the current one."""
    from client.credentials import CredentialsError, CredentialsFile

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
