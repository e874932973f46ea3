"""Threat: an agent's strings drive the operator's terminal through `dctl`.

Labels, host facts, preflight checks, GPU names and instance messages (which also become event
messages) are chosen by whoever runs an agent. Printed raw, `\\x1b]0;...` retitles the terminal
(or tmux pane), cursor-up + erase-line hides lines printed above, OSC 8 plants a hyperlink,
and rich markup styles cells or links them. The database here already holds such strings (rows
written before the API refused them): `dctl host list`, `host show`, `events` and `doctor` run
in a pseudo-terminal must show them inert, with the markup as plain text.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.security.hostile_terminal import (
    HOST,
    assert_inert,
    dctl_env,
    planted_plane,
    run_in_terminal,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`dctl`'s environment against a control plane holding hostile rows."""
    tmp = tmp_path_factory.mktemp("hostile")
    with planted_plane(tmp) as live:
        yield dctl_env(live, tmp)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["host", "list"], 0),
        (["host", "show", HOST], 0),
        (["events"], 0),
        (["doctor"], 1),  # the planted check failed: an error finding
    ],
)
def test_hostile_agent_strings_reach_the_terminal_inert(
    env: dict[str, str], args: list[str], code: int
) -> None:
    exit_code, screen = run_in_terminal(args, env)
    assert exit_code == code, screen.decode(errors="replace")
    assert_inert(screen)
