"""`dctl server` and `dctl db`: run the control plane and manage its database schema.

An adapter: flags -> `controlplane.settings` -> `controlplane.main.run`, with the CLI's part of a
first start: the first admin token saved as a context in the credentials file (and shown once on
a terminal). The control plane is imported inside the commands, so `dctl --help` stays light.
"""

from __future__ import annotations

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
    from controlplane.main import database_url
    from controlplane.settings import SettingsError

    try:
        return database_url(settings)
    except SettingsError as exc:
        fail(str(exc), USAGE)


def _database_failure(url: str, exc: Exception) -> NoReturn:
    from controlplane.main import database_failure

    fail(str(database_failure(url, exc)))


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
    from controlplane.errors import AdminTokenDiscarded, ControlPlaneFailure
    from controlplane.main import run
    from controlplane.settings import SettingsError

    settings = _settings(
        config, database_url=db, host=host, port=port, tls_cert=tls_cert, tls_key=tls_key
    )
    try:
        code = run(
            settings,
            announce=lambda secret: _announce_admin_token(secret, settings),
            migrate=migrate,
        )
    except SettingsError as exc:
        fail(str(exc), USAGE)
    except AdminTokenDiscarded:
        fail(
            "the first admin token could not be saved (see above) and stdout is not a terminal, "
            "so nobody would ever see it: it was deleted. Fix the credentials file's directory "
            "(XDG_CONFIG_HOME) or start the server on a terminal once"
        )
    except ControlPlaneFailure as exc:
        fail(str(exc))
    if code:
        raise typer.Exit(code)


def _announce_admin_token(secret: str, settings: ControlPlaneSettings) -> bool:
    """First start: add the admin token to the credentials file, and print it once on a terminal.

    On anything but a terminal (a service manager's journal, a redirect, CI logs) stdout is
    kept, so the secret goes only to the 0600 credentials file, and the output says where.
    False when the token reached nobody (not a terminal, and the file could not be written).

    Over HTTPS the context trusts the served certificate file itself (a path: a certificate
    renewed in place stays trusted), whoever signed it.
    """
    from client.credentials import CredentialsError, CredentialsFile
    from controlplane.main import local_host, local_url
    from runtime.tls import TlsError, check_name

    url = local_url(settings)
    on_terminal = sys.stdout.isatty()
    if on_terminal:
        print(f"admin token (shown only this once): {secret}", flush=True)
    # `run` checked the pair: both files or neither.
    cert, key = settings.tls_cert, settings.tls_key
    if cert is not None and key is not None:
        try:
            check_name(cert, key, local_host(settings.host))
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
        context = store.add(
            url, secret, name="default", ca_file=str(cert) if cert is not None else None
        )
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
