"""Threat: the SQLite store holds every instance's API key (and every token's hash) in clear, and
was created 0644: any user of the control plane's machine could read the keys of every engine.

The store is now created 0600 before SQLite opens it, and SQLite gives its `-wal` and `-shm`
files the database's own mode. A store made by an older version (or copied in) that others may
read is left as it is, but named in a warning with the `chmod 600` to run.

The real store: migrated by the code `dctl server --migrate` runs, then written to by the
control plane served on loopback, under the usual umask 022.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane import migrate
from controlplane.db import make_engine
from tests.security.live_controlplane import serve


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask most systems give a service: new files readable by every user."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_store_and_its_wal_and_shm_files_are_private_to_their_owner(
    tmp_path: Path, umask_022: None
) -> None:
    db = tmp_path / "dctl.db"
    url = f"sqlite:///{db}"
    migrate.upgrade(url)
    for plane in serve(url):
        # A write while the server holds the store open: the WAL and its index exist now.
        plane.token("operator")
        side_files = [db.with_name("dctl.db-wal"), db.with_name("dctl.db-shm")]
        assert all(path.exists() for path in side_files)
        assert {path.name: mode(path) for path in [db, *side_files]} == {
            "dctl.db": 0o600,
            "dctl.db-wal": 0o600,
            "dctl.db-shm": 0o600,
        }


def test_a_store_others_can_read_is_named_in_a_warning_with_the_chmod_to_run(
    tmp_path: Path, umask_022: None, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "old store.db"
    url = f"sqlite:///{db}"
    migrate.upgrade(url)
    db.chmod(0o644)  # as an older dctl created it
    with caplog.at_level(logging.WARNING, logger="controlplane.db"):
        make_engine(url).dispose()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{db} is readable by other users (mode 644) and holds every instance API key: "
        f"run `chmod 600 '{db}'`"
    ]
    assert mode(db) == 0o644  # the operator's file: named, not changed behind their back

    caplog.clear()
    db.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="controlplane.db"):
        make_engine(url).dispose()
    assert not caplog.records
