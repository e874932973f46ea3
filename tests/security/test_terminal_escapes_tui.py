"""Threat: an agent's strings drive the operator's terminal through `dctl tui`, even read-only.

The dashboard shows labels, host facts, preflight checks, GPU names, instance messages and
events. Sent to the terminal as they are, their escape sequences retitle it, erase lines and
plant hyperlinks, and rich markup styles or links cells. The database here already holds such
strings (rows written before the API refused them); `dctl tui --readonly` runs in a
pseudo-terminal through the overview, hosts, a host's detail and the events, and the terminal
must receive none of them as instructions, with the markup shown as plain text.
"""

from __future__ import annotations

from pathlib import Path

from tests.security.hostile_terminal import (
    HOST,
    HOSTILE,
    MARKUP,
    MARKUP_LINK,
    Terminal,
    assert_inert,
    dctl_env,
    planted_plane,
)

# What the hostile strings leave on screen: the link markup, as text.
SHOWN = MARKUP_LINK.encode()
VIEW_NAMES = b"overview hosts deployments models events rollouts"  # the `:` prompt's help


def go_to(terminal: Terminal, view: str) -> int:
    """Switch to VIEW with `:`; where the output stood before."""
    mark = terminal.send(":")
    terminal.wait_for(VIEW_NAMES, since=mark)
    terminal.send(f"{view}\r")
    return mark


def test_hostile_agent_strings_reach_the_terminal_inert_in_the_dashboard(tmp_path: Path) -> None:
    with planted_plane(tmp_path) as live:
        terminal = Terminal(["tui", "--readonly"], dctl_env(live, tmp_path))
        try:
            # The overview: alerts quote the failed check, the last events the hostile one.
            terminal.wait_for(b"last events")
            terminal.wait_for(SHOWN)
            mark = go_to(terminal, "hosts")
            terminal.wait_for(b"heartbeat", since=mark)
            terminal.wait_for(HOST.encode(), since=mark)  # its row: agent version and all
            mark = terminal.send("\r")  # the host's detail: facts, labels, GPUs, checks
            terminal.wait_for(b"preflight", since=mark)
            terminal.wait_for(SHOWN, since=mark)
            terminal.send("\x1b")
            mark = go_to(terminal, "events")
            terminal.wait_for(b"actor", since=mark)
            terminal.wait_for(SHOWN, since=mark)
            terminal.send("\x11")  # ctrl+q
            screen = terminal.finish()
        finally:
            if terminal.proc.poll() is None:
                terminal.proc.kill()
    assert terminal.proc.returncode == 0, screen[-2000:]
    assert_inert(screen, full_screen=True)


def test_a_panel_keeps_its_lines_and_styles_while_the_hostile_text_goes() -> None:
    from rich.text import Text

    from tui.widgets.cells import plain

    panel = Text.assemble(("host ", "bold"), ("ready", "green"))
    panel.append(f"\nlabels zone={HOSTILE}", style="italic")
    panel.append("\nnext line")
    shown = plain(panel)
    assert shown.plain == f"host ready\nlabels zone={MARKUP}click{MARKUP_LINK}\nnext line"
    assert [(s.start, s.end, s.style) for s in shown.spans[:2]] == [
        (0, 5, "bold"),
        (5, 10, "green"),
    ]
    assert {str(s.style) for s in shown.spans[2:]} == {"italic"}  # the line still italic
    assert plain("a\nb").plain == "a b"  # a cell stays one line
