"""The one rule for text another machine sends to an operator's terminal: the API refuses
control characters, the printers strip them (and whole escape sequences with what they carry)."""

from __future__ import annotations

import pytest

from protocol.plain_text import printable, refuse_control_characters

OSC_TITLE = "\x1b]0;pwned\x07"
ERASE_LINE = "\x1b[1A\x1b[2K"
OSC_LINK = "\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\"
C1_CSI = "\x9b2J"


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        (f"a{OSC_TITLE}b", "ab"),  # the title goes with its sequence, not printed as text
        (f"a{ERASE_LINE}b", "ab"),
        (OSC_LINK, "click"),  # the link's text stays, its URL goes
        (f"a{C1_CSI}b", "ab"),
        ("\x1b]0;no terminator", ""),
        ("\x1b(Bok", "ok"),
        ("nul\x00 del\x7f bell\x07", "nul del bell"),
        ("two\nlines\r\nhere", "two lines  here"),  # words stay apart on one line
    ],
)
def test_printable_strips_escape_sequences_and_control_characters(sent: str, shown: str) -> None:
    assert printable(sent) == shown


@pytest.mark.parametrize(
    "text", ["", "gpu-1", "tab\tok", "[bold red]x[/]", "NVIDIA H100 80GB HBM3", "ünï©ødé ✓"]
)
def test_printable_leaves_plain_text_and_markup_alone(text: str) -> None:
    # Markup is harmless text here: printers show it with rich's Text, never parse it.
    assert printable(text) == text


@pytest.mark.parametrize("text", [OSC_TITLE, ERASE_LINE, OSC_LINK, C1_CSI, "a\nb", "\x7f", "\x00"])
def test_the_api_rule_refuses_every_control_character(text: str) -> None:
    with pytest.raises(ValueError, match="control character U") as refused:
        refuse_control_characters(text)
    message = str(refused.value)  # what the API's 422 says after the field's name
    assert "control character U+" in message and "printable text" in message
    assert "pwned" not in message  # the value is not echoed back


@pytest.mark.parametrize("text", ["", "tab\tok", "[link=http://x]y[/link]", "ünï©ødé ✓"])
def test_the_api_rule_takes_printable_text(text: str) -> None:
    assert refuse_control_characters(text) == text
