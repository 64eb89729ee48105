"""The entropy audit (``entropy_flow_audit_steps``): what an optimizer step really did to its batch's entropy.

:class:`EntropyAudit` is a `TrainerCallback`. On every k-th optimizer step it keeps the step's micro-batches with their
per-token entropies before the update; right after ``optimizer.step()`` (before the scheduler moves the learning
rate) it re-scores them in the precision of their first scoring and logs ``entropy_flow/measured_delta``, the change of
their mean token entropy (per-token differences summed in float64). With the `param` estimate it also logs, from the
real (clipped) gradient and the optimizer's state just before the step, the predicted first-order change
``entropy_flow/predicted_delta``, and ``entropy_flow/step_first_order`` = <grad Hbar, theta_after - theta_before>, the
first-order change of the parameter change the optimizer really wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from opefo_trl.experimental.optimizer import inner
from opefo_trl.experimental.param_flow import ParamFlow
from opefo_trl.experimental.step_model import first_order_change
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.trainer.batch_state import Scores


@dataclass
class AuditedBatch:
    """A micro-batch of an audited step and its per-token entropies before the update."""

    batch: dict
    entropies: torch.Tensor
    full_precision: bool


class EntropyAudit(TrainerCallback):
    """Args:
    every: audit every k-th optimizer step (0: never).
    global_step: the Trainer's ``state.global_step`` (optimizer steps done).
    score, score_full_precision: the scoring forwards (``Scorer``) the batches are re-scored with.
    loss_mask: TRL's loss mask of a micro-batch (the tokens whose mean entropy is measured).
    reduce_sum: sums a tensor over ranks; ``device`` holds the sums.
    log_metrics: where the metrics go.
    params: the trainable parameters; ``optimizer``: the torch optimizer that steps.
    """

    def __init__(
        self,
        every: int,
        global_step: Callable[[], int],
        score: Callable[[dict], Scores],
        score_full_precision: Callable[[dict], Scores],
        loss_mask: Callable[[dict], torch.Tensor],
        reduce_sum: ReduceSum,
        device: Callable[[], torch.device],
        log_metrics: Callable[[dict[str, float]], None],
        params: Callable[[], list[torch.Tensor]],
        optimizer: Callable[[], torch.optim.Optimizer],
    ):
        self.every, self.global_step = every, global_step
        self.score, self.score_full_precision, self.loss_mask = score, score_full_precision, loss_mask
        self.reduce_sum, self.device, self.log_metrics = reduce_sum, device, log_metrics
        self.params, self.optimizer = params, optimizer
        self.batches: list[AuditedBatch] = []
        self.param_flow: ParamFlow | None = None  # the `param` estimate of the audited step (grad Hbar)
        self.before: dict[str, float] = {}  # figures taken just before the audited optimizer step

    def due(self) -> bool:
        """Whether the optimizer step in progress is audited."""
        return self.every > 0 and (self.global_step() + 1) % self.every == 0

    def keep_param_flow(self, flow: ParamFlow) -> None:
        """The `param` estimate of this step's rollout, kept for the audit (its loss gradient freed)."""
        if self.due():
            flow.loss_grad = None
            self.param_flow = flow

    def keep_batch(self, batch: dict, entropies: torch.Tensor, full_precision: bool) -> None:
        if self.due():
            self.batches.append(AuditedBatch(batch, entropies, full_precision))

    @torch.no_grad()
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """`param`, audited step: the first-order change predicted from the real (clipped) gradient and the optimizer's
        state before the step, and <grad Hbar, theta> to difference after it."""
        if self.param_flow is None or not self.due():
            return
        params, entropy_grad = self.params(), self.param_flow.entropy_grad
        self.before = {
            "entropy_flow/predicted_delta": first_order_change(
                self.optimizer(), params, entropy_grad, (p.grad for p in params)
            ),
            "parameter_projection": inner(entropy_grad, params),
        }

    @torch.no_grad()
    def on_optimizer_step(self, args, state, control, **kwargs):
        if not self.due() or not self.batches:
            self.param_flow, self.batches = None, []
            return
        sums = torch.zeros(2, dtype=torch.float64, device=self.device())
        for audited in self.batches:
            rescore = self.score_full_precision if audited.full_precision else self.score
            after = rescore(audited.batch).measured_entropies
            mask = self.loss_mask(audited.batch).double()
            sums += torch.stack([((after.double() - audited.entropies.double()) * mask).sum(), mask.sum()])
        sums = self.reduce_sum(sums)
        metrics = {"entropy_flow/measured_delta": float(sums[0] / sums[1].clamp(min=1))}
        if self.before:
            assert self.param_flow is not None  # on_pre_optimizer_step filled `before` from it
            projection = inner(self.param_flow.entropy_grad, self.params())
            metrics["entropy_flow/predicted_delta"] = self.before["entropy_flow/predicted_delta"]
            metrics["entropy_flow/step_first_order"] = projection - self.before["parameter_projection"]
        self.log_metrics(metrics)
        self.param_flow, self.batches, self.before = None, [], {}
