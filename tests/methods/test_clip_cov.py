"""Clip-Cov: the covariance scores, the budget inside the window, never a token PPO already clipped."""

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.methods import (
    ClipCov,
    covariance_scores,
)


def test_covariance_scores_use_means_over_valid_tokens():
    batch = random_batch()
    m = batch.factor.bool()
    expected = (batch.advantages - batch.advantages[m].mean()) * (batch.logps - batch.logps[m].mean())
    torch.testing.assert_close(covariance_scores(batch), expected)


def test_clip_cov_drops_exactly_the_budget_inside_the_window_and_never_ppo_clipped_tokens():
    # Half of the tokens get a ratio far outside [0.8, 1.2]: those in the clipped direction must never be picked.
    batch = random_batch(seed=1, old_shift=lambda g, b, t: (torch.rand(b, t, generator=g) > 0.5) * 1.0)
    method = ClipCov(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0, epsilon_low=0.2, epsilon_high=0.2)
    cov = covariance_scores(batch)
    clipped = method.ppo_clipped(batch)
    window = batch.in_loss & (cov > 0.5) & (cov < 4.0)
    assert clipped.any() and (window & ~clipped).sum() > 10
    torch.manual_seed(0)
    dropped = method.select(batch)
    n_valid = int(batch.in_loss.sum())
    assert int(dropped.sum()) == max(1, int(0.05 * n_valid))
    assert not (dropped & ~window).any(), "a token outside (lb, ub) or padding was dropped"
    assert not (dropped & clipped).any(), "a token PPO already clipped was dropped"
    torch.manual_seed(0)  # the same random pick as above
    weights = method.micro_batch_terms(batch, batch.logps).weights
    assert torch.equal(weights, (~dropped).float())
    assert method.pop_metrics()["clip_cov/dropped_frac"] == pytest.approx(int(dropped.sum()) / n_valid)


def test_clip_cov_drops_all_candidates_when_fewer_than_the_budget_and_at_least_one():
    batch = random_batch(seed=2)
    cov = covariance_scores(batch)
    top = cov[batch.in_loss].max().item()
    method = ClipCov(clip_cov_ratio=0.5, clip_cov_lb=top - 1e-6, clip_cov_ub=top + 1.0)  # exactly one candidate
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(clip_cov_ratio=1e-9, clip_cov_lb=-1e9, clip_cov_ub=1e9)  # budget rounds down to 0: still one
    assert int(method.select(batch).sum()) == 1
    method = ClipCov(clip_cov_ratio=0.5, clip_cov_lb=1e8, clip_cov_ub=1e9)  # no candidate at all
    assert int(method.select(batch).sum()) == 0
