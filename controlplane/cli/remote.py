"""The CLI's connection to a control plane: the context to use, the client, one-line errors.

Commands that talk to the API do `with connect() as api: ...`; a missing context, an
unreachable server or an error answer becomes one `error: ...` line on stderr and exit 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from controlplane.cli.exits import USAGE, fail

if TYPE_CHECKING:
    from controlplane.client import ControlPlaneClient

_HINTS = {
    401: "check the token: `dctl context list`, or set DCTL_TOKEN",
}


@contextmanager
def connect(timeout: float = 10.0) -> Iterator[ControlPlaneClient]:
    """A client for the current context (`DCTL_URL`/`DCTL_TOKEN` override it); errors exit 1."""
    # Imported here so that `dctl --help` never pays for httpx and pydantic.
    from controlplane.client import ClientError, ControlPlaneClient
    from controlplane.credentials import CredentialsError, resolve

    try:
        context = resolve()
    except CredentialsError as exc:
        fail(str(exc))
    client = ControlPlaneClient.from_context(context, timeout=timeout)
    try:
        yield client
    except ClientError as exc:
        hint = _HINTS.get(exc.status or 0)
        fail(f"{exc}; {hint}" if hint else str(exc))
    finally:
        client.close()


def split_name_version(value: str, what: str = "model version") -> tuple[str, str]:
    """`NAME:VERSION` -> (NAME, VERSION); anything else is a usage error (exit 2)."""
    name, sep, version = value.partition(":")
    if not sep or not name or not version or ":" in version:
        fail(f"{what} {value!r}: write it as NAME:VERSION, e.g. sdar-moe:v1", USAGE)
    return name, version
