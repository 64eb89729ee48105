"""OPEFO: the balancing lambda* of the factor-weighted flow, the step balance through the context's step model,
the ablations and the regime guard."""

import dataclasses
import warnings

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.maths.entropy_flow import flow_stats, token_weights, weight_signs
from opefo_trl.methods import (
    OPEFO,
    REGIME_GUARD,
    SINGLE_PROCESS,
    MethodContext,
    TokenBatch,
)


def test_opefo_rollout_weights_balance_the_flow_and_report_metrics():
    batch = random_batch(seed=6)
    method = OPEFO()
    weights = method.rollout_weights(batch)
    stats = flow_stats(batch.flow, batch.factor)
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/lambda"] == pytest.approx(stats.lambda_star.item())
    assert metrics["opefo/lambda_applied"] == pytest.approx(stats.lambda_star.item())
    assert abs(metrics["opefo/weighted_net"]) < 1e-5 * (stats.increase + stats.decrease).item()
    assert not any(name.startswith("entropy_flow/") for name in metrics)  # the diagnostics' prefix is not OPEFO's
    assert weights.shape == batch.logps.shape
    method.on_optimizer_step()  # a second optimizer step on the same rollout batch (off-policy opt-in) logs it too
    assert method.pop_metrics() == metrics


def test_opefo_balances_the_factor_weighted_flow():
    batch = random_batch(seed=8)
    batch.factor = torch.rand(batch.factor.shape, generator=torch.Generator().manual_seed(0)) * batch.factor
    batch.factor[1] = 0.0  # a sequence the loss drops
    weights = OPEFO().rollout_weights(batch)
    effective = (batch.factor * weights * batch.flow).double().sum()
    gross = (batch.factor * batch.flow.abs()).double().sum()
    assert abs(effective.item()) <= 1e-6 * gross.item()
    unweighted = (batch.factor * batch.flow).double().sum()
    assert abs(unweighted.item()) > 1e-3 * gross.item()


def test_opefo_step_balance_takes_the_root_of_the_step_change():
    """opefo_balance='step': lambda is where the step model's first-order change is 0, not the paper's lambda*."""
    batch = random_batch(seed=8)
    calls = []

    def step_change(lam):  # smooth, nonlinear in lambda (Adam's moments), root at 0.2
        calls.append(lam)
        return 3e-3 * (lam - 0.2) + 1e-3 * (lam**3 - 0.2**3)

    signs_seen = []

    def step_model(signs):
        signs_seen.append(signs)
        return step_change

    method = OPEFO(opefo_balance="step")
    weights = method.rollout_weights(batch, MethodContext(step_model=step_model))
    (signs,) = signs_seen  # the step model is built once, for the weights 1 + lambda * s_t the method applies
    torch.testing.assert_close(signs, weight_signs(batch.flow))
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/lambda_applied"] == pytest.approx(0.2, abs=1e-7)
    assert abs(metrics["opefo/step_change"]) <= 1e-7 * abs(metrics["opefo/step_change_unweighted"])
    assert metrics["opefo/step_change_unweighted"] == pytest.approx(step_change(0.0))
    assert metrics["opefo/lambda"] == pytest.approx(flow_stats(batch.flow, batch.factor).lambda_star.item())
    torch.testing.assert_close(weights, token_weights(batch.flow, metrics["opefo/lambda_applied"]))
    assert len(calls) < 20
    with pytest.raises(ValueError, match="step model"):
        OPEFO(opefo_balance="step").rollout_weights(batch)


def test_opefo_step_balance_without_a_root_in_reach_takes_the_better_end_and_warns_once():
    batch = random_batch(seed=8)
    for change, end in ((lambda lam: -1.0 + 0.1 * lam, 1.0), (lambda lam: 1.0 + 0.1 * lam, -1.0)):
        method = OPEFO(opefo_balance="step")
        with pytest.warns(UserWarning, match=r"no lambda in \[-1, 1\] gives this step the first-order entropy change"):
            weights = method.rollout_weights(batch, MethodContext(step_model=lambda signs, change=change: change))
        method.on_optimizer_step()
        assert method.pop_metrics()["opefo/lambda_applied"] == end
        assert weights.min() >= 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method.rollout_weights(batch, MethodContext(step_model=lambda signs, change=change: change))  # once


