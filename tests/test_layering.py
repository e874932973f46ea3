"""The dependency arrows of DESIGN.md, enforced by parsing every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("controlplane", "agent", "engine", "tui")


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, at module level or inside functions, made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # `from controlplane import wire` imports controlplane.wire.
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    return found


def violations(part: str, module: str, imported: str) -> str | None:
    """Why `module` (in `part`) may not import `imported`, or None when it may."""
    top = imported.split(".")[0]
    if top == "textual" and part != "tui":
        return "only tui imports textual"
    if part == "engine" and top in PARTS and top != "engine":
        return "engine imports none of the other parts"
    if part == "agent":
        if top == "engine":
            return "agent runs the engine as a subprocess, never imports it"
        if top == "tui":
            return "agent never imports tui"
        wire = imported == "controlplane.wire" or imported.startswith("controlplane.wire.")
        if top == "controlplane" and imported != "controlplane" and not wire:
            return "agent imports only controlplane.wire of the control plane"
    cli = module.startswith("controlplane.cli")
    if part == "controlplane" and not cli and top in {"agent", "engine", "tui"}:
        return "controlplane imports neither agent, engine nor tui (only controlplane.cli may)"
    if module == "controlplane.wire" and top not in {"pydantic", "__future__"}:
        import sys

        if top not in sys.stdlib_module_names:
            return "controlplane.wire imports only pydantic and the standard library"
    return None


def all_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for part in PARTS:
        for path in sorted((root / part).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for imported in sorted(imports_of(path, root)):
                reason = violations(part, module, imported)
                if reason:
                    problems.append(f"{module} imports {imported}: {reason}")
    return problems


def test_the_tree_respects_the_layering() -> None:
    assert all_violations() == []


@pytest.mark.parametrize(
    ("relpath", "source", "reason"),
    [
        ("engine/bad.py", "from agent import gpu\n", "engine imports none"),
        ("engine/bad.py", "def f():\n    import controlplane.models\n", "engine imports none"),
        ("agent/bad.py", "from controlplane import models\n", "only controlplane.wire"),
        ("agent/bad.py", "from controlplane.wire import Heartbeat\nimport engine\n", "subprocess"),
        ("controlplane/bad.py", "def f():\n    from engine import LLM\n", "controlplane imports"),
        ("controlplane/bad.py", "import textual\n", "only tui imports textual"),
        ("controlplane/wire.py", "import sqlalchemy\n", "only pydantic"),
        ("agent/sub/bad.py", "from .. import x\nfrom ...controlplane import api\n", "only"),
    ],
)
def test_a_forbidden_import_is_caught(
    tmp_path: Path, relpath: str, source: str, reason: str
) -> None:
    for part in PARTS:
        (tmp_path / part).mkdir()
    target = tmp_path / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    problems = all_violations(tmp_path)
    assert problems, f"{relpath} was not caught"
    assert all(reason in p for p in problems), problems


def test_allowed_imports_pass(tmp_path: Path) -> None:
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "agent" / "ok.py").write_text(
        "from controlplane.wire import Heartbeat\nimport json\n"
    )
    (tmp_path / "controlplane" / "cli").mkdir()
    (tmp_path / "controlplane" / "cli" / "ok.py").write_text("def f():\n    import engine\n")
    (tmp_path / "tui" / "ok.py").write_text("import textual\nfrom controlplane import client\n")
    assert all_violations(tmp_path) == []
