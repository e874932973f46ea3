"""The dependency arrows of DESIGN.md, enforced by parsing every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("protocol", "client", "cli", "controlplane", "agent", "engine", "tui")
# What each part may import of the project (itself always). `cli` is the composition root.
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "client": {"protocol"},
    "engine": {"protocol"},
    "agent": {"protocol"},
    # alembic's migrations belong to the control plane's store.
    "controlplane": {"protocol", "migrations"},
    "tui": {"protocol", "client"},
    "cli": set(PARTS) | {"migrations"},
}
# The gateway lives in the control plane's folder but is its own stateless process: it talks to
# the control plane through the REST client only, and nothing else of the control plane may
# lean on it (nor it on the store or the API's frameworks).
GATEWAY = "controlplane.gateway"
GATEWAY_ALLOWED = {"protocol", "client"}
GATEWAY_FORBIDDEN_THIRD_PARTY = {"sqlmodel", "sqlalchemy", "fastapi", "torch", "alembic"}
# Besides the standard library, the contracts use pydantic (+ pydantic-settings) and PyYAML.
PROTOCOL_THIRD_PARTY = {"pydantic", "pydantic_settings", "pydantic_core", "yaml"}


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
            # `from controlplane import wire` imports protocol.wire.
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
    import sys

    top = imported.split(".")[0]
    in_gateway = module == GATEWAY or module.startswith(GATEWAY + ".")
    imports_gateway = imported == GATEWAY or imported.startswith(GATEWAY + ".")
    if in_gateway:
        if top == "controlplane" and not imports_gateway:
            return "the gateway imports only protocol and client of the project"
        if top in {*PARTS, "migrations"} and top not in GATEWAY_ALLOWED | {"controlplane"}:
            return "the gateway imports only protocol and client of the project"
        if top in GATEWAY_FORBIDDEN_THIRD_PARTY:
            return "the gateway stays free of the store, FastAPI and torch"
        return None
    if imports_gateway and part != "cli":
        return "only cli starts the gateway; the control plane never imports it"
    if top == "textual" and part not in {"tui", "cli"}:
        return "only tui imports textual"
    if top in {*PARTS, "migrations"} and top != part and top not in ALLOWED[part]:
        allowed = ", ".join(sorted(ALLOWED[part])) or "nothing"
        return f"{part} imports only {allowed} of the project, not {top}"
    allowed_top = PROTOCOL_THIRD_PARTY | {"protocol", "__future__"}
    if part == "protocol" and top not in allowed_top and top not in sys.stdlib_module_names:
        return "protocol imports only pydantic, PyYAML and the standard library"
    if part in {"client", "tui"} and top in {"sqlmodel", "sqlalchemy", "fastapi", "torch"}:
        return f"{part} stays importable without sqlmodel, sqlalchemy, fastapi and torch"
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
        ("engine/bad.py", "from agent import gpu\n", "engine imports only protocol"),
        ("engine/bad.py", "def f():\n    import controlplane.models\n", "engine imports only"),
        ("agent/bad.py", "from controlplane import models\n", "agent imports only protocol"),
        ("agent/bad.py", "from protocol.wire import Heartbeat\nimport engine\n", "not engine"),
        ("controlplane/bad.py", "def f():\n    from engine import LLM\n", "not engine"),
        ("controlplane/bad.py", "from cli import app\n", "not cli"),
        ("controlplane/bad.py", "import textual\n", "only tui imports textual"),
        ("protocol/wire.py", "import sqlalchemy\n", "only pydantic"),
        ("protocol/bad.py", "from controlplane import models\n", "protocol imports only nothing"),
        ("client/bad.py", "import sqlmodel\n", "without sqlmodel"),
        ("client/bad.py", "from controlplane.models import Host\n", "client imports only"),
        ("tui/bad.py", "from controlplane import db\n", "tui imports only client, protocol"),
        ("tui/bad.py", "import torch\n", "without sqlmodel"),
        ("agent/sub/bad.py", "from .. import x\nfrom ...controlplane import api\n", "only"),
        (
            "controlplane/gateway/bad.py",
            "from controlplane import db\n",
            "only protocol and client",
        ),
        ("controlplane/gateway/bad.py", "import sqlalchemy\n", "free of the store"),
        ("controlplane/gateway/bad.py", "from agent import gpu\n", "only protocol and client"),
        ("controlplane/api/bad.py", "from controlplane.gateway import app\n", "never imports it"),
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
    (tmp_path / "agent" / "ok.py").write_text("from protocol.wire import Heartbeat\nimport json\n")
    (tmp_path / "cli" / "ok.py").write_text("def f():\n    import engine\n    import agent\n")
    (tmp_path / "tui" / "ok.py").write_text("import textual\nfrom client import http\n")
    (tmp_path / "protocol" / "ok.py").write_text("import pydantic\nimport yaml\nimport json\n")
    (tmp_path / "controlplane" / "ok.py").write_text("import sqlmodel\nfrom protocol import wire\n")
    (tmp_path / "controlplane" / "gateway").mkdir()
    (tmp_path / "controlplane" / "gateway" / "ok.py").write_text(
        "import httptools\nfrom client.http import AsyncControlPlaneClient\n"
        "from controlplane.gateway import routes\nfrom . import balancer\n"
    )
    (tmp_path / "cli" / "gw.py").write_text(
        "def f():\n    from controlplane.gateway import serve\n"
    )
    assert all_violations(tmp_path) == []
