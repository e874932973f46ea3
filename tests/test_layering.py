"""The dependency arrows of DESIGN.md, enforced by parsing every module's imports; and one
exception class per name across the parts."""

from __future__ import annotations

import ast
import builtins
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = (
    "protocol", "runtime", "client", "cli", "controlplane", "gateway", "agent", "engine", "tui",
    "provision", "doctor", "migrations", "monitoring",
)  # fmt: skip
# What each part may import of the project (itself always). `cli` is the composition root.
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    # A contract's validators may check local files (an engine config's TLS key and certificate).
    "protocol": {"runtime"},
    "client": {"protocol", "runtime"},
    "engine": {"protocol", "runtime"},
    "agent": {"protocol", "runtime"},
    # alembic's migrations belong to the control plane's store, which runs them.
    "controlplane": {"protocol", "runtime", "migrations"},
    # Each revision describes the store as it was then: never the control plane's live models.
    "migrations": set(),
    # Files for Prometheus and Grafana, and the code that generates the dashboard.
    "monitoring": set(),
    # Their own processes and tools: they reach the control plane over its REST API only.
    "gateway": {"protocol", "runtime", "client"},
    "provision": {"protocol", "runtime", "client"},
    "doctor": {"protocol", "runtime", "client"},
    "tui": {"protocol", "runtime", "client"},
    "cli": set(PARTS),
}
# Third-party packages a part must stay importable without: the store and the servers' frameworks
# stay out of what runs without them, and only tui (and cli, which starts it) imports textual.
_STORE_AND_SERVERS = {"sqlmodel", "sqlalchemy", "alembic", "fastapi", "torch"}
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "protocol": {"textual"},
    "runtime": {"textual"},
    "client": _STORE_AND_SERVERS | {"textual"},
    "engine": {"textual"},
    "agent": {"textual"},
    "controlplane": {"textual"},
    "gateway": _STORE_AND_SERVERS | {"textual"},
    "provision": _STORE_AND_SERVERS | {"textual"},
    "doctor": _STORE_AND_SERVERS | {"textual"},
    "tui": _STORE_AND_SERVERS,
    "cli": set(),
    "migrations": set(),
    "monitoring": set(),
}
# Parts that may import no third-party package but these (the standard library always): the
# contracts use pydantic (+ pydantic-settings) and PyYAML.
ONLY_THIRD_PARTY: dict[str, set[str]] = {
    "protocol": {"pydantic", "pydantic_settings", "pydantic_core", "yaml"},
    "runtime": {"pydantic", "pydantic_settings", "pydantic_core", "yaml"},
    "migrations": {"alembic", "sqlalchemy"},
    "monitoring": set(),
}


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


def violations(part: str, imported: str) -> str | None:
    """Why a module of `part` may not import `imported`, or None when it may."""
    top = imported.split(".")[0]
    if top in PARTS:
        if top == part or top in ALLOWED[part]:
            return None
        allowed = ", ".join(sorted(ALLOWED[part])) or "nothing"
        return f"{part} imports only {allowed} of the project, not {top}"
    if top in FORBIDDEN_THIRD_PARTY[part]:
        return f"{part} stays importable without {top}"
    only = ONLY_THIRD_PARTY.get(part)
    if only is not None and top not in only and top not in sys.stdlib_module_names:
        also = f" and {', '.join(sorted(only))}" if only else ""
        return f"{part} imports only the standard library{also}"
    return None


def all_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for part in PARTS:
        for path in sorted((root / part).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for imported in sorted(imports_of(path, root)):
                reason = violations(part, imported)
                if reason:
                    problems.append(f"{module} imports {imported}: {reason}")
    return problems


# Inside a part: a package that reaches others of it through one ports module only, which names
# what it uses. (package, its ports module, the packages reached, what may still be imported
# directly: the services' domain errors are the control plane's shared vocabulary.)
PORTS: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    (
        "controlplane.rollouts",
        "controlplane.rollouts.ports",
        ("controlplane.services", "controlplane.planner"),
        ("controlplane.services.errors",),
    ),
]


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


