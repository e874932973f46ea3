"""The training recipe's schedule: each phase warms up and decays on its own."""

from __future__ import annotations

import itertools

from engine.training.train import learning_rate


def test_a_phase_warms_up_linearly_then_decays_to_a_tenth_of_its_peak() -> None:
    rates = [learning_rate(1e-3, 50, 800, s) for s in range(800)]
    assert rates[0] == 1e-3 / 50 and rates[49] == 1e-3  # linear warm-up to the peak
    assert all(a >= b for a, b in itertools.pairwise(rates[49:]))  # then only down
    assert abs(rates[-1] - 1e-4) < 1e-7  # a tenth of the peak at the phase's last step
