"""Token choice and confidence: invalid rows excluded, seeded draws, top-k / top-p."""

from __future__ import annotations

import math

import torch

from engine.sampling import RowSampler, choose_tokens

MASK = 3
VOCAB_LIMIT = 8  # the tokenizer defines ids 0..7; the model has 10 rows


def sampler(temperature: float = 1.0, seed: int | None = 0, **kw: float) -> RowSampler:
    return RowSampler.create(
        temperature=temperature,
        top_k=int(kw.get("top_k", 0)),
        top_p=float(kw.get("top_p", 1.0)),
        seed=seed,
        device="cpu",
    )


def choose(
    logits: torch.Tensor, rows: list[int], samplers: list[RowSampler]
) -> tuple[torch.Tensor, torch.Tensor]:
    return choose_tokens(
        logits.clone(), rows, samplers, mask_token_id=MASK, vocab_limit=VOCAB_LIMIT
    )


def test_mask_token_and_undefined_rows_are_never_chosen() -> None:
    logits = torch.zeros(2, 10)
    logits[:, MASK] = 50.0
    logits[:, 9] = 60.0
    logits[0, 5] = 1.0
    tokens, conf = choose(logits, [2], [sampler(temperature=0.0)])
    assert tokens.tolist() == [5, 0]  # row 1: all valid ties -> lowest id
    # Confidence is the softmax over the valid ids only.
    assert math.isclose(float(conf[0]), math.e / (math.e + 6), rel_tol=1e-6)
    many = torch.zeros(500, 10)
    many[:, MASK] = 5.0
    many[:, 8:] = 5.0
    drawn, _ = choose(many, [500], [sampler(temperature=2.0)])
    assert not set(drawn.tolist()) & {MASK, 8, 9}


def test_confidence_uses_raw_logits_not_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    tokens, conf = choose(logits, [1], [sampler(temperature=5.0, seed=1, top_k=1)])
    raw = torch.softmax(logits[0, :VOCAB_LIMIT].masked_fill(torch.arange(8) == MASK, -1e9), -1)
    assert int(tokens[0]) == 0
    assert math.isclose(float(conf[0]), float(raw[0]), rel_tol=1e-6)


def test_seeded_draws_reproduce_and_do_not_depend_on_other_requests() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 10)
    alone, _ = choose(logits[:4], [4], [sampler(seed=7)])
    again, _ = choose(logits[:4], [4], [sampler(seed=7)])
    # The same request behind a greedy and a sampling neighbour, in a different row offset.
    batched, _ = choose(
        torch.cat([logits[4:5], logits[:4], logits[5:6]]),
        [1, 4, 1],
        [sampler(temperature=0.0), sampler(seed=7), sampler(seed=99)],
    )
    assert alone.tolist() == again.tolist() == batched[1:5].tolist()


def test_different_seeds_give_different_draws() -> None:
    logits = torch.zeros(64, 10)
    a, _ = choose(logits, [64], [sampler(seed=1)])
    b, _ = choose(logits, [64], [sampler(seed=2)])
    assert a.tolist() != b.tolist()


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.full((6000, 10), -30.0)
    logits[:, 0], logits[:, 1], logits[:, 2] = math.log(0.6), math.log(0.3), math.log(0.1)
    tokens, _ = choose(logits, [6000], [sampler(temperature=1.0, seed=3)])
    freq = torch.bincount(tokens, minlength=10).float() / 6000
    assert abs(float(freq[0]) - 0.6) < 0.03
    assert abs(float(freq[1]) - 0.3) < 0.03
    assert abs(float(freq[2]) - 0.1) < 0.02


def test_top_k_and_top_p_restrict_the_draw() -> None:
    logits = torch.zeros(400, 10)
    logits[:, 0], logits[:, 1], logits[:, 2] = 3.0, 2.9, 2.8
    top2, _ = choose(logits, [400], [sampler(seed=4, top_k=2)])
    assert set(top2.tolist()) == {0, 1}
    # p(0) ~ 0.34 under these logits: top_p=0.3 keeps only the most likely token.
    top_p, _ = choose(logits, [400], [sampler(seed=4, top_p=0.3)])
    assert set(top_p.tolist()) == {0}


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_top_one() -> None:
    logits = torch.full((4000, 10), -30.0)
    logits[:, 0], logits[:, 1], logits[:, 2] = math.log(0.5), math.log(0.3), math.log(0.2)
    hot = RowSampler.create(temperature=1.0, top_k=0, top_p=1.0, seed=5, device="cpu", min_p=0.5)
    tokens, _ = choose(logits, [4000], [hot])
    # 0.2 < 0.5 * 0.5 is dropped; 0.3 stays, and the draw renormalises over what is left.
    assert set(tokens.tolist()) == {0, 1}
    assert abs(float((tokens == 0).float().mean()) - 0.5 / 0.8) < 0.03


def test_banned_tokens_are_never_chosen_at_their_rows_only() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 4] = 9.0  # everyone's favourite
    banned = (torch.tensor([0, 2]), torch.tensor([4, 4]))
    tokens, confidence = choose_tokens(
        logits.clone(), [3], [sampler(temperature=0.0)],
        mask_token_id=MASK, vocab_limit=VOCAB_LIMIT, banned=banned,
    )  # fmt: skip
    assert tokens[1] == 4 and tokens[0] != 4 and tokens[2] != 4
    # Like the mask token, a banned token takes no probability from the others.
    assert abs(float(confidence[0]) - 1 / (VOCAB_LIMIT - 2)) < 1e-6
