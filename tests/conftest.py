"""How the suite is split: markers by directory, and which tests share a pytest-xdist worker.

Markers (registered in pyproject.toml): `e2e` for every test of a directory that starts real
process stacks (control plane, agents, engines, gateways, sshd, Prometheus), `fuzz` for the
property-based fuzzing of the APIs, `slow` for single tests that take long. `make test-fast`
deselects all three.

Under `pytest -n N --dist loadgroup` (`make test`, `make test-fast`) a test with an
`xdist_group` runs on that group's worker. Each e2e directory is one group, so its stack (a
session or module fixture) is built once, not by every worker. A test elsewhere that uses a
module-scoped fixture (a real server, a checkpoint) is grouped with its module's other such
tests for the same reason. Everything else is spread test by test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent

E2E_DIRS = frozenset({"agent_e2e", "gateway_e2e", "rollout_e2e", "provision", "observability"})
# Modules elsewhere that start stacks too: the benchmarks' smoke runs (a fleet, a provisioned
# host, servers under load), sshd.
E2E_MODULES = frozenset({"test_bench_smoke.py", "security/test_provision_revoked_host_key.py"})
# The per-test limit (fixtures included) for e2e tests; pyproject's `timeout` for the rest.
E2E_TIMEOUT_S = 900
FUZZ_MODULES = frozenset({"controlplane/test_fuzz.py", "engine_server/test_fuzz_openapi.py"})
# Tests that must not overlap a directory's tests, so run on its worker: the provisioning
# benchmark creates and deletes the `dctl` service user, as tests/provision's fleet does.
SAME_WORKER_AS = {"test_bench_smoke.py::test_benchmark_smoke[provision.py]": "provision"}


def _shares_module_state(item: pytest.Item) -> bool:
    """Whether ITEM uses a fixture built once per module or class."""
    # pytest keeps the fixtures a test function resolved in `_fixtureinfo` (no public API).
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    definitions = info.name2fixturedefs.values()
    return any(d.scope in ("module", "class", "package") for defs in definitions for d in defs)


# tryfirst: pytest-xdist reads `xdist_group` in its own modifyitems hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of e2e directories and fuzz modules; give each its xdist group."""
    # The `xdist_group` marker exists (for --strict-markers) only where pytest-xdist is installed.
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        relative = item.path.relative_to(TESTS)
        module, top = relative.as_posix(), relative.parts[0]
        if top in E2E_DIRS or module in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)
            # pytest-timeout counts a test's fixtures too: the first test of a stack pays for
            # building it (a provisioned fleet took 170 s alone on CI), more on a shared CPU.
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
        if module in FUZZ_MODULES:
            item.add_marker(pytest.mark.fuzz)
        group = SAME_WORKER_AS.get(item.nodeid.removeprefix("tests/"))
        if group is None and top in E2E_DIRS:
            group = top
        elif group is None and _shares_module_state(item):
            group = module
        if grouping and group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