def port_violations(root: Path = ROOT) -> list[str]:
    """Every import that reaches past a package's ports module."""
    problems = []
    for package, port, reached, direct in PORTS:
        for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            if module == port:
                continue
            for imported in sorted(imports_of(path, root)):
                if _within(imported, reached) and not _within(imported, direct):
                    problems.append(f"{module} imports {imported}: {package} uses it via {port}")
    return problems


def test_the_tree_respects_the_layering() -> None:
    assert all_violations() == []


def test_every_part_has_its_rules() -> None:
    assert set(ALLOWED) == set(FORBIDDEN_THIRD_PARTY) == set(PARTS)
    assert all((ROOT / part / "__init__.py").is_file() for part in PARTS)


@pytest.mark.parametrize(
    ("relpath", "source", "reason"),
    [
        ("engine/bad.py", "from agent import gpu\n", "engine imports only protocol"),
        ("engine/bad.py", "def f():\n    import controlplane.models\n", "engine imports only"),
        ("agent/bad.py", "from controlplane import models\n", "agent imports only protocol"),
        ("agent/bad.py", "from protocol.wire import Heartbeat\nimport engine\n", "not engine"),
        ("agent/bad.py", "import provision\n", "not provision"),
        ("controlplane/bad.py", "def f():\n    from engine import LLM\n", "not engine"),
        ("controlplane/bad.py", "from cli import app\n", "not cli"),
        ("controlplane/bad.py", "import textual\n", "controlplane stays importable without"),
        ("controlplane/api/bad.py", "from gateway import app\n", "not gateway"),
        ("protocol/wire.py", "import sqlalchemy\n", "imports only the standard library and"),
        ("protocol/bad.py", "from controlplane import models\n", "protocol imports only runtime"),
        ("runtime/bad.py", "from protocol import wire\n", "runtime imports only nothing"),
        ("runtime/bad.py", "import httpx\n", "imports only the standard library and"),
        ("client/bad.py", "import sqlmodel\n", "without sqlmodel"),
        ("client/bad.py", "from controlplane.models import Host\n", "client imports only"),
        ("tui/bad.py", "from controlplane import db\n", "tui imports only client, protocol"),
        ("tui/bad.py", "import torch\n", "tui stays importable without torch"),
        ("agent/sub/bad.py", "from .. import x\nfrom ...controlplane import api\n", "only"),
        ("gateway/bad.py", "from controlplane import db\n", "gateway imports only client"),
        ("gateway/bad.py", "import sqlalchemy\n", "gateway stays importable without"),
        ("gateway/bad.py", "from agent import gpu\n", "gateway imports only client, protocol"),
        ("gateway/sub/bad.py", "from ...cli import output\n", "not cli"),
        ("provision/bad.py", "from controlplane import models\n", "provision imports only client"),
        ("provision/bad.py", "def f():\n    from agent.settings import X\n", "not agent"),
        ("provision/bad.py", "from cli.exits import fail\n", "not cli"),
        ("provision/bad.py", "import alembic\n", "provision stays importable without"),
        ("doctor/bad.py", "from cli import output\n", "doctor imports only client, protocol"),
        ("doctor/bad.py", "from gateway import routes\n", "not gateway"),
        ("doctor/bad.py", "import fastapi\n", "doctor stays importable without"),
        ("migrations/env.py", "import controlplane.models\n", "migrations imports only nothing"),
        ("migrations/versions/0099_x.py", "from controlplane.db import X\n", "not controlplane"),
        ("migrations/env.py", "import fastapi\n", "the standard library and alembic, sqlalchemy"),
        ("monitoring/grafana/bad.py", "from engine import metrics\n", "monitoring imports only"),
        ("monitoring/bad.py", "import yaml\n", "monitoring imports only the standard library"),
        ("controlplane/bad.py", "from monitoring import ARTEFACTS\n", "not monitoring"),
        ("tui/bad.py", "import migrations\n", "not migrations"),
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
    (tmp_path / "runtime" / "ok.py").write_text("import pydantic_settings\nimport ssl\n")
    (tmp_path / "agent" / "tls.py").write_text("from runtime.tls import client_context\n")
    (tmp_path / "controlplane" / "ok.py").write_text("import sqlmodel\nfrom protocol import wire\n")
    (tmp_path / "gateway" / "ok.py").write_text(
        "import httptools\nfrom client.http import AsyncControlPlaneClient\n"
        "from gateway import routes\nfrom . import balancer\nfrom protocol.gateway import Pool\n"
    )
    (tmp_path / "provision" / "ok.py").write_text(
        "import paramiko\nfrom client.http import ControlPlaneClient\nfrom .ssh import Remote\n"
    )
    (tmp_path / "doctor" / "ok.py").write_text(
        "from client import calls\nfrom protocol import rest\n"
    )
    (tmp_path / "cli" / "parts.py").write_text(
        "def f():\n    from gateway import main\n    import provision.ssh\n    import doctor\n"
        "    import monitoring\n    import migrations\n"
    )
    (tmp_path / "controlplane" / "migrate.py").write_text("import alembic\nimport migrations\n")
    (tmp_path / "migrations" / "env.py").write_text("from alembic import context\nimport typing\n")
    (tmp_path / "migrations" / "r1.py").write_text("import sqlalchemy as sa\nimport secrets\n")
    (tmp_path / "monitoring" / "ok.py").write_text(
        "import json\nfrom importlib import resources\nfrom monitoring.grafana import promql\n"
    )
    assert all_violations(tmp_path) == []


def test_rollouts_reach_the_services_through_their_ports() -> None:
    assert port_violations() == []


@pytest.mark.parametrize(
    "source",
    [
        "from controlplane.services.placement import bump_generation\n",
        "def f():\n    from controlplane.planner import plan_fleet\n",
        "from ..services import traffic\n",
    ],
)
def test_an_import_past_the_ports_is_caught(tmp_path: Path, source: str) -> None:
    rollouts = tmp_path / "controlplane" / "rollouts"
    rollouts.mkdir(parents=True)
    (rollouts / "ports.py").write_text("from controlplane.services import placement\n")
    (rollouts / "ok.py").write_text(
        "from controlplane.rollouts.ports import load_versions\n"
        "from controlplane.services.errors import Invalid\n"
        "from controlplane.models import Rollout\n"
    )
    assert port_violations(tmp_path) == []
    (rollouts / "bad.py").write_text(source)
    problems = port_violations(tmp_path)
    assert problems and all(p.startswith("controlplane.rollouts.bad imports") for p in problems)
    assert all("via controlplane.rollouts.ports" in p for p in problems)


# One exception class per name: an `except Refused` must not read as catching another part's
# `Refused`. Names two parts share on purpose, each with the reason (none today).
SHARED_EXCEPTION_NAMES: dict[str, str] = {}
_BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)


def _base_name(base: ast.expr) -> str:
    while isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def exception_classes(root: Path = ROOT) -> dict[str, list[str]]:
    """Every exception class of the parts, by name: where each is defined (`module:line`).

    By parsing: a class is an exception when a base is a builtin exception, a class found to be
    one (to a fixed point, so subclasses of subclasses count), or a name ending in Error or
    Exception (a third party's: `HTTPException`, `SQLAlchemyError`).
    """
    classes: list[tuple[str, set[str], str]] = []
    for part in PARTS:
        for path in sorted((root / part).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            classes.extend(
                (node.name, {_base_name(b) for b in node.bases}, f"{module}:{node.lineno}")
                for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef)
            )
    found: set[str] = set()
    while True:
        more = {
            name
            for name, bases, _ in classes
            if name not in found
            and any(
                b in _BUILTIN_EXCEPTIONS or b in found or b.endswith(("Error", "Exception"))
                for b in bases
            )
        }
        if not more:
            break
        found |= more
    where: dict[str, list[str]] = {}
    for name, _, at in classes:
        if name in found:
            where.setdefault(name, []).append(at)
    return where


def shared_exception_names(root: Path = ROOT) -> list[str]:
    """Every exception class name defined more than once and not listed as shared on purpose."""
    return [
        f"{name}: {', '.join(at)}"
        for name, at in sorted(exception_classes(root).items())
        if len(at) > 1 and name not in SHARED_EXCEPTION_NAMES
    ]


def test_no_two_exception_classes_share_a_name() -> None:
    assert shared_exception_names() == []
    defined = exception_classes()
    assert all(len(defined.get(name, [])) > 1 for name in SHARED_EXCEPTION_NAMES), "stale entry"


def test_exception_classes_that_share_a_name_are_caught(tmp_path: Path) -> None:
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "runtime" / "a.py").write_text(
        "class Refused(Exception):\n    pass\n\nclass Base(ValueError):\n    pass\n\n"
        "class Gone(Base):\n    pass\n\nclass Plan:\n    pass\n"
    )
    (tmp_path / "agent" / "b.py").write_text("class Plan:\n    pass\n")
    assert shared_exception_names(tmp_path) == []
    (tmp_path / "controlplane" / "api").mkdir()
    (tmp_path / "controlplane" / "api" / "c.py").write_text(
        "from starlette.exceptions import HTTPException\n\n"
        "class Refused(HTTPException):\n    pass\n"
    )
    (tmp_path / "gateway" / "d.py").write_text(
        "import errors\n\nclass Failure(errors.GatewayError):\n    pass\n\n"
        "def f():\n    class Gone(Failure):\n        pass\n"
    )
    assert shared_exception_names(tmp_path) == [
        "Gone: runtime.a:7, gateway.d:7",
        "Refused: runtime.a:1, controlplane.api.c:3",
    ]


