"""Threats to the control plane's tokens: a host taken over with a bootstrap token, and a token
with N uses left used more than N times by parallel requests.

Registering a host that exists needs proof: the host's own agent token, or the one-use token an
admin's `dctl host rekey NAME` issues bound to that host; a plain bootstrap token gets 409 and
the host keeps its token. Bootstrap tokens expire after 24 h unless told otherwise. A limited
token's uses are spent by a conditional decrement whose result every path honours, so exactly
N of any number of parallel requests succeed, on SQLite and on PostgreSQL.

Every test talks to a real control plane on loopback (`live_controlplane`), or to a real
`dctl server` through the CLI.
"""

# Fixtures imported from tests/controlplane, tests/cli and live_controlplane are named again by
# the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import sqlalchemy as sa

from tests.cli.conftest import Dctl, Server, dctl, server
from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live


def active_agent_tokens(live: LiveControlPlane, host: str) -> list[dict[str, object]]:
    return [
        t
        for t in live.tokens()
        if t["host"] == host and t["role"] == "agent" and t["revoked_at"] is None
    ]


# --- finding 2: a bootstrap token takes over an existing host ---------------------------------


def test_a_bootstrap_token_cannot_take_over_a_registered_host(live: LiveControlPlane) -> None:
    owner = live.register("gpu-1")
    stolen = live.token("bootstrap", uses=5)
    takeover = live.call("POST", f"{V}/agents/register", stolen, json={"name": "gpu-1"})
    assert takeover.status_code == 409, takeover.text
    message = takeover.json()["message"]
    assert "gpu-1" in message and "dctl host rekey gpu-1" in message
    # Nothing changed: the host's agent keeps its token, the attacker got none, no use spent.
    assert live.heartbeat(owner).status_code == 200
    assert [t["id"] for t in active_agent_tokens(live, "gpu-1")] == [owner.split("_")[1]]
    boot = next(t for t in live.tokens() if t["id"] == stolen.split("_")[1])
    assert boot["uses_left"] == 5
    # A bootstrap token still registers new hosts.
    assert live.register("gpu-2", token=stolen).startswith("dctl_")


def test_a_host_registers_again_only_with_its_own_agent_token(live: LiveControlPlane) -> None:
    old = live.register("gpu-1")
    other = live.register("gpu-2")
    again = live.call("POST", f"{V}/agents/register", old, json={"name": "gpu-1"})
    assert again.status_code == 200, again.text
    new = again.json()["agent_token"]
    assert live.heartbeat(old).status_code == 401  # the old token is revoked
    assert live.heartbeat(new).status_code == 200
    # An agent token re-registers its own host only, and creates none.
    for name in ("gpu-1", "gpu-3"):
        refused = live.call("POST", f"{V}/agents/register", other, json={"name": name})
        assert refused.status_code == 403, refused.text
        assert "bound to (gpu-2)" in refused.json()["message"]
    assert live.heartbeat(new).status_code == 200


def test_an_admin_rekey_token_registers_that_host_once_and_only_it(
    live: LiveControlPlane,
) -> None:
    old = live.register("gpu-1")
    for role in ("viewer", "operator", "bootstrap"):
        refused = live.call("POST", f"{V}/hosts/gpu-1/rekey", live.token(role))
        assert refused.status_code == 403, (role, refused.text)
    assert live.call("POST", f"{V}/hosts/nope/rekey", live.admin).status_code == 404
    first = live.call("POST", f"{V}/hosts/gpu-1/rekey", live.admin).json()["secret"]
    issued = live.call("POST", f"{V}/hosts/gpu-1/rekey", live.admin)
    assert issued.status_code == 201, issued.text
    rekey = issued.json()
    assert (rekey["role"], rekey["host"], rekey["uses_left"]) == ("bootstrap", "gpu-1", 1)
    assert rekey["expires_at"].startswith((live.clock() + timedelta(hours=24)).date().isoformat())
    # Issuing it changes nothing yet; only the newest re-key token works.
    assert live.heartbeat(old).status_code == 200
    stale = live.call("POST", f"{V}/agents/register", first, json={"name": "gpu-1"})
    assert stale.status_code == 401 and "revoked" in stale.json()["message"]
    # Bound to gpu-1: no other name, and that refusal spends nothing.
    elsewhere = live.call("POST", f"{V}/agents/register", rekey["secret"], json={"name": "gpu-2"})
    assert elsewhere.status_code == 403 and "(gpu-1)" in elsewhere.json()["message"]
    new = live.register("gpu-1", token=rekey["secret"])
    assert live.heartbeat(old).status_code == 401
    assert live.heartbeat(new).status_code == 200
    replay = live.call("POST", f"{V}/agents/register", rekey["secret"], json={"name": "gpu-1"})
    assert replay.status_code == 401
    kinds = [e["kind"] for e in live.call("GET", f"{V}/events", live.admin).json()["items"]]
    assert kinds.count("host.rekey_issued") == 2 and "host.reregistered" in kinds


