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
    for _ in range(RegimeWatch.EARLY_STEPS - 1):
        optimizer_step(method, batch)
        assert method.regime_warning() is None  # fewer than 3 steps: no verdict yet
    optimizer_step(method, batch)
    message = method.regime_warning()
    assert "averaged over the first 3 optimizer steps (one-sided 95% lower bound 1) is 1" in message
    assert "entropy_flow_estimate='param'" in message and "entropy_flow_audit_steps" in message
    optimizer_step(method, batch)
    assert method.regime_warning() is None  # once


def lambda_batch(lam):
    """A rollout batch of two likely tokens whose flows make lambda* = ``lam``: P = 1 - lam, N = 1 + lam."""
    flow = torch.tensor([[1.0 - lam, -(1.0 + lam)]])
    ones = torch.ones_like(flow)
    return TokenBatch(logps=-0.1 * ones, entropies=ones, advantages=ones, factor=ones, flow=flow)


def first_warning_step(method, lambdas):
    """The optimizer step (from 1) after which the guard first warns, and its message; (None, None) if it never does."""
    for step, lam in enumerate(lambdas, 1):
        optimizer_step(method, lambda_batch(lam))
        message = method.regime_warning()
        if message is not None:
            return step, message
    return None, None


#: |lambda*| of the paper's estimate on SmolLM2-135M-Instruct's first four GRPO rollouts (benchmarks/real_flow.py;
#: docs/algorithm.md, "On a real pretrained model").
REAL_MODEL_LAMBDAS = [0.383, 0.254, 0.189, 0.615]


def test_regime_guard_warns_within_the_first_steps_of_a_real_model_run_out_of_the_regime():
    """A real model's step takes minutes on a CPU, and a full window of 20 steps told a shorter run nothing. The
    paper's estimate's |lambda*| on the real model's first rollouts is out of the regime by step 3: their mean 0.275,
    its one-sided 95% lower bound 0.109 > 0.1."""
    step, message = first_warning_step(OPEFO(), REAL_MODEL_LAMBDAS)
    assert step == 3
    assert message.startswith(REGIME_GUARD)
    assert "averaged over the first 3 optimizer steps (one-sided 95% lower bound 0.109) is 0.275" in message


def test_regime_guard_waits_for_evidence_on_noisy_first_steps():
    """A healthy run's |lambda*| (the demo's digit task averages 0.04) with a few large steps: no early verdict, and
    none over the full window either."""
    lambdas = [0.15, 0.02, 0.12, 0.01, 0.03, 0.2, 0.02, 0.04, 0.01, 0.03] * 6
    assert first_warning_step(OPEFO(), lambdas) == (None, None)


def test_regime_guards_early_quantiles_are_students_t():
    """The one-sided 95% quantiles of the early verdict, for every step count before the window is full, against
    the tail of Student's t density integrated numerically."""
    assert sorted(RegimeWatch.T95) == list(range(RegimeWatch.EARLY_STEPS - 1, RegimeWatch.WINDOW - 1))
    x = torch.linspace(0.0, 2000.0, 4_000_001, dtype=torch.float64)
    for dof, quantile in RegimeWatch.T95.items():
        log_norm = torch.lgamma(torch.tensor((dof + 1) / 2.0)) - torch.lgamma(torch.tensor(dof / 2.0))
        density = torch.exp(log_norm - 0.5 * torch.log(torch.tensor(dof * torch.pi)))
        density = density * (1 + x**2 / dof) ** (-(dof + 1) / 2)
        tail = torch.trapezoid(density.where(x >= quantile, 0.0), x)
        assert float(tail) == pytest.approx(0.05, abs=2e-4), dof


def test_regime_guard_warns_once_when_entropy_climbs_far_above_its_start():
    """The second trigger: the rollout's mean token entropy above 1.2x the first rollout's (the divergence the demo
    diagnosed happened with |lambda*| ~ 0.04, where the lambda trigger stays quiet). The advice follows the
    estimate: the tabular one is told why it can mislead, `param` with the batch balance is sent to the step balance."""
    batch = random_batch(seed=9)
    for estimate, says in (("opefo", "(no factor pi)"), ("param", "opefo_balance='step', which zeroes")):
        method = OPEFO(flow_estimate=estimate, opefo_lambda_warn=2.0)  # (|lambda*| <= 1: only this trigger fires)
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
    messages = []
    for _ in range(RegimeWatch.WINDOW):
        optimizer_step(method, batch)
        messages.append(method.regime_warning())
    # After one step at a share of 0.19 and four at 0.996 the lower bound of the mean (0.49) is still below one half:
    # the early verdict waits for evidence; the next step decides.
    assert messages[:4] == [None] * 4 and messages[4] is not None and messages[5:] == [None] * (len(messages) - 5)
    message = messages[4]
    assert message.startswith(REGIME_GUARD) and "opefo/low_prob_flow_share" in message
    assert "over the first 6 optimizer steps" in message
    optimizer_step(method, batch)
    assert method.regime_warning() is None  # once


def test_the_low_probability_setting_is_checked():
    with pytest.raises(ValueError, match=r"probability in \(0, 1\)"):
        OPEFO(opefo_low_prob=1.0)


def biased_batch(lam, bias_part):
    """``lambda_batch(lam)`` whose estimate's on-policy mean accounts for ``bias_part`` of its lambda*:
    lambda_bias = -bias_net / (P + N) with P + N = 2."""
    batch = lambda_batch(lam)
    return dataclasses.replace(batch, flow_bias=torch.tensor([[-2.0 * bias_part, 0.0]]))


def test_regime_guard_judges_lambda_star_net_of_the_estimates_bias_and_says_so():
    """A lambda* that the estimate's on-policy mean accounts for is no imbalance of the batch: the guard judges
    lambda* - lambda_bias, and its message names which part it saw."""
    explained = OPEFO(opefo_lambda_warn=0.1)
    for _ in range(RegimeWatch.WINDOW):
        optimizer_step(explained, biased_batch(0.5, bias_part=0.45))  # 0.05 left: in the regime
        assert explained.regime_warning() is None
    imbalanced = OPEFO(opefo_lambda_warn=0.1)
    for _ in range(RegimeWatch.EARLY_STEPS):
        optimizer_step(imbalanced, biased_batch(0.5, bias_part=0.1))  # 0.4 left
        message = imbalanced.regime_warning()
    assert message is not None  # at the third step, the earliest verdict
    assert "net of the estimate's on-policy bias (entropy_flow/lambda_net_of_bias" in message
    assert "lambda_bias, averaged 0.1 in absolute value" in message and ") is 0.4 " in message
    unknown = OPEFO(opefo_lambda_warn=0.1)
    for _ in range(RegimeWatch.EARLY_STEPS):
        optimizer_step(unknown, lambda_batch(0.5))  # no bias computed: the whole lambda* is judged
    assert "with any bias of the estimate in it" in unknown.regime_warning()
