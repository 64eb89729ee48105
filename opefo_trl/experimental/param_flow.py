"""The exact first-order flow through a network's parameters (docs/algorithm.md section 4).

Pure torch, no TRL import. The tabular estimates of ``entropy_flow`` treat each position's logits as free
parameters; in a network all positions share the parameters theta, so one token's update moves the entropy at every
position. With Hbar the mean token entropy of the rollout batch's completion positions and an update
delta theta = eta D sum_t c_t w_t grad log pi_t (c_t = f_t A_t: the loss's coefficient of the token's log-prob; D: the
optimizer's diagonal preconditioner), to first order

    delta Hbar = eta sum_t c_t w_t u_t,    u_t = <D grad_theta Hbar, grad_theta log pi_t>.

``ParamFlowEstimator`` computes grad Hbar and the loss gradient a = -sum_t c_t grad log pi_t by backward passes, and
takes u_t for every token at once as the Jacobian-vector product of theta -> (log pi_t)_t in the direction v = D grad
Hbar, by forward-mode AD (``opefo_trl.experimental.param_jvp.completion_jvp`` for a transformers model). It is given
tensors only: whoever holds the model (``opefo_trl.experimental.param_estimate.ParamEstimate``) runs the scoring
forwards and the forward-mode passes over the micro-batches and hands over what they return, in two stages:

1. per micro-batch ``add_batch(logps, entropies, mask, coefficient)`` (with the graph; the two backwards), per probe
   batch ``add_probe(entropies, mask)``; then ``direction()`` gives v (None when grad Hbar is orthogonal to it);
2. along v, per micro-batch ``add_tangents(u, dh)`` and per probe batch ``add_probe_tangent(dh)``, in the same order;
   then ``finish()`` gives the ``ParamFlow``.

Two checks compare the forward-mode results with the backward-mode ones on every batch: the derivative of Hbar along
v (``check_error``, against <grad Hbar, v>) and the batch's net flow sum_t c_t u_t (against -<v, a>;
``lambda_error``, the error it implies for lambda* = -net / gross). Both modes are exact up to rounding, so the
checks estimate the rounding error (they are not bounds); a large one means the two passes disagree (a forward that
is not the one differentiated, dropout, a wrong logit transform).

With probe batches (``add_probe``: completions the update does not train on, e.g. earlier rollouts re-scored under
the current parameters), Hbar is the mean token entropy of the update's own tokens and the probe's together: the
policy gradient and its c_t are the batch's, only the direction v = D grad Hbar (and with it u_t) changes.

The optimizer's real next step, whose momentum this D does not describe, is modelled exactly in
``opefo_trl.experimental.step_model`` (the optimizer's update itself in ``opefo_trl.experimental.optimizer``).

Example (a linear softmax policy, where everything can be checked by hand):
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True); x = torch.randn(4, 3, dtype=torch.float64)
    >>> def policy(weight):
    ...     logp = torch.log_softmax(x @ weight.T, -1)
    ...     return logp[:, :1], -(logp.exp() * logp).sum(-1, keepdim=True)
    >>> mask, coefficient = torch.ones(4, 1, dtype=torch.float64), torch.tensor([[1.0], [-1.0], [0.5], [0.0]])
    >>> estimator = ParamFlowEstimator([W], token_count([mask]))
    >>> estimator.add_batch(*policy(W), mask, coefficient)
    >>> direction = estimator.direction()
    >>> estimator.add_tangents(*torch.func.jvp(policy, (W.detach(),), (direction[0],))[1])
    >>> flow = estimator.finish()
    >>> flow.check_error < 1e-12 and flow.lambda_error < 1e-12
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from opefo_trl.experimental.optimizer import (
    PreconditionedDirection,
    clip_coefficient,
    compute_dtype,
    global_norm,
    inner,
)
from opefo_trl.experimental.step_model import StepModel
from opefo_trl.maths.ranks import ReduceSum, single_process_sum

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


def _sum_over_ranks(value: torch.Tensor, reduce_sum: ReduceSum = single_process_sum) -> float:
    """A scalar summed over ranks, in float64."""
    return float(reduce_sum(value.double().reshape(1))[0])


def token_count(masks: Sequence[torch.Tensor], reduce_sum: ReduceSum = single_process_sum) -> float:
    """The number of tokens Hbar averages: those the masks select (the micro-batches' and the probe's), summed over
    ranks; at least 1, so that a batch without tokens divides by 1."""
    return max(_sum_over_ranks(cast(torch.Tensor, sum(m.sum() for m in masks)), reduce_sum), 1.0)


@dataclass
class ParamFlow:
    """What ``ParamFlowEstimator.finish`` found for one rollout batch (per micro-batch lists, (B, T) each).

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

    Fed micro-batch by micro-batch in two stages (module docstring). ``direction``, ``finish`` and
    ``signed_gradient`` sum over ranks (as ``token_count`` does): every rank calls them, in the same order.

    Args:
        params: the trainable parameters theta.
        tokens: the number of tokens Hbar averages, over the micro-batches and the probe, summed over ranks
            (``token_count``).
        reduce_sum: sums a tensor over data-parallel ranks (every rank then holds the same gradients and direction).
        optimizer: the torch Adam/AdamW whose next step D describes, or None for plain SGD (D = identity).
        max_grad_norm: the Trainer's gradient clipping, applied to the gradient D is built from.

    Cost per rollout batch: per micro-batch a forward with two backwards (grad Hbar and a) and one forward-mode pass
    (u_t, dH_t); per probe batch a forward with one backward and a forward-mode pass; for the step model a forward
    with one backward (b). Extra memory: grad Hbar and a (two copies of the trainable parameters in their compute
    dtype), the direction v during the forward-mode passes (a third), then b.
    """

    def __init__(
        self,
        params,
        tokens: float,
        reduce_sum: ReduceSum = single_process_sum,
        optimizer=None,
        max_grad_norm=None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.tokens, self.reduce_sum = tokens, reduce_sum
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        self.entropy_grad, self.loss_grad = self._zeros(), self._zeros()
        # Stage 1: the micro-batches' detached scores and c_t, the probe's H_t, and the masks both stages weigh with.
        self.logps: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.coefficients: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.probe_entropies: list[torch.Tensor] = []
        self.probe_masks: list[torch.Tensor] = []
        self._entropy_sum: torch.Tensor | None = None  # sum of H_t over the tokens, float64 on the device: no sync
        # Stage 2: u_t per micro-batch and the sums of the checks (float64 on the host).
        self._flow: ParamFlow | None = None  # set by direction()
        self._exact_derivative = self._exact_net = 0.0
        self._alignment: list[torch.Tensor] = []
        self._entropy_change, self._net, self._gross = 0.0, 0.0, 0.0
        self._probe_tangents = 0
        self._signed_grad: list[torch.Tensor] | None = None

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

    def _add_entropy(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        if self._entropy_sum is None:
            self._entropy_sum = torch.zeros((), dtype=torch.float64, device=mask.device)
        self._entropy_sum += (entropies.detach().double() * mask).sum()

    def add_batch(
        self, logps: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor, coefficient: torch.Tensor
    ) -> None:
        """One micro-batch's log pi_t and H_t from the scoring forward, (B, T) with their graph in the parameters;
        ``mask`` selects the tokens Hbar averages (the loss tokens), ``coefficient`` is c_t of the unweighted loss
        L = -sum_t c_t log pi_t, from the detached scores. Adds its grad Hbar and a (the graph is freed)."""
        coefficient = coefficient.to(logps.dtype)
        self._accumulate(self.entropy_grad, (entropies * mask).sum() / self.tokens, retain=True)
        self._accumulate(self.loss_grad, -(coefficient * logps).sum(), retain=False)
        self.logps.append(logps.detach())
        self.entropies.append(entropies.detach())
        self.coefficients.append(coefficient)
        self.masks.append(mask)
        self._add_entropy(entropies, mask)

    def add_probe(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """One probe batch's H_t (with its graph) and mask: tokens Hbar averages too, outside the loss (module
        docstring). After every ``add_batch``."""
        self._accumulate(self.entropy_grad, (entropies * mask).sum() / self.tokens, retain=False)
        self.probe_entropies.append(entropies.detach())
        self.probe_masks.append(mask)
        self._add_entropy(entropies, mask)

    def direction(self) -> list[torch.Tensor] | None:
        """v = D grad Hbar from grad Hbar and a summed over ranks, for the forward-mode passes; None when
        <grad Hbar, v> = 0 (no token moves Hbar to first order: no pass is needed, ``finish`` gives u_t = 0). The
        caller holds the only reference to v: dropping it before ``finish`` frees its memory."""
        self._reduce(self.entropy_grad)
        self._reduce(self.loss_grad)
        clip = clip_coefficient(global_norm(self.loss_grad), self.max_grad_norm) if self.optimizer is not None else 1.0
        direction = list(PreconditionedDirection(self.optimizer, self.params, self.entropy_grad, self.loss_grad, clip))
        self._exact_derivative = inner(self.entropy_grad, direction)  # d Hbar / d e along v
        self._exact_net = -inner(direction, self.loss_grad)  # sum_t c_t u_t = <v, -a>
        assert self._entropy_sum is not None  # add_batch was called
        self._flow = ParamFlow(
            alignment=[torch.zeros_like(lp) for lp in self.logps],
            logps=self.logps,
            entropies=self.entropies,
            coefficients=self.coefficients,
            entropy_grad=self.entropy_grad,
            loss_grad=self.loss_grad,
            check_error=0.0,
            lambda_error=0.0,
            lambda_star=0.0,
            clip=clip,
            entropy=_sum_over_ranks(self._entropy_sum, self.reduce_sum) / self.tokens,
            probe_entropies=self.probe_entropies,
        )
        return None if self._exact_derivative == 0.0 else direction

    def add_tangents(self, u: torch.Tensor, dh: torch.Tensor) -> None:
        """The derivatives of log pi_t and H_t along the direction, (B, T), of the next micro-batch (``add_batch``'s
        order)."""
        mask, c = self.masks[len(self._alignment)], self.coefficients[len(self._alignment)]
        contribution = c.double() * u.double()
        self._entropy_change += float((dh.double() * mask).sum())
        self._net, self._gross = self._net + float(contribution.sum()), self._gross + float(contribution.abs().sum())
        self._alignment.append(u.float())

    def add_probe_tangent(self, dh: torch.Tensor) -> None:
        """The derivative of H_t along the direction of the next probe batch (``add_probe``'s order): only for the
        check, the probe's share of the derivative of Hbar."""
        self._entropy_change += float((dh.double() * self.probe_masks[self._probe_tangents]).sum())
        self._probe_tangents += 1

    def finish(self) -> ParamFlow:
        """The flow: u_t of every micro-batch and the checks, the sums over ranks taken (u_t = 0 without a
        direction)."""
        flow = self._flow
        assert flow is not None, "direction() first"
        if self._exact_derivative == 0.0:
            return flow
        assert len(self._alignment) == len(self.logps) and self._probe_tangents == len(self.probe_masks)
        sums = self.reduce_sum(
            torch.tensor(
                [self._entropy_change, self._net, self._gross], dtype=torch.float64, device=self._alignment[-1].device
            )
        )
        entropy_change, net, gross = (float(x) for x in sums)
        flow.alignment = self._alignment
        flow.check_error = relative_error(entropy_change / self.tokens, self._exact_derivative)
        flow.lambda_star = -net / gross if gross > 0 else 0.0
        flow.lambda_error = abs(net - self._exact_net) / gross if gross > 0 else 0.0
        return flow

    def add_signed(self, logps: torch.Tensor, signed_coefficient: torch.Tensor) -> None:
        """One micro-batch's log pi_t from a scoring forward (with its graph) and s_t c_t: adds its share of b (the
        graph is freed). A forward and backward per micro-batch: keeping stage 1's graph instead would keep every
        recomputed chunk of the LM head's logits too."""
        if self._signed_grad is None:
            self._signed_grad = self._zeros()
        self._accumulate(self._signed_grad, -(signed_coefficient.to(logps.dtype) * logps).sum(), retain=False)

    def signed_gradient(self) -> list[torch.Tensor]:
        """b = grad of -sum_t s_t c_t log pi_t (summed over ranks) from the ``add_signed`` micro-batches: the
        gradient's derivative in lambda when the tokens are weighted 1 + lambda s_t."""
        total, self._signed_grad = self._signed_grad, None
        return self._reduce(self._zeros() if total is None else total)

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
