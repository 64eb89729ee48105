"""opefo_trl.maths.step_model against torch's own optimizers."""

import pytest
import torch

from opefo_trl.maths.step_model import adam_preconditioner, param_groups

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
