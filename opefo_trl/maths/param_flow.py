"""The exact first-order flow through a network's parameters, and the exact step balance (docs/algorithm.md s. 4).

Pure torch, no TRL import. The tabular estimates of ``entropy_flow`` treat each position's logits as free
parameters; in a network all positions share the parameters theta, so one token's update moves the entropy at every
position. With Hbar the mean token entropy of the rollout batch's completion positions and an update
delta theta = eta D sum_t c_t w_t grad log pi_t (c_t = f_t A_t: the loss's coefficient of the token's log-prob; D: the
optimizer's diagonal preconditioner), to first order

    delta Hbar = eta sum_t c_t w_t u_t,    u_t = <D grad_theta Hbar, grad_theta log pi_t>.

``ParamFlowEstimator`` computes u_t for every token at once as a Jacobian-vector product of theta -> (log pi_t)_t in
the direction v = D grad Hbar, by a central finite difference

    u_t ~ (log pi_t(theta + e v) - log pi_t(theta - e v)) / (2 e),

rather than by forward-mode AD, because the log-probabilities come from TRL's fused, chunked LM-head kernel (a
custom autograd function with no forward-mode rule) and through PEFT and DDP wrappers, all of which an ordinary
forward pass handles unchanged. Two checks against exact quantities from the gradients run on every batch: the
derivative of Hbar along v (``check_error``) and the batch's net flow sum_t c_t u_t = -<v, a>, with a the loss
gradient (``lambda_error``: the error it implies for lambda* = -net / gross).

The optimizer's real next step, whose momentum this D does not describe, is modelled exactly in
``opefo_trl.maths.step_model``.

Example (a linear softmax policy, where everything can be checked by hand):
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True); x = torch.randn(4, 3, dtype=torch.float64)
    >>> def score(batch):
    ...     logp = torch.log_softmax(x @ W.T, -1)
    ...     return logp[:, :1], -(logp.exp() * logp).sum(-1, keepdim=True)
    >>> estimator = ParamFlowEstimator([W], score)
    >>> mask, coefficient = torch.ones(4, 1, dtype=torch.float64), torch.tensor([[1.0], [-1.0], [0.5], [0.0]])
    >>> flow = estimator.estimate([None], [mask], lambda batch, logps, entropies: coefficient)
    >>> flow.check_error < 1e-6 and flow.lambda_error < 1e-6
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from opefo_trl.maths.step_model import (
    PreconditionedDirection,
    StepModel,
    clip_coefficient,
    compute_dtype,
    global_norm,
    inner,
)

ReduceSum = Callable[[torch.Tensor], torch.Tensor]
#: score(batch) -> (log pi_t, H_t), both (B, T), differentiable in the parameters when grad is enabled.
ScoreFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
#: coefficients(batch, logps, entropies) -> c_t (B, T): the unweighted loss is L = -sum_t c_t log pi_t.
CoefficientFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]

#: Sizes of the finite-difference perturbation relative to the norm of the trainable parameters, tried in this order
#: until both checks pass (else the one with the smallest lambda* error is used). The error of a central difference is
#: curvature (~ e^2) plus the forward's rounding (~ eps / e). Measured on the warm tiny test model against a float64
#: reference (64 x 24 tokens, lambda* = -0.106), the float32 lambda* error was 4.4e-4 / 4.4e-5 / 3.9e-6 / 1.7e-6 /
#: 2.8e-5 / 2.4e-5 at 3e-4 / 1e-4 / 3e-5 / 1e-5 / 3e-6 / 1e-6, and the net-flow check's bound 1.3-1.8x the error.
FD_RELATIVE_STEPS = {torch.float32: (1e-5, 3e-5, 1e-4, 3e-6), torch.float64: (1e-7, 1e-6, 1e-8)}
#: The derivative of Hbar along the direction may differ from the exact one by this much (relative).
CHECK_TOLERANCE = 0.05
#: The lambda* error implied by the net-flow check may be this fraction of |lambda*|.
LAMBDA_ERROR_TOLERANCE = 0.1


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def relative_error(estimate: float, exact: float) -> float:
    """|estimate - exact| / |exact| (inf when exact is 0 and estimate is not)."""
    if exact == 0.0:
        return 0.0 if estimate == 0.0 else float("inf")
    return abs(estimate - exact) / abs(exact)


def finite_difference_step(
    params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], relative: float = 1e-4
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
    bit for bit afterwards (from a copy), whatever ``evaluate`` raises. ``direction`` may compute its items lazily."""
    backup = [p.detach().clone() for p in params]
    try:
        results = []
        for sign in (1.0, -1.0):
            for i, p in enumerate(params):
                p.add_(direction[i].to(p.dtype), alpha=sign * step)
            results.append(evaluate())
            for p, saved in zip(params, backup, strict=True):
                p.copy_(saved)
        return results[0], results[1]
    finally:
        for p, saved in zip(params, backup, strict=True):
            p.copy_(saved)


