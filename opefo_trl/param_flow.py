"""The exact first-order entropy flow through a network's parameters: the ``param`` estimate (docs/algorithm.md s. 4).

Pure torch, no TRL import. The tabular estimates of ``entropy_flow`` treat each position's logits as free
parameters; in a network all positions share the parameters theta, so one token's update moves the entropy at every
position. With Hbar the mean token entropy of the rollout batch's completion positions and an update
delta theta = eta D sum_t c_t w_t A_t grad log pi_t (D: the optimizer's diagonal preconditioner), to first order

    delta Hbar = eta sum_t c_t w_t d_t,    d_t = A_t u_t,    u_t = <D grad_theta Hbar, grad_theta log pi_t>.

u_t for every token at once is a Jacobian-vector product of theta -> (log pi_t)_t in the direction v = D grad Hbar.
We take it by a central finite difference in float32,

    u_t ~ (log pi_t(theta + e v) - log pi_t(theta - e v)) / (2 e),

rather than by forward-mode AD, because the log-probabilities come from TRL's fused, chunked LM-head kernel (a
custom autograd function with no forward-mode rule) and through PEFT and DDP wrappers, all of which an ordinary
forward pass handles unchanged. The step e is relative to the parameters' size (``FD_RELATIVE_STEPS``) and checked on
every batch: the same two forwards give the finite-difference derivative of Hbar along v, which must equal the exact
<grad Hbar, D grad Hbar> computed from the gradient (``relative_error``); the trainer tries the next step size when it
does not, and logs the discrepancy.

Example (a linear softmax policy, where everything can be checked by hand):
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True); x = torch.randn(4, 3, dtype=torch.float64)
    >>> def logp_and_entropy():
    ...     logp = torch.log_softmax(x @ W.T, -1)
    ...     return logp[:, 0], -(logp.exp() * logp).sum(-1)
    >>> grad = torch.autograd.grad(logp_and_entropy()[1].mean(), W)[0]
    >>> step = finite_difference_step([W], [grad])
    >>> plus, minus = evaluate_on_both_sides([W], [grad], step, lambda: logp_and_entropy()[0])
    >>> u = (plus - minus) / (2 * step)
    >>> exact = torch.autograd.grad(logp_and_entropy()[0].sum(), W)[0]
    >>> bool(torch.allclose(u.sum(), (exact * grad).sum(), rtol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Sizes of the finite-difference perturbation relative to the norm of the trainable parameters, tried in this order
#: until the check passes: large enough that a float32 forward resolves the change of log pi (rounding ~1e-7 / step),
#: small enough that the curvature term stays small (measured on the tiny test model: 1e-4 gave 0.02-0.2% error along
#: both the raw and the Adam-preconditioned entropy gradient; 1e-3 up to 5% along the raw one).
FD_RELATIVE_STEPS = (1e-4, 1e-3, 1e-5)


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Euclidean norm of a list of tensors taken as one vector (fp64 accumulation)."""
    return float(
        torch.sqrt(sum((t.detach().double().square().sum() for t in tensors), torch.zeros((), dtype=torch.float64)))
    )


def finite_difference_step(
    params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], relative: float = FD_RELATIVE_STEPS[0]
) -> float:
    """e such that the perturbation e * direction has norm ``relative * max(|theta|, 1)``, |theta| the parameters'
    norm. Raises when the direction is zero (there is nothing to difference)."""
    direction_norm = global_norm(direction)
    if direction_norm == 0.0:
        raise ValueError("The finite-difference direction is zero; there is no entropy gradient to follow.")
    return relative * max(global_norm(params), 1.0) / direction_norm


@torch.no_grad()
def evaluate_on_both_sides(
    params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], step: float, evaluate: Callable[[], Any]
) -> tuple[Any, Any]:
    """``evaluate()`` at theta + step * direction and at theta - step * direction; the parameters are restored
    bit for bit afterwards (from a copy), whatever ``evaluate`` raises."""
    backup = [p.detach().clone() for p in params]
    try:
        results = []
        for sign in (1.0, -1.0):
            for p, v in zip(params, direction, strict=True):
                p.add_(v.to(p.dtype), alpha=sign * step)
            results.append(evaluate())
            for p, saved in zip(params, backup, strict=True):
                p.copy_(saved)
        return results[0], results[1]
    finally:
        for p, saved in zip(params, backup, strict=True):
            p.copy_(saved)


