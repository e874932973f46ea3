"""Threat: a rollout's `notify` webhook as a way in and a way out.

An operator sets the URL, the control plane sends the POST from inside the network. So the URL
could aim at cloud metadata (169.254.169.254), loopback admin ports or the private network
(SSRF), directly or through a name that resolves there; the event log, which every viewer
reads, could tell closed ports, open ports and status codes apart (an oracle); a huge answer
could fill the control plane's memory and a slow one hold every other rollout's notifications.
And the URL itself is often the secret (`user:password@`, `?sig=`, a Slack hook's path), so
viewers must not read it and no log may carry it. A real control plane on loopback, the
attacker's real requests, real receivers on 127.0.0.1 and the control plane's own sender.
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests
# that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from controlplane.models import Event
from controlplane.rollouts.controller import RolloutController
from controlplane.rollouts.notify import Notifier
from runtime.logs import configure_logging
from tests.agent.loopback import LoopbackServer
from tests.controlplane.conftest import db_url, gpu, manifest, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live, serve
from tests.security.webhook_receivers import (
    FakeDns,
    closed_port,
    https_receiver,
    raw_receiver,
    tls_for,
    wait_until,
)

MIB = 1 << 20
HOOK_SECRETS = ("hook-pass", "PathSecret", "QuerySecret")
SECRET_HOOK = "https://hook-user:hook-pass@hooks.example.com/services/PathSecret?sig=QuerySecret"
PRIVATE_URLS = [
    "http://169.254.169.254/latest/meta-data/iam/",
    "http://127.0.0.1:8700/api/v1/tokens",
    "http://127.1/",
    "http://2130706433/",
    "http://[::1]:22/",
    "http://[::ffff:127.0.0.1]/",
    "http://10.0.0.1/",
    "http://192.168.1.1/",
    "http://[fd00::1]/",
    "http://localhost:8080/",
    "http://0.0.0.0/",
]


def fleet(live: LiveControlPlane) -> None:
    """demo:v1 and demo:v2, host gpu-1 with 8 GPUs, deployment web of v1 with 2 instances."""
    for version, seed in (("v1", 1), ("v2", 7)):
        body = {"version": version, "source_uri": "/nonexistent",
                "manifest": manifest("config.json", "model.safetensors", seed=seed)}  # fmt: skip
        registered = live.call("POST", f"{V}/models/demo/versions", live.admin, json=body)
        assert registered.status_code == 201, registered.text
    agent = live.register("gpu-1")
    assert live.heartbeat(agent, gpus=[gpu(i) for i in range(8)]).status_code == 200
    body = {"name": "web", "model": "demo", "version": "v1", "placement": {"hosts": ["gpu-1"]},
            "instances_per_host": 2}  # fmt: skip
    created = live.call("POST", f"{V}/deployments", live.admin, json=body)
    assert created.status_code == 201, created.text


def rollouts(live: LiveControlPlane) -> RolloutController:
    (found,) = [c for c in live.app.state.controllers.controllers if c.name == "rollouts"]
    assert isinstance(found, RolloutController)
    return found


def sender(live: LiveControlPlane, **options: Any) -> Notifier:
    """The controller's sender with OPTIONS (by default two attempts 10 ms apart), in its
    place."""
    controller = rollouts(live)
    controller.notifier.close()
    options = {"backoff_s": (0.01,), **options}
    controller.notifier = Notifier(controller._notice_failed, **options)
    return controller.notifier


def roll_out(live: LiveControlPlane, token: str, notify: str) -> httpx.Response:
    body = {"to": "v2", "policy": {"notify": notify}}
    return live.call("POST", f"{V}/deployments/web/rollout", token, json=body)


def failures(live: LiveControlPlane, token: str) -> dict[int, str]:
    """The `rollout.notify_failed` events a viewer reads: message by rollout."""
    params = {"kind": "rollout.notify_failed"}
    items = live.call("GET", f"{V}/events", token, params=params).json()["items"]
    return {item["data"]["rollout"]: item["message"] for item in items}


# --- what viewers read ---------------------------------------------------------------------------


def test_viewers_and_operators_see_only_the_webhooks_scheme_and_host(
    live: LiveControlPlane,
) -> None:
    fleet(live)
    viewer, operator = live.token("viewer"), live.token("operator")
    policy = {"rollout_policy": {"notify": SECRET_HOOK, "interval_s": 60}}
    assert live.call("PATCH", f"{V}/deployments/web", live.admin, json=policy).status_code == 200
    started = live.call("POST", f"{V}/deployments/web/rollout", operator, json={"to": "v2"})
    assert started.status_code == 201, started.text
    paths = [f"{V}/deployments", f"{V}/deployments/web", f"{V}/deployments/web/rollout",
             f"{V}/deployments/web/rollouts", f"{V}/events",
             f"{V}/deployments/web/rollouts/{started.json()['id']}"]  # fmt: skip
    answers = {
        f"{who}'s GET {path}": live.call("GET", path, token).text
        for who, token in (("viewer", viewer), ("operator", operator))
        for path in paths
    }
    answers["operator's POST"] = started.text
    leaks = [
        f"{s} in {where}" for where, text in answers.items() for s in HOOK_SECRETS if s in text
    ]
    assert leaks == []
    shown = live.call("GET", f"{V}/deployments/web/rollout", viewer).json()["policy"]["notify"]
    assert shown == "https://hooks.example.com/…"
    whole = live.call("GET", f"{V}/deployments/web", live.admin).json()["rollout_policy"]["notify"]
    assert whole == SECRET_HOOK
    # What viewers see cannot be saved back over the real URL by mistake.
    back = {"rollout_policy": {"notify": shown}}
    refused = live.call("PATCH", f"{V}/deployments/web", operator, json=back)
    assert refused.status_code == 422 and "give the whole URL" in refused.text


def test_events_written_before_the_fix_show_viewers_no_whole_webhook_url(
    live: LiveControlPlane,
) -> None:
    # An event log from before: the policy change and a failed delivery with the whole URL.
    with Session(live.engine) as session:
        session.add(Event(time=live.clock(), actor="admin", kind="deployment.updated",
                          subject="deployment/web", message=f"notify set to {SECRET_HOOK}",
                          data={"rollout_policy": {"notify": SECRET_HOOK}}))  # fmt: skip
        session.add(Event(time=live.clock(), actor="controller", kind="rollout.notify_failed",
                          subject="deployment/web", data={"url": [SECRET_HOOK]},
                          message=f"webhook {SECRET_HOOK}: 500"))  # fmt: skip
        session.commit()
    for token in (live.token("viewer"), live.token("operator")):
        seen = live.call("GET", f"{V}/events", token)
        assert seen.status_code == 200
        assert [s for s in HOOK_SECRETS if s in seen.text] == []
        (updated,) = [e for e in seen.json()["items"] if e["kind"] == "deployment.updated"]
        assert updated["data"] == {"rollout_policy": {"notify": "https://hooks.example.com/…"}}
    # The admin's audit log keeps what happened.
    assert live.call("GET", f"{V}/events", live.admin).text.count(SECRET_HOOK) == 4


def test_no_log_line_carries_the_webhooks_password_or_query(tmp_path: Path) -> None:
    root, chatty = logging.getLogger(), [logging.getLogger(n) for n in ("httpx", "httpcore")]
    saved = root.handlers[:], root.level, [c.level for c in chatty]
    stream = io.StringIO()
    configure_logging("debug", "kv", stream)
    try:
        with LoopbackServer(lambda seen: (500, {}, b"no")) as receiver:
            hook = (
                f"http://hook-user:hook-pass@127.0.0.1:{receiver.port}/PathSecret?sig=QuerySecret"
            )
            notifier = Notifier(lambda notice, error: None, allow_private=True, backoff_s=(0.01,))
            notifier.send(hook, {"rollout": 1})
            notifier.close()
            assert len(receiver.seen) == 2 and receiver.seen[0].path.endswith("QuerySecret")
        logging.getLogger("dctl.test").info("a URL logged whole: %s", hook)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for logger, level in zip(chatty, saved[2], strict=True):
            logger.setLevel(level)
    out = stream.getvalue()
    assert "rollout notification to http://127.0.0.1/\\u2026, attempt 2, failed: HTTP 500" in out
    assert "http://***@127.0.0.1" in out  # the formatter, for a URL logged by hand
    assert [s for s in ("hook-pass", "QuerySecret") if s in out] == []


# --- where the POST may go ----------------------------------------------------------------------


def test_a_webhook_to_a_private_address_is_refused_with_the_setting_that_allows_it(
    live: LiveControlPlane,
) -> None:
    fleet(live)
    operator = live.token("operator")
    for url in PRIVATE_URLS:
        started = roll_out(live, operator, url)
        assert started.status_code == 422, (url, started.text)
        assert "policy.notify" in started.text and "notify_allow_private" in started.text
        patch = {"rollout_policy": {"notify": url}}
        patched = live.call("PATCH", f"{V}/deployments/web", operator, json=patch)
        assert patched.status_code == 422, (url, patched.text)
        assert "rollout_policy.notify" in patched.text and "notify_allow_private" in patched.text
    assert live.call("GET", f"{V}/deployments/web/rollouts", operator).json() == []


@pytest.fixture
def private_allowed(db_url: str) -> Iterator[LiveControlPlane]:
    """A control plane with `notify_allow_private = true`."""
    yield from serve(db_url, notify_allow_private=True)


def test_notify_allow_private_lets_an_admin_send_webhooks_inside(
    private_allowed: LiveControlPlane,
) -> None:
    fleet(private_allowed)
    with LoopbackServer(lambda seen: (204, {}, b"")) as receiver:
        started = roll_out(private_allowed, private_allowed.admin, f"{receiver.url}/hook")
        assert started.status_code == 201, started.text
        rollouts(private_allowed).tick(private_allowed.clock())
        rollouts(private_allowed).notifier.close()
        assert [seen.path for seen in receiver.seen] == ["/hook"]


def test_a_name_that_resolves_to_a_private_address_gets_no_request(
    live: LiveControlPlane,
) -> None:
    fleet(live)
    with LoopbackServer(lambda seen: (204, {}, b"")) as receiver:
        # Names are judged when sent, by every address they have: one private one is enough.
        dns = FakeDns({"hooks.rebind.test": ["93.184.216.34", "127.0.0.1"]})
        sender(live, resolve=dns)
        started = roll_out(
            live, live.token("operator"), f"http://hooks.rebind.test:{receiver.port}/"
        )
        assert started.status_code == 201, started.text
        rollouts(live).tick(live.clock())
        rollouts(live).notifier.close()
        assert receiver.seen == [] and dns.asked == ["hooks.rebind.test"]
    (message,) = failures(live, live.token("viewer")).values()
    assert "refused" in message and "notify_allow_private" in message
    assert "1 attempt)" in message  # refused for good: no retries


def test_the_post_goes_to_the_address_checked_with_the_name_in_host_sni_and_certificate(
    live: LiveControlPlane, tmp_path: Path
) -> None:
    fleet(live)
    server_tls, client_tls = tls_for("hooks.pinned.test", tmp_path)
    with https_receiver(server_tls) as (port, seen):
        # The system resolver knows no `.test` name: a request that arrives went where the
        # check looked, and its TLS handshake was for the name (the certificate has no IP).
        dns = FakeDns({"hooks.pinned.test": ["127.0.0.1"]})
        sender(live, resolve=dns, verify=client_tls, allow_private=True)
        hook = f"https://hook-user:hook-pass@hooks.pinned.test:{port}/hook?sig=QuerySecret"
        assert roll_out(live, live.admin, hook).status_code == 201
        rollouts(live).tick(live.clock())
        rollouts(live).notifier.close()
        (post,) = seen
    assert dns.asked == ["hooks.pinned.test"]
    assert post.headers["host"] == f"hooks.pinned.test:{port}"
    assert post.path == "/hook?sig=QuerySecret"
    assert post.authorization == "Basic aG9vay11c2VyOmhvb2stcGFzcw=="  # hook-user:hook-pass
    assert failures(live, live.admin) == {}


# --- what comes back ----------------------------------------------------------------------------


def test_the_event_log_tells_no_closed_port_from_an_open_one_nor_one_status_from_another(
    live: LiveControlPlane,
) -> None:
    notifier = sender(live, allow_private=True)
    answer = {
        500: (500, {}, b"Internal Server Error: stack trace"),
        503: (503, {"Retry-After": "1"}, b""),
        404: (404, {}, b"no such hook"),
        401: (401, {}, b""),
    }
    with (
        LoopbackServer(lambda seen: (200, {}, b"")) as elsewhere,
        LoopbackServer(lambda seen: answer[int(seen.path.strip("/"))]) as statuses,
        LoopbackServer(lambda seen: (302, {"Location": f"{elsewhere.url}/"}, b"")) as redirect,
        raw_receiver(b"SSH-2.0-OpenSSH_9.6\r\n") as ssh,
        raw_receiver(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n") as half,
    ):
        targets = {
            1: f"http://127.0.0.1:{closed_port()}/",
            2: f"http://127.0.0.1:{ssh}/",
            3: f"http://127.0.0.1:{half}/",
            4: f"{statuses.url}/500",
            5: f"{statuses.url}/503",
            6: f"{statuses.url}/404",
            7: f"{statuses.url}/401",
            8: f"{redirect.url}/",
        }
        for rollout, url in targets.items():
            notifier.send(url, {"deployment": "web", "rollout": rollout, "event": "state"})
        notifier.close()
        assert elsewhere.seen == []  # redirects are not followed
    said = failures(live, live.token("viewer"))
    assert said[1] == said[2] == said[3]
    assert said[4] == said[5] and said[6] == said[7]
    assert said[1].endswith("failed: unreachable (2 attempts)")
    assert said[4].endswith("failed: HTTP 5xx (2 attempts)")
    assert said[6].endswith("failed: HTTP 4xx (2 attempts)")
    assert said[8].endswith("failed: HTTP 3xx (2 attempts)")


def test_a_huge_answer_is_not_read(live: LiveControlPlane) -> None:
    notifier = sender(live, allow_private=True)
    size = 128 * MIB
    chunks = (b"\0" * MIB for _ in range(size // MIB))
    with LoopbackServer(lambda seen: (200, {"Content-Length": str(size)}, chunks)) as receiver:
        notifier.send(f"{receiver.url}/", {"deployment": "web", "rollout": 1, "event": "state"})
        notifier.close()
        assert len(receiver.seen) == 1
    # What the sockets' buffers took before the sender hung up; the body is never read.
    assert receiver.bytes_sent < 16 * MIB
    assert failures(live, live.admin) == {}


def test_a_slow_receiver_does_not_hold_up_another_rollouts_notifications(
    live: LiveControlPlane,
) -> None:
    deadline_s = 3.0
    notifier = sender(live, allow_private=True, deadline_s=deadline_s, backoff_s=())
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    with (
        raw_receiver(head, drip_s=0.2) as slow,
        LoopbackServer(lambda seen: (204, {}, b"")) as fast,
    ):
        notifier.send(f"http://127.0.0.1:{slow}/", {"deployment": "a", "rollout": 1})
        notifier.send(f"{fast.url}/", {"deployment": "b", "rollout": 2})
        # While the slow receiver still holds its attempt, the other rollout's notice is there.
        assert wait_until("the other rollout's notice", lambda: fast.seen) < deadline_s
        # The drip does not stretch the attempt: it ends at the deadline, not minutes later.
        took = wait_until("the slow receiver's failure", lambda: failures(live, live.admin))
        assert took < 2 * deadline_s
        notifier.close()
    assert failures(live, live.admin) == {1: "notification to http://127.0.0.1/… failed: "
                                              "unreachable (1 attempt)"}  # fmt: skip
