"""The demo's ports: free loopback ports, kept in the data dir so that a second run reuses them
(and the URLs it printed) while they are still free."""

from __future__ import annotations

import socket
from pathlib import Path

from cli.exits import CliError


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on HOST:PORT and it can be bound."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_range(count: int) -> tuple[int, int]:
    """COUNT consecutive free loopback ports."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            first = int(sock.getsockname()[1])
        if first + count <= 65535 and all(port_is_free(p) for p in range(first, first + count)):
            return first, first + count - 1
    raise CliError(f"could not find {count} consecutive free ports on 127.0.0.1")


def kept_port(saved: Path) -> int:
    """The port SAVED names when it is still free, else a new free one (then saved)."""
    if saved.is_file() and saved.read_text().strip().isdigit():
        port = int(saved.read_text().strip())
        if port_is_free(port):
            return port
    port = free_port_range(1)[0]
    saved.write_text(f"{port}\n")
    return port


def kept_port_range(saved: Path, count: int) -> tuple[int, int]:
    """The range SAVED names (`FIRST-LAST`) when all of it is still free, else COUNT new free
    ports (then saved)."""
    if saved.is_file():
        low, _, high = saved.read_text().strip().partition("-")
        if low.isdigit() and high.isdigit():
            span = range(int(low), int(high) + 1)
            if all(port_is_free(p) for p in span):
                return int(low), int(high)
    first, last = free_port_range(count)
    saved.write_text(f"{first}-{last}\n")
    return first, last
