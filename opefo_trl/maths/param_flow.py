"""The exact first-order flow through a network's parameters (docs/algorithm.md section 4).

Pure torch, no TRL import. The tabular estimates of ``entropy_flow`` treat each position's logits as free
parameters; in a network all positions share the parameters theta, so one token's update moves the entropy at every
position. With Hbar the mean token entropy of the rollout batch's completion positions and an update
delta theta = eta D sum_t c_t w_t grad log pi_t (c_t = f_t A_t: the loss's coefficient of the token's log-prob; D: the
optimizer's diagonal preconditioner), to first order

    delta Hbar = eta sum_t c_t w_t u_t,    u_t = <D grad_theta Hbar, grad_theta log pi_t>.

``ParamFlowEstimator`` computes grad Hbar and the loss gradient a = -sum_t c_t grad log pi_t by backward passes, and
u_t for every token at once as the Jacobian-vector product of theta -> (log pi_t)_t in the direction v = D grad Hbar,
by forward-mode AD (``jvp``; ``opefo_trl.maths.param_jvp.completion_jvp`` for a transformers model). Two checks
compare the forward-mode results with the backward-mode ones on every batch: the derivative of Hbar along v
(``check_error``, against <grad Hbar, v>) and the batch's net flow sum_t c_t u_t (against -<v, a>;
``lambda_error``, the error it implies for lambda* = -net / gross). Both modes are exact up to rounding, so the
checks estimate the rounding error (they are not bounds); a large one means the two passes disagree (a forward that
is not the one differentiated, dropout, a wrong logit transform).

With ``probe`` batches (completions the update does not train on, e.g. earlier rollouts re-scored under the current
parameters), Hbar is the mean token entropy of the update's own tokens and the probe's together: the policy gradient
and its c_t are the batch's, only the direction v = D grad Hbar (and with it u_t) changes.

The optimizer's real next step, whose momentum this D does not describe, is modelled exactly in
``opefo_trl.maths.step_model`` (the optimizer's update itself in ``opefo_trl.maths.optimizer``).

Example (a linear softmax policy, where everything can be checked by hand):
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True); x = torch.randn(4, 3, dtype=torch.float64)
    >>> def policy(weight):
    ...     logp = torch.log_softmax(x @ weight.T, -1)
    ...     return logp[:, :1], -(logp.exp() * logp).sum(-1, keepdim=True)
    >>> def jvp(batch, direction):
    ...     return torch.func.jvp(policy, (W.detach(),), (direction[0],))[1]
    >>> estimator = ParamFlowEstimator([W], lambda batch: policy(W), jvp)
    >>> mask, coefficient = torch.ones(4, 1, dtype=torch.float64), torch.tensor([[1.0], [-1.0], [0.5], [0.0]])
    >>> flow = estimator.estimate([None], [mask], lambda batch, logps, entropies: coefficient)
    >>> flow.check_error < 1e-12 and flow.lambda_error < 1e-12
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from opefo_trl.maths.optimizer import PreconditionedDirection, clip_coefficient, compute_dtype, global_norm, inner
from opefo_trl.maths.ranks import ReduceSum, single_process_sum
from opefo_trl.maths.step_model import StepModel

#: score(batch) -> (log pi_t, H_t), both (B, T), differentiable in the parameters when grad is enabled.
ScoreFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
#: jvp(batch, direction) -> (u_t, dH_t), both (B, T): the derivatives of log pi_t and H_t along ``direction`` (one
#: tensor per trainable parameter), at the current parameters.
JvpFn = Callable[[Any, Sequence[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
#: coefficients(batch, logps, entropies) -> c_t (B, T): the unweighted loss is L = -sum_t c_t log pi_t.
CoefficientFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]

#: The derivative of Hbar along the direction may differ from the backward-mode one by this much (relative).
CHECK_TOLERANCE = 1e-2
#: The lambda* error implied by the net-flow check may be this fraction of |lambda*| (or this much, if larger). In
#: float32 the backward-mode net -<v, a> is the less precise side: a = -sum_t c_t grad log pi_t cancels (the
#: advantages sum to zero), and v = D grad Hbar is largest where Adam's second moment is smallest, so the logged
#: lambda_error can exceed the flow's own error by orders of magnitude; the warning is for a real disagreement.
LAMBDA_ERROR_TOLERANCE = 0.1
LAMBDA_ERROR_FLOOR = 1e-4


def relative_error(estimate: float, exact: float) -> float:
    """|estimate - exact| / |exact| (inf when exact is 0 and estimate is not)."""
    if exact == 0.0:
        return 0.0 if estimate == 0.0 else float("inf")
    return abs(estimate - exact) / abs(exact)


@dataclass
class ParamFlow:
    """What ``ParamFlowEstimator.estimate`` found for one rollout batch (per micro-batch lists, (B, T) each).

    ``alignment`` is u_t; ``logps``/``entropies`` are the scoring pass's (detached, before any update);
    ``coefficients`` the c_t of the unweighted loss. ``entropy_grad`` (grad Hbar) and ``loss_grad`` (a) are summed
    over ranks and kept for the step model and the audit. The checks (module docstring): ``check_error`` is the
    relative difference of the forward-mode derivative of Hbar along v = D grad Hbar from <grad Hbar, v>;
    ``lambda_error`` is |net - net_backward| / gross, the lambda* error implied by the net flow sum_t c_t u_t against
    -<v, a>. ``clip`` is that of the unweighted gradient. ``entropy`` is Hbar (over the batch and the probe, summed
    over ranks) and ``probe_entropies`` the probe batches' H_t, both before any update."""

    alignment: list[torch.Tensor]
    logps: list[torch.Tensor]
    entropies: list[torch.Tensor]
    coefficients: list[torch.Tensor]
    entropy_grad: list[torch.Tensor]
    loss_grad: list[torch.Tensor] | None  # None once the trainer no longer needs it (its memory freed)
    check_error: float
    lambda_error: float
    lambda_star: float
    clip: float
    entropy: float = 0.0
    probe_entropies: list[torch.Tensor] = field(default_factory=list)


