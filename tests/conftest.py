"""How the suite is split: markers by directory, and which tests share a pytest-xdist worker.

Markers (registered in pyproject.toml): `e2e` for every test that starts real processes
(control plane, agents, engine servers and their ranks, gateways, sshd, Prometheus), `fuzz` for the
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
# host, servers under load), sshd, an engine's ranks (a process each), real agent processes.
E2E_MODULES = frozenset({
    "test_bench_smoke.py", "security/test_provision_revoked_host_key.py",
    "engine_server/test_parallel_serve.py", "engine_parallel/test_rank_failures.py",
    "agent/test_cli_agent.py", "security/test_agent_poisoned_desired_state.py",
    "security/test_agent_secret_exposure.py", "security/test_agent_local_source_guessing.py",
    "test_bench_gpu_vllm_backend.py",
    # An engine server process each (as engine_server's), and a control plane with one.
    "security/test_engine_hostile_headers.py", "security/test_engine_request_limits.py",
    "security/test_engine_special_token_forgery.py", "tune/test_apply.py", "tune/test_remote.py",
})  # fmt: skip
# Directories whose tests talk to a real engine server process (one per module): e2e for
# `make test-fast`, but spread over the workers test by test, like the rest.
SERVER_PROCESS_DIRS = frozenset({"engine_server"})
# Single tests elsewhere that start a stack (an agent serving engines over TLS).
E2E_TESTS = frozenset({
    "security/test_tls.py::test_an_agent_registers_heartbeats_and_serves_engines_over_https",
})  # fmt: skip
# Single tests that wait out real deadlines by design (a receiver, body or idle connection
# trickling or held for seconds).
SLOW_TESTS = frozenset({
    "security/test_controlplane_rollout_webhook.py::"
    "test_a_slow_receiver_does_not_hold_up_another_rollouts_notifications",
    "security/test_agent_metrics_scrape.py::test_a_trickling_metrics_body_is_dropped_at_the_deadline",
    "gateway/test_proxy.py::test_a_connection_the_openai_client_still_keeps_alive_is_still_open",
})  # fmt: skip
# Modules whose every test is long: training-quality checks of the demo model, models split
# over up to four ranks against one process.
SLOW_MODULES = frozenset({
    "engine_training/test_demo_model.py", "engine_parallel/test_parallel_model.py",
})  # fmt: skip
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
        test = item.nodeid.split("[")[0].removeprefix("tests/")
        if module in SLOW_MODULES or test in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if (
            top in E2E_DIRS
            or top in SERVER_PROCESS_DIRS
            or module in E2E_MODULES
            or test in E2E_TESTS
        ):
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
