"""Sampling: greedy, temperature/top-p semantics, per-position seeding, vectorised == per-row."""

from __future__ import annotations

import pytest
import torch

from splitserve.engines.base import Sampling
from splitserve.engines.sampling import position_uniform, sample, sample_rows


def test_position_uniform_is_keyed_by_seed_and_position() -> None:
    draws = [position_uniform(42, p) for p in range(1000)]
    assert draws == [position_uniform(42, p) for p in range(1000)]  # no hidden state
    assert len(set(draws)) == 1000 and all(0.0 <= u < 1.0 for u in draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55
    assert position_uniform(43, 5) != position_uniform(42, 5)
    assert position_uniform(None, 5) != position_uniform(None, 5)
    # pinned values: a draw must not change across versions, or split prefill/decode deployments diverge
    assert position_uniform(0, 0) == pytest.approx(0.6524484863740322, abs=0)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert sample(logits, [Sampling(), Sampling()], [0, 0]) == [1, 0]


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.randn(4, 1000)
    picks = sample(logits, [Sampling(temperature=5.0, top_p=1e-6, seed=s) for s in range(4)], [7] * 4)
    assert picks == logits.argmax(-1).tolist()


def test_top_p_restricts_to_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    picks = sample(logits, [Sampling(temperature=1.0, top_p=0.8, seed=s) for s in range(400)], [1] * 400)
    assert set(picks) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    share = picks.count(0) / len(picks)
    assert 0.55 < share < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    picks = [sample(probs.log().unsqueeze(0), [Sampling(temperature=1.0, seed=1)], [p])[0] for p in range(3000)]
    freq = [picks.count(i) / len(picks) for i in range(3)]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.03)


def test_vectorised_rows_equal_one_by_one() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    samplings = [
        Sampling(),
        Sampling(0.7, 0.9, 1),
        Sampling(1.3, 1.0, 2),
        Sampling(),
        Sampling(1.0, 0.5, 3),
        Sampling(0.2, 0.95, 4),
    ]
    positions = [3, 10, 11, 12, 100, 5]
    together = sample(logits, samplings, positions)
    alone = [sample(logits[i : i + 1], [samplings[i]], [positions[i]])[0] for i in range(6)]
    assert together == alone


def test_sample_rows_clamps_a_uniform_of_one() -> None:
    logits = torch.tensor([[0.0, 0.0, -1e9]])
    token = sample_rows(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert token.item() == 1  # the last *kept* token, never the zero-probability one


def test_sampling_validation() -> None:
    with pytest.raises(ValueError):
        Sampling(temperature=-1)
    with pytest.raises(ValueError):
        Sampling(top_p=0)
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 3), [Sampling()], [0])