def test_opefo_weight_signs_make_the_weights_affine_in_lambda():
    batch = random_batch(seed=3)
    for sides in ("both", "increase_only", "decrease_only"):
        signs = weight_signs(batch.flow, sides)
        for lam in (-0.7, 0.003, 1.0):
            torch.testing.assert_close(token_weights(batch.flow, lam, sides), 1.0 + lam * signs)


def test_a_method_without_a_step_model_is_told_which_estimate_computes_it():
    with pytest.raises(ValueError, match="only entropy_flow_estimate='param' computes"):
        SINGLE_PROCESS.step_change(torch.ones(1, 2))


@pytest.mark.parametrize("empty", ["increase", "decrease"])
def test_a_one_sided_batch_warns_once_with_the_figures(empty):
    """P = 0 or N = 0: lambda* = +/-1 zeroes the other side's weights; the user is told at the first occurrence."""
    batch = random_batch(seed=9)
    batch.flow = -batch.flow.abs() if empty == "increase" else batch.flow.abs()
    method = OPEFO()
    with pytest.warns(UserWarning, match=r"is empty: P=.*N=.*gives every S. token weight 0") as caught:
        weights = method.rollout_weights(batch)
    assert ("S+ is empty" in str(caught[0].message)) == (empty == "increase")
    assert weights.abs().max() == 0.0  # every token carries flow, every one gets weight 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        method.rollout_weights(batch)  # warned once


def test_opefo_needs_the_flow():
    batch = random_batch()
    batch.flow = None
    with pytest.raises(ValueError, match="TokenBatch.flow"):
        OPEFO().rollout_weights(batch)


def test_opefo_fixed_lambda_and_sides():
    batch = random_batch(seed=7)
    flow = batch.flow
    weights = OPEFO(opefo_lambda=0.001, opefo_sides="increase_only").rollout_weights(batch)
    torch.testing.assert_close(weights[flow > 0], torch.full_like(weights[flow > 0], 1.001))
    assert torch.all(weights[flow <= 0] == 1.0)
    assert torch.all(OPEFO(opefo_lambda=0.0).rollout_weights(batch) == 1.0)


def test_regime_guard_warns_once_when_lambda_stays_large():
    method = OPEFO(opefo_lambda_warn=0.1)
    batch = random_batch(seed=9)
    batch.flow = -batch.flow.abs()  # every token decreases entropy: lambda* = 1
    for _ in range(OPEFO.REGIME_WINDOW - 1):
        method.rollout_weights(batch)
        assert method.regime_warning() is None  # fewer than 20 steps: no verdict yet
    method.rollout_weights(batch)
    message = method.regime_warning()
    assert "averaged over the last 20 optimizer steps is 1" in message and "entropy_flow_estimate='param'" in message
    assert "entropy_flow_audit_steps" in message
    method.rollout_weights(batch)
    assert method.regime_warning() is None  # once


def test_regime_guard_warns_once_when_entropy_climbs_far_above_its_start():
    """The second trigger: the rollout's mean token entropy above 1.2x the first rollout's (the divergence the demo
    diagnosed happened with |lambda*| ~ 0.04, where the lambda trigger stays quiet). The advice follows the
    estimate: the tabular one is told why it can mislead, `param` with the batch balance is sent to the step balance."""
    batch = random_batch(seed=9)
    for estimate, says in (("opefo", "(no factor pi)"), ("param", "opefo_balance='step', which zeroes")):
        method = OPEFO(flow_estimate=estimate)
        method.rollout_weights(batch)
        assert method.regime_warning() is None
        method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 1.15))  # healthy runs peak here
        assert method.regime_warning() is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the one-sided warning does not apply; nothing else may warn here)
            method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 1.3))
        message = method.regime_warning()
        assert message.startswith(REGIME_GUARD) and "1.30x the first rollout's" in message and says in message
        method.rollout_weights(dataclasses.replace(batch, entropies=batch.entropies * 2.0))
        assert method.regime_warning() is None  # once


