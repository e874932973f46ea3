"""Reading HTTP bodies whose size the sender chooses: never more than the agent can use.

A server (a control plane, a file server, or whoever answers in their place) decides how long a
body is; the agent decides how much of it it reads. Every body is read from a streamed response,
through `read_capped`, so an endless error page costs a few KiB and a dropped connection, not
the agent's memory.
"""

from __future__ import annotations

import httpx

# What a person needs from an error page; the rest is not worth holding.
ERROR_BODY_LIMIT = 4096


def read_capped(response: httpx.Response, limit: int) -> bytes:
    """At most LIMIT bytes of a streamed RESPONSE's body; reading stops there.

    Read LIMIT + 1 to learn whether the body was longer than LIMIT.
    """
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk[: limit - len(body)]
        if len(body) >= limit:
            break
    return bytes(body)


def error_text(response: httpx.Response, limit: int = ERROR_BODY_LIMIT) -> str:
    """The start of an error body as text (at most LIMIT bytes read)."""
    return read_capped(response, limit).decode(errors="replace")
