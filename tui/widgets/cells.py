"""Table cells and panel lines as coloured Rich text: a value in its health colour, gauges,
sparklines and progress bars; `plain` for whatever holds text a server sent."""

from __future__ import annotations

from rich.text import Text

from protocol.plain_text import CONTROL_CHARACTER, printable
from tui import format as fmt
from tui.health import STYLE, Level


def plain(value: str | Text) -> Text:
    """VALUE as the TUI shows text a server sent: a str as one line of text (never markup), a
    Text built here with its line breaks and styles kept; control characters stripped either
    way (`printable`), so an agent's string cannot drive the terminal."""
    if isinstance(value, str):
        return Text(printable(value))
    if not CONTROL_CHARACTER.search(value.plain.replace("\n", "")):
        return value
    # Cut at every style boundary and around every line break, clean each piece: the styles
    # stay on their characters and the panel keeps its lines.
    text = value.plain
    cuts = {o for span in value.spans for o in (span.start, span.end)}
    cuts |= {o for i, c in enumerate(text) if c == "\n" for o in (i, i + 1)}
    pieces = value.divide(sorted(cuts))
    for piece in pieces:
        if piece.plain != "\n":
            piece.plain = printable(piece.plain)
    return value.blank_copy().join(pieces)


def styled(value: str, level: Level) -> Text:
    """VALUE in the colour of LEVEL."""
    return Text(value, style=STYLE[level])


def gauge(fraction: float | None, level: Level, width: int = 10, label: str = "") -> Text:
    """A bar of WIDTH cells filled to FRACTION in LEVEL's colour, then LABEL."""
    text = Text(fmt.bar(fraction, width), style=STYLE[level] if fraction is not None else "dim")
    if label:
        text.append(f" {label}")
    return text


def spark(
    values: list[float], width: int = 20, top: float | None = None, style: str = "cyan"
) -> Text:
    """A sparkline of the last WIDTH values, or a dim dash when there are none yet."""
    line = fmt.sparkline(values, width, top)
    return Text(line, style=style) if line else Text(fmt.NONE, style="dim")


def progress(
    step: int, steps: int, weight: int, width: int = 20, served: float | None = None
) -> Text:
    """`step k/n` with a bar of the steps done and the canary's current weight, with the share
    of requests it was SERVED when known (`20% (served 2%)`)."""
    fraction = step / steps if steps else 0.0
    text = Text(f"step {step}/{steps} ")
    text.append(fmt.bar(fraction, width), style="green")
    text.append(f" {fmt.served(weight, served)}")
    return text
