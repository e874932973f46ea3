"""DiffusionGemma's decoding rules: each equal, bit for bit, to the reference's own class or
call (`transformers.models.diffusion_gemma.generation_diffusion_gemma`) on random data, and
each as a statement of the rule itself. Per-row generators keep rows independent."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding
from engine.families.diffusion_gemma.sampling import (
    CanvasStability,
    apply_temperature,
    denoising_step,
    entropy_bound_acceptance,
    initial_canvas,
    renoise_canvas,
    sample_denoiser_canvas,
    stable_and_confident,
    step_temperatures,
    token_entropy,
)

L, V = 16, 50


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded like torch.manual_seed(seed) seeds the global one."""
    return torch.Generator().manual_seed(seed)


def random_logits(seed: int, rows: int = 4) -> torch.Tensor:
    """(rows, L, V) logits whose per-position scales spread entropies from ~0 to ~log V."""
    g = gen(seed)
    scale = torch.logspace(-1, 1.5, L)[torch.randperm(L, generator=g)]
    return torch.randn(rows, L, V, generator=g) * scale[None, :, None]


def decoding(**fields: float | int) -> DiffusionGemmaDecoding:
    return DiffusionGemmaDecoding(canvas_length=L, **fields)  # type: ignore[arg-type]


def reference_sampler(bound: float) -> EntropyBoundSampler:
    return EntropyBoundSampler(
        EntropyBoundSamplerConfig(entropy_bound=bound),
        canvas_length=L,
        vocab_size=V,
        max_denoising_steps=1,
    )


