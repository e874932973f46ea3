"""`dctl server` and `dctl db`: run the control plane and manage its database schema."""

from __future__ import annotations

import socket
import sys
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


def _settings(**overrides: object) -> ControlPlaneSettings:
    from controlplane.settings import SettingsError, load_controlplane_settings

    try:
        return load_controlplane_settings(**overrides)
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


def _local_url(host: str, port: int) -> str:
    # A server bound to every interface is still reached by its own CLI on loopback.
    reach = "127.0.0.1" if host in {"0.0.0.0", "", "::"} else host
    if ":" in reach:
        reach = f"[{reach}]"
    return f"http://{reach}:{port}"


def server(
    db: str | None = DB_OPTION,
    host: str | None = typer.Option(None, "--host", help="Address to listen on [127.0.0.1]."),
    port: int | None = typer.Option(None, "--port", help="Port to listen on [8700]."),
    migrate: bool = typer.Option(
        False, "--migrate", help="Upgrade the database schema before starting."
    ),
) -> None:
    """Run the control plane (REST API, controllers); refuses a database whose schema is behind."""
    import sqlalchemy as sa

    from controlplane import migrate as migrations
    from protocol.logs import configure_logging

    settings = _settings(database_url=db, host=host, port=port)
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
    if secret is not None:
        _announce_admin_token(secret, _local_url(settings.host, settings.port))

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep dctl's structured logging (and its secret redaction)
        access_log=settings.log_level == "debug",
        server_header=False,
    )
    runner = uvicorn.Server(config)
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


def _announce_admin_token(secret: str, url: str) -> None:
    """First start: print the admin token once and add it to the credentials file."""
    from client.credentials import CredentialsError, CredentialsFile

    print(f"admin token (shown only this once): {secret}", flush=True)
    store = CredentialsFile()
    try:
        context = store.add(url, secret, name="default")
    except CredentialsError as exc:
        print(f"warning: could not save the admin token: {exc}", file=sys.stderr, flush=True)
        return
    current, _ = store.load()
    note = "" if current == context.name else f"; `dctl context use {context.name}` to use it"
    print(f"saved as context {context.name!r} in {store.path}{note}", flush=True)


@db_app.command("upgrade")
def db_upgrade(
    revision: str = typer.Argument("head", help="Target revision [head]."),
    db: str | None = DB_OPTION,
) -> None:
    """Upgrade the database to the latest schema (or to REVISION)."""
    _run_alembic("upgrade", revision, db)


@db_app.command("downgrade")
def db_downgrade(
    revision: str = typer.Argument(..., help="Target revision, or `base` to drop everything."),
    db: str | None = DB_OPTION,
) -> None:
    """Downgrade the database to REVISION."""
    _run_alembic("downgrade", revision, db)


@db_app.command("current")
def db_current(db: str | None = DB_OPTION) -> None:
    """Show the database's schema revision and whether it is the newest."""
    import sqlalchemy as sa

    from controlplane import migrate as migrations

    url = _database_url(_settings(database_url=db))
    try:
        at, newest = migrations.current(url), migrations.head()
    except migrations.SchemaError as exc:
        fail(str(exc))
    except sa.exc.SQLAlchemyError as exc:
        _database_failure(url, exc)
    state = "up to date" if at == newest else f"behind {newest}: run `dctl db upgrade`"
    print(f"{at or 'empty'} ({state})")


def _run_alembic(direction: str, revision: str, db: str | None) -> None:
    import sqlalchemy as sa
    from alembic.util import CommandError

    from controlplane import migrate as migrations

    url = _database_url(_settings(database_url=db))
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
