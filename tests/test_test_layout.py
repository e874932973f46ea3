"""Test helpers live in conftest.py files and helper modules (`tests/clock.py`,
`tests/controlplane/fleet.py`, ...), never in a test module another one imports: importing a
`test_*` module ties one test file to another's internals and, imported as a module, makes pytest
collect and run its tests a second time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "bench")


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a file imports, relative imports made absolute; for
    `from M import N` both M and M.N, since N may be a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def is_test_module(dotted: str) -> bool:
    """Whether a dotted name reaches into a `test_*` module."""
    return any(part.startswith("test_") for part in dotted.split("."))


def offenders(root: Path = ROOT) -> list[str]:
    """One line per import of a `test_*` module under tests/ and bench/, naming file and line."""
    problems: list[str] = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            relpath = path.relative_to(root).as_posix()
            reported: set[int] = set()
            for line, dotted in imported_modules(path, root):
                if is_test_module(dotted) and line not in reported:
                    reported.add(line)
                    problems.append(
                        f"{relpath}:{line} imports {dotted}: move what it needs into a "
                        "conftest.py or a helper module (a name without the test_ prefix)"
                    )
    return problems


def test_no_module_imports_a_test_module() -> None:
    assert offenders() == []


def test_the_scan_reads_the_test_tree() -> None:
    """Guards the rule above against passing because it found nothing to read."""
    scanned = [p for folder in SCANNED for p in (ROOT / folder).rglob("test_*.py")]
    assert len(scanned) > 100
    assert any(dotted == "tests.clock.FakeClock" for p in scanned for _, dotted in
               imported_modules(p, ROOT))  # fmt: skip


@pytest.mark.parametrize(
    ("relpath", "source", "named"),
    [
        ("tests/tune/test_a.py", "from tests.cli.test_commands import register_host\n",
         "tests.cli.test_commands"),
        ("tests/gateway/test_a.py", "import tests.test_layering\n", "tests.test_layering"),
        ("tests/engine/test_a.py", "from tests.engine import test_config\n",
         "tests.engine.test_config"),
        ("tests/engine/test_a.py", "from .test_config import qwen3_moe\n",
         "tests.engine.test_config"),
        ("tests/engine/test_a.py", "from . import test_config\n", "tests.engine.test_config"),
        ("tests/agent/helpers.py", "def f():\n    from tests.security.test_tls import x\n",
         "tests.security.test_tls"),
        ("bench/run.py", "import importlib\nimportlib.import_module('tests.cli.test_commands')\n",
         "tests.cli.test_commands"),
    ],
)  # fmt: skip
def test_an_import_of_a_test_module_is_named(
    tmp_path: Path, relpath: str, source: str, named: str
) -> None:
    for folder in SCANNED:
        (tmp_path / folder).mkdir()
    target = tmp_path / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    [problem] = offenders(tmp_path)
    assert problem.startswith(f"{relpath}:") and f"imports {named}" in problem, problem


def test_helper_modules_and_conftest_imports_pass(tmp_path: Path) -> None:
    for folder in SCANNED:
        (tmp_path / folder).mkdir()
    (tmp_path / "tests" / "controlplane").mkdir()
    (tmp_path / "tests" / "controlplane" / "test_a.py").write_text(
        "import pytest\nfrom tests.clock import FakeClock\n"
        "from tests.controlplane.conftest import Api, deploy\n"
        "from tests.controlplane.fleet import beat\nfrom .fleet import report\n"
        "from tests import uvicorn_thread\nfrom engine.testing import x\n"
    )
    (tmp_path / "bench" / "gateway.py").write_text("from tests.gateway.canned_engine import E\n")
    assert offenders(tmp_path) == []