class ParamFlowEstimator:
    """The `param` estimate of one rollout batch: u_t = <D grad Hbar, grad log pi_t> for every token, checked.

    Args:
        params: the trainable parameters theta.
        score: ``score(batch) -> (logps, entropies)`` of one micro-batch, (B, T), differentiable when grad is enabled.
        jvp: ``jvp(batch, direction) -> (u_t, dH_t)`` of one micro-batch (``JvpFn``).
        reduce_sum: sums a tensor over data-parallel ranks (every rank then holds the same gradients and direction).
        optimizer: the torch Adam/AdamW whose next step D describes, or None for plain SGD (D = identity).
        max_grad_norm: the Trainer's gradient clipping, applied to the gradient D is built from.

    Cost per rollout batch: per micro-batch a forward with two backwards (grad Hbar and a) and one forward-mode pass
    (u_t, dH_t); per probe batch a forward with one backward and a forward-mode pass; for the step model a forward
    with one backward (b). Extra memory: grad Hbar and a (two copies of the trainable parameters in their compute
    dtype), the direction v during the forward-mode pass (a third), then b.
    """

    def __init__(
        self,
        params,
        score: ScoreFn,
        jvp: JvpFn,
        reduce_sum: ReduceSum = single_process_sum,
        optimizer=None,
        max_grad_norm=None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.score, self.jvp, self.reduce_sum = score, jvp, reduce_sum
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm

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

    def estimate(
        self,
        batches: Sequence[Any],
        masks: Sequence[torch.Tensor],
        coefficients: CoefficientFn,
        probe: Sequence[tuple[Any, torch.Tensor]] = (),
    ) -> ParamFlow:
        """u_t of every micro-batch; ``masks`` select the tokens Hbar averages (the loss tokens), ``coefficients``
        gives the unweighted loss's c_t from the scoring pass's detached log pi_t and H_t. ``probe``: (batch, mask)
        pairs whose tokens Hbar averages too, outside the loss (module docstring)."""
        probe_masks = [mask for _, mask in probe]
        tokens = max(self._sum(cast(torch.Tensor, sum(m.sum() for m in [*masks, *probe_masks]))), 1.0)
        entropy_grad, loss_grad = self._zeros(), self._zeros()
        logps_list, entropies_list, coefficient_list, probe_entropies = [], [], [], []
        entropy_sum = torch.zeros((), dtype=torch.float64, device=masks[0].device)  # on the device: no sync
        with torch.enable_grad():
            for batch, mask in zip(batches, masks, strict=True):
                logps, entropies = self.score(batch)
                coefficient = coefficients(batch, logps.detach(), entropies.detach()).to(logps.dtype)
                self._accumulate(entropy_grad, (entropies * mask).sum() / tokens, retain=True)
                self._accumulate(loss_grad, -(coefficient * logps).sum(), retain=False)
                logps_list.append(logps.detach())
                entropies_list.append(entropies.detach())
                coefficient_list.append(coefficient)
                entropy_sum += (entropies.detach().double() * mask).sum()
            for batch, mask in probe:
                _, entropies = self.score(batch)
                self._accumulate(entropy_grad, (entropies * mask).sum() / tokens, retain=False)
                probe_entropies.append(entropies.detach())
                entropy_sum += (entropies.detach().double() * mask).sum()
        self._reduce(entropy_grad)
        self._reduce(loss_grad)
        clip = clip_coefficient(global_norm(loss_grad), self.max_grad_norm) if self.optimizer is not None else 1.0
        direction = list(PreconditionedDirection(self.optimizer, self.params, entropy_grad, loss_grad, clip))
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
            clip=clip,
            entropy=self._sum(entropy_sum) / tokens,
            probe_entropies=probe_entropies,
        )
        if exact_derivative == 0.0:  # no entropy gradient: no token moves Hbar to first order
            return flow
        alignment, entropy_change, net, gross = [], 0.0, 0.0, 0.0
        for batch, mask, c in zip(batches, masks, coefficient_list, strict=True):
            u, dh = self.jvp(batch, direction)
            contribution = c.double() * u.double()
            entropy_change += float((dh.double() * mask).sum())
            net, gross = net + float(contribution.sum()), gross + float(contribution.abs().sum())
            alignment.append(u.float())
        for batch, mask in probe:  # only for the check: the probe's share of the derivative of Hbar
            _, dh = self.jvp(batch, direction)
            entropy_change += float((dh.double() * mask).sum())
        del direction
        sums = self.reduce_sum(torch.tensor([entropy_change, net, gross], dtype=torch.float64, device=u.device))
        entropy_change, net, gross = (float(x) for x in sums)
        flow.alignment = alignment
        flow.check_error = relative_error(entropy_change / tokens, exact_derivative)
        flow.lambda_star = -net / gross if gross > 0 else 0.0
        flow.lambda_error = abs(net - exact_net) / gross if gross > 0 else 0.0
        return flow

    def signed_gradient(self, batches: Sequence[Any], signed_coefficients: Sequence[torch.Tensor]):
        """b = grad of -sum_t s_t c_t log pi_t (summed over ranks): the gradient's derivative in lambda when the
        tokens are weighted 1 + lambda s_t. One forward and backward per micro-batch (keeping the estimate's graph
        instead would keep every recomputed chunk of the LM head's logits too)."""
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


def imprecision(flow: ParamFlow) -> str | None:
    """The warning for a batch whose forward- and backward-mode results disagree beyond rounding (None if they
    agree)."""
    allowed = max(LAMBDA_ERROR_TOLERANCE * abs(flow.lambda_star), LAMBDA_ERROR_FLOOR)
    if flow.check_error <= CHECK_TOLERANCE and flow.lambda_error <= allowed:
        return None
    return (
        "entropy_flow_estimate='param' checks failed: the forward-mode flow and the backward-mode gradients "
        "disagree on this batch beyond rounding: the derivative of the mean entropy differs by "
        f"{flow.check_error:.2%} (tolerance {CHECK_TOLERANCE:.1%}), and the net flow implies a lambda* error of "
        f"{flow.lambda_error:.3g} (lambda* = {flow.lambda_star:.3g}; tolerance {allowed:.3g}). The two passes do not "
        "see the same function: dropout, a scoring forward other than the one differentiated, or a logit transform "
        "(temperature, logit scale, softcapping) that differs between them. entropy_flow/param_lambda_error logs the "
        "estimate every step."
    )
