"""Every way a call to the control plane can fail, mapped onto one `ClientError`.

The sync and the async client both go through `transport_errors` (around sending) and `answer`
(reading what came back), so a refused connection, a timeout, a redirect, an error status, a
body that is not JSON and a body of the wrong shape read the same whichever client a caller uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import httpx
from pydantic import ValidationError

from client.calls import Call
from runtime.tls import verification_failure

T = TypeVar("T")


class ClientError(Exception):
    """A request failed; `message` is what the server (or the network) said, `status` its code.

    `status` is None when no HTTP answer came back (connection refused, timeout, bad URL).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.message} (HTTP {self.status})"


def error_message(response: httpx.Response) -> str:
    """The human message of an error response: our `message`, FastAPI `detail`, or the text."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text.splitlines()[0][:300] if text else response.reason_phrase
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return value
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                return str(value["message"])
            if isinstance(value, list) and value and isinstance(value[0], dict):
                # FastAPI validation errors: name the field and what is wrong with it.
                first = value[0]
                where = ".".join(str(p) for p in first.get("loc", []) if p != "body")
                msg = str(first.get("msg", "invalid input"))
                return f"{where}: {msg}" if where else msg
    return response.reason_phrase


@contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    """Turn whatever httpx raises while sending into a `ClientError` that says what to check."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ClientError(
            f"control plane at {base_url} did not answer in time; is it overloaded, or is "
            "the URL right? (`dctl context list`)"
        ) from exc
    except httpx.UnsupportedProtocol as exc:
        raise ClientError(
            f"control plane URL {base_url!r} must start with http:// or https://"
        ) from exc
    except httpx.InvalidURL as exc:
        raise ClientError(f"control plane URL {base_url!r} is not valid: {exc}") from exc
    except httpx.ConnectError as exc:
        refused = verification_failure(exc)
        if refused is None:
            raise _unreachable(base_url, exc) from exc
        raise ClientError(
            f"the TLS certificate of the control plane at {base_url} is not trusted "
            f"({refused.verify_message}): if a private CA signed it, pass that CA's certificate "
            "with --ca-file (`dctl context add NAME --url URL --ca-file FILE`) or set "
            "DCTL_CA_FILE; without one the system trust store is used"
        ) from exc
    except httpx.RemoteProtocolError as exc:
        if base_url.startswith("http://"):
            # A TLS server hangs up on plain HTTP without a word.
            raise ClientError(
                f"the control plane at {base_url} closed the connection without answering; "
                "if it serves HTTPS, use an https:// URL"
            ) from exc
        raise _unreachable(base_url, exc) from exc
    except httpx.TransportError as exc:
        raise _unreachable(base_url, exc) from exc
    except httpx.HTTPError as exc:
        # What is left (a body that cannot be decoded, too many redirects) is the server's fault.
        raise ClientError(f"control plane at {base_url}: {exc or type(exc).__name__}") from exc


def _unreachable(base_url: str, exc: Exception) -> ClientError:
    return ClientError(
        f"cannot reach the control plane at {base_url}: {exc or type(exc).__name__}; "
        "is it running there? (`dctl context list` shows the URL in use)"
    )


def answer(base_url: str, call: Call[T], response: httpx.Response) -> T:
    """What CALL returns for RESPONSE, or a `ClientError` saying why there is nothing to return."""
    if response.status_code == 304 and call.not_modified_is_none:
        return cast(T, None)  # httpx counts 304 among redirects: answered before them
    if response.is_redirect:
        # Redirects are not followed: a bearer token must not be replayed to another address.
        target = response.headers.get("location", "elsewhere")
        raise ClientError(
            f"control plane at {base_url} redirects to {target}; point the context at that "
            "URL (`dctl context list`)",
            response.status_code,
        )
    if response.status_code >= 400:
        raise ClientError(error_message(response), response.status_code)
    body: Any = None
    if response.content:
        try:
            body = response.json()
        except ValueError as exc:
            raise ClientError(
                f"control plane at {base_url} answered {call.method} {call.path} with "
                "non-JSON; is that URL a dctl control plane?",
                response.status_code,
            ) from exc
    try:
        return call.read(body)
    except ValidationError as exc:
        raise ClientError(_mismatch(base_url, call, exc)) from exc


def _mismatch(base_url: str, call: Call[Any], exc: ValidationError) -> str:
    # Client and server ship together; a mismatch means two different dctl versions.
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return (
        f"{call.method} {call.path}: the control plane at {base_url} answered in a form this "
        f"dctl does not understand ({where}: {err['msg']}); are both the same dctl version?"
    )