def test_regime_guard_stays_quiet_in_the_paper_regime():
    method = OPEFO()
    gen = torch.Generator().manual_seed(1)
    flow = torch.randn(8, 64, generator=gen)
    flow = flow - flow.mean()  # a balanced flow: lambda* ~ 0
    batch = TokenBatch(flow, flow.abs(), torch.ones_like(flow), torch.ones_like(flow), flow=flow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3 * OPEFO.REGIME_WINDOW):
            method.rollout_weights(batch)
            assert method.regime_warning() is None


def test_an_entropy_setpoint_solves_for_its_share_of_the_gap():
    """opefo_entropy_target: lambda makes the step's first-order change rate * (target - H), H the context's entropy
    (the step model's batch or probe), not 0; the metrics give the change reached and the one asked for."""
    batch = random_batch(seed=8)

    def step_change(lam):
        return 3e-3 * (lam - 0.2) + 1e-3 * (lam**3 - 0.2**3)

    method = OPEFO(opefo_balance="step", opefo_entropy_target=1.5, opefo_entropy_target_rate=0.5)
    method.rollout_weights(batch, MethodContext(step_model=lambda signs: step_change, entropy=1.498))
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/step_target"] == pytest.approx(0.5 * (1.5 - 1.498))
    assert metrics["opefo/step_change"] == pytest.approx(metrics["opefo/step_target"], rel=1e-6)
    assert step_change(metrics["opefo/lambda_applied"]) == pytest.approx(1e-3, rel=1e-6)
    assert metrics["opefo/step_change_unweighted"] == pytest.approx(step_change(0.0))
    with pytest.raises(ValueError, match="MethodContext.entropy"):
        method.rollout_weights(batch, MethodContext(step_model=lambda signs: step_change))


@pytest.mark.parametrize(
    "settings, says",
    [
        (dict(opefo_entropy_target=1.0), "only opefo_balance='step' solves for"),
        (dict(opefo_balance="step", opefo_entropy_target=-0.1), "mean token entropy"),
        (dict(opefo_balance="step", opefo_entropy_target=float("nan")), "mean token entropy"),
        (dict(opefo_balance="step", opefo_entropy_target=1.0, opefo_entropy_target_rate=0.0), r"in \(0, 1\]"),
        (dict(opefo_low_prob=1.0), r"probability in \(0, 1\)"),
    ],
)
def test_setpoint_and_low_probability_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=says):
        OPEFO(**settings)


def test_the_flow_share_of_negligible_tokens_is_logged_and_warned_once_when_the_balance_rests_on_it():
    batch = random_batch(seed=4)
    batch.logps = torch.full_like(batch.logps, -0.1)  # every token likely ...
    batch.logps[:, :10] = -6.0  # ... but ten per sequence, sampled at probability 0.0025
    method = OPEFO(opefo_lambda=0.0, opefo_lambda_warn=2.0)  # (|lambda*| <= 1: only the new trigger can fire)
    method.rollout_weights(batch)
    method.on_optimizer_step()
    share = method.pop_metrics()["opefo/low_prob_flow_share"]
    moved = (batch.factor * batch.flow).abs().double()
    assert share == pytest.approx(float(moved[:, :10].sum() / moved.sum()))
    assert 0 < share < 0.5
    lower = OPEFO(opefo_lambda=0.0, opefo_low_prob=0.001)  # the floor is the user's: 0.0025 is not below 0.001
    lower.rollout_weights(batch)
    lower.on_optimizer_step()
    assert lower.pop_metrics()["opefo/low_prob_flow_share"] == 0.0
    quiet = OPEFO(opefo_lambda=0.0, opefo_lambda_warn=2.0)
    for _ in range(OPEFO.REGIME_WINDOW):
        quiet.rollout_weights(batch)
    assert quiet.regime_warning() is None
    batch.flow[:, 10:] *= 1e-3  # the flow now sits on the negligible tokens
    for step in range(OPEFO.REGIME_WINDOW):
        method.rollout_weights(batch)
        if step < OPEFO.REGIME_WINDOW - 2:
            assert method.regime_warning() is None
    message = method.regime_warning()
    assert message.startswith(REGIME_GUARD) and "opefo/low_prob_flow_share" in message
    method.rollout_weights(batch)
    assert method.regime_warning() is None  # once
