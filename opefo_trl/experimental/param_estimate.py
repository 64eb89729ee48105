"""The `param` estimate over a rollout batch's micro-batches, and the step model it offers a method
(`opefo_trl.experimental.param_flow`, `opefo_trl.experimental.step_model`).

The estimator (pure maths) is given tensors; ``ParamEstimate`` runs the passes over the micro-batches and hands it
what they return: the trainer's scoring forwards in full precision on the unwrapped model (no DDP hooks: the
estimator all-reduces its gradients itself), the loss coefficients c_t = f_t A_t of the loss TRL will apply
(unweighted), and the forward-mode passes along the direction the estimator gives. The step model (``step_change``)
is built only when a method asks for it (OPEFO's step balance).

With ``probe_rollouts`` K > 1 (``entropy_flow_probe_rollouts``), the entropy the flow is measured on is that of this
rollout batch and the K - 1 before it, re-scored under the current parameters: the estimate keeps those earlier
micro-batches (their token ids and masks, on the device) and hands them to the estimator as its probe, after the
micro-batches of a fixed probe if there is one (``opefo_trl.experimental.fixed_probe``).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch

from opefo_trl.experimental.optimizer import check_optimizer
from opefo_trl.experimental.param_flow import ParamFlow, ParamFlowEstimator, imprecision, token_count
from opefo_trl.experimental.step_model import StepModel
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods import RolloutWeights, StepChange
from opefo_trl.trainer.batch_state import RolloutItem, Scores
from opefo_trl.trainer.loss_mirror import LossMirror


class ParamEstimate:
    """Runs the `param` estimate of each rollout batch and builds its step model on request: per micro-batch (and
    probe batch) the scoring forward, then along the estimator's direction the forward-mode pass, and for the step
    model one more scoring forward, each handed to the ``ParamFlowEstimator`` as tensors.

    Args:
        params: the trainable parameters, read when an estimate starts.
        score: the full-precision scoring forward of a TRL micro-batch (``Scorer.score_full_precision``).
        jvp: the forward-mode pass ``jvp(batch, params, direction) -> (u_t, dH_t)`` (``Scorer.jvp``).
        loss: TRL's loss factor (``LossMirror``).
        reduce_sum: sums a tensor over ranks; ``num_processes`` ranks.
        optimizer: the torch optimizer whose next step D and the step model describe.
        max_grad_norm: the Trainer's gradient clipping.
        log_metrics: where ``entropy_flow/param_check_error`` and ``param_lambda_error`` go.
        main_process: warnings are issued there only.
        probe_rollouts: the rollout batches (this one included) whose mean token entropy the flow is measured on.
        fixed_probe: the micro-batches of a fixed probe (``fixed_probe.FixedProbe.batches``), measured too.
    """

    def __init__(
        self,
        params: Callable[[], list[torch.Tensor]],
        score: Callable[[dict], Scores],
        jvp: Callable[[dict, Sequence[torch.Tensor], Sequence[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
        loss: LossMirror,
        reduce_sum: ReduceSum,
        num_processes: int,
        optimizer: Callable[[], torch.optim.Optimizer],
        max_grad_norm: float | None,
        log_metrics: Callable[[dict[str, float]], None],
        main_process: bool,
        probe_rollouts: int = 1,
        fixed_probe: Callable[[], list[tuple[RolloutItem, torch.Tensor]]] | None = None,
    ):
        self.params, self.score, self.jvp, self.loss = params, score, jvp, loss
        self.reduce_sum, self.num_processes = reduce_sum, num_processes
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        self.log_metrics, self.main_process = log_metrics, main_process
        self._warned_imprecise = False
        self._step: tuple[torch.Tensor, StepModel] | None = None  # this rollout's signs and step model
        #: The micro-batches (and loss masks) of the earlier rollouts in the probe, oldest first.
        self._earlier: deque[list[tuple[RolloutItem, torch.Tensor]]] = deque(maxlen=probe_rollouts - 1)
        self.fixed_probe = fixed_probe
        self.probe: list[tuple[RolloutItem, torch.Tensor]] = []  # the probe of the last estimate

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer, preconditioner: str) -> None:
        """Refuse an optimizer whose update the preconditioner does not model (accelerate's wrapper looked into)."""
        check_optimizer(getattr(optimizer, "optimizer", optimizer), preconditioner)

    @staticmethod
    def _full_precision(params: Sequence[torch.Tensor]) -> torch.autocast:
        """Autocast off for the estimate's forwards and backwards: a backward run inside an autocast region (a training
        step under bf16 mixed precision) recomputes checkpointed activations in half precision."""
        return torch.autocast(params[0].device.type, enabled=False)

    def _score(self, item: RolloutItem) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(item.batch)
        item.full_precision = scores.detached()
        return scores.logps, scores.measured_entropies

    def _coefficients(self, item: RolloutItem, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        """c_t = f_t A_t of TRL's unweighted loss, from the scoring pass's detached log pi_t and H_t; fills in the
        item's scores (where TRL's pass gave none), factor and audit entropies."""
        assert item.full_precision is not None  # scored just now by _score
        if item.scores is None:  # TRL's loss and its entropy mask read H_t, whatever entropy the flow measures
            item.scores = Scores(logps.float(), item.full_precision.entropies.float())
        item.audit_entropies = entropies
        item.factor = self.loss.factor(item.batch, item.scores.logps, item.scores.entropies, item.advantages)
        return item.factor * item.advantages

    def _flow(
        self, estimator: ParamFlowEstimator, items: Sequence[RolloutItem], masks: Sequence[torch.Tensor]
    ) -> ParamFlow:
        """Feeds the estimator its two stages (``opefo_trl.experimental.param_flow``): the scoring forwards of the items
        and of the probe, then their forward-mode passes along the direction."""
        with torch.enable_grad():
            for item, mask in zip(items, masks, strict=True):
                logps, entropies = self._score(item)
                estimator.add_batch(
                    logps, entropies, mask, self._coefficients(item, logps.detach(), entropies.detach())
                )
            for item, mask in self.probe:
                estimator.add_probe(self._score(item)[1], mask)
        direction = estimator.direction()
        if direction is not None:
            for item in items:
                estimator.add_tangents(*self.jvp(item.batch, estimator.params, direction))
            for item, _ in self.probe:  # only for the check: the probe's share of the derivative of Hbar
                estimator.add_probe_tangent(self.jvp(item.batch, estimator.params, direction)[1])
            del direction  # freed before the step model's gradient is taken
        return estimator.finish()

    def estimate(self, items: Sequence[RolloutItem]) -> tuple[ParamFlowEstimator, ParamFlow]:
        """u_t of every micro-batch; fills in each item's scores (where TRL's pass gave none), factor and audit
        entropies."""
        params = self.params()
        masks = [self.loss.mask(item.batch).float() for item in items]
        self._step = None
        fixed = [] if self.fixed_probe is None else self.fixed_probe()
        self.probe = [*fixed, *(pair for rollout in self._earlier for pair in rollout)]
        with self._full_precision(params):
            tokens = token_count([*masks, *(mask for _, mask in self.probe)], self.reduce_sum)
            estimator = ParamFlowEstimator(
                params, tokens, self.reduce_sum, optimizer=self.optimizer(), max_grad_norm=self.max_grad_norm
            )
            flow = self._flow(estimator, items, masks)
        if self._earlier.maxlen:  # a copy of the dict: the trainer replaces its advantages and adds its state
            self._earlier.append(
                [
                    (RolloutItem(dict(item.batch), item.advantages), mask)
                    for item, mask in zip(items, masks, strict=True)
                ]
            )
        self.log_metrics({"entropy_flow/param_check_error": flow.check_error})
        self.log_metrics({"entropy_flow/param_lambda_error": flow.lambda_error})
        message = imprecision(flow)
        if message and not self._warned_imprecise and self.main_process:
            self._warned_imprecise = True
            warnings.warn(message + " (Warned once.)", stacklevel=2)
        return estimator, flow

    def step_change(
        self, estimator: ParamFlowEstimator, flow: ParamFlow, items: Sequence[RolloutItem], signs: torch.Tensor
    ) -> StepChange:
        """F(lambda) of the real next optimizer step with the rollout's tokens weighted 1 + lambda * signs (``signs``
        over the whole local rollout batch), identical on every rank."""
        sizes = [len(item.advantages) for item in items]
        signed = [s * c for s, c in zip(signs.split(sizes), flow.coefficients, strict=True)]
        with self._full_precision(estimator.params):
            with torch.enable_grad():
                for item, signed_coefficient in zip(items, signed, strict=True):
                    estimator.add_signed(self._score(item)[0], signed_coefficient)
            model = estimator.step_model(flow, estimator.signed_gradient())
        self._step = (signs, model)
        change = model.change
        if self.num_processes == 1:
            return change

        # Every rank computes F from the same reduced gradients and replicated optimizer state; averaging makes the
        # root search bit-identical on all of them.
        def averaged(lam: float) -> float:
            value = torch.tensor([change(lam)], dtype=torch.float64, device=signs.device)
            return float(self.reduce_sum(value)[0]) / self.num_processes

        return averaged

    def finish(self, decided: RolloutWeights, gradient: bool) -> list[torch.Tensor] | None:
        """The end of a rollout's estimate, once the method weighed it. With ``gradient``: the gradient of the loss TRL
        will apply with the weights the method decided, g = a + lambda b, when it declares them 1 + lambda * s_t
        (``decided.lam``) with the signs s_t of the step model it built; None when it built none or declared weights
        of another form (TRL's training pass then computes the gradient). On-policy, with a loss linear in the token
        weights, this is the gradient TRL's pass would compute (``opefo_trl.experimental.stand_ins``); it is formed in
        place of a."""
        step, self._step = self._step, None
        if step is None or not gradient or decided.lam is None:
            return None
        signs, model = step
        assert decided.signs is not None  # given with lam (RolloutWeights)
        if decided.signs is not signs and not torch.equal(decided.signs, signs):
            raise RuntimeError(
                "The method's RolloutWeights declare signs other than those it built the step model with "
                "(context.step_change(signs)): give RolloutWeights.affine the same signs, or no lam for weights of "
                "another form."
            )
        return [a.add_(b, alpha=decided.lam) for a, b in zip(model.a, model.b, strict=True)]