# ----------------------------------------------------------------------------------------------------------------------
# The estimator
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ParamFlow:
    """What ``ParamFlowEstimator.estimate`` found for one rollout batch (per micro-batch lists, (B, T) each).

    ``alignment`` is u_t; ``logps``/``entropies`` are the scoring pass's (detached, before any update);
    ``coefficients`` the c_t of the unweighted loss. ``entropy_grad`` (grad Hbar) and ``loss_grad`` (a) are summed
    over ranks and kept for the step model and the audit. The checks: ``check_error`` is the relative error of the
    finite-difference derivative of Hbar along v = D grad Hbar against the exact <grad Hbar, v>; ``lambda_error`` is
    |net_fd - net_exact| / gross, the error of lambda* = -net / gross implied by the net flow sum_t c_t u_t against
    its exact value -<v, a>. ``clip`` is that of the unweighted gradient."""

    alignment: list[torch.Tensor]
    logps: list[torch.Tensor]
    entropies: list[torch.Tensor]
    coefficients: list[torch.Tensor]
    entropy_grad: list[torch.Tensor]
    loss_grad: list[torch.Tensor] | None  # None once the trainer no longer needs it (its memory freed)
    check_error: float
    lambda_error: float
    lambda_star: float
    step_size: float
    clip: float


