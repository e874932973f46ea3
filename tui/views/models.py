"""`:models`: models and their versions as a tree (base -> diffusion -> finetune), with digest,
size, memory plan, and the deployments and hosts that hold each version."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from client import AsyncControlPlaneClient
from protocol.rest import DeploymentOut, HostOut, ModelOut, VersionOut
from protocol.version_ref import VersionRef
from protocol.wire import MemoryPlan
from tui import fetch
from tui import format as fmt
from tui.fetch import ModelsData
from tui.views.base import ViewScreen
from tui.widgets.cells import plain

_LINE_STYLE = {"base": "cyan", "diffusion": "magenta", "finetune": "green"}


def plan_text(plan: MemoryPlan | None) -> str:
    """`mem 14.0 GiB + 96.0 KiB/tok`, or N/A without a plan."""
    if plan is None:
        return f"mem {fmt.NA}"
    fixed = plan.weights_bytes + plan.activation_bytes
    return f"mem {fmt.size(fixed)} + {fmt.size(plan.kv_bytes_per_token)}/tok"


def holders(
    model: str, version: VersionOut, deployments: list[DeploymentOut], hosts: list[HostOut]
) -> str:
    """`web (stable) · gpu-1, gpu-2`: deployments running the version and hosts holding it."""
    used = [
        f"{d.name} ({'stable' if d.version == version.version else 'canary'})"
        for d in deployments
        if d.model == model and version.version in (d.version, d.canary_version)
    ]
    digest = version.digest.removeprefix("sha256:")
    held = [
        h.name
        for h in hosts
        if h.facts and any(s.removeprefix("sha256:") == digest for s in h.facts.snapshots)
    ]
    return f"{', '.join(used) or 'no deployment'} · {', '.join(held) or 'on no host'}"


def version_label(
    model: str, version: VersionOut, deployments: list[DeploymentOut], hosts: list[HostOut]
) -> Text:
    """One version's line in the tree."""
    text = Text(version.version, style="bold")
    text.append(f" {version.line}", style=_LINE_STYLE.get(version.line, ""))
    if version.deprecated:
        text.append(" deprecated", style="dim")
    text.append(f"  {fmt.short_digest(version.digest)}  {fmt.size(version.total_bytes)}")
    text.append(f"  {plan_text(version.memory_plan)}  ")
    text.append(holders(model, version, deployments, hosts), style="dim")
    return text


def lineage(model: ModelOut) -> dict[str | None, list[VersionOut]]:
    """The versions by parent VERSION (None: no parent in this model), oldest first."""
    known = {v.version for v in model.versions}
    children: dict[str | None, list[VersionOut]] = defaultdict(list)
    for version in model.versions:
        parent = None
        if version.parent:
            ref = VersionRef.parse(version.parent)  # the control plane wrote it
            parent = ref.version if ref.model == model.name and ref.version in known else None
        children[parent].append(version)
    return children


class ModelsScreen(ViewScreen):
    """The model tree, rebuilt on each refresh, fully expanded."""

    TITLE = "models"

    def body(self) -> ComposeResult:
        """One tree."""
        tree: Tree[str] = Tree("models", id="models")
        tree.show_root = False
        yield tree

    async def fetch(self, client: AsyncControlPlaneClient) -> ModelsData:
        """Models, deployments, hosts."""
        return await fetch.models(client)

    def show(self, data: ModelsData) -> None:
        """Rebuild the tree."""
        tree: Tree[str] = self.query_one("#models", Tree)
        tree.clear()
        for model in data.models:
            node = tree.root.add(
                plain(Text.assemble((model.name, "bold"), f"  {len(model.versions)} versions")),
                data=model.name,
                expand=True,
            )
            self._add_versions(node, model, lineage(model), None, data)
        tree.root.expand()

    def _add_versions(
        self,
        node: TreeNode[str],
        model: ModelOut,
        children: dict[str | None, list[VersionOut]],
        parent: str | None,
        data: ModelsData,
    ) -> None:
        """Add the versions whose parent is PARENT under NODE, and theirs under them."""
        for version in children.get(parent, []):
            label = version_label(model.name, version, data.deployments, data.hosts)
            ref = str(VersionRef(model.name, version.version))
            child = node.add(plain(label), data=ref, expand=True)
            if children.get(version.version):
                self._add_versions(child, model, children, version.version, data)
            else:
                child.allow_expand = False
