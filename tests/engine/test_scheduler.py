"""Admission, slots, chunked prefill, cancellation and accounting of the continuous batcher."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidParams
from engine.params import SamplingParams
from engine.runner import RequestResult
from engine.sampling import RowSampler
from engine.scheduler import Phase, Request, Scheduler
from tests.engine.conftest import MASK_ID
from tests.engine.decoding_fixtures import Parts, one_thread, peaked, run_core

__all__ = ["one_thread", "peaked"]  # fixtures, imported for pytest


def request(rid: str, prompt_len: int, block: int = 4) -> Request:
    req = Request(
        request_id=rid,
        prompt_ids=list(range(10, 10 + prompt_len)),
        params=SamplingParams(max_tokens=8),
        block_size=block,
        sampler=RowSampler.create(temperature=0.0, top_k=0, top_p=1.0, seed=None, device="cpu"),
        detokenizer=IncrementalDetokenizer(lambda ids: "".join(chr(i) for i in ids)),
    )
    req.open_block(req.prefill_target, MASK_ID)
    return req


def test_admission_is_fifo_into_free_slots_and_waits_when_full() -> None:
    sched = Scheduler(2)
    for i in range(3):
        sched.add(request(f"r{i}", 6))
    admitted = sched.admit()
    assert [r.request_id for r in admitted] == ["r0", "r1"]
    assert {r.slot for r in admitted} == {0, 1}
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert sched.admit() == []
    slot_of_r0 = admitted[0].slot
    freed = sched.remove("r0")
    assert freed is not None and freed.slot == -1
    (third,) = sched.admit()
    assert third.request_id == "r2" and third.slot == slot_of_r0


def test_first_block_keeps_the_prompt_tail_and_masks_the_rest() -> None:
    sched = Scheduler(1)
    sched.add(request("r", 6))
    (req,) = sched.admit()
    assert req.phase is Phase.PREFILL and req.prefill_target == 4
    assert req.block_tokens == [14, 15, MASK_ID, MASK_ID]
    assert req.block_masked == [False, False, True, True]
    assert req.masked_at_block_start == 2
    req.committed = 4  # the prefill ran: the request decodes from its first block
    assert req.phase is Phase.DECODE and req.block_start == 4


def test_the_plan_lets_a_request_decode_in_the_iteration_that_ends_its_prefill() -> None:
    sched = Scheduler(3, prefill_budget=8)
    sched.add(request("long", 18))  # 16 prompt positions to prefill: two iterations
    sched.add(request("short", 6))  # 4
    sched.add(request("tiny", 2))  # none: decodes at once
    plan = sched.schedule()
    assert [[(c.request.request_id, c.length) for c in g] for g in plan.prefills] == [[("long", 8)]]
    assert [[r.request_id for r in g] for g in plan.decodes] == [["tiny"]]
    assert plan.num_requests == 2
    sched.running["long"].committed = 8
    plan = sched.schedule()
    assert [[(c.request.request_id, c.length) for c in g] for g in plan.prefills] == [[("long", 8)]]
    # "short" gets nothing of the budget yet; "long" decodes right after its last chunk.
    assert [[r.request_id for r in g] for g in plan.decodes] == [["long", "tiny"]]


def test_the_scheduler_never_changes_decoding_state() -> None:
    sched = Scheduler(2, prefill_budget=8)
    for rid, length in (("a", 9), ("b", 3)):
        sched.add(request(rid, length))
    before = {
        r.request_id: (r.committed, list(r.block_tokens), r.step_in_block) for r in [*sched.waiting]
    }
    sched.schedule()
    sched.schedule()
    after = {
        r.request_id: (r.committed, list(r.block_tokens), r.step_in_block)
        for r in sched.running.values()
    }
    assert after == before


@pytest.mark.usefixtures("one_thread")
def test_one_method_applies_the_runner_results(peaked: Parts) -> None:
    """The runner returns plain data and changes no request; update_from_output applies it."""
    core = peaked.core(max_batch_size=1)
    core.add_request("r", list(range(10, 16)), SamplingParams(max_tokens=12, steps=2))
    plan = core.scheduler.schedule()
    (chunk,) = plan.prefills[0]
    state = (chunk.request.committed, chunk.request.forwards)
    (prefilled,) = core.runner.prefill(plan.prefills[0])
    assert prefilled == RequestResult("r", prefilled=4)
    assert (chunk.request.committed, chunk.request.forwards) == state
    core.update_from_output([prefilled])
    (group,) = plan.decodes
    request = group[0]
    assert (request.committed, request.forwards) == (4, 1)
    tokens, masked = list(request.block_tokens), list(request.block_masked)
    (denoised,) = core.runner.decode(group)
    assert (request.block_tokens, request.block_masked) == (tokens, masked)
    assert denoised.denoised and not denoised.committed_block
    assert len(denoised.unmasked) == 1  # 2 masked positions, steps=2: one per step
    core.update_from_output([denoised])
    (offset,) = denoised.unmasked
    assert request.block_tokens[offset] == denoised.tokens[0]
    assert not request.block_masked[offset]
    assert (request.step_in_block, request.forwards) == (1, 2)


def test_short_prompt_skips_prefill() -> None:
    sched = Scheduler(1)
    sched.add(request("r", 3))
    (req,) = sched.admit()
    assert req.phase is Phase.DECODE
    assert sched.prefill_chunks() == []


def test_prefill_is_chunked_in_whole_blocks_within_the_budget() -> None:
    sched = Scheduler(3, prefill_budget=10)
    sched.add(request("long", 30))
    sched.add(request("short", 9))
    sched.admit()
    chunks = sched.prefill_chunks()
    assert [(c.request.request_id, c.start, c.length) for c in chunks] == [("long", 0, 8)]
    sched.running["long"].committed = 24  # 4 tokens left of its 28-token target
    chunks = sched.prefill_chunks()
    assert [(c.request.request_id, c.length) for c in chunks] == [("long", 4), ("short", 4)]


def test_oldest_prefill_progresses_even_with_a_tiny_budget() -> None:
    sched = Scheduler(1, prefill_budget=1)
    sched.add(request("r", 16, block=8))
    sched.admit()
    assert [c.length for c in sched.prefill_chunks()] == [8]


def test_removing_a_waiting_request() -> None:
    sched = Scheduler(1)
    sched.add(request("a", 4))
    sched.add(request("b", 4))
    sched.admit()
    assert sched.remove("b") is not None
    assert sched.num_waiting == 0
    assert sched.remove("nope") is None


@pytest.mark.usefixtures("one_thread")
def test_more_requests_than_slots_all_finish_with_the_same_tokens(peaked: Parts) -> None:
    prompts = [peaked.tokenizer.encode(t) for t in ("The quick", "Hello world", "def add", "A")]
    batch = {f"r{i}": (p, SamplingParams(max_tokens=10 + i)) for i, p in enumerate(prompts)}
    core = peaked.core(max_batch_size=2)
    for rid, (p, params) in batch.items():
        core.add_request(rid, p, params)
    core.step()
    assert (core.num_running, core.num_waiting) == (2, 2)
    assert core.last_step.batch_size == 2
    run_core(core, {})
    assert core.num_running == core.num_waiting == 0
    limited = run_core(peaked.core(max_batch_size=2), batch)
    roomy = run_core(peaked.core(max_batch_size=4), batch)
    for rid in batch:
        assert limited[rid].token_ids == roomy[rid].token_ids
        assert limited[rid].finish_reason == roomy[rid].finish_reason is not None


@pytest.mark.usefixtures("one_thread")
def test_abort_frees_the_slot_at_the_next_step(peaked: Parts) -> None:
    core = peaked.core(max_batch_size=1)
    prompt = peaked.tokenizer.encode("one two three four five six")
    core.add_request("a", prompt, SamplingParams(max_tokens=40))
    core.add_request("b", prompt, SamplingParams(max_tokens=6))
    for _ in range(3):
        core.step()
    assert core.kv_cache_bytes_used > 0
    assert (core.num_running, core.num_waiting) == (1, 1)
    core.abort_request("a")
    updates = core.step()
    (aborted,) = [u for u in updates if u.request_id == "a"]
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.stats is not None and aborted.stats.prompt_tokens == len(prompt)
    # "b" took the freed slot in that same step.
    assert (core.num_running, core.num_waiting) == (1, 0)
    run_core(core, {})
    assert not core.has_unfinished()
    assert core.kv_cache_bytes_used == 0


@pytest.mark.usefixtures("one_thread")
def test_abort_of_a_waiting_request_and_of_unknown_ids(peaked: Parts) -> None:
    core = peaked.core(max_batch_size=1)
    core.add_request("a", [10, 11, 12], SamplingParams(max_tokens=4))
    core.add_request("b", [10, 11, 12], SamplingParams(max_tokens=4))
    core.abort_request("b")
    core.abort_request("never-existed")
    updates = core.step()
    assert [(u.request_id, u.finish_reason) for u in updates if u.finished] == [("b", "abort")]


@pytest.mark.usefixtures("one_thread")
def test_kv_cache_accounting(peaked: Parts) -> None:
    core = peaked.core(max_batch_size=2, max_seq_len=64)
    per_token = core.cache.bytes_per_token
    assert core.kv_cache_bytes_total == 2 * 64 * per_token
    core.add_request("r", list(range(10, 19)), SamplingParams(max_tokens=12))  # 9 prompt tokens
    core.step()  # prefill of 8 prompt tokens, then the first denoising step
    assert core.kv_cache_bytes_used == 8 * per_token


@pytest.mark.usefixtures("one_thread")
def test_long_prompt_prefill_does_not_stall_running_requests(peaked: Parts) -> None:
    text = "one two three four five six seven eight nine ten " * 3
    long_prompt = peaked.tokenizer.encode(text)
    assert len(long_prompt) >= 24
    core = peaked.core(max_batch_size=2)
    core.scheduler.prefill_budget = 4  # one block per step
    core.add_request("short", [10, 11, 12], SamplingParams(max_tokens=30, steps=4))
    core.step()
    core.add_request("long", long_prompt, SamplingParams(max_tokens=8))
    unmasked = []
    for _ in range(4):
        core.step()
        unmasked.append(core.last_step.tokens_unmasked)
        assert core.last_step.forwards == 2  # a prefill chunk and the decode forward
        # Only the denoising forward is timed (for dllm_denoise_step_seconds), by block size.
        [(block_size, seconds)] = core.last_step.denoise_s
        assert block_size == core.scheduler.running["short"].block_size and seconds > 0
    assert core.scheduler.running["long"].phase is Phase.PREFILL
    assert sum(unmasked) >= 3  # "short" kept denoising meanwhile
    run_core(core, {})
    # Chunking changes nothing in the result.
    alone = run_core(peaked.core(), {"long": (long_prompt, SamplingParams(max_tokens=8))})
    core2 = peaked.core()
    core2.scheduler.prefill_budget = 4
    assert (
        run_core(core2, {"long": (long_prompt, SamplingParams(max_tokens=8))})["long"].token_ids
        == alone["long"].token_ids
    )


@pytest.mark.usefixtures("one_thread")
def test_duplicate_request_id_is_refused(peaked: Parts) -> None:
    core = peaked.core()
    core.add_request("same", [10, 11], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidParams) as err:
        core.add_request("same", [10, 11], SamplingParams(max_tokens=2))
    assert err.value.field == "request_id"
