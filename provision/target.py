"""The SSH target a user names: `USER@HOST[:PORT]`, IPv6 as `USER@[ADDR]:PORT`."""

from __future__ import annotations

import getpass
import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PORT = 22

_EXPECTED = "expected USER@HOST[:PORT] (IPv6: USER@[ADDRESS]:PORT)"
# Login names and host names as OpenSSH accepts them in practice; nothing that a shell, an
# ssh option parser or a known_hosts line would read differently (spaces, commas, a leading -).
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_BRACKETED = re.compile(r"\[(?P<host>[^\[\]]+)\](?::(?P<port>[^:]*))?")


@dataclass(frozen=True)
class SshTarget:
    """Who to log in as, and where: one host of the fleet as SSH reaches it."""

    user: str
    host: str
    port: int = DEFAULT_PORT

    @classmethod
    def parse(cls, text: str, default_user: str | None = None) -> SshTarget:
        """Read `user@host`, `user@host:2222`, `user@[::1]:2222` or `host` (user: the default).

        Host names are lowercased, as OpenSSH does before it looks them up in known_hosts."""
        raw = text.strip()
        user_part, at, host_part = raw.rpartition("@")
        if at and not user_part:
            raise ValueError(f"bad SSH target {text!r}: the user before '@' is empty; {_EXPECTED}")
        user = user_part if at else (default_user or getpass.getuser())
        if not _USER.fullmatch(user):
            raise ValueError(f"bad SSH target {text!r}: bad user name {user!r}; {_EXPECTED}")
        host, port_text = _split_host_port(text, host_part)
        return cls(user=user, host=host.lower(), port=_parse_port(text, port_text))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == DEFAULT_PORT else f":{self.port}"
        return f"{self.user}@{host}{port}"

    @property
    def known_hosts_name(self) -> str:
        """The name of this host in a known_hosts file: `host`, or `[host]:port` off port 22."""
        if self.port == DEFAULT_PORT:
            return self.host
        return f"[{self.host}]:{self.port}"


def _split_host_port(text: str, host_part: str) -> tuple[str, str | None]:
    """The host and the port text (None when absent) of `host[:port]` or `[v6][:port]`."""
    if not host_part:
        raise ValueError(f"bad SSH target {text!r}: no host; {_EXPECTED}")
    bracketed = _BRACKETED.fullmatch(host_part)
    if bracketed:
        host = bracketed["host"]
        if not (_is_ip(host) or _HOST.fullmatch(host)):
            raise ValueError(f"bad SSH target {text!r}: bad host {host!r}; {_EXPECTED}")
        return host, bracketed["port"]
    if host_part.count(":") > 1:
        # A bare IPv6 address: its colons leave no room for a port.
        if not _is_ip(host_part):
            raise ValueError(f"bad SSH target {text!r}: bad IPv6 address; {_EXPECTED}")
        return host_part, None
    host, colon, port_text = host_part.partition(":")
    if not _HOST.fullmatch(host):
        raise ValueError(f"bad SSH target {text!r}: bad host {host!r}; {_EXPECTED}")
    return host, port_text if colon else None


def _parse_port(text: str, port_text: str | None) -> int:
    """The port number in PORT_TEXT (22 when absent), checked to be 1..65535."""
    if port_text is None:
        return DEFAULT_PORT
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad SSH target {text!r}: port must be 1..65535; {_EXPECTED}")
    return int(port_text)


def _is_ip(text: str) -> bool:
    """Whether TEXT is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