# Inside the TUI: its headless core (formatting, health levels, fetching and shaping the data, the
# actions' rules, its settings) imports without textual, so it is tested without a screen; the
# screens and widgets build on it, never the other way round. Packages are listed too: importing
# a module imports its packages first.
TUI_HEADLESS = frozenset({
    "tui", "tui.actions", "tui.actions.canary", "tui.actions.rules", "tui.fetch", "tui.format",
    "tui.health", "tui.link", "tui.settings", "tui.traffic", "tui.widgets", "tui.widgets.cells",
})  # fmt: skip


def _module_path(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def headless_violations(root: Path = ROOT, headless: frozenset[str] = TUI_HEADLESS) -> list[str]:
    """Every import of textual, or of a TUI module outside HEADLESS, by a module in HEADLESS."""
    problems = []
    for module in sorted(headless):
        path = _module_path(root, module)
        if path is None:
            problems.append(f"{module} is listed as headless but does not exist")
            continue
        for imported in sorted(imports_of(path, root)):
            top = imported.split(".")[0]
            if top == "textual":
                problems.append(f"{module} imports {imported}: the TUI's core imports without it")
            elif top == "tui":
                # `from tui.format import duration` also yields `tui.format.duration`, a name.
                target = imported if _module_path(root, imported) else imported.rpartition(".")[0]
                if target not in headless:
                    problems.append(f"{module} imports {imported}: {target} needs textual")
    return problems


def test_the_tui_core_imports_only_itself() -> None:
    assert headless_violations() == []


def test_the_tui_core_imports_with_textual_blocked() -> None:
    # One process for all: with textual blocked, any import of it fails wherever it comes from.
    # tui.app is the control that shows the block works.
    script = (
        "import importlib, json, sys\n"
        "sys.modules['textual'] = None  # `import textual...` now raises ImportError\n"
        "errors = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        errors[name] = str(exc)\n"
        "print(json.dumps(errors))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *sorted(TUI_HEADLESS), "tui.app"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    errors = json.loads(result.stdout)
    assert list(errors) == ["tui.app"], errors


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("from textual.widgets import Static\n", "tui.format imports textual.widgets"),
        ("from tui import dialogs\n", "tui.dialogs needs textual"),
        ("def f():\n    from tui.views.base import View\n", "tui.views.base needs textual"),
        ("from .dialogs import ConfirmDialog\n", "tui.dialogs needs textual"),
    ],
)
def test_a_textual_import_in_the_tui_core_is_caught(
    tmp_path: Path, source: str, reason: str
) -> None:
    tui = tmp_path / "tui"
    (tui / "views").mkdir(parents=True)
    for name in ("__init__.py", "health.py", "dialogs.py", "views/__init__.py", "views/base.py"):
        (tui / name).write_text("")
    headless = frozenset({"tui", "tui.format", "tui.health"})
    (tui / "format.py").write_text("from tui.health import Level\nfrom rich.text import Text\n")
    assert headless_violations(tmp_path, headless) == []
    (tui / "format.py").write_text(source)
    problems = headless_violations(tmp_path, headless)
    assert problems and all(reason in p for p in problems), problems
