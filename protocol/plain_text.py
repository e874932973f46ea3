"""Plain text: strings that other machines send and an operator's terminal shows.

An agent chooses its labels, facts, GPU names and instance messages; the CLI and the TUI print
them. A control character among them is an instruction to the terminal (set the window title,
move the cursor up and erase a line, plant a hyperlink), so both ends guard against it:

- `refuse_control_characters`, the rule of `protocol.wire.PlainText` (the type of such fields
  in API bodies), refuses control characters (C0 but tab, DEL, C1): 422 naming the field;
- `printable()` strips them from anything a server sent before it is printed, so rows stored
  before the API refused them (or written by an older control plane) are shown inert too.

Rich markup (`[bold]`, `[link=...]`) is not a control character: whoever prints server text
prints it as text, never as markup (a rich `Text`, not a markup string). The standard library
only: the CLI imports this module before it needs pydantic or rich.
"""

from __future__ import annotations

import re

# C0 but tab (a tab is whitespace a person typed; Rich expands it), DEL and C1.
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
# A whole escape sequence, so that what it carries (a title, a URL) goes with it rather than
# being printed as text: CSI (ESC [ or C1 CSI) up to its final byte; OSC, DCS, SOS, PM and APC up
# to their terminator (BEL or ST) or the end of the string; any other ESC with its
# intermediates and final byte.
ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
# Line breaks become a blank, so the words on either side stay apart on one line.
_BLANKS = str.maketrans({"\n": " ", "\r": " ", "\v": " ", "\f": " "})


def printable(text: str) -> str:
    """TEXT with escape sequences and other control characters removed (line breaks as a
    blank); what the CLI and the TUI do to every string a server sent before printing it."""
    if not CONTROL_CHARACTER.search(text):
        return text
    return CONTROL_CHARACTER.sub("", ESCAPE_SEQUENCE.sub("", text).translate(_BLANKS))


def refuse_control_characters(value: str) -> str:
    """VALUE if it holds no control character (tab allowed); else ValueError saying which."""
    found = CONTROL_CHARACTER.search(value)
    if found is not None:
        # The value itself is not echoed: it is what a terminal must not receive.
        raise ValueError(
            f"control character U+{ord(found.group()):04X} at position {found.start()}: "
            "send printable text (no escape sequences or line breaks; tab is allowed)"
        )
    return value
