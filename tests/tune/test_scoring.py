"""Agreement, percentiles and one setting's summary."""

from __future__ import annotations

import pytest

from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import (
    Batch,
    RequestSample,
    agreement,
    mean_agreement,
    percentile,
    summarise,
)


def test_agreement_is_position_by_position_over_the_longer_output() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 3, 4], [1, 9, 3, 9]) == 0.5
    # An early stop: the missing positions are mismatches.
    assert agreement([1, 2, 3, 4], [1, 2]) == 0.5
    # A longer answer: the extra positions are mismatches too.
    assert agreement([1, 2], [1, 2, 3, 4]) == 0.5
    # No shift tolerance: the positions are the diffusion positions.
    assert agreement([1, 2, 3], [0, 1, 2]) == 0.0
    assert agreement([], []) == 1.0
    assert agreement([], [1]) == 0.0


def test_mean_agreement_averages_per_prompt() -> None:
    assert mean_agreement([[1, 2], [1, 2, 3, 4]], [[1, 2], [1]]) == pytest.approx((1 + 0.25) / 2)
    with pytest.raises(ValueError):
        mean_agreement([[1]], [])


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(1, 21))), 95) == pytest.approx(19.05)
    assert percentile([7.0], 95) == 7.0


def test_summary_counts_tokens_per_denoising_step_and_throughput() -> None:
    batch = Batch(
        [
            RequestSample(
                e2e_s=1.0,
                completion_tokens=8,
                units=[1] * 8,
                denoise_steps=2,
                engine_tokens_per_forward=2.0,
            ),
            RequestSample(
                e2e_s=3.0,
                completion_tokens=4,
                units=[1] * 4,
                denoise_steps=4,
                engine_tokens_per_forward=1.0,
            ),
        ],
        wall_s=4.0,
    )
    result = summarise(DecodeSetting(4, threshold=0.9), batch, [[1] * 8, [1] * 8])
    assert result.tokens_per_forward == 12 / 6
    assert result.engine_tokens_per_forward == 1.5
    assert result.throughput_tps == 3.0
    assert result.p50_s == 2.0
    assert result.agreement == pytest.approx((1.0 + 0.5) / 2)
    assert result.heldout_accuracy is None


def test_over_http_tokens_per_forward_is_not_known() -> None:
    batch = Batch([RequestSample(e2e_s=1.0, completion_tokens=5, units=["a", "b"])], wall_s=1.0)
    result = summarise(DecodeSetting(4, threshold=0.9), batch, [["a", "b"]])
    assert result.tokens_per_forward is None and result.engine_tokens_per_forward is None
