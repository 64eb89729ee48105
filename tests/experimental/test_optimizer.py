"""opefo_trl.experimental.optimizer against torch's own optimizers: the update each step really makes, Adam's
preconditioner, and the optimizers the `param` estimate refuses."""

import pytest
import torch

from opefo_trl.experimental.optimizer import adam_preconditioner, check_optimizer, optimizer_update, param_groups

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_adam_preconditioner_is_torch_adamw_s_own_after_real_steps(amsgrad):
    """D = 1 / (sqrt(v_hat) + eps) of the next step, computed before it from the optimizer's state and the gradient
    about to be applied, against the step torch.optim.AdamW then takes: with beta1 = 0 and no weight decay its update
    is -lr g D, so D = -delta / (lr g). Steps 1, 2 and 10 of gradients of varying scale, float64 parameters. The
    recovered D carries the rounding of the two parameter values, 2 ulp(p) / (lr |g|) (error estimate, per element),
    besides ~1e-15 relative for the two orders of the same float64 expression. Without Adam's bias correction
    1 / (1 - beta2^t), D is off by a factor sqrt(1 - beta2^t): 0.03 at step 1, 0.1 at step 10."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, dtype=torch.float64, generator=gen))
    lr = 1e-3
    optimizer = torch.optim.AdamW([p], lr=lr, betas=(0.0, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=amsgrad)
    group = param_groups(optimizer)[id(p)]
    checked = []
    for step in range(1, 11):
        grad = torch.randn(64, dtype=torch.float64, generator=gen) * 10.0 ** (step % 3 - 1)
        preconditioner = adam_preconditioner(optimizer, group, p, grad)
        before = p.detach().clone()
        p.grad = grad.clone()
        optimizer.step()
        if step in (1, 2, 10):
            recovered = (before - p.detach()) / (lr * grad)
            rounding = 2 * torch.finfo(torch.float64).eps * before.abs().clamp(min=1) / (lr * grad.abs())
            assert ((preconditioner - recovered).abs() <= rounding + 1e-14 * recovered.abs()).all()
            checked.append(step)
    assert checked == [1, 2, 10]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),  # coupled weight decay
        lambda ps: torch.optim.SGD(ps, lr=0.3),
    ],
    ids=["adamw", "adamw_amsgrad", "adam_coupled_decay", "sgd"],
)
def test_optimizer_update_is_the_change_torch_really_makes(make):
    """optimizer_update, read from the state before the step, equals the parameters' change after torch's step, on
    every step (bias corrections, moments, amsgrad, both weight decays), to float64 rounding."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    optimizer = make(params)
    for _ in range(4):
        gradient = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        groups = param_groups(optimizer)
        predicted = [optimizer_update(optimizer, groups[id(p)], p, g) for p, g in zip(params, gradient, strict=True)]
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, gradient, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for p, b, u in zip(params, before, predicted, strict=True):
            torch.testing.assert_close(p.detach() - b, u, rtol=1e-10, atol=1e-14)


def test_preconditioners_refuse_an_optimizer_they_do_not_model():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"'adam' models the update of Adam/AdamW, but the optimizer is SGD"):
        check_optimizer(torch.optim.SGD([p], lr=0.1), "adam")
    with pytest.raises(ValueError, match=r"'none' models the update of plain SGD, but the optimizer is AdamW"):
        check_optimizer(torch.optim.AdamW([p]), "none")
    with pytest.raises(ValueError, match="momentum=0.9"):
        check_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9), "none")
    with pytest.raises(ValueError, match="maximize=True"):
        check_optimizer(torch.optim.AdamW([p], maximize=True), "adam")
    check_optimizer(torch.optim.Adam([p]), "adam")
    check_optimizer(torch.optim.SGD([p], lr=0.1), "none")