def test_bootstrap_tokens_expire_after_a_day_unless_told_otherwise(
    live: LiveControlPlane,
) -> None:
    forgotten = live.token("bootstrap")
    row = next(t for t in live.tokens() if t["id"] == forgotten.split("_")[1])
    assert row["expires_at"] is not None
    week = live.token("bootstrap", expires_in_s=7 * 86400)
    viewer = live.token("viewer")  # other roles keep no expiry unless asked
    assert next(t for t in live.tokens() if t["id"] == viewer.split("_")[1])["expires_at"] is None
    live.clock.advance(24 * 3600)
    late = live.call("POST", f"{V}/agents/register", forgotten, json={"name": "gpu-1"})
    assert late.status_code == 401 and "expired" in late.json()["message"]
    assert live.register("gpu-1", token=week)


def test_the_cli_rekeys_a_host_and_says_how_to_limit_a_bootstrap_token(
    dctl: Dctl,
    server: Server,
) -> None:
    created = dctl("token", "create", "fleet-boot", "--role", "bootstrap")
    assert created.code == 0, created.stderr
    assert "--uses 1" in created.stderr and "2" in created.stderr  # names the expiry date
    boot = created.stdout.strip()
    auth = {"Authorization": f"Bearer {boot}"}
    reply = httpx.post(f"{server.url}{V}/agents/register", json={"name": "cli-rk"}, headers=auth)
    agent = reply.json()["agent_token"]
    taken = httpx.post(f"{server.url}{V}/agents/register", json={"name": "cli-rk"}, headers=auth)
    assert taken.status_code == 409 and "dctl host rekey cli-rk" in taken.json()["message"]
    single = dctl("token", "create", "one-boot", "--role", "bootstrap", "--uses", "1")
    assert single.code == 0 and "--uses 1" not in single.stderr

    rekeyed = dctl("host", "rekey", "cli-rk")
    assert rekeyed.code == 0, rekeyed.stderr
    secret = rekeyed.stdout.strip()
    assert secret.startswith("dctl_") and "--bootstrap-token-file" in rekeyed.stderr
    again = httpx.post(
        f"{server.url}{V}/agents/register",
        json={"name": "cli-rk"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert again.status_code == 200, again.text
    beat = httpx.post(
        f"{server.url}{V}/agents/heartbeat", json={}, headers={"Authorization": f"Bearer {agent}"}
    )
    assert beat.status_code == 401
    assert dctl("host", "rekey", "no-such-host").code != 0


# --- finding 6: parallel requests spend more uses than a token has -----------------------------


def in_parallel(count: int, request: Callable[[int], int]) -> Counter[int]:
    """Run `request(i)` for i < count on as many threads, released at once; status counts."""
    start = threading.Barrier(count)

    def one(i: int) -> int:
        start.wait()
        return request(i)

    with ThreadPoolExecutor(count) as pool:
        return Counter(pool.map(one, range(count)))


def uses_left(live: LiveControlPlane, secret: str) -> int | None:
    with live.engine.connect() as conn:
        value = conn.execute(
            sa.text("SELECT uses_left FROM apitoken WHERE key_id = :k"), {"k": secret.split("_")[1]}
        ).scalar_one()
    return None if value is None else int(value)


def test_parallel_requests_cannot_use_a_token_more_times_than_it_has_uses(
    live: LiveControlPlane,
) -> None:
    limited = live.token("viewer", uses=5)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        statuses = in_parallel(
            32,
            lambda _: (
                http.get(f"{V}/hosts", headers={"Authorization": f"Bearer {limited}"}).status_code
            ),
        )
    assert statuses == Counter({200: 5, 401: 27})
    assert uses_left(live, limited) == 0


def test_parallel_registrations_cannot_spend_more_uses_than_a_bootstrap_token_has(
    live: LiveControlPlane,
) -> None:
    boot = live.token("bootstrap", uses=3)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        statuses = in_parallel(
            24,
            lambda i: (
                http.post(
                    f"{V}/agents/register",
                    json={"name": f"race-{i}"},
                    headers={"Authorization": f"Bearer {boot}"},
                ).status_code
            ),
        )
    assert statuses == Counter({200: 3, 401: 21})
    hosts = live.call("GET", f"{V}/hosts", live.admin).json()
    assert len(hosts) == 3


def test_parallel_heartbeats_cannot_spend_more_uses_than_an_agent_token_has(
    live: LiveControlPlane,
) -> None:
    agent = live.register("gpu-1")
    with live.engine.begin() as conn:
        conn.execute(sa.text("UPDATE apitoken SET uses_left = 4 WHERE role = 'agent'"))
    with httpx.Client(base_url=live.url, timeout=30) as http:
        statuses = in_parallel(
            20,
            lambda _: (
                http.post(
                    f"{V}/agents/heartbeat", json={}, headers={"Authorization": f"Bearer {agent}"}
                ).status_code
            ),
        )
    assert statuses == Counter({200: 4, 401: 16})
    assert uses_left(live, agent) == 0
