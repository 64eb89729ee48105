"""PAR: positive-advantage tokens weighted by the coefficient, the entropy-guided controller over ranks."""

import pytest
import torch
from methods_batch import random_batch

from opefo_trl.methods import (
    PAR,
    MethodContext,
    TokenBatch,
)


def test_par_scales_only_positive_advantage_tokens():
    batch = random_batch(seed=5)
    batch.advantages = torch.tensor([1.5, -0.5, 0.0, 2.0])[:, None].expand_as(batch.logps)
    weights = PAR(par_coef=0.3).micro_batch_terms(batch, batch.logps).weights
    positive = batch.advantages > 0
    assert positive.any() and (~positive).any()
    torch.testing.assert_close(weights[positive], torch.full_like(weights[positive], 0.3))
    assert torch.all(weights[~positive] == 1.0)


def test_par_controller_moves_by_one_step_per_optimizer_step_within_bounds():
    par = PAR(par_coef=None, par_coef_init=0.1, par_entropy_target=0.2, par_coef_step=0.05)
    low = TokenBatch(torch.zeros(1, 4), torch.full((1, 4), 0.1), torch.ones(1, 4), torch.ones(1, 4))
    high = TokenBatch(torch.zeros(1, 4), torch.full((1, 4), 0.9), torch.ones(1, 4), torch.ones(1, 4))
    coefs = []
    for batch in [low, low, low, high] + [high] * 25:
        par.micro_batch_terms(batch, batch.logps)
        par.micro_batch_terms(batch, batch.logps)  # two micro-batches, one optimizer step
        par.on_optimizer_step()
        coefs.append(par.coef)
    assert coefs[:4] == pytest.approx([0.05, 0.0, 0.0, 0.05])
    assert max(coefs) == 1.0 and coefs[-1] == 1.0
    steps = torch.tensor(coefs, dtype=torch.float64).diff().abs()
    assert torch.all(steps <= 0.05 + 1e-9)
    assert par.state_dict() == {"coef": 1.0, "adaptive": True}
    fresh = PAR()
    fresh.load_state_dict(par.state_dict())
    assert fresh.coef == 1.0
    constant = PAR(par_coef=0.3)  # a constant coefficient is configuration: a checkpoint does not override it
    constant.load_state_dict(par.state_dict())
    assert constant.coef == 0.3


def test_par_controller_uses_the_rank_reduced_mean_entropy():
    par = PAR(par_coef=None, par_coef_init=0.5)
    par.micro_batch_terms(
        *(lambda b: (b, b.logps))(
            TokenBatch(torch.zeros(1, 2), torch.full((1, 2), 0.1), torch.ones(1, 2), torch.ones(1, 2))
        )
    )
    # Another rank saw 2 tokens of entropy 0.5: global mean (0.2 + 1.0) / 4 = 0.3 >= 0.2 -> coefficient goes up.
    par.on_optimizer_step(MethodContext(reduce_sum=lambda t: t + torch.tensor([1.0, 2.0], dtype=t.dtype)))
    assert par.coef == pytest.approx(0.55)
    assert par.pop_metrics()["par/entropy"] == pytest.approx(0.3)


def test_par_controller_ignores_tokens_outside_the_loss():
    par = PAR(par_coef=None, par_coef_init=0.5)
    entropies = torch.tensor([[0.1, 0.1, 5.0]])
    factor = torch.tensor([[1.0, 1.0, 0.0]])  # the high-entropy token is masked out of the loss
    par.micro_batch_terms(TokenBatch(torch.zeros(1, 3), entropies, torch.ones(1, 3), factor), torch.zeros(1, 3))
    par.on_optimizer_step()
    assert par.pop_metrics()["par/entropy"] == pytest.approx(0.1)
    assert par.coef == pytest.approx(0.45)
