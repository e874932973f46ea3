"""Messages the refresh workers post back to their view: data arrived, or the refresh failed."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class DataArrived(Message):
    """A refresh worker fetched its view's data (one of the `tui.fetch` snapshots)."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self.data = data


class RefreshFailed(Message):
    """A refresh worker could not fetch its view's data; `error` says why, for the banner, and
    `unreachable` whether no answer came at all (else the control plane answered an error)."""

    def __init__(self, error: str, unreachable: bool = True) -> None:
        super().__init__()
        self.error = error
        self.unreachable = unreachable