# -- temperature ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t_min", "t_max", "steps"), [(0.4, 0.8, 48), (0.0, 2.5, 7), (0.13, 0.17, 33), (1.1, 3.7, 1)]
)
def test_temperature_schedule_is_the_references(t_min: float, t_max: float, steps: int) -> None:
    logits = random_logits(0, rows=1)
    processor = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, steps)
    settings = decoding(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    for taken in range(steps):
        # The reference counts the steps remaining, N..1, as an int32 tensor.
        remaining = torch.tensor(steps - taken, dtype=torch.int32)
        expected = processor(None, logits, cur_step=remaining)
        got = apply_temperature(logits, step_temperatures([settings], [taken]))
        assert torch.equal(got, expected), taken


def test_temperature_per_row_in_a_batch() -> None:
    settings = [decoding(), decoding(t_min=0.0, t_max=2.0, max_denoising_steps=5)]
    logits = random_logits(1, rows=2)
    got = apply_temperature(logits, step_temperatures(settings, [10, 2]))
    for row, (d, taken) in enumerate(zip(settings, [10, 2], strict=True)):
        alone = apply_temperature(logits[row : row + 1], step_temperatures([d], [taken]))
        assert torch.equal(got[row], alone[0])


def test_temperature_cools_linearly_from_t_max_to_one_step_above_t_min() -> None:
    d = decoding(t_min=0.2, t_max=1.0, max_denoising_steps=4)
    temps = step_temperatures([d] * 4, [0, 1, 2, 3]).tolist()
    assert temps == pytest.approx([1.0, 0.8, 0.6, 0.4])  # t_min + (t_max - t_min) * (4 - k) / 4


# -- entropy and acceptance -------------------------------------------------------------------


def test_entropy_is_the_categorical_entropy() -> None:
    logits = random_logits(2)
    logits[0, 0, :10] = -math.inf  # impossible tokens count 0 * log 0 = 0
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(token_entropy(logits), expected)


@pytest.mark.parametrize("bound", [0.1, 1.0, 4.0, 1000.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_acceptance_is_the_reference_samplers(bound: float, seed: int) -> None:
    logits = random_logits(seed)
    g = gen(seed + 100)
    current = torch.randint(0, V, (4, L), generator=g)
    drawn = torch.randint(0, V, (4, L), generator=g)
    sampler = reference_sampler(bound)
    expected = sampler.accept_canvas(current, drawn, logits, cur_step=1)

    accepted = entropy_bound_acceptance(token_entropy(logits), torch.full((4,), bound))
    assert torch.equal(accepted, sampler.accepted_token_mask)
    assert torch.equal(torch.where(accepted, drawn, current), expected)


@pytest.mark.parametrize("bound", [0.05, 0.5, 3.0])
def test_lowest_entropy_tokens_are_accepted_while_sum_minus_max_stays_within_bound(
    bound: float,
) -> None:
    entropy = torch.rand(6, L, generator=gen(3)) * 2
    accepted = entropy_bound_acceptance(entropy, torch.full((6,), bound))
    for row in range(6):
        h = sorted(entropy[row].tolist())
        # The largest k with h_1 + ... + h_k - h_k <= bound (h ascending); always >= 1.
        k = max(n for n in range(1, L + 1) if sum(h[:n]) - h[n - 1] <= bound + 1e-6)
        chosen = sorted(entropy[row][accepted[row]].tolist())
        assert chosen == pytest.approx(h[:k])


def test_at_least_one_token_is_accepted_however_uncertain() -> None:
    entropy = torch.full((2, L), 50.0)
    entropy[1, 5] = 49.0
    accepted = entropy_bound_acceptance(entropy, torch.full((2,), 1e-6))
    assert accepted.sum(dim=-1).tolist() == [1, 1]
    assert accepted[1, 5]


def test_each_row_has_its_own_bound() -> None:
    entropy = torch.full((2, L), 0.25)
    accepted = entropy_bound_acceptance(entropy, torch.tensor([0.5, 2.0]))
    assert accepted.sum(dim=-1).tolist() == [3, 9]  # (k - 1) * 0.25 <= bound


# -- random draws ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_initial_canvas_draws_are_the_references(seed: int) -> None:
    torch.manual_seed(seed)
    expected = reference_sampler(0.1).initialize_canvas(batch_size=1, device=torch.device("cpu"))
    assert torch.equal(initial_canvas([gen(seed)], L, V), expected)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_denoiser_draws_are_the_references_global_multinomial(seed: int) -> None:
    probs = torch.softmax(random_logits(seed, rows=1), dim=-1)
    torch.manual_seed(seed)
    # The reference flattens (batch, canvas) into rows and draws one sample each.
    expected = torch.multinomial(probs.view(-1, V), num_samples=1).view(1, L)
    assert torch.equal(sample_denoiser_canvas(probs, [gen(seed)]), expected)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_renoising_is_the_reference_samplers(seed: int) -> None:
    logits = random_logits(seed, rows=1)
    current = torch.randint(0, V, (1, L), generator=gen(seed + 1))
    drawn = torch.randint(0, V, (1, L), generator=gen(seed + 2))
    sampler = reference_sampler(1.0)
    accepted_canvas = sampler.accept_canvas(current, drawn, logits, cur_step=1)
    torch.manual_seed(seed)
    expected = sampler.renoise_canvas(accepted_canvas, cur_step=1)

    mask = entropy_bound_acceptance(token_entropy(logits), torch.tensor([1.0]))
    got = renoise_canvas(accepted_canvas, mask, [gen(seed)], V)
    assert torch.equal(got, expected)
    assert torch.equal(got[mask], drawn[mask])  # accepted tokens stay


def test_renoising_draws_a_whole_canvas_even_when_everything_is_accepted() -> None:
    # The stream must stay aligned with the reference, which always draws L tokens.
    g, twin = gen(4), gen(4)
    canvas = torch.arange(L).view(1, L)
    assert torch.equal(renoise_canvas(canvas, torch.ones(1, L, dtype=torch.bool), [g], V), canvas)
    initial_canvas([twin], L, V)
    assert torch.equal(initial_canvas([g], L, V), initial_canvas([twin], L, V))


# -- stopping -------------------------------------------------------------------------------


def argmax_trajectory(seed: int, steps: int, rows: int) -> list[torch.Tensor]:
    """Argmax canvases that often repeat the previous step's, sometimes change one token."""
    g = gen(seed)
    canvas = torch.randint(0, V, (rows, L), generator=g)
    out = []
    for _ in range(steps):
        change = torch.rand(rows, generator=g) < 0.35
        moved = canvas.clone()
        moved[:, 0] = (moved[:, 0] + 1) % V
        canvas = torch.where(change[:, None], moved, canvas)
        out.append(canvas)
    return out


@pytest.mark.parametrize("stability_threshold", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_stopping_is_the_reference_criteria_over_many_steps(
    stability_threshold: int, seed: int
) -> None:
    rows, steps, confidence = 5, 12, 1.5
    criteria = StableAndConfidentStoppingCriteria(stability_threshold, confidence)
    states = [CanvasStability()] * rows
    stops = 0
    for step, argmax in enumerate(argmax_trajectory(seed, steps, rows)):
        # Rows from diffuse to peaked, so the mean entropy falls on both sides of the threshold.
        sharpness = torch.rand(rows, 1, 1, generator=gen(seed * 100 + step)) * 20
        logits = random_logits(seed * 100 + step, rows=rows) * sharpness
        expected = criteria(argmax, logits)
        got, states = stable_and_confident(
            argmax,
            token_entropy(logits),
            states,
            torch.full((rows,), stability_threshold),
            torch.full((rows,), confidence),
        )
        assert got == expected.tolist(), step
        stops += sum(got)
    assert stops > 0  # the case is not vacuous


def test_a_stable_and_confident_canvas_stops_after_threshold_steps() -> None:
    canvas = torch.arange(L).view(1, L)
    sure = torch.zeros(1, L)  # entropy 0: fully confident
    states = [CanvasStability()]
    results = []
    for _ in range(4):
        stop, states = stable_and_confident(
            canvas, sure, states, torch.tensor([2]), torch.tensor([0.005])
        )
        results.append(stop[0])
    # Steps 1 and 2 have no two equal predecessors yet; step 3 is the first stable one.
    assert results == [False, False, True, True]


def test_a_changed_canvas_restarts_the_count_and_an_unsure_one_never_stops() -> None:
    a, b = torch.zeros(1, L, dtype=torch.long), torch.ones(1, L, dtype=torch.long)
    sure, unsure = torch.zeros(1, L), torch.full((1, L), 0.01)
    states = [CanvasStability()]
    seen = []
    for canvas, entropy in [(a, sure), (a, sure), (b, sure), (b, unsure), (b, sure)]:
        stop, states = stable_and_confident(
            canvas, entropy, states, torch.tensor([1]), torch.tensor([0.005])
        )
        seen.append((stop[0], states[0].unchanged_steps))
    assert seen == [(False, 0), (True, 1), (False, 0), (False, 1), (True, 2)]


def test_stability_zero_stops_at_the_first_confident_step() -> None:
    stop, _ = stable_and_confident(
        torch.zeros(2, L, dtype=torch.long),
        torch.tensor([[0.001] * L, [0.1] * L]),
        [CanvasStability()] * 2,
        torch.tensor([0, 0]),
        torch.tensor([0.005, 0.005]),
    )
    assert stop == [True, False]


# -- a whole step ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3])
def test_a_canvas_of_steps_makes_the_references_draws_and_decisions(seed: int) -> None:
    # The reference's denoising loop for one canvas at batch 1 (without the model: the
    # "decoder" returns fixed logits per step), on the global RNG, against ours on a generator.
    steps, bound = 6, 2.0
    settings = decoding(max_denoising_steps=steps, entropy_bound=bound, confidence_threshold=2.0)
    step_logits = [random_logits(seed * 10 + k, rows=1) for k in range(steps)]
    processor = LinearTemperatureScheduleLogitsProcessor(settings.t_min, settings.t_max, steps)
    sampler = reference_sampler(bound)
    criteria = StableAndConfidentStoppingCriteria(1, 2.0)

    torch.manual_seed(seed)
    canvas = sampler.initialize_canvas(1, torch.device("cpu"))
    reference = []
    for k, remaining in enumerate(reversed(range(1, steps + 1))):
        scaled = processor(
            None, step_logits[k], cur_step=torch.tensor(remaining, dtype=torch.int32)
        )
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs.view(-1, V), num_samples=1).view(1, L)
        argmax = torch.argmax(scaled, dim=-1)
        canvas = sampler.renoise_canvas(sampler.accept_canvas(canvas, drawn, scaled, k), k)
        reference.append((canvas, argmax, scaled, criteria(argmax, scaled).item()))

    g = gen(seed)
    canvas = initial_canvas([g], L, V)
    states = [CanvasStability()]
    for k in range(steps):
        step = denoising_step(
            step_logits[k],
            canvas,
            decodings=[settings],
            steps_taken=[k],
            generators=[g],
            stability=states,
        )
        canvas, states = step.next_canvas, step.stability
        ref_canvas, ref_argmax, ref_scaled, ref_stop = reference[k]
        assert torch.equal(step.next_canvas, ref_canvas), k
        assert torch.equal(step.argmax_canvas, ref_argmax), k
        assert torch.equal(step.self_conditioning_logits, ref_scaled), k
        assert step.finished == [ref_stop or k == steps - 1], k


def test_other_rows_and_their_generators_do_not_change_a_row() -> None:
    settings = [
        decoding(entropy_bound=0.5),
        decoding(t_min=0.0, t_max=2.0, entropy_bound=3.0, max_denoising_steps=9),
        decoding(),
    ]
    logits = random_logits(8, rows=3)
    generators = [gen(11), gen(22), gen(33)]
    canvas = initial_canvas(generators, L, V)
    batch = denoising_step(
        logits,
        canvas,
        decodings=settings,
        steps_taken=[0, 4, 47],
        generators=generators,
        stability=[CanvasStability()] * 3,
    )
    alone_gen = gen(22)
    alone_canvas = initial_canvas([alone_gen], L, V)
    alone = denoising_step(
        logits[1:2],
        alone_canvas,
        decodings=settings[1:2],
        steps_taken=[4],
        generators=[alone_gen],
        stability=[CanvasStability()],
    )
    assert torch.equal(canvas[1], alone_canvas[0])
    assert torch.equal(batch.next_canvas[1], alone.next_canvas[0])
    assert torch.equal(batch.argmax_canvas[1], alone.argmax_canvas[0])
    assert torch.equal(batch.accepted[1], alone.accepted[0])
    assert torch.equal(batch.self_conditioning_logits[1], alone.self_conditioning_logits[0])
    assert batch.finished == [False, False, True]  # the third row took its 48th, last step
