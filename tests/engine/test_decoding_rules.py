"""The pure decoding rules: unmasking counts, selection order, finish detection, streaming."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decoding import (
    NOT_MASKED,
    Finish,
    detect_finish,
    most_confident,
    releasable_text,
    unmask_counts,
)
from engine.detokenizer import IncrementalDetokenizer


def counts_for(
    *,
    step: int,
    masked_now: int,
    masked_at_start: int,
    above: int = 0,
    steps: int = 0,
    min_steps: int = 1,
    max_steps: int = 0,
) -> int:
    def t(v: int) -> torch.Tensor:
        return torch.tensor([v])

    return int(
        unmask_counts(
            step=t(step),
            masked_now=t(masked_now),
            masked_at_start=t(masked_at_start),
            above_threshold=t(above),
            steps=t(steps),
            min_steps=t(min_steps),
            max_steps=t(max_steps),
        )[0]
    )


def run_steps_mode(masks: int, steps: int) -> list[int]:
    accepted, left, k = [], masks, 0
    while left:
        n = counts_for(step=k, masked_now=left, masked_at_start=masks, steps=steps)
        accepted.append(n)
        left -= n
        k += 1
    return accepted


@pytest.mark.parametrize(
    ("masks", "steps", "expected"),
    [
        (32, 8, [4] * 8),
        (30, 8, [4, 4, 4, 4, 4, 4, 3, 3]),
        (5, 8, [1, 1, 1, 1, 1]),  # fewer masks than steps: one per step, then done
        (7, 1, [7]),
    ],
)
def test_steps_mode_quota_finishes_block_in_steps(
    masks: int, steps: int, expected: list[int]
) -> None:
    assert run_steps_mode(masks, steps) == expected


def test_threshold_mode_accepts_all_above_and_at_least_one() -> None:
    assert counts_for(step=0, masked_now=10, masked_at_start=10, above=0) == 1
    assert counts_for(step=0, masked_now=10, masked_at_start=10, above=6) == 6
    assert counts_for(step=3, masked_now=2, masked_at_start=10, above=2) == 2


def test_min_steps_caps_each_step_so_block_takes_at_least_min_steps() -> None:
    # r=8 masks left, min_steps=4: at most ceil(8/4)=2 at step 0, ceil(6/3)=2 at step 1, ...
    left, k, accepted = 8, 0, []
    while left:
        n = counts_for(step=k, masked_now=left, masked_at_start=8, above=8, min_steps=4)
        accepted.append(n)
        left -= n
        k += 1
    assert accepted == [2, 2, 2, 2]
    # After min_steps, the cap no longer applies.
    assert counts_for(step=4, masked_now=5, masked_at_start=9, above=5, min_steps=4) == 5


def test_max_steps_accepts_everything_left_at_the_last_allowed_step() -> None:
    assert counts_for(step=2, masked_now=9, masked_at_start=12, above=0, max_steps=3) == 9
    assert counts_for(step=1, masked_now=9, masked_at_start=12, above=0, max_steps=3) == 1
    # Also in steps mode.
    assert counts_for(step=1, masked_now=28, masked_at_start=32, steps=8, max_steps=2) == 28


def test_most_confident_ties_go_to_lower_position_and_skip_unmasked() -> None:
    conf = torch.tensor(
        [
            [0.5, 0.9, 0.5, NOT_MASKED, 0.5],
            [NOT_MASKED, 0.2, 0.2, 0.2, 0.2],
        ]
    )
    chosen = most_confident(conf, torch.tensor([2, 3]))
    assert chosen.tolist() == [
        [True, True, False, False, False],
        [False, True, True, True, False],
    ]


def decode_chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def detect(
    known: list[int], *, max_tokens: int = 100, stop: list[str] | None = None, emitted: int = 0
) -> Finish | None:
    """detect_finish on `known`, of which the first `emitted` tokens were emitted already."""
    text = IncrementalDetokenizer(decode_chars)
    text.extend(known[:emitted])
    return detect_finish(
        emitted,
        known[emitted:],
        max_tokens=max_tokens,
        eos_token_ids=frozenset({0}),
        find_stop=(lambda extra: text.find_stop(extra, stop)) if stop else None,
    )


def test_finish_at_first_eos_excludes_it() -> None:
    result = detect([ord("a"), ord("b"), 0, ord("c"), 0])
    assert result is not None
    assert (result.num_tokens, result.reason) == (2, "stop")


def test_not_finished_while_prefix_has_no_eos() -> None:
    assert detect([ord("a"), ord("b")]) is None


def test_length_finish_cuts_at_max_tokens_even_mid_block() -> None:
    result = detect([ord(c) for c in "abcdefg"], max_tokens=5)
    assert result is not None
    assert (result.num_tokens, result.reason) == (5, "length")
    # An EOS beyond max_tokens does not count.
    result = detect([ord(c) for c in "abcde"] + [0], max_tokens=5)
    assert result == Finish(num_tokens=5, reason="length")


def test_stop_string_keeps_completing_token_and_cuts_text_before_it() -> None:
    known = [ord(c) for c in "hello END world"]
    result = detect(known, stop=["END", "wor"])
    assert result is not None
    assert result.reason == "stop"
    assert result.num_tokens == len("hello END")
    assert result.text_end == len("hello ")


def test_eos_before_stop_string_wins() -> None:
    known = [ord("a"), 0, *[ord(c) for c in "END"]]
    result = detect(known, stop=["END"])
    assert result is not None
    assert (result.num_tokens, result.reason, result.text_end) == (1, "stop", None)


def test_stop_string_across_emitted_and_new_tokens() -> None:
    known = [ord(c) for c in "hello END world"]
    result = detect(known, stop=["END"], emitted=len("hello E"))
    assert result == Finish(num_tokens=len("hello END"), reason="stop", text_end=len("hello "))


def test_releasable_text_holds_back_possible_stop_prefix_and_partial_chars() -> None:
    assert releasable_text("abcdef", finished=False, stop=["xyz"]) == "abcd"
    assert releasable_text("abc\ufffd", finished=False, stop=[]) == "abc"
    assert releasable_text("abc\ufffd", finished=True, stop=[]) == "abc\ufffd"
    assert releasable_text("ab", finished=False, stop=["long stop"]) == ""


# No deadline: on a shared 2-core machine a 64-step loop of tiny tensor ops can take a while.
@settings(deadline=None, max_examples=60)
@given(masks=st.integers(1, 64), steps=st.integers(1, 64))
def test_steps_mode_always_finishes_in_exactly_min_of_steps_and_masks(
    masks: int, steps: int
) -> None:
    accepted = run_steps_mode(masks, steps)
    assert sum(accepted) == masks
    assert len(accepted) == min(steps, masks)
    assert max(accepted) - min(accepted) <= 1  # the quota is spread evenly


@settings(deadline=None, max_examples=60)
@given(
    masks=st.integers(1, 32),
    min_steps=st.integers(1, 32),
    above=st.lists(st.integers(0, 32), min_size=32, max_size=32),
    max_steps=st.integers(0, 40),
)
def test_threshold_mode_respects_min_and_max_steps(
    masks: int, min_steps: int, above: list[int], max_steps: int
) -> None:
    left, k = masks, 0
    while left:
        n = counts_for(
            step=k,
            masked_now=left,
            masked_at_start=masks,
            above=min(above[k % 32], left),
            min_steps=min_steps,
            max_steps=max_steps,
        )
        assert 1 <= n <= left
        left -= n
        k += 1
    if max_steps:
        assert k <= max_steps
    assert k >= min(min_steps, masks, max_steps or masks)