def _adam_group(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> tuple[dict, dict]:
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    state = optimizer.state.get(p) or {}
    if "betas" not in group or (state and "exp_avg_sq" not in state):
        raise ValueError(
            f"entropy_flow_preconditioner='adam' needs Adam's moments, but {type(optimizer).__name__} keeps no "
            "'exp_avg_sq'. Use an Adam optimizer (optim='adamw_torch') or entropy_flow_preconditioner='none'."
        )
    return group, state


@torch.no_grad()
def adam_preconditioner_(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], gradient: Sequence[torch.Tensor]
) -> float:
    """Overwrite ``gradient`` (this step's loss gradient, one fp32 tensor per parameter) with the diagonal
    preconditioner D of the next Adam/AdamW update, and return the weight of this batch's gradient in it.

    Adam's update is -lr * m_hat_t / (sqrt(v_hat_t) + eps) with m_t = beta1 m_{t-1} + (1 - beta1) g_t and
    v_t = beta2 v_{t-1} + (1 - beta2) g_t^2, i.e. -lr * ((1 - beta1) / (1 - beta1^t) * D g_t + D momentum) with
    D = 1 / (sqrt(v_hat_t) + eps). v_t is estimated from the stored second moments and this batch's gradient (which
    matters: early in training, and for parameters such as the embedding rows of rare tokens, g_t^2 dominates v_t).
    In place, so that the estimate costs no memory beyond the gradient buffer. Raises ValueError for an optimizer
    without Adam's moments.

    The returned weight is that of the parameters Adam has stepped most often (torch's AdamW steps every parameter
    that has a gradient, so normally all of them); a parameter whose first gradient comes later really gets weight
    1 on its first step, an approximation this single scale does not capture.
    """
    scales = [1.0]
    for p, g in zip(params, gradient, strict=True):
        group, state = _adam_group(optimizer, p)
        (beta1, beta2), eps = group["betas"], group["eps"]
        step = float(state.get("step", 0)) + 1
        v = g.square_().mul_(1 - beta2)
        if state:
            v.add_(state["exp_avg_sq"].float(), alpha=beta2)
            if group.get("amsgrad"):
                torch.maximum(v, state["max_exp_avg_sq"].float(), out=v)
        v.div_(1 - beta2**step).sqrt_().add_(eps).reciprocal_()
        scales.append((1 - beta1) / (1 - beta1**step))
    return min(scales)  # (1 - beta1) / (1 - beta1^t) falls with t: the most-stepped parameters


@torch.no_grad()
def adam_momentum_term(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor]
) -> float:
    """<direction, beta1 m_{t-1} / (1 - beta1^t)>: what earlier batches carry into the next Adam step, seen along
    ``direction`` (0 before the first step)."""
    total = 0.0
    for p, v in zip(params, direction, strict=True):
        group, state = _adam_group(optimizer, p)
        if state:
            beta1 = group["betas"][0]
            step = float(state["step"]) + 1
            total += float((v.double() * state["exp_avg"].double()).sum()) * beta1 / (1 - beta1**step)
    return total


def inner(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """sum_i <a_i, b_i> over two lists of tensors (fp64 accumulation)."""
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)))


def predicted_entropy_change(
    learning_rate: float, clip: float, applied_net: float, gradient_scale: float = 1.0, momentum_term: float = 0.0
) -> float:
    """First-order change of Hbar made by one optimizer step: lr * (gradient_scale * clip * applied_net -
    momentum_term), with applied_net = sum_t f_t w_t d_t the flow of the update the loss applies, clip the gradient
    clipping coefficient, and momentum_term = <D grad Hbar, momentum> (Adam; 0 for plain SGD). Weight decay is not
    included.

    >>> predicted_entropy_change(1e-3, 1.0, -2.0)
    -0.002
    """
    return learning_rate * (gradient_scale * clip * applied_net - momentum_term)


def carried_flow(momentum_term: float, gradient_scale: float, clip: float = 1.0) -> float:
    """The net flow the next optimizer step applies on top of this batch's, in the units of sum_t f_t w_t d_t:
    -momentum_term / (gradient_scale * clip). A batch whose applied net flow is minus this leaves Hbar unchanged to
    first order through the whole step (``predicted_entropy_change`` is then 0): OPEFO's ``opefo_balance="step"``.

    >>> carried_flow(momentum_term=1.5, gradient_scale=0.5)
    -3.0
    >>> predicted_entropy_change(1e-3, 1.0, applied_net=3.0, gradient_scale=0.5, momentum_term=1.5)
    0.0
    """
    return -momentum_term / (gradient_scale * clip)


def relative_error(estimate: float, exact: float) -> float:
    """|estimate - exact| / |exact| (inf when exact is 0 and estimate is not)."""
    if exact == 0.0:
        return 0.0 if estimate == 0.0 else float("inf")
    return abs(estimate - exact) / abs(exact)
