"""opefo_trl.experimental.step_model against the real step torch's AdamW takes, and the step balance's root finder."""

import pytest
import torch

from opefo_trl.experimental.optimizer import inner
from opefo_trl.experimental.step_model import StepModel, first_order_change, solve_step_balance

pytestmark = pytest.mark.numerics


def test_the_step_model_is_the_first_order_change_of_the_real_clipped_adamw_step():
    """change(lambda) = <h, delta theta> of torch's AdamW step with the clipped gradient a + lambda b: the gradient
    clip depends on lambda through ||a + lambda b||, and the moments on lambda nonlinearly."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for _ in range(3):  # some history
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        optimizer.step()
    h, a, b = ([torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params] for _ in range(3))
    model = StepModel(optimizer, params, h, a, b, max_grad_norm=1.0)
    state = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    start = [p.detach().clone() for p in params]
    assert len({round(model.clip(lam), 6) for lam in (-0.9, 0.0, 0.4)}) == 3  # the clip depends on lambda
    for lam in (-0.9, 0.0, 0.4):
        assert model.clip(lam) < 1.0  # the clip is active
        predicted = model.change(lam)  # from the state before the step
        for p, ga, gb in zip(params, a, b, strict=True):
            p.grad = ga + lam * gb
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # the Trainer's clipping, by torch, not by the model
        optimizer.step()
        real = inner(h, [p.detach() - s for p, s in zip(params, start, strict=True)])
        assert predicted == pytest.approx(real, rel=1e-9)
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
                optimizer.state[p] = {k: v.clone() for k, v in state[p].items()}


def test_the_step_model_of_float32_parameters_has_a_root_at_adam_s_first_step():
    """Float32 parameters, Adam's first step (update ~ -lr g / (|g| + eps)), gradients a + lambda b that cross zero
    inside [-1, 1]: float32 rounding of a + lambda b near a crossing, divided by eps, makes a float32 evaluation jump
    by ~1e-5 of change(0) between neighbouring lambdas (measured 5.7e-6 on a trainer's first step). Evaluated in
    float64 the model is continuous and the root is found to the solver's tolerance; each evaluation is still the
    real float32 step's first-order change up to that step's own rounding."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.zeros(20_000, dtype=torch.float32, requires_grad=True)]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    b = torch.randn(20_000, generator=gen) * torch.rand(20_000, generator=gen).pow(4)
    crossing = torch.rand(20_000, generator=gen) * 1.6 - 0.6  # where a_i + lambda b_i = 0
    a, h = -crossing * b, torch.randn(20_000, generator=gen)
    model = StepModel(optimizer, params, [h], [a], [b])
    balance = solve_step_balance(model.change)
    assert balance.bracketed and abs(balance.residual) <= 1e-7 * abs(balance.unweighted), balance
    # The model is the real step's first order: torch's float32 step taken at the root.
    params[0].grad = (a.double() + balance.lam * b.double()).float()
    optimizer.step()
    real = inner([h], [params[0].detach()])
    assert abs(real - balance.residual) <= 1e-3 * abs(balance.unweighted)


def test_solve_step_balance_finds_the_root_and_reports_an_unreachable_one():
    result = solve_step_balance(lambda lam: -2e-3 + 1e-2 * lam + 3e-3 * lam**2)
    assert result.bracketed and abs(result.residual) <= 1e-7 * 2e-3 and result.unweighted == -2e-3
    assert result.lam == pytest.approx((-1e-2 + (1e-4 + 4 * 3e-3 * 2e-3) ** 0.5) / 6e-3, rel=1e-6)
    assert result.evaluations < 15
    unreachable = solve_step_balance(lambda lam: -1.0 + 0.1 * lam)
    assert not unreachable.bracketed and unreachable.lam == 1.0 and unreachable.residual == pytest.approx(-0.9)
    assert solve_step_balance(lambda lam: 0.0 * lam).lam == 0.0


def test_first_order_change_skips_parameters_without_a_gradient():
    p, q = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([p, q], lr=0.5)
    h = [torch.ones(2), torch.ones(2)]
    assert first_order_change(optimizer, [p, q], h, [torch.ones(2), None]) == pytest.approx(-1.0)
