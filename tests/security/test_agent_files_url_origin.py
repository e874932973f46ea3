"""Threat: the agent token leaks to whatever host a heartbeat reply's `files_url` names.

Control planes used to build `files_url` from the request's Host header, and the agent sent its
bearer token to any absolute URL it was given; a spoofed Host (or a hostile reply) pointed it at
an attacker's server. Now a path is joined to the agent's configured control-plane URL, an
absolute URL is accepted only on that origin (scheme, host, port), and anything else fails the
instance without a single request going out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.control_plane import files_url_on
from agent.errors import ForeignUrl
from protocol.wire import InstanceState
from tests.agent.fakes import FakeLauncher
from tests.agent.loopback import (
    FILES_PREFIX,
    FakeControlPlane,
    agent_for,
    checkpoint,
    desired_instance,
    recording_server,
    settle,
)

REMOTE = "s3://bucket/demo/v1"  # not on this host: the files must come over HTTP


@pytest.mark.parametrize(
    "make_url",
    [
        lambda attacker, cp: f"{attacker}/steal/",  # another port on the same host
        lambda attacker, cp: f"http://localhost:{attacker.rsplit(':', 1)[1]}/steal/",
        lambda attacker, cp: "https" + cp.removeprefix("http") + FILES_PREFIX,  # other scheme
        lambda attacker, cp: f"//127.0.0.1:{attacker.rsplit(':', 1)[1]}/steal/",
    ],
    ids=["other-port", "other-host", "other-scheme", "scheme-relative"],
)
def test_a_files_url_off_the_control_plane_gets_no_request_and_fails_the_instance(
    tmp_path: Path, make_url: object
) -> None:
    src = checkpoint(tmp_path / "weights")
    with recording_server() as attacker, FakeControlPlane(files=src) as cp:
        files_url = make_url(attacker.url, cp.url)  # type: ignore[operator]
        cp.instances = [desired_instance(src, source_uri=REMOTE, files_url=files_url)]
        launcher = FakeLauncher()
        agent = agent_for(tmp_path, cp.url, launcher)
        settle(agent)
        settle(agent)
        assert attacker.seen == []
        assert [s.path for s in cp.requests_with_token() if s.method == "GET"] == []
        observed = cp.observed()[5]
    assert observed.state == InstanceState.FAILED
    assert "files_url" in observed.message and "not on the control plane" in observed.message
    assert launcher.launched == []


def test_a_files_url_path_is_fetched_from_the_configured_control_plane(tmp_path: Path) -> None:
    # Behind a proxy the control plane lives under a prefix; the path joins the configured URL,
    # not the bare host (a Host-header-built URL would have lost the prefix, or the host).
    src = checkpoint(tmp_path / "weights")
    with FakeControlPlane(prefix="/dctl", files=src) as cp:
        cp.instances = [desired_instance(src, source_uri=REMOTE, files_url=FILES_PREFIX)]
        launcher = FakeLauncher()
        agent = agent_for(tmp_path, cp.url, launcher)
        settle(agent)
        gets = [s for s in cp.server.seen if s.method == "GET"]
    assert {s.path for s in gets} == {
        f"/dctl{FILES_PREFIX}config.json",
        f"/dctl{FILES_PREFIX}model.safetensors",
    }
    assert all(s.authorization == f"Bearer {cp.agent_token}" for s in gets)
    assert len(launcher.launched) == 1


def test_an_absolute_files_url_on_the_control_plane_origin_is_still_accepted(
    tmp_path: Path,
) -> None:
    src = checkpoint(tmp_path / "weights")
    with FakeControlPlane(files=src) as cp:
        absolute = f"HTTP://127.0.0.1:{cp.server.port}{FILES_PREFIX}"  # the old, Host-built form
        cp.instances = [desired_instance(src, source_uri=REMOTE, files_url=absolute)]
        launcher = FakeLauncher()
        agent = agent_for(tmp_path, cp.url, launcher)
        settle(agent)
    assert len(launcher.launched) == 1


@pytest.mark.parametrize(
    "files_url",
    [
        "http://evil.example\\@127.0.0.1:8700/api/",  # the parser httpx uses decides the host
        "http://127.0.0.1:8700\\@evil.example/api/",
        "http://user:pass@127.0.0.1:8700/api/",
        "@evil.example/api/",
        "api/v1/models/",
    ],
)
def test_urls_that_only_look_like_the_control_plane_are_refused(files_url: str) -> None:
    with pytest.raises(ForeignUrl, match="not on the control plane"):
        files_url_on("http://127.0.0.1:8700", files_url)
