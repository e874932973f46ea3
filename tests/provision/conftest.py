"""Two "hosts" for provisioning tests: two real sshd on loopback, each with its own host key.

Both let `ssh_client_key` log in as root. sshd comes from openssh-server (`.ci/run` installs it);
without it these tests skip and say why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sshd import SshServer, client_key, sshd_available


@pytest.fixture(scope="session")
def ssh_client_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The private key (ed25519, no passphrase) the tests log in with; `.pub` next to it."""
    return client_key(tmp_path_factory.mktemp("ssh-client"))


@pytest.fixture(scope="session")
def sshd_pair(
    tmp_path_factory: pytest.TempPathFactory, ssh_client_key: Path
) -> Iterator[tuple[SshServer, SshServer]]:
    """Two running sshd, each a host with its own port and host key, root login by key."""
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    public = ssh_client_key.with_suffix(".pub")
    servers = [SshServer(tmp_path_factory.mktemp(f"sshd-{n}"), [public]) for n in (1, 2)]
    try:
        for server in servers:
            server.start()
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def known_hosts(tmp_path: Path) -> Path:
    """A known-hosts file path in an empty folder: the file does not exist yet."""
    return tmp_path / "known_hosts"