class ParamFlowEstimator:
    """The `param` estimate of one rollout batch: u_t = <D grad Hbar, grad log pi_t> for every token, checked.

    Args:
        params: the trainable parameters theta (perturbed in place during the finite difference, restored bit for bit).
        score: ``score(batch) -> (logps, entropies)`` of one micro-batch, (B, T), differentiable when grad is enabled;
            run in float32 or float64 (the finite difference needs it).
        reduce_sum: sums a tensor over data-parallel ranks (every rank then holds the same gradients and direction).
        optimizer: the torch Adam/AdamW whose next step D describes, or None for plain SGD (D = identity).
        max_grad_norm: the Trainer's gradient clipping, applied to the gradient D is built from.
        score_dtype: the precision ``score`` computes in, which sets the finite-difference step sizes; by default the
            parameters'. TRL's fused LM head computes log-probs and entropies in float32 even for float64 weights.

    Cost per rollout batch: a forward with two backwards per micro-batch (grad Hbar and a), two no-grad forwards
    per micro-batch per step size tried, and, for the step model, a forward with one backward (b). Extra memory:
    three copies of the trainable parameters (grad Hbar, a and, during the finite difference, the backup of theta;
    then b), in their compute dtype.
    """

    def __init__(
        self,
        params,
        score: ScoreFn,
        reduce_sum: ReduceSum = _identity,
        optimizer=None,
        max_grad_norm=None,
        score_dtype: torch.dtype | None = None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.score, self.reduce_sum = score, reduce_sum
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        dtype = self.params[0].dtype
        if dtype not in FD_RELATIVE_STEPS:
            raise ValueError(
                f"The `param` estimate differences float32 or float64 forwards; the parameters are {dtype}."
            )
        # The steps of the coarser of the parameters' and the forward's precision.
        precision = torch.float32 if torch.float32 in (dtype, score_dtype) else dtype
        self.relative_steps = FD_RELATIVE_STEPS[precision]

    def _zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p, dtype=compute_dtype(p)) for p in self.params]

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        for t in tensors:
            t.copy_(self.reduce_sum(t))
        return tensors

    def _accumulate(self, totals: list[torch.Tensor], objective: torch.Tensor, retain: bool) -> None:
        parts = torch.autograd.grad(objective, self.params, retain_graph=retain, allow_unused=True)
        for running, part in zip(totals, parts, strict=True):
            if part is not None:
                running.add_(part)

    def _sum(self, value: torch.Tensor) -> float:
        return float(self.reduce_sum(value.double().reshape(1))[0])

    def estimate(self, batches: Sequence[Any], masks: Sequence[torch.Tensor], coefficients: CoefficientFn) -> ParamFlow:
        """u_t of every micro-batch; ``masks`` select the tokens Hbar averages (the loss tokens), ``coefficients``
        gives the unweighted loss's c_t from the scoring pass's detached log pi_t and H_t."""
        tokens = max(self._sum(cast(torch.Tensor, sum(mask.sum() for mask in masks))), 1.0)  # masks: never empty
        entropy_grad, loss_grad = self._zeros(), self._zeros()
        logps_list, entropies_list, coefficient_list = [], [], []
        with torch.enable_grad():
            for batch, mask in zip(batches, masks, strict=True):
                logps, entropies = self.score(batch)
                coefficient = coefficients(batch, logps.detach(), entropies.detach()).to(logps.dtype)
                self._accumulate(entropy_grad, (entropies * mask).sum() / tokens, retain=True)
                self._accumulate(loss_grad, -(coefficient * logps).sum(), retain=False)
                logps_list.append(logps.detach())
                entropies_list.append(entropies.detach())
                coefficient_list.append(coefficient)
        self._reduce(entropy_grad)
        self._reduce(loss_grad)
        clip = clip_coefficient(global_norm(loss_grad), self.max_grad_norm) if self.optimizer is not None else 1.0
        direction = PreconditionedDirection(self.optimizer, self.params, entropy_grad, loss_grad, clip)
        exact_derivative = inner(entropy_grad, direction)  # d Hbar / d e along v
        exact_net = -inner(direction, loss_grad)  # sum_t c_t u_t = <v, -a>
        flow = ParamFlow(
            alignment=[torch.zeros_like(lp) for lp in logps_list],
            logps=logps_list,
            entropies=entropies_list,
            coefficients=coefficient_list,
            entropy_grad=entropy_grad,
            loss_grad=loss_grad,
            check_error=0.0,
            lambda_error=0.0,
            lambda_star=0.0,
            step_size=0.0,
            clip=clip,
        )
        if exact_derivative == 0.0:  # no entropy gradient: no token moves Hbar to first order
            return flow

        def evaluate():
            return [self.score(batch) for batch in batches]

        best = None
        for relative in self.relative_steps:  # the first step size whose checks pass; else the most accurate one
            step = finite_difference_step(self.params, direction, relative)
            plus, minus = evaluate_on_both_sides(self.params, direction, step, evaluate)
            alignment = [(lp - lm) / (2 * step) for (lp, _), (lm, _) in zip(plus, minus, strict=True)]
            entropy_change = sum(((hp - hm) * m).sum() for (_, hp), (_, hm), m in zip(plus, minus, masks, strict=True))
            derivative = self._sum(entropy_change) / tokens / (2 * step)
            net = self._sum(sum((c * u).sum() for c, u in zip(coefficient_list, alignment, strict=True)))
            gross = self._sum(sum((c * u).abs().sum() for c, u in zip(coefficient_list, alignment, strict=True)))
            check = relative_error(derivative, exact_derivative)
            lam = -net / gross if gross > 0 else 0.0
            lam_error = abs(net - exact_net) / gross if gross > 0 else 0.0
            passed = check <= CHECK_TOLERANCE and lam_error <= LAMBDA_ERROR_TOLERANCE * abs(lam)
            if best is None or lam_error < best[0] or passed:
                best = (lam_error, check, lam, step, alignment)
            if passed:
                break
        assert best is not None  # relative_steps is never empty
        flow.lambda_error, flow.check_error, flow.lambda_star, flow.step_size, alignment = best
        flow.alignment = [u.float() for u in alignment]
        return flow

    def signed_gradient(self, batches: Sequence[Any], signed_coefficients: Sequence[torch.Tensor]):
        """b = grad of -sum_t s_t c_t log pi_t (summed over ranks): the gradient's derivative in lambda when the
        tokens are weighted 1 + lambda s_t. One forward and backward per micro-batch."""
        total = self._zeros()
        with torch.enable_grad():
            for batch, coefficient in zip(batches, signed_coefficients, strict=True):
                logps, _ = self.score(batch)
                self._accumulate(total, -(coefficient.to(logps.dtype) * logps).sum(), retain=False)
        return self._reduce(total)

    def step_model(self, flow: ParamFlow, signed_grad) -> StepModel:
        return StepModel(
            self.optimizer, self.params, flow.entropy_grad, flow.loss_grad, signed_grad, self.max_grad_norm
        )


def warn_imprecise(flow: ParamFlow, steps: Sequence[float]) -> str | None:
    """The warning for a batch whose checks failed at every step size (None when they passed)."""
    if flow.check_error <= CHECK_TOLERANCE and flow.lambda_error <= LAMBDA_ERROR_TOLERANCE * abs(flow.lambda_star):
        return None
    return (
        f"entropy_flow_estimate='param': at every finite-difference step size tried {tuple(steps)}, the checks "
        f"against exact values fail on this batch: the derivative of the mean entropy is off by "
        f"{flow.check_error:.2%}, and the net flow implies a lambda* error of {flow.lambda_error:.3g} (lambda* = "
        f"{flow.lambda_star:.3g}; tolerance {LAMBDA_ERROR_TOLERANCE:.0%} of it). The per-token flow is imprecise "
        "(float32 resolution or strong curvature): entropy_flow/param_lambda_error logs the bound every step."
    )
