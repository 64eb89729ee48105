"""KL-Cov: the top-k tokens by covariance, the hand-derived gradient of the penalty, inert on-policy."""

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.methods import (
    KLCov,
    covariance_scores,
)


def test_kl_cov_penalises_exactly_the_top_k_with_the_hand_derived_gradient():
    batch = random_batch(seed=3, old_shift=lambda g, b, t: torch.randn(b, t, generator=g) * 0.1)
    method = KLCov(kl_cov_ratio=0.03, kl_cov_coef=2.0)
    chosen = method.select(batch)
    valid = batch.in_loss
    k = max(1, int(0.03 * int(valid.sum())))
    assert int(chosen.sum()) == k
    cov = covariance_scores(batch)
    assert cov[chosen].min() >= cov[valid & ~chosen].max()
    logps = batch.logps.clone().requires_grad_(True)
    terms = method.micro_batch_terms(batch, logps)
    assert terms.weights is None
    terms.extra_loss.sum().backward()
    expected = 2.0 * torch.sign(batch.logps - batch.old_logps) * chosen
    torch.testing.assert_close(logps.grad, expected)
    assert method.pop_metrics()["kl_cov/penalised_frac"] == pytest.approx(k / int(valid.sum()))


def test_kl_cov_is_inert_on_policy():
    batch = random_batch(seed=4)  # old_logps None: ratio 1
    logps = batch.logps.clone().requires_grad_(True)
    KLCov(kl_cov_ratio=0.1).micro_batch_terms(batch, logps).extra_loss.sum().backward()
    assert torch.count_nonzero(logps.grad) == 0
