"""The control plane's entry module: one control-plane process, checked and served (`run`).

`dctl server` only turns its flags into `ControlPlaneSettings` and calls `run(settings, ...)`,
handing in how the first admin token reaches the operator (the CLI's credentials file), which
this part may not import.

`run` checks the TLS files and the database URL, upgrades the schema when asked and refuses one
that is behind, binds the socket, makes the first admin token on a first start and hands it to
`announce` (deleting it again when it reached nobody), then serves the app with uvicorn until
SIGTERM or SIGINT. `dctl db` shares `database_url` and `database_failure`.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

import sqlalchemy as sa

from controlplane import migrate as migrations
from controlplane.bootstrap import discard_admin_token, ensure_admin_token
from controlplane.db import DatabaseUrlError, make_engine, normalise_url
from controlplane.errors import AdminTokenDiscarded, ControlPlaneFailure
from controlplane.settings import ControlPlaneSettings, SettingsError
from runtime.logs import configure_logging
from runtime.tls import TlsError, check_server_files

EXIT_OK = 0

# Hands the first admin token's secret to the operator; returns whether it reached anyone.
Announce = Callable[[str], bool]


def run(settings: ControlPlaneSettings, *, announce: Announce, migrate: bool = False) -> int:
    """Serve SETTINGS until SIGTERM/SIGINT (blocking); returns the exit code, 0.

    MIGRATE upgrades the schema first. ANNOUNCE gets the first admin token on a first start.
    Raises `SettingsError` for a setting that cannot be used (a usage error) and
    `ControlPlaneFailure` when the control plane cannot start. Configures logging itself.
    """
    import uvicorn

    from controlplane.app import create_app

    tls = tls_files(settings)
    url = database_url(settings)
    configure_logging(settings.log_level, settings.log_format)
    try:
        if migrate:
            migrations.upgrade(url, "head")
        migrations.ensure_up_to_date(url)
    except migrations.SchemaError as exc:
        raise ControlPlaneFailure(str(exc)) from None
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    # Bound before the first admin token is minted, so a busy port fails cleanly and early.
    listener = _listen(settings.host, settings.port)
    try:
        _first_admin_token(url, announce)
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(settings),
                host=settings.host,
                port=settings.port,
                log_config=None,  # keep dctl's structured logging (and its secret redaction)
                access_log=settings.log_level == "debug",
                server_header=False,
                ssl_certfile=tls[0] if tls else None,
                ssl_keyfile=tls[1] if tls else None,
            )
        )
        server.run(sockets=[listener])
    finally:
        listener.close()
    if not server.started:
        raise ControlPlaneFailure("the control plane did not start; the log above says why")
    return EXIT_OK


def local_host(host: str) -> str:
    """Where this machine reaches a control plane bound to HOST: loopback for every interface."""
    return "127.0.0.1" if host in {"0.0.0.0", "", "::"} else host


def local_url(settings: ControlPlaneSettings) -> str:
    """The URL the control plane of SETTINGS is reached at from its own machine."""
    reach = local_host(settings.host)
    if ":" in reach:
        reach = f"[{reach}]"
    return f"{'https' if settings.tls_cert is not None else 'http'}://{reach}:{settings.port}"


def tls_files(settings: ControlPlaneSettings) -> tuple[str, str] | None:
    """The certificate and key to serve HTTPS with, checked; None for plain HTTP.

    A key file every user can read is refused (`runtime.tls.check_key_file`). Plain HTTP on an
    address other machines reach is allowed, with a warning: tokens would travel in clear.
    Warnings go to stderr, since logging is not set up yet.
    """
    cert, key = settings.tls_cert, settings.tls_key
    if cert is None and key is None:
        # The bind address itself: 0.0.0.0 and :: listen on every interface, though a local
        # client reaches them on loopback (`local_host`).
        if settings.host not in {"127.0.0.1", "::1", "localhost"}:
            _warn(
                f"serving plain HTTP on {settings.host}: tokens travel in clear; pass "
                "--tls-cert FILE --tls-key FILE (env DCTL_TLS_CERT, DCTL_TLS_KEY)"
            )
        return None
    if cert is None or key is None:
        raise SettingsError(
            "--tls-cert and --tls-key go together (env DCTL_TLS_CERT, DCTL_TLS_KEY)"
        )
    try:
        warnings = check_server_files(cert, key)
    except TlsError as exc:
        raise SettingsError(f"tls_cert/tls_key (--tls-cert, --tls-key): {exc}") from None
    for warning in warnings:
        _warn(warning)
    return str(cert), str(key)


def database_url(settings: ControlPlaneSettings) -> str:
    """The database URL of SETTINGS, normalised; makes the data dir for the default SQLite file.

    Raises `SettingsError` for a database dctl does not support.
    """
    url = settings.resolved_database_url()
    try:
        url = normalise_url(url)
    except DatabaseUrlError as exc:
        raise SettingsError(str(exc)) from None
    if url.startswith("sqlite") and settings.database_url is None:
        # The default SQLite file lives in the data dir, which may not exist on a fresh machine.
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return url


def database_failure(url: str, exc: Exception) -> ControlPlaneFailure:
    """The failure to report for the database at URL failing with EXC."""
    # The driver's message names the problem (no such host, auth failed); the URL may hold a
    # password, so only its scheme and host part are shown.
    safe = sa.engine.make_url(url).render_as_string(hide_password=True)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    return ControlPlaneFailure(f"database {safe}: {detail}")


def _first_admin_token(url: str, announce: Announce) -> None:
    """On a first start, mint the admin token and announce it; delete it if it reached nobody.

    Deleted rather than kept, so the next start makes a new one instead of leaving a control
    plane nobody can administer.
    """
    engine = make_engine(url)
    try:
        secret = ensure_admin_token(engine)
        if secret is None or announce(secret):
            return
        discard_admin_token(engine, secret)
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    finally:
        engine.dispose()
    raise AdminTokenDiscarded


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
        raise ControlPlaneFailure(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
            "or stop what uses it"
        ) from None
    return listener


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
