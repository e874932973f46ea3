"""View names for `:` (with tab completion) and the ctrl+p command palette."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from tui.app import DctlApp

# The top-level views, in the order `?` and the palette list them, with what each shows.
VIEWS: dict[str, str] = {
    "overview": "fleet counts, deployments, hosts, active rollouts, events, alerts",
    "hosts": "hosts and their GPUs",
    "deployments": "deployments, their traffic and rollouts",
    "models": "models and versions as a tree",
    "events": "the event log, live",
    "rollouts": "rollout history with outcomes",
}
# Words `:` takes besides view names.
QUIT_WORDS = ("q", "quit")


def complete(text: str) -> str:
    """Tab completion of a view name: the longest common prefix of the names TEXT starts."""
    prefix = text.strip().lower()
    matches = [name for name in VIEWS if name.startswith(prefix)]
    if not matches:
        return text
    common = matches[0]
    for name in matches[1:]:
        while not name.startswith(common):
            common = common[:-1]
    return common


def resolve(text: str) -> str | None:
    """The view a `:` command names (a unique prefix is enough), else None."""
    word = text.strip().lower()
    if word in VIEWS:
        return word
    matches = [name for name in VIEWS if word and name.startswith(word)]
    return matches[0] if len(matches) == 1 else None


class ViewCommands(Provider):
    """The palette's entries: one per view."""

    @property
    def _dctl(self) -> DctlApp:
        from tui.app import DctlApp

        assert isinstance(self.app, DctlApp)
        return self.app

    async def discover(self) -> Hits:
        """Every view, before anything is typed."""
        for name, help_text in VIEWS.items():
            yield DiscoveryHit(f"view: {name}", partial(self._dctl.show_view, name), help=help_text)

    async def search(self, query: str) -> Hits:
        """Views whose name matches QUERY."""
        matcher = self.matcher(query)
        for name, help_text in VIEWS.items():
            score = matcher.match(f"view: {name}")
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(f"view: {name}"),
                    partial(self._dctl.show_view, name),
                    help=help_text,
                )
