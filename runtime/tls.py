"""TLS in one place: how every dctl client verifies a server, and the checks on a server's files.

Clients (the CLI, the agent's link to the control plane, the agent's engine probes, the gateway)
verify with `client_context`: the certificates of a CA file when one is given, else the system
trust store; hostnames are always checked and there is no switch to turn verification off.

Servers (`dctl server`, the agent's `/metrics`, engines) get a certificate and a key file, checked
by `check_server_files` before anything listens: the pair must load, and the key must not be
accessible to every user of the machine (refused, like ssh refuses such a key; readable by its
group is allowed, with a warning, for the `ssl-cert` group convention).
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

__all__ = [
    "TlsError",
    "check_key_file",
    "check_name",
    "check_server_files",
    "client_context",
    "verification_failure",
]

StrPath = str | os.PathLike[str]


class TlsError(ValueError):
    """A certificate, key or CA file cannot be used; the message names it and what to do."""


def client_context(ca_file: StrPath | None = None) -> ssl.SSLContext:
    """A context that verifies servers against CA_FILE, or the system trust store without one.

    Every certificate in CA_FILE is a trust anchor, an intermediate or a server's own certificate
    included (partial chains are accepted), so a self-signed certificate can be its own CA file.
    """
    try:
        context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except FileNotFoundError:
        raise TlsError(f"CA file {ca_file} does not exist") from None
    except ssl.SSLError as exc:  # an OSError too: caught first
        raise TlsError(
            f"CA file {ca_file} holds no usable certificate (PEM expected): {exc.reason or exc}"
        ) from None
    except OSError as exc:
        raise TlsError(f"CA file {ca_file} cannot be read: {exc.strerror or exc}") from None
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def verification_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind EXC, if that is what it is (httpx wraps
    httpcore, which wraps the `ssl` error), so callers can say which CA file to pass."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def check_key_file(key_file: StrPath) -> str | None:
    """Refuse (`TlsError`) a private key every user can access; a warning when its group can."""
    try:
        mode = stat.S_IMODE(os.stat(key_file).st_mode)  # a symlink's target is what counts
    except OSError as exc:
        raise TlsError(f"key file {key_file} cannot be read: {exc.strerror or exc}") from None
    if mode & 0o007:
        raise TlsError(
            f"key file {key_file} is accessible to every user of this machine (mode {mode:04o}): "
            f"a private key others can read is a leaked key; run `chmod 600 {key_file}`"
        )
    if mode & 0o070:
        return (
            f"key file {key_file} is readable by its group (mode {mode:04o}); fine for a "
            f"dedicated group such as ssl-cert, otherwise run `chmod 600 {key_file}`"
        )
    return None


def _server_context(cert_file: StrPath, key_file: StrPath) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert_file), str(key_file))
    except FileNotFoundError as exc:
        raise TlsError(f"{exc.filename or cert_file} does not exist") from None
    except ssl.SSLError as exc:  # an OSError too: caught first
        raise TlsError(
            f"certificate {cert_file} and key {key_file} do not load as a matching PEM pair "
            f"({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise TlsError(f"{cert_file} / {key_file} cannot be read: {exc.strerror or exc}") from None
    return context


def check_server_files(cert_file: StrPath, key_file: StrPath) -> list[str]:
    """Check that CERT_FILE and KEY_FILE can serve TLS; returns warnings, raises `TlsError`."""
    warning = check_key_file(key_file)
    _server_context(cert_file, key_file)
    return [warning] if warning else []


def check_name(
    cert_file: StrPath, key_file: StrPath, name: str, ca_file: StrPath | None = None
) -> None:
    """Raise `TlsError` unless a client trusting CA_FILE (default: the certificate itself) accepts
    CERT_FILE for NAME (a host name or an IP address).

    A TLS handshake in memory, so nothing listens: the same check a real client makes, chain and
    name included, before engines or clients find out one at a time.
    """
    server = _server_context(cert_file, key_file)
    client = client_context(ca_file or cert_file)
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client.wrap_bio(to_client, to_server, server_hostname=name)
    server_side = server.wrap_bio(to_server, to_client, server_side=True)
    pending = [client_side, server_side]
    for _ in range(8):  # TLS 1.3 needs two round trips; a few more cost nothing
        for side in list(pending):
            try:
                side.do_handshake()
                pending.remove(side)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as exc:
                trusted = Path(ca_file) if ca_file else "itself"
                raise TlsError(
                    f"certificate {cert_file} is not accepted for {name} by a client trusting "
                    f"{trusted}: {exc.verify_message}"
                ) from None
            except ssl.SSLError as exc:
                raise TlsError(f"certificate {cert_file}: handshake failed: {exc}") from None
        if not pending:
            return
    raise TlsError(f"certificate {cert_file}: the test handshake did not complete")
