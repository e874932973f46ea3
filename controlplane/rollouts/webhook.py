"""One POST of a rollout notification, and which addresses a notification may go to.

The `notify` URL is set by an operator, but the control plane sends the request: from inside
the network, where loopback, link-local (169.254.169.254: cloud metadata), private and
unique-local addresses reach what no operator should reach through it. So the name is resolved
once per attempt, every address it has is checked, and the connection goes to a checked
address with the name kept for the Host header, SNI and the certificate check: a DNS answer
that changes between the check and the connect (rebinding) is never asked for. Private targets
need `[controlplane] notify_allow_private = true`.

What comes back is bounded: no redirects, the status line and headers only (h11 caps those at
16 KiB; the body is never read) and one deadline for the whole attempt, so a receiver that
drips a byte every few seconds cannot hold a sender for longer. What viewers may learn of an
attempt is its class (`HTTP 5xx`, `unreachable`), never what told a closed port from an open
one; the log gets the detail.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from controlplane.services.errors import Invalid

DEADLINE_S = 10.0  # one attempt, from the DNS lookup to the response's headers
SETTING = "[controlplane] notify_allow_private = true (env DCTL_NOTIFY_ALLOW_PRIVATE=1)"

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses to connect to (as getaddrinfo gives them)
Resolver = Callable[[str, int], Awaitable[list[str]]]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LOCAL_NAMES = ("localhost", "localhost.localdomain")


def is_public(address: IpAddress) -> bool:
    """True for an address a notification may go to without `notify_allow_private`: a global
    unicast one, also when it hides inside an IPv6 address (mapped, 6to4, NAT64, Teredo)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if address.sixtofour is not None:
            return is_public(address.sixtofour)
        if address.teredo is not None:
            return is_public(address.teredo[1])
        if address in _NAT64:
            return is_public(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return address.is_global and not address.is_multicast


def check_target(url: str | None, field: str, allow_private: bool) -> None:
    """Raise `Invalid` (422, naming FIELD and what to do) when URL cannot be set as a notify
    target: a private address written as a number in any form or a localhost name (unless
    allowed), the masked form viewers see, or no URL at all. Other names are not looked up
    here (their answer may change): every send checks what they resolve to."""
    problem = _refusal(url, field, allow_private) if url else None
    if problem:
        raise Invalid(problem)


def _refusal(url: str, field: str, allow_private: bool) -> str | None:
    if url.endswith("/…"):
        return (
            f"{field}: {url} is the URL as shown below admin (scheme and host only): "
            "give the whole URL"
        )
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"{field}: not a URL: {exc}"
    if not target.host:
        return f"{field}: {url} names no host"
    if allow_private:
        return None
    host = target.host.rstrip(".").lower()
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        private = True
    else:
        try:  # numbers only (127.1, 2130706433, [::ffff:127.0.0.1]): no DNS in a request
            infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
        except (socket.gaierror, UnicodeError):
            return None
        private = any(not is_public(ipaddress.ip_address(info[4][0])) for info in infos)
    if not private:
        return None
    return (
        f"{field}: {host} is a loopback, link-local or private address; rollout notifications "
        f"go to public addresses unless the control plane sets {SETTING}"
    )


@dataclass(frozen=True)
class Attempt:
    """How one attempt went: `shown` is what the event log may say (viewers read it), `detail`
    what the control plane's log says; `final` when another attempt cannot go better."""

    ok: bool
    shown: str = ""
    detail: str = ""
    final: bool = False


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's addresses from the system resolver (IPv6 and IPv4, in its order)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def post_json(
    url: str,
    body: dict[str, Any],
    *,
    allow_private: bool = False,
    resolve: Resolver = system_resolver,
    verify: ssl.SSLContext | bool = True,
    deadline_s: float = DEADLINE_S,
) -> Attempt:
    """POST BODY as JSON to URL once, over a checked address, within DEADLINE_S."""
    target = httpx.URL(url)
    name = target.raw_host.decode("ascii")
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        async with asyncio.timeout(deadline_s):
            addresses = [ipaddress.ip_address(a) for a in await resolve(name, port)]
            blocked = [a for a in addresses if not is_public(a)]
            if blocked and not allow_private:
                return Attempt(
                    False,
                    f"refused: {target.host} resolves to a private address; set {SETTING} "
                    "to send there",
                    f"{target.host} resolves to {', '.join(map(str, blocked))}",
                    final=True,
                )
            status = await _post_pinned(target, addresses, body, verify)
    except TimeoutError:
        return Attempt(False, "unreachable", f"no answer within {deadline_s:g} s")
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        return Attempt(False, "unreachable", f"{type(exc).__name__}: {exc}")
    if 200 <= status < 300:
        return Attempt(True)
    return Attempt(False, f"HTTP {status // 100}xx", f"HTTP {status}")


async def _post_pinned(
    target: httpx.URL,
    addresses: list[IpAddress],
    body: dict[str, Any],
    verify: ssl.SSLContext | bool,
) -> int:
    """The status of a POST to the first of ADDRESSES that accepts a connection, asking for
    TARGET's name (Host header, SNI, certificate) without looking it up again."""
    if not addresses:
        raise httpx.ConnectError(f"{target.host} has no address")
    auth = httpx.BasicAuth(target.username, target.password) if target.userinfo else None
    headers = {"Host": target.netloc.decode("ascii")}
    # trust_env=False: a proxy from the environment would resolve the name again. No timeout
    # of its own: the caller's deadline covers the whole attempt.
    async with httpx.AsyncClient(
        verify=verify, trust_env=False, follow_redirects=False, timeout=None
    ) as client:
        failure: httpx.ConnectError | None = None
        for address in addresses:
            pinned = httpx.URL(
                scheme=target.scheme, host=str(address), port=target.port, raw_path=target.raw_path
            )
            try:
                async with client.stream(
                    "POST",
                    pinned,
                    json=body,
                    headers=headers,
                    auth=auth,
                    extensions={"sni_hostname": target.raw_host.decode("ascii")},
                ) as response:
                    return response.status_code  # the body stays unread
            except httpx.ConnectError as exc:
                failure = exc
        assert failure is not None
        raise failure
