"""The credentials file: contexts are only ever added, edits are atomic, secrets stay private."""

from __future__ import annotations

import multiprocessing
import stat
import tomllib
from pathlib import Path

import pytest

from client.credentials import Context, CredentialsError, CredentialsFile, resolve


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_add_creates_a_private_file_with_a_current_context(tmp_path: Path) -> None:
    path = tmp_path / "dctl" / "credentials"
    added = CredentialsFile(path).add("http://127.0.0.1:8700", "dctl_abc_secret")
    assert added == Context("default", "http://127.0.0.1:8700", "dctl_abc_secret")
    assert mode(path) == 0o600
    data = tomllib.loads(path.read_text())
    assert data == {
        "current": "default",
        "contexts": {"default": {"url": "http://127.0.0.1:8700", "token": "dctl_abc_secret"}},
    }


def test_a_taken_name_is_never_overwritten(tmp_path: Path) -> None:
    store = CredentialsFile(tmp_path / "credentials")
    store.add("http://a:1", "dctl_a_1")
    second = store.add("http://b:2", "dctl_b_2")
    third = store.add("http://c:3", "dctl_c_3")
    current, contexts = store.load()
    assert (second.name, third.name) == ("default-2", "default-3")
    assert current == "default"
    assert contexts["default"] == Context("default", "http://a:1", "dctl_a_1")
    assert contexts["default-3"].token == "dctl_c_3"


def test_hand_edits_and_comments_survive_add_and_use(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    original = (
        "# my fleets\n"
        'current = "prod"  # the big one\n'
        "\n"
        "[contexts.prod]\n"
        'url = "https://cp.example:8700"\n'
        'token = "dctl_p_x"\n'
        "extra = 1\n"
    )
    path.write_text(original)
    path.chmod(0o600)
    store = CredentialsFile(path)
    store.add("http://127.0.0.1:8700", "dctl_l_y", name="lab")
    store.use("lab")
    text = path.read_text()
    assert text.startswith("# my fleets\n")
    assert "extra = 1" in text and "[contexts.prod]" in text
    current, contexts = store.load()
    assert current == "lab"
    assert contexts["prod"] == Context("prod", "https://cp.example:8700", "dctl_p_x")


def test_use_of_an_unknown_context_names_the_known_ones(tmp_path: Path) -> None:
    store = CredentialsFile(tmp_path / "credentials")
    store.add("http://a:1", "t", name="alpha")
    with pytest.raises(CredentialsError, match=r"no context named 'beta' \(known: alpha\)"):
        store.use("beta")


def test_a_file_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    CredentialsFile(path).add("http://a:1", "dctl_a_1")
    path.chmod(0o644)
    with pytest.raises(CredentialsError, match=r"chmod 600"):
        CredentialsFile(path).load()


def test_broken_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text("current = \n")
    path.chmod(0o600)
    with pytest.raises(CredentialsError, match="not valid TOML") as info:
        CredentialsFile(path).load()
    assert str(path) in str(info.value)


def test_names_and_values_with_odd_characters_round_trip(tmp_path: Path) -> None:
    store = CredentialsFile(tmp_path / "credentials")
    store.add('http://h:1/path?q="x"\\', "tok\u00e9n", name="lab.eu:1")
    _, contexts = store.load()
    assert contexts["lab.eu:1"] == Context("lab.eu:1", 'http://h:1/path?q="x"\\', "tok\u00e9n")
    with pytest.raises(CredentialsError, match="invalid context name"):
        store.add("http://h:1", "t", name="bad name\n")


def _add_one(path: str, i: int) -> None:
    CredentialsFile(Path(path)).add(f"http://h{i}:1", f"dctl_{i}_s", name="ci")


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_one, args=(str(path), i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    _, contexts = CredentialsFile(path).load()
    assert sorted(c.url for c in contexts.values()) == sorted(f"http://h{i}:1" for i in range(8))
    assert mode(path) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_env_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    CredentialsFile(path).add("http://file:1", "dctl_file_x")
    assert resolve(path=path, env={}) == Context("default", "http://file:1", "dctl_file_x")
    got = resolve(path=path, env={"DCTL_TOKEN": "dctl_env_y"})
    assert (got.url, got.token) == ("http://file:1", "dctl_env_y")
    got = resolve(path=tmp_path / "none", env={"DCTL_URL": "http://e:2", "DCTL_TOKEN": "t"})
    assert (got.url, got.token) == ("http://e:2", "t")


def test_the_file_token_is_never_sent_to_another_url(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    CredentialsFile(path).add("http://file:1", "dctl_file_x")
    assert resolve(path=path, env={"DCTL_URL": "http://elsewhere:9"}).token is None
    assert resolve(path=path, env={"DCTL_URL": "http://file:1/"}).token == "dctl_file_x"


def test_no_context_at_all_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="DCTL_URL"):
        resolve(path=tmp_path / "credentials", env={})
    with pytest.raises(CredentialsError, match="no context named 'x'"):
        resolve(path=tmp_path / "credentials", env={"DCTL_CONTEXT": "x"})
