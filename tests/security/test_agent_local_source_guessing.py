"""Threat: an operator tests guesses about any file an agent can read on its GPU host.

A model version's source and manifest are the operator's word. The agent copied a "local"
source from any path and reported what it found: a wrong guess came back as "got N bytes sha256
abcdef..." (the file's real size and digest prefix), a right one as a verified snapshot. A
private key, a token file or `/etc/shadow` on every host of a deployment could be probed so.

The agent now copies local sources only from below `[agent] model_roots` (none by default),
opening each file without a symlink leading out; anything else must come from the control
plane's file URL. A right and a wrong guess get the same report, which names no digest and no
size of the file.

A real `dctl agent` process (default settings) and an in-process agent with its real snapshot
store, against a control plane on loopback that sends the operator's desired state.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from protocol.wire import InstanceState, Manifest
from tests.agent.loopback import (
    FakeControlPlane,
    agent_command,
    agent_env,
    agent_for,
    agent_log,
    checkpoint,
    desired_instance,
    run_agent,
    settle,
    wait_until,
)
from tests.processes import stop

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"


def guessing(instance_id: int, source: Path, name: str, guess: bytes) -> dict[str, Any]:
    """A desired instance whose "weights" are one file NAME of SOURCE, as the operator guesses
    it; the control plane offers no file URL (nothing of it is on the control plane's disk)."""
    entry = {"path": name, "size": len(guess), "sha256": hashlib.sha256(guess).hexdigest()}
    manifest = Manifest.model_validate({"files": [entry]})
    model = {"name": "demo", "version": f"v{instance_id}", "digest": manifest.digest(),
             "manifest": manifest.model_dump(mode="json"), "source_uri": str(source),
             "files_url": None}  # fmt: skip
    return {"instance_id": instance_id, "deployment": "demo",
            "port": 18000 + instance_id, "model": model}  # fmt: skip


def assert_nothing_of_the_secret_in(reports: list[bytes]) -> None:
    """No heartbeat carries the secret's digest (any 12-hex prefix) or its size."""
    real = hashlib.sha256(SECRET).hexdigest()
    text = b"".join(reports).decode()
    assert real[:12] not in text
    assert f"{len(SECRET)} bytes" not in text


def test_the_agent_by_default_tells_a_right_guess_from_a_wrong_one_by_nothing(
    tmp_path: Path,
) -> None:
    secrets_dir = tmp_path / "home" / ".ssh"
    secrets_dir.mkdir(parents=True)
    (secrets_dir / "id_ed25519").write_bytes(SECRET)
    right = guessing(1, secrets_dir, "id_ed25519", SECRET)
    wrong = guessing(2, secrets_dir, "id_ed25519", SECRET.replace(b"A", b"B"))
    with FakeControlPlane(instances=[right, wrong]) as cp:
        argv = agent_command(cp.url, tmp_path / "data")  # no --model-root: the default
        agent = run_agent(tmp_path, argv, agent_env(tmp_path, DCTL_BOOTSTRAP_TOKEN="boot"))
        try:

            def both_failed() -> bool:
                observed = cp.observed()
                return all(
                    i in observed and observed[i].state == InstanceState.FAILED for i in (1, 2)
                )

            wait_until("both guesses reported", lambda: both_failed() or agent.poll() is not None)
            assert agent.poll() is None, agent_log(tmp_path)[-3000:]
            observed = cp.observed()
            failures = {f.digest: f.error for f in cp.beats[-1].facts.snapshot_failures}
        finally:
            stop(agent)
    messages = []
    for instance in (right, wrong):
        digest = instance["model"]["digest"]
        message = observed[instance["instance_id"]].message
        assert "model roots" in message and "model_roots" in message
        assert failures[digest] in message
        messages.append(message.replace(digest[:12], "DIGEST"))
    assert messages[0] == messages[1]  # the same words for a right and a wrong guess
    assert_nothing_of_the_secret_in([seen.body for seen in cp.server.seen])
    assert not list((tmp_path / "data" / "snapshots" / "snapshots").iterdir())


def test_a_symlink_below_a_model_root_does_not_lead_the_copy_out(tmp_path: Path) -> None:
    secrets_dir = tmp_path / "etc"
    secrets_dir.mkdir()
    (secrets_dir / "shadow").write_bytes(SECRET)
    models = tmp_path / "models"
    source = checkpoint(models / "demo")
    (source / "shadow").symlink_to(secrets_dir / "shadow")
    (models / "etc").symlink_to(secrets_dir)  # a whole directory leading out, too
    attempts = [
        guessing(1, source, "shadow", SECRET),
        guessing(2, source, "shadow", b"wrong guess"),
        guessing(3, models / "etc", "shadow", SECRET),
        guessing(4, models / "demo" / ".." / ".." / "etc", "shadow", SECRET),
    ]
    with FakeControlPlane(instances=attempts) as cp:
        agent = agent_for(tmp_path, cp.url, model_roots=[models])
        for _ in range(len(attempts)):
            settle(agent)
        observed = cp.observed()
    assert all(observed[i].state == InstanceState.FAILED for i in (1, 2, 3, 4)), observed
    assert_nothing_of_the_secret_in([seen.body for seen in cp.server.seen])
    assert not list((tmp_path / "data" / "snapshots" / "snapshots").iterdir())


def test_a_source_below_a_model_root_is_still_copied_from_disk(tmp_path: Path) -> None:
    models = tmp_path / "models"
    source = checkpoint(models / "demo")
    with FakeControlPlane(instances=[desired_instance(source, instance_id=1)]) as cp:
        agent = agent_for(tmp_path, cp.url, model_roots=[models])
        settle(agent)
        observed = cp.observed()
        fetched = [seen.path for seen in cp.server.seen if seen.method == "GET"]
    assert observed[1].state == InstanceState.STARTING, observed[1].message
    assert fetched == []  # no file came over HTTP: it was copied from the model root
    stored = list((tmp_path / "data" / "snapshots" / "snapshots").iterdir())
    assert [path.name for path in stored] == [desired_instance(source)["model"]["digest"]]
