"""Instances as 2-rank groups in a real fleet: a fake 4-GPU host, deployment `demo` with
`--gpus-per-instance 2` and `parallel.size 2` on the CPU (gloo), two instances of two ranks
each, the gateway in front and a steady load. Killing one instance's rank 1 with SIGKILL
restarts that instance and it serves again; `dctl restart` under load fails no request. The
tests share one fleet, in file order."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from tests.agent_e2e.conftest import Stack, boot_stack, wait_for
from tests.processes import alive, worker_ranks
from tests.rollout_e2e.conftest import BASE_CONFIG, RolloutFleet, serving_fleet

HOST = "par-host"
# Ranks are CPU processes (gloo) with one torch thread each: two instances of two ranks on a
# host whose four GPUs are fake.
PARALLEL_CONFIG = {
    **BASE_CONFIG,
    "resources": {"device": "cpu", "threads": 1},
    "parallel": {"size": 2},
}


@pytest.fixture(scope="module")
def parallel_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutFleet]:
    """Deployment `demo` (2 instances x 2 ranks) on demo:v1, a gateway and a steady load."""
    home = tmp_path_factory.mktemp("parfleet")
    stack = boot_stack(home, HOST)
    stack.agent_args = [
        "4xH200" if arg == "2xH200" else arg for arg in stack.agent_args
    ]  # four fake GPUs: two instances of two

    def register(stack: Stack) -> None:
        stack.dctl("model", "create-demo", str(home / "ckpt"), "--random")
        stack.dctl("model", "register", "demo:v1", str(home / "ckpt"))

    with serving_fleet(
        home, stack, register, gpus_per_instance=2, engine_config=PARALLEL_CONFIG,
        load_threads=2, ready_timeout_s=300, host=HOST,
    ) as ro:  # fmt: skip
        yield ro


def engine_pids(ro: RolloutFleet) -> dict[int, int]:
    """Each instance's engine process (its rank 0), by instance id."""
    instances = ro.api.get_deployment("demo").instances
    return {i.id: i.pid for i in instances if i.pid is not None}


def test_each_instance_is_a_two_rank_group_serving_through_the_gateway(
    parallel_fleet: RolloutFleet,
) -> None:
    ro = parallel_fleet
    pids = engine_pids(ro)
    assert len(pids) == 2
    assert all(len(worker_ranks(pid)) == 1 for pid in pids.values())
    client = openai.OpenAI(
        base_url=f"{ro.fleet.gateways[0].url}/v1", api_key=ro.fleet.client_token, max_retries=0
    )
    for _ in range(4):  # both instances, whichever the gateway picks
        done = client.completions.create(model="demo", prompt="Hello", max_tokens=8)
        assert done.usage is not None and 1 <= done.usage.completion_tokens <= 8


def test_a_killed_rank_one_restarts_its_instance_which_serves_again(
    parallel_fleet: RolloutFleet,
) -> None:
    ro = parallel_fleet
    before = engine_pids(ro)
    victim, engine = next(iter(before.items()))
    (rank_one,) = worker_ranks(engine)
    os.kill(rank_one, signal.SIGKILL)
    wait_for("rank 0 to exit", lambda: not alive([engine]), 30)
    wait_for(
        "the instance restarted",
        lambda: engine_pids(ro).get(victim) not in (None, engine),
        120,
    )
    ro.all_ready("v1", timeout_s=300)
    after = engine_pids(ro)
    assert after[victim] != engine  # restarted: a new group
    assert len(worker_ranks(after[victim])) == 1
    other = next(i for i in before if i != victim)
    assert after[other] == before[other]  # the other instance was not touched
    ready = time.monotonic()
    time.sleep(3)
    answers = ro.load.since(ready)
    assert answers and all(a.status == 200 for a in answers)


def test_a_rolling_restart_of_two_rank_instances_fails_no_request(
    parallel_fleet: RolloutFleet,
) -> None:
    ro = parallel_fleet
    before = engine_pids(ro)
    start_count = len(ro.load.answers)
    result = ro.dctl("restart", "demo")
    assert result.returncode == 0, result.stdout + result.stderr
    ro.all_ready("v1", timeout_s=300)
    after = engine_pids(ro)
    assert before.keys() == after.keys() and all(before[i] != after[i] for i in before)
    assert not alive(list(before.values()))
    answers = ro.load.answers[start_count:]
    assert len(answers) > 20 and all(a.status == 200 for a in answers), [
        a for a in answers if a.status != 200
    ][:5]
