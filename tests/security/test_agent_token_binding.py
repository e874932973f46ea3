"""Threat: the agent token goes to a control plane it was not issued by, or through a planted link.

The token is bound to the control plane that issued it (recorded with the identity); an agent
started with `--control-plane` pointing elsewhere stops with a message saying how to re-register,
and sends nothing. The token and identity files are written 0600 through a fresh `O_EXCL |
O_NOFOLLOW` file and read `O_NOFOLLOW`: a symlink planted at their paths (by anyone who could
write the data dir) is neither written through nor read and sent as the token.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.control_plane import AgentIdentity, IdentityStore
from agent.errors import UnusableIdentity
from agent.private_files import write_private
from tests.agent.loopback import (
    FakeControlPlane,
    agent_command,
    agent_env,
    agent_for,
    agent_log,
    run_agent,
    wait_until,
)
from tests.processes import stop

TOKEN = "agent-secret-token"


def saved_identity(data_dir: Path, control_plane: str) -> IdentityStore:
    store = IdentityStore(data_dir / "agent")
    store.save(AgentIdentity(host_id=1, host_name="gpu-1", control_plane=control_plane,
                             token=TOKEN))  # fmt: skip
    return store


def test_an_agent_pointed_at_another_control_plane_does_not_send_it_the_token(
    tmp_path: Path,
) -> None:
    with FakeControlPlane() as issuer, FakeControlPlane() as elsewhere:
        store = saved_identity(tmp_path / "data", issuer.url)
        argv = agent_command(elsewhere.url, tmp_path / "data")
        agent = run_agent(tmp_path, argv, agent_env(tmp_path))
        try:
            wait_until("the agent to stop", lambda: agent.poll() is not None or elsewhere.beats)
            assert elsewhere.requests_with_token() == []
            assert agent.wait(timeout=20) == 1
        finally:
            stop(agent)
        log = agent_log(tmp_path)
        assert elsewhere.server.seen == [] and issuer.server.seen == []
    assert f"issued by the control plane {issuer.url}, not {elsewhere.url}" in log
    assert f"remove {store.identity_file} and {store.token_file}" in log


def test_the_same_control_plane_spelled_differently_is_still_the_same(tmp_path: Path) -> None:
    store = saved_identity(tmp_path, "http://127.0.0.1:8700")
    for spelling in ("http://127.0.0.1:8700/", "HTTP://127.0.0.1:8700"):
        identity = store.load(spelling)
        assert identity is not None and identity.token == TOKEN
    for other in ("https://127.0.0.1:8700", "http://127.0.0.1:8701", "http://localhost:8700"):
        with pytest.raises(UnusableIdentity, match="issued by the control plane"):
            store.load(other)


@pytest.mark.parametrize("name", ["agent-token", "identity.json"])
def test_a_symlink_planted_at_an_identity_path_is_not_written_through(
    tmp_path: Path, name: str
) -> None:
    victim = tmp_path / "victim"  # e.g. a file of the agent's user the attacker wants replaced
    victim.write_text("precious")
    store = IdentityStore(tmp_path / "agent")
    store.directory.mkdir()
    (store.directory / name).symlink_to(victim)
    store.save(AgentIdentity(host_id=1, host_name="gpu-1", control_plane="http://cp:8700",
                             token=TOKEN))  # fmt: skip
    assert victim.read_text() == "precious"
    for path in (store.token_file, store.identity_file):
        assert not path.is_symlink()
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
    assert store.load("http://cp:8700") is not None


def test_registration_replaces_a_link_planted_before_the_first_start(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (tmp_path / "data" / "agent").mkdir(parents=True)
    (tmp_path / "data" / "agent" / "identity.json").symlink_to(victim)
    with FakeControlPlane(agent_token=TOKEN) as cp:
        agent = agent_for(tmp_path, cp.url)
        assert agent.heartbeat_once() is not None  # registered, saved, heartbeat sent
    assert not victim.exists()
    assert not (tmp_path / "data" / "agent" / "identity.json").is_symlink()


def test_a_symlink_planted_at_the_token_path_is_not_read_and_sent(tmp_path: Path) -> None:
    secret = tmp_path / "id_ed25519"  # any file the agent's user can read
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    with FakeControlPlane() as cp:
        store = saved_identity(tmp_path / "data", cp.url)
        store.token_file.unlink()
        store.token_file.symlink_to(secret)
        agent = agent_for(tmp_path, cp.url)
        with pytest.raises(UnusableIdentity, match="symlink"):
            agent.heartbeat_once()
        assert cp.server.seen == []


def test_private_files_are_0600_from_creation_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_private(tmp_path / "agent-token", TOKEN)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "agent-token").stat().st_mode) == 0o600
    planted = tmp_path / "agent-token.tmp"  # the temporary name, planted as a link
    planted.symlink_to(tmp_path / "victim")
    write_private(tmp_path / "agent-token", "new")
    assert not (tmp_path / "victim").exists()
    assert (tmp_path / "agent-token").read_text() == "new"
