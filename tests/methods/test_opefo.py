"""OPEFO as in the paper: the balancing lambda* of the factor-weighted flow, the weights it declares, the
static-lambda and one-sided ablations."""

import warnings

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.maths.entropy_flow import flow_stats, token_weights, weight_signs
from opefo_trl.methods import OPEFO


def test_opefo_rollout_weights_balance_the_flow_and_report_metrics():
    batch = random_batch(seed=6)
    method = OPEFO()
    weights = method.rollout_weights(batch).weights
    stats = flow_stats(batch.flow, batch.factor)
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert method.lambda_star == pytest.approx(stats.lambda_star.item())
    assert metrics["opefo/lambda_applied"] == pytest.approx(stats.lambda_star.item())  # nothing else logs lambda*
    assert abs(metrics["opefo/weighted_net"]) < 1e-5 * (stats.increase + stats.decrease).item()
    assert not any(name.startswith("entropy_flow/") for name in metrics)  # the diagnostics' prefix is not OPEFO's
    assert weights.shape == batch.logps.shape
    method.on_optimizer_step()  # a second optimizer step on the same rollout batch (off-policy opt-in) logs it too
    assert method.pop_metrics() == metrics


@pytest.mark.parametrize(
    "settings, logged",
    [(dict(), False), (dict(opefo_lambda=0.001), True), (dict(entropy_flow_diagnostics=False), True)],
    ids=["lambda_star", "static_lambda", "no_diagnostics"],
)
def test_the_lambda_applied_is_logged_once_under_one_name(settings, logged):
    """In a trainer on-policy with the diagnostics, entropy_flow/lambda logs the lambda* OPEFO applies, so OPEFO logs
    its lambda only when it is another (a fixed lambda) or nothing else logs it (diagnostics off); off-policy the step's
    lambda* is not the rollout batch's, so it is logged too."""
    from opefo_trl import OPEFOConfig

    common = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    for config, expected in [
        (OPEFOConfig(**common, **settings), logged),
        (OPEFOConfig(**common, **settings, num_iterations=2, allow_off_policy=True), True),
    ]:
        method = OPEFO.from_config(config)
        decided = method.rollout_weights(random_batch(seed=6))
        method.on_optimizer_step()
        metrics = method.pop_metrics()
        assert ("opefo/lambda_applied" in metrics) is expected
        assert metrics.get("opefo/lambda_applied", decided.lam) == decided.lam
        assert "opefo/lambda" not in metrics and "opefo/weighted_net" in metrics


def test_opefo_balances_the_factor_weighted_flow():
    batch = random_batch(seed=8)
    batch.factor = torch.rand(batch.factor.shape, generator=torch.Generator().manual_seed(0)) * batch.factor
    batch.factor[1] = 0.0  # a sequence the loss drops
    weights = OPEFO().rollout_weights(batch).weights
    effective = (batch.factor * weights * batch.flow).double().sum()
    gross = (batch.factor * batch.flow.abs()).double().sum()
    assert abs(effective.item()) <= 1e-6 * gross.item()
    unweighted = (batch.factor * batch.flow).double().sum()
    assert abs(unweighted.item()) > 1e-3 * gross.item()


def test_opefo_weight_signs_make_the_weights_affine_in_lambda():
    batch = random_batch(seed=3)
    for sides in ("both", "increase_only", "decrease_only"):
        signs = weight_signs(batch.flow, sides)
        for lam in (-0.7, 0.003, 1.0):
            torch.testing.assert_close(token_weights(batch.flow, lam, sides), 1.0 + lam * signs)


@pytest.mark.parametrize("empty", ["increase", "decrease"])
def test_a_one_sided_batch_warns_once_with_the_figures(empty):
    """P = 0 or N = 0: lambda* = +/-1 zeroes the other side's weights; the user is told at the first occurrence."""
    batch = random_batch(seed=9)
    batch.flow = -batch.flow.abs() if empty == "increase" else batch.flow.abs()
    method = OPEFO()
    with pytest.warns(UserWarning, match=r"is empty: P=.*N=.*gives every S. token weight 0") as caught:
        weights = method.rollout_weights(batch).weights
        method.on_optimizer_step()  # the regime watch sees the rollout at the step's end
    assert ("S+ is empty" in str(caught[0].message)) == (empty == "increase")
    assert weights.abs().max() == 0.0  # every token carries flow, every one gets weight 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method.rollout_weights(batch)  # warned once
        method.on_optimizer_step()


def test_opefo_needs_the_flow():
    batch = random_batch()
    batch.flow = None
    with pytest.raises(ValueError, match="TokenBatch.flow"):
        OPEFO().rollout_weights(batch)


def test_opefo_fixed_lambda_and_sides():
    batch = random_batch(seed=7)
    flow = batch.flow
    weights = OPEFO(opefo_lambda=0.001, opefo_sides="increase_only").rollout_weights(batch).weights
    torch.testing.assert_close(weights[flow > 0], torch.full_like(weights[flow > 0], 1.001))
    assert torch.all(weights[flow <= 0] == 1.0)
    assert torch.all(OPEFO(opefo_lambda=0.0).rollout_weights(batch).weights == 1.0)


@pytest.mark.parametrize("settings", [dict(), dict(opefo_lambda=0.3, opefo_sides="decrease_only")])
def test_opefo_declares_its_weights_as_one_plus_lambda_times_the_signs(settings):
    """What the trainer reads to write a + lambda b: the lambda applied and the signs s_t of w_t = 1 + lambda s_t."""
    batch = random_batch(seed=6)
    method = OPEFO(**settings)
    decided = method.rollout_weights(batch)
    method.on_optimizer_step()
    assert decided.lam == method.pop_metrics()["opefo/lambda_applied"]
    assert torch.equal(decided.signs, weight_signs(batch.flow, method.settings.opefo_sides))
    assert torch.equal(decided.weights, 1.0 + torch.tensor(decided.lam) * decided.signs)
