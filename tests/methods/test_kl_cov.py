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


def test_kl_cov_on_policy_with_rescored_old_logps_gives_the_chosen_tokens_a_full_size_random_sign_gradient():
    """TRL's separately re-scored old log-probs (vLLM importance-sampling correction) that differ from the training
    forward's by 1e-6 in either direction: the penalty's gradient is +-coef on every chosen token, not ~1e-6."""
    batch = random_batch(seed=4, old_shift=lambda g, b, t: torch.randn(b, t, generator=g).sign() * 1e-6)
    logps = batch.logps.clone().requires_grad_(True)
    method = KLCov(kl_cov_ratio=0.1, kl_cov_coef=1.0)
    method.micro_batch_terms(batch, logps).extra_loss.sum().backward()
    chosen = method.select(batch)
    assert logps.grad[chosen].abs().eq(1.0).all() and logps.grad[~chosen].eq(0).all()
    signs = logps.grad[chosen]
    assert (signs > 0).any() and (signs < 0).any()


def test_kl_cov_warns_what_it_does_on_policy(tmp_path):
    """On-policy without old log-probs: inert. With vLLM importance-sampling correction: random-sign gradients."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_setup import make_config

    with pytest.warns(UserWarning, match="is inert: TRL keeps no old log-probs"):
        make_config(tmp_path, method="kl_cov", epsilon=1e9, epsilon_high=1e9)
    with pytest.warns(UserWarning, match=r"gradient of \+-kl_cov_coef \(in units of the loss normaliser\) of random"):
        make_config(tmp_path, method="kl_cov", epsilon=1e9, epsilon_high=1e9, use_vllm=True)
