"""OPEFO's step balance and entropy setpoint (opefo_trl.experimental.opefo_step) through the context's step model."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

from opefo_trl.maths.entropy_flow import flow_stats, token_weights, weight_signs
from opefo_trl.methods import OPEFO, SINGLE_PROCESS, MethodContext

sys.path.insert(0, str(Path(__file__).parents[1] / "methods"))  # methods_batch: the method tests' batches
from methods_batch import random_batch  # noqa: E402


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
    decided = method.rollout_weights(batch, MethodContext(step_model=step_model))
    weights = decided.weights
    (signs,) = signs_seen  # the step model is built once, for the weights 1 + lambda * s_t the method applies
    torch.testing.assert_close(signs, weight_signs(batch.flow))
    assert decided.signs is signs  # declared: the trainer writes a + lambda b of this step model
    method.on_optimizer_step()
    metrics = method.pop_metrics()
    assert metrics["opefo/lambda_applied"] == pytest.approx(0.2, abs=1e-7)
    assert abs(metrics["opefo/step_change"]) <= 1e-7 * abs(metrics["opefo/step_change_unweighted"])
    assert metrics["opefo/step_change_unweighted"] == pytest.approx(step_change(0.0))
    assert method.lambda_star == pytest.approx(flow_stats(batch.flow, batch.factor).lambda_star.item())
    torch.testing.assert_close(weights, token_weights(batch.flow, metrics["opefo/lambda_applied"]))
    assert decided.lam == metrics["opefo/lambda_applied"]
    assert len(calls) < 20
    with pytest.raises(ValueError, match="step model"):
        OPEFO(opefo_balance="step").rollout_weights(batch)


def test_opefo_step_balance_without_a_root_in_reach_takes_the_better_end_and_warns_once():
    batch = random_batch(seed=8)
    for change, end in ((lambda lam: -1.0 + 0.1 * lam, 1.0), (lambda lam: 1.0 + 0.1 * lam, -1.0)):
        method = OPEFO(opefo_balance="step")
        with pytest.warns(UserWarning, match=r"no lambda in \[-1, 1\] gives this step the first-order entropy change"):
            weights = method.rollout_weights(
                batch, MethodContext(step_model=lambda signs, change=change: change)
            ).weights
        method.on_optimizer_step()
        assert method.pop_metrics()["opefo/lambda_applied"] == end
        assert weights.min() >= 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            method.rollout_weights(batch, MethodContext(step_model=lambda signs, change=change: change))  # once


def test_a_method_without_a_step_model_is_told_which_estimate_computes_it():
    with pytest.raises(ValueError, match="only entropy_flow_estimate='param' computes"):
        SINGLE_PROCESS.step_change(torch.ones(1, 2))


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
    ],
)
def test_setpoint_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=says):
        OPEFO(**settings)
