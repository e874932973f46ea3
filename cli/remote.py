"""The CLI's connection to a control plane: the context to use, the client, one-line errors.

Commands that talk to the API do `with connect() as api: ...`; a missing context, an
unreachable server or an error answer becomes one `error: ...` line on stderr and exit 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from cli.exits import USAGE, fail

if TYPE_CHECKING:
    from pydantic import ValidationError

    from client.credentials import Context
    from client.http import ControlPlaneClient
    from protocol.version_ref import VersionRef

T = TypeVar("T")

_HINTS = {
    401: "check the token: `dctl context list`, or set DCTL_TOKEN",
}
# protocol.wire's NAME_PATTERN and VERSION_PATTERN, said for a person.
_NAME_RULE = (
    "lowercase letters, digits and '-' (at most 63, starting and ending with a letter or digit)"
)
_VERSION_RULE = "letters, digits, '.', '_' and '-' (at most 64)"


def current_context() -> Context:
    """The context in use (`DCTL_URL`/`DCTL_TOKEN` override it); none configured exits 1."""
    from client.credentials import CredentialsError, resolve

    try:
        return resolve()
    except CredentialsError as exc:
        fail(str(exc))


@contextmanager
def connect(timeout: float = 10.0) -> Iterator[ControlPlaneClient]:
    """A client for the current context (`DCTL_URL`/`DCTL_TOKEN` override it); errors exit 1."""
    # Imported here so that `dctl --help` never pays for httpx and pydantic.
    from client.errors import ClientError
    from client.http import ControlPlaneClient

    context = current_context()
    try:
        client = ControlPlaneClient.from_context(context, timeout=timeout)
    except ClientError as exc:
        # A context (or DCTL_URL) whose URL is not http(s)://HOST is refused here, before any call.
        fail(str(exc))
    try:
        yield client
    except ClientError as exc:
        hint = _HINTS.get(exc.status or 0)
        fail(f"{exc}; {hint}" if hint else str(exc))
    finally:
        client.close()


def parse_version_ref(value: str, what: str = "model version") -> VersionRef:
    """`NAME:VERSION` as `VersionRef.parse` reads it; anything else is a usage error (exit 2)."""
    from protocol.version_ref import VersionRef

    try:
        return VersionRef.parse(value)
    except ValueError:
        message = f"{what} {value!r}: write it as NAME:VERSION, e.g. sdar-moe:v1"
        if ":" in value:  # a half is empty or holds what its rule refuses: say the rules
            message += f" (NAME: {_NAME_RULE}; VERSION: {_VERSION_RULE})"
        fail(message, USAGE)


def validated(build: Callable[[], T]) -> T:
    """Build a request body; bad user input is a usage error (exit 2) naming the field."""
    from pydantic import ValidationError

    try:
        return build()
    except ValidationError as exc:
        fail(describe(exc), USAGE)


def describe(exc: ValidationError) -> str:
    """One line naming the first bad field and, for names, what a good one looks like."""
    from protocol.wire import NAME_PATTERN, VERSION_PATTERN

    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "input"
    pattern = (err.get("ctx") or {}).get("pattern")
    if pattern == NAME_PATTERN:
        return f"{where} {err['input']!r}: use {_NAME_RULE}"
    if pattern == VERSION_PATTERN:
        return f"{where} {err['input']!r}: use {_VERSION_RULE}"
    # A rule over several fields (a model validator) has no field to name; its message does.
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if err["loc"] else message
