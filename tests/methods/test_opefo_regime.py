"""OPEFO's regime watch (opefo_trl.methods.opefo_regime): the guard's warnings and the flow share of negligible
tokens."""

import dataclasses
import warnings

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.methods import OPEFO, REGIME_GUARD, TokenBatch
from opefo_trl.methods.opefo_regime import RegimeWatch


def optimizer_step(method, batch):
    """One optimizer step on a rollout batch: its weights, then the step's end, where the regime watch sees it."""
    method.rollout_weights(batch)
    method.on_optimizer_step()


def test_regime_guard_warns_once_when_lambda_stays_large():
    method = OPEFO(opefo_lambda_warn=0.1)
    batch = random_batch(seed=9)
    batch.flow = -batch.flow.abs()  # every token decreases entropy: lambda* = 1
    for _ in range(RegimeWatch.WINDOW - 1):
        optimizer_step(method, batch)
        assert method.regime_warning() is None  # fewer than 20 steps: no verdict yet
    optimizer_step(method, batch)
    message = method.regime_warning()
    assert "averaged over the last 20 optimizer steps is 1" in message and "entropy_flow_estimate='param'" in message
    assert "entropy_flow_audit_steps" in message
    optimizer_step(method, batch)
    assert method.regime_warning() is None  # once


def test_regime_guard_warns_once_when_entropy_climbs_far_above_its_start():
    """The second trigger: the rollout's mean token entropy above 1.2x the first rollout's (the divergence the demo
    diagnosed happened with |lambda*| ~ 0.04, where the lambda trigger stays quiet). The advice follows the
    estimate: the tabular one is told why it can mislead, `param` with the batch balance is sent to the step balance."""
    batch = random_batch(seed=9)
    for estimate, says in (("opefo", "(no factor pi)"), ("param", "opefo_balance='step', which zeroes")):
        method = OPEFO(flow_estimate=estimate)
        optimizer_step(method, batch)
        assert method.regime_warning() is None
        optimizer_step(method, dataclasses.replace(batch, entropies=batch.entropies * 1.15))  # healthy runs peak here
        assert method.regime_warning() is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the one-sided warning does not apply; nothing else may warn here)
            optimizer_step(method, dataclasses.replace(batch, entropies=batch.entropies * 1.3))
        message = method.regime_warning()
        assert message.startswith(REGIME_GUARD) and "1.30x the first rollout's" in message and says in message
        optimizer_step(method, dataclasses.replace(batch, entropies=batch.entropies * 2.0))
        assert method.regime_warning() is None  # once


def test_regime_guard_stays_quiet_in_the_paper_regime():
    method = OPEFO()
    gen = torch.Generator().manual_seed(1)
    flow = torch.randn(8, 64, generator=gen)
    flow = flow - flow.mean()  # a balanced flow: lambda* ~ 0
    batch = TokenBatch(flow, flow.abs(), torch.ones_like(flow), torch.ones_like(flow), flow=flow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3 * RegimeWatch.WINDOW):
            optimizer_step(method, batch)
            assert method.regime_warning() is None


def test_the_flow_share_of_negligible_tokens_is_logged_and_warned_once_when_the_balance_rests_on_it():
    batch = random_batch(seed=4)
    batch.logps = torch.full_like(batch.logps, -0.1)  # every token likely ...
    batch.logps[:, :10] = -6.0  # ... but ten per sequence, sampled at probability 0.0025
    method = OPEFO(opefo_lambda=0.0, opefo_lambda_warn=2.0)  # (|lambda*| <= 1: only the new trigger can fire)
    optimizer_step(method, batch)
    share = method.pop_metrics()["opefo/low_prob_flow_share"]
    moved = (batch.factor * batch.flow).abs().double()
    assert share == pytest.approx(float(moved[:, :10].sum() / moved.sum()))
    assert 0 < share < 0.5
    lower = OPEFO(opefo_lambda=0.0, opefo_low_prob=0.001)  # the floor is the user's: 0.0025 is not below 0.001
    optimizer_step(lower, batch)
    assert lower.pop_metrics()["opefo/low_prob_flow_share"] == 0.0
    quiet = OPEFO(opefo_lambda=0.0, opefo_lambda_warn=2.0)
    for _ in range(RegimeWatch.WINDOW):
        optimizer_step(quiet, batch)
    assert quiet.regime_warning() is None
    batch.flow[:, 10:] *= 1e-3  # the flow now sits on the negligible tokens
    for step in range(RegimeWatch.WINDOW):
        optimizer_step(method, batch)
        if step < RegimeWatch.WINDOW - 2:
            assert method.regime_warning() is None
    message = method.regime_warning()
    assert message.startswith(REGIME_GUARD) and "opefo/low_prob_flow_share" in message
    optimizer_step(method, batch)
    assert method.regime_warning() is None  # once


def test_the_low_probability_setting_is_checked():
    with pytest.raises(ValueError, match=r"probability in \(0, 1\)"):
        OPEFO(opefo_low_prob=1.0)
