"""`KEY=VALUE` labels as people write them: on flags, in env vars, in config files.

One parser for every place a label is typed (`dctl deploy create --label`, `dctl agent --label`,
`DCTL_AGENT_LABELS`), so `gpu = h100` means the same everywhere. Which keys and values are
allowed is the wire's business (`RegisterRequest`, `Placement`), not this module's.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_labels(items: Iterable[str]) -> dict[str, str]:
    """`["gpu=h100", "zone="]` -> `{"gpu": "h100", "zone": ""}`; ValueError names a bad item.

    Blanks around key and value are dropped; the value may be empty and may contain '=' (only
    the first one splits); a repeated key keeps its last value, as a later flag overrides.
    """
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r}: write it as KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels
