"""`dctl server` and `dctl db`: run the control plane and manage its database schema."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from cli.exits import USAGE, fail

if TYPE_CHECKING:
    from controlplane.settings import ControlPlaneSettings

db_app = typer.Typer(
    help="Manage the control-plane database schema (alembic).", no_args_is_help=True
)

DB_OPTION = typer.Option(
    None, "--db", help="Database URL (default: DCTL_DATABASE_URL, else SQLite in the data dir)."
)
CONFIG_OPTION = typer.Option(
    None,
    "--config",
    help="Settings file whose [controlplane] table to read (default: DCTL_CONFIG, else "
    "~/.config/dctl/config.toml).",
)


def _settings(config: Path | None, **overrides: object) -> ControlPlaneSettings:
    from controlplane.settings import SettingsError, load_controlplane_settings

    try:
        return load_controlplane_settings(config, **overrides)
    except SettingsError as exc:
        fail(str(exc), USAGE)


def _database_url(settings: ControlPlaneSettings) -> str:
    from controlplane.db import DatabaseUrlError, normalise_url

    url = settings.resolved_database_url()
    try:
        url = normalise_url(url)
    except DatabaseUrlError as exc:
        fail(str(exc), USAGE)
    if url.startswith("sqlite") and settings.database_url is None:
        # The default SQLite file lives in the data dir, which may not exist on a fresh machine.
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return url


def _database_failure(url: str, exc: Exception) -> NoReturn:
    # The driver's message names the problem (no such host, auth failed); the URL may hold a
    # password, so only its scheme and host part are shown.
    from sqlalchemy.engine import make_url

    safe = make_url(url).render_as_string(hide_password=True)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    fail(f"database {safe}: {detail}")


def _local_host(host: str) -> str:
    # A server bound to every interface is still reached by its own CLI on loopback.
    return "127.0.0.1" if host in {"0.0.0.0", "", "::"} else host


def _local_url(host: str, port: int, tls: bool = False) -> str:
    reach = _local_host(host)
    if ":" in reach:
        reach = f"[{reach}]"
    return f"{'https' if tls else 'http'}://{reach}:{port}"


def _tls_files(settings: ControlPlaneSettings) -> tuple[str, str] | None:
    """The certificate and key to serve HTTPS with, checked; None for plain HTTP.

    A key file every user can read is refused (`runtime.tls.check_key_file`). Plain HTTP on an
    address other machines reach is allowed, with a warning: tokens would travel in clear.
    """
    from runtime.tls import TlsError, check_server_files

    cert, key = settings.tls_cert, settings.tls_key
    if cert is None and key is None:
        if _local_host(settings.host) not in {"127.0.0.1", "::1", "localhost"}:
            print(
                f"warning: serving plain HTTP on {settings.host}: tokens travel in clear; pass "
                "--tls-cert FILE --tls-key FILE (env DCTL_TLS_CERT, DCTL_TLS_KEY)",
                file=sys.stderr,
                flush=True,
            )
        return None
    if cert is None or key is None:
        fail("--tls-cert and --tls-key go together (env DCTL_TLS_CERT, DCTL_TLS_KEY)", USAGE)
    try:
        warnings = check_server_files(cert, key)
    except TlsError as exc:
        fail(f"tls_cert/tls_key (--tls-cert, --tls-key): {exc}", USAGE)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return str(cert), str(key)


def server(
    db: str | None = DB_OPTION,
    config: Path | None = CONFIG_OPTION,
    host: str | None = typer.Option(None, "--host", help="Address to listen on [127.0.0.1]."),
    port: int | None = typer.Option(None, "--port", help="Port to listen on [8700]."),
    migrate: bool = typer.Option(
        False, "--migrate", help="Upgrade the database schema before starting."
    ),
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", help="Serve HTTPS with this PEM certificate (chain included)."
    ),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", help="The certificate's private key (PEM; not readable by others)."
    ),
) -> None:
    """Run the control plane (REST API, controllers); refuses a database whose schema is behind."""
    import sqlalchemy as sa

    from controlplane import migrate as migrations
    from runtime.logs import configure_logging

    settings = _settings(
        config, database_url=db, host=host, port=port, tls_cert=tls_cert, tls_key=tls_key
    )
    tls = _tls_files(settings)
    url = _database_url(settings)
    configure_logging(settings.log_level, settings.log_format)
    try:
        if migrate:
            migrations.upgrade(url, "head")
        migrations.ensure_up_to_date(url)
    except migrations.SchemaError as exc:
        fail(str(exc))
    except sa.exc.SQLAlchemyError as exc:
        _database_failure(url, exc)

    import uvicorn

    from controlplane.app import create_app
    from controlplane.bootstrap import ensure_admin_token
    from controlplane.db import make_engine

    # Bind before the first admin token is minted, so a busy port fails cleanly and early.
    listener = _listen(settings.host, settings.port)
    engine = make_engine(url)
    try:
        secret = ensure_admin_token(engine)
    except sa.exc.SQLAlchemyError as exc:
        _database_failure(url, exc)
    finally:
        engine.dispose()
    if secret is not None and not _announce_admin_token(secret, settings, tls):
        _discard_admin_token(url, secret)

    server_config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep dctl's structured logging (and its secret redaction)
        access_log=settings.log_level == "debug",
        server_header=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    runner = uvicorn.Server(server_config)
    runner.run(sockets=[listener])
    if not runner.started:
        fail("the control plane did not start; the log above says why")


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT for uvicorn to serve on; a clear error when it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as exc:
        fail(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
            "or stop what uses it"
        )
    return listener


def _announce_admin_token(
    secret: str, settings: ControlPlaneSettings, tls: tuple[str, str] | None
) -> bool:
    """First start: add the admin token to the credentials file, and print it once on a terminal.

    On anything but a terminal (a service manager's journal, a redirect, CI logs) stdout is
    kept, so the secret goes only to the 0600 credentials file, and the output says where.
    False when the token reached nobody (not a terminal, and the file could not be written).

    Over HTTPS the context trusts the served certificate file itself (a path: a certificate
    renewed in place stays trusted), whoever signed it.
    """
    from client.credentials import CredentialsError, CredentialsFile
    from runtime.tls import TlsError, check_name

    url = _local_url(settings.host, settings.port, tls is not None)
    on_terminal = sys.stdout.isatty()
    if on_terminal:
        print(f"admin token (shown only this once): {secret}", flush=True)
    if tls is not None:
        try:
            check_name(*tls, _local_host(settings.host))
        except TlsError as exc:
            print(
                f"warning: the saved context {url} will not verify: {exc}; add one with a name "
                "the certificate holds: `dctl context add NAME --url https://NAME:PORT --ca-file "
                "FILE`",
                file=sys.stderr,
                flush=True,
            )
    store = CredentialsFile()
    try:
        context = store.add(url, secret, name="default", ca_file=tls[0] if tls else None)
    except CredentialsError as exc:
        print(f"warning: could not save the admin token: {exc}", file=sys.stderr, flush=True)
        return on_terminal
    current, _ = store.load()
    note = "" if current == context.name else f"; `dctl context use {context.name}` to use it"
    if on_terminal:
        print(f"saved as context {context.name!r} in {store.path}{note}", flush=True)
    else:
        print(
            f"first admin token created and saved only in {store.path} (mode 0600), as context "
            f"{context.name!r}: stdout is not a terminal, so it is not printed{note}",
            flush=True,
        )
    return True


def _discard_admin_token(url: str, secret: str) -> NoReturn:
    """Delete a first admin token nobody received, so the next start makes a new one."""
    from controlplane.bootstrap import discard_admin_token
    from controlplane.db import make_engine

    engine = make_engine(url)
    try:
        discard_admin_token(engine, secret)
    finally:
        engine.dispose()
    fail(
        "the first admin token could not be saved (see above) and stdout is not a terminal, "
        "so nobody would ever see it: it was deleted. Fix the credentials file's directory "
        "(XDG_CONFIG_HOME) or start the server on a terminal once"
    )


@db_app.command("upgrade")
def db_upgrade(
    revision: str = typer.Argument("head", help="Target revision [head]."),
    db: str | None = DB_OPTION,
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Upgrade the database to the latest schema (or to REVISION)."""
    _run_alembic("upgrade", revision, db, config)


@db_app.command("downgrade")
def db_downgrade(
    revision: str = typer.Argument(..., help="Target revision, or `base` to drop everything."),
    db: str | None = DB_OPTION,
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Downgrade the database to REVISION."""
    _run_alembic("downgrade", revision, db, config)


@db_app.command("current")
def db_current(db: str | None = DB_OPTION, config: Path | None = CONFIG_OPTION) -> None:
    """Show the database's schema revision and whether it is the newest."""
    import sqlalchemy as sa

    from controlplane import migrate as migrations

    url = _database_url(_settings(config, database_url=db))
    try:
        at, newest = migrations.current(url), migrations.head()
    except migrations.SchemaError as exc:
        fail(str(exc))
    except sa.exc.SQLAlchemyError as exc:
        _database_failure(url, exc)
    state = "up to date" if at == newest else f"behind {newest}: run `dctl db upgrade`"
    print(f"{at or 'empty'} ({state})")


def _run_alembic(direction: str, revision: str, db: str | None, config: Path | None) -> None:
    import sqlalchemy as sa
    from alembic.util import CommandError

    from controlplane import migrate as migrations

    url = _database_url(_settings(config, database_url=db))
    step = migrations.upgrade if direction == "upgrade" else migrations.downgrade
    try:
        step(url, revision)
        at = migrations.current(url)
    except CommandError as exc:
        fail(f"db {direction} {revision}: {exc}", USAGE)
    except sa.exc.SQLAlchemyError as exc:
        _database_failure(url, exc)
    print(f"database at {at or 'base (empty)'}")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.command("server")(server)
    app.add_typer(db_app, name="db")
