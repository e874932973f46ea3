"""Tokens: format, hashed at rest, revocation, expiry, last_used resolution, first admin."""

from __future__ import annotations

import hashlib

import sqlalchemy as sa

from controlplane.bootstrap import ensure_admin_token
from tests.controlplane.conftest import Api


def stored_tokens(api: Api) -> list[dict[str, object]]:
    """The apitoken table as raw rows."""
    with api.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM apitoken"))]


def test_secrets_are_shown_once_and_stored_only_as_sha256(api: Api) -> None:
    created = api.as_admin("POST", "/api/v1/tokens", json={"name": "ci", "role": "operator"})
    assert created.status_code == 201
    secret = created.json()["secret"]
    prefix, key_id, random = secret.split("_", 2)
    assert prefix == "dctl" and key_id == created.json()["id"] and len(random) >= 40
    rows = stored_tokens(api)
    dumped = repr(rows)
    assert secret not in dumped and random not in dumped
    row = next(r for r in rows if r["key_id"] == key_id)
    assert row["secret_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    listed = api.as_admin("GET", "/api/v1/tokens").text
    assert secret not in listed and "secret" not in listed
    events = api.as_admin("GET", "/api/v1/events").text
    assert secret not in events


def test_wrong_secret_with_a_real_id_is_refused(api: Api) -> None:
    secret = api.token("viewer")
    forged = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    assert api.call("GET", "/api/v1/hosts", forged).status_code == 401
    assert api.call("GET", "/api/v1/hosts", secret).status_code == 200


def test_revoked_tokens_stop_working_at_once(api: Api) -> None:
    secret = api.token("operator", name="ci")
    assert api.call("GET", "/api/v1/hosts", secret).status_code == 200
    revoked = api.as_admin("DELETE", "/api/v1/tokens/ci")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    response = api.call("GET", "/api/v1/hosts", secret)
    assert response.status_code == 401 and "revoked" in response.json()["message"]
    assert api.as_admin("DELETE", "/api/v1/tokens/nope").status_code == 404
    names = [t["name"] for t in api.as_admin("GET", "/api/v1/tokens").json()]
    assert "ci" not in names
    every = api.as_admin("GET", "/api/v1/tokens", params={"include_revoked": True}).json()
    assert "ci" in [t["name"] for t in every]


def test_duplicate_names_must_be_revoked_by_id(api: Api) -> None:
    api.token("viewer", name="dup")
    api.token("viewer", name="dup")
    ambiguous = api.as_admin("DELETE", "/api/v1/tokens/dup")
    assert ambiguous.status_code == 409 and "by its id" in ambiguous.json()["message"]


def test_expiry_and_uses_limit_every_role(api: Api) -> None:
    short = api.token("viewer", expires_in_s=3600)
    api.clock.advance(3599)
    assert api.call("GET", "/api/v1/hosts", short).status_code == 200
    api.clock.advance(1)
    expired = api.call("GET", "/api/v1/hosts", short)
    assert expired.status_code == 401 and "expired" in expired.json()["message"]
    twice = api.token("viewer", uses=2)
    assert api.call("GET", "/api/v1/tokens", twice).status_code == 403  # refused: no use spent
    assert [api.call("GET", "/api/v1/hosts", twice).status_code for _ in range(3)] == [
        200,
        200,
        401,
    ]


def test_last_used_is_written_at_most_once_a_minute(api: Api) -> None:
    secret = api.token("viewer", name="reader")

    def last_used() -> object:
        return next(
            t for t in api.as_admin("GET", "/api/v1/tokens").json() if t["name"] == "reader"
        )["last_used_at"]

    api.call("GET", "/api/v1/hosts", secret)
    first = last_used()
    assert first is not None
    api.clock.advance(59)
    api.call("GET", "/api/v1/hosts", secret)
    assert last_used() == first
    api.clock.advance(1)
    api.call("GET", "/api/v1/hosts", secret)
    assert last_used() != first


def test_first_admin_token_is_created_only_once(api: Api) -> None:
    # The fixture already ran ensure_admin_token on this database.
    assert ensure_admin_token(api.engine) is None
    api.as_admin("DELETE", "/api/v1/tokens/admin")
    assert ensure_admin_token(api.engine) is None  # revoked still counts: never re-issued
    assert api.as_admin("GET", "/api/v1/hosts").status_code == 401


def test_admins_cannot_mint_agent_tokens(api: Api) -> None:
    response = api.as_admin("POST", "/api/v1/tokens", json={"name": "a", "role": "agent"})
    assert response.status_code == 422 and response.json()["message"].startswith("role:")


def test_cached_agent_tokens_still_honour_revocation(api: Api) -> None:
    agent = api.register("gpu-1")["agent_token"]
    assert api.heartbeat(agent).status_code == 200  # now cached
    key_id = agent.split("_")[1]
    assert api.as_admin("DELETE", f"/api/v1/tokens/{key_id}").status_code == 200
    assert api.heartbeat(agent).status_code == 401  # this replica forgets at once
    other = api.register("gpu-2")["agent_token"]
    assert api.heartbeat(other).status_code == 200
    # Revoked behind this replica's back (as another replica would): refused at once, since
    # the heartbeat's own write re-checks the token row.
    with api.engine.begin() as conn:
        conn.execute(sa.text("UPDATE apitoken SET revoked_at = created_at WHERE role = 'agent'"))
    refused = api.heartbeat(other)
    assert refused.status_code == 401 and "revoked" in refused.json()["message"]


def test_a_limited_agent_token_spends_a_use_only_on_a_heartbeat_that_commits(api: Api) -> None:
    agent = api.register("gpu-1")["agent_token"]
    with api.engine.begin() as conn:
        conn.execute(sa.text("UPDATE apitoken SET uses_left = 2 WHERE role = 'agent'"))
    assert api.heartbeat(agent, gpus=[{"index": "zero"}]).status_code == 422  # spends nothing
    assert api.heartbeat(agent).status_code == 200
    assert api.heartbeat(agent).status_code == 200
    spent = api.heartbeat(agent)
    assert spent.status_code == 401 and "no uses left" in spent.json()["message"]
