"""Every micro-batch TRL trains on: what the token method adds to its loss, and the end of each optimizer step.

`GRPOTrainer._compute_loss` scores the micro-batch (`_get_per_token_logps_and_entropies`) *before* it reads
``inputs["advantages"]``, so the method's weights are written into the advantages inside that call: the weights of a
deferred rollout and of PAR / Clip-Cov depend on the training forward's log-probs (pinned by
``test_trl_reads_the_advantages_after_the_scoring_call``). One :class:`LossCall` is one loss forward: it works on a
copy of TRL's dict (the method may replace ``advantages``, and TRL reuses buffered micro-batches when
``num_iterations > 1``) and observes that scoring call; :class:`MicroBatchWeigher` applies the method there, adds its
extra per-token loss aggregated like TRL's policy loss, sums the step's entropy-flow diagnostics, and at the optimizer
step's end runs the method's controllers and logs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from opefo_trl.maths.entropy_flow import TABULAR_ESTIMATES, FlowStats, flow_per_unit_advantage, flow_stats
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods import MethodContext, TokenBatch, TokenMethod, decide_rollout_weights
from opefo_trl.trainer.batch_state import STATE_KEY, MicroBatchState, per_token
from opefo_trl.trainer.loss_mirror import LossMirror
from opefo_trl.trainer.stand_ins import served_scores, write_gradient


class LossCall:
    """One micro-batch's loss forward: TRL's dict copied, its state, and what the method made of it; it observes the
    forward's scoring call (``OPEFOTrainer._get_per_token_logps_and_entropies``)."""

    def __init__(self, weigher: MicroBatchWeigher, inputs: dict):
        self.weigher = weigher
        self.inputs = dict(inputs)
        self.state: MicroBatchState | None = inputs.get(STATE_KEY)
        self.needs_vocab_stats = weigher.needs_vocab_stats(self.state)
        self.extra_loss: torch.Tensor | None = None
        self.factor_loss: torch.Tensor | None = None  # per token, already weighted by f_t (times the ranks)
        self.weighted = False  # the deferred rollout weights were applied
        self.entropies_before: torch.Tensor | None = None  # for the audit
        self.logps: torch.Tensor | None = None  # TRL's scored log pi_t, attached, and the factor used for them
        self.factor: torch.Tensor | None = None
        self.full_precision = False  # the precision entropies_before were taken in

    def accepts(self, model) -> bool:
        return True  # the loss scores only the policy (possibly DDP/DeepSpeed-wrapped)

    def served(self) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """What TRL's scoring call returns without running the model (None: it runs)."""
        if self.state is None or self.state.served is None:
            return None
        return served_scores(self.state.served)  # a stand-in for TRL's forward (stand_ins.py says when it is exact)

    def observe(self, logps: torch.Tensor, entropies: torch.Tensor, vocab: tuple) -> None:
        self.weigher.apply(self, logps, entropies, vocab)


class MicroBatchWeigher:
    """Args:
    method: the token method.
    estimate: ``entropy_flow_estimate``; ``diagnostics``: ``entropy_flow_diagnostics``.
    rollout_flow: the rollout pass computes factor and flow (then the loss reads them from the micro-batch's state).
    loss: TRL's loss factor and aggregation.
    reduce_sum: sums a tensor over ranks; ``log_metrics``: where metrics go; ``main_process``: warnings go there.
    params: the trainable parameters, whose ``.grad`` a rollout's written gradient goes into (``stand_ins``).
    task_tokens: ``entropy_flow_task_tokens``: the diagnostics also log the shares of the flow sampled outside them.
    check_mirror: the factor is used (flows, weights): the first micro-batch's TRL loss is checked against it once
        (``LossMirror.check_against_trl``).
    """

    def __init__(
        self,
        method: TokenMethod,
        estimate: str,
        diagnostics: bool,
        rollout_flow: bool,
        loss: LossMirror,
        reduce_sum: ReduceSum,
        log_metrics: Callable[[dict[str, float]], None],
        main_process: bool,
        params: Callable[[], list[torch.Tensor]] = list,
        task_tokens: torch.Tensor | None = None,
        check_mirror: bool = True,
    ):
        self.method, self.estimate, self.diagnostics, self.rollout_flow = method, estimate, diagnostics, rollout_flow
        self.loss, self.log_metrics, self.main_process, self.params = loss, log_metrics, main_process, params
        self.task_tokens, self.check_mirror = task_tokens, check_mirror
        self.mirror_difference: float | None = None  # what the one-time check found
        self.context = MethodContext(reduce_sum)
        self.step_flow: FlowStats | None = None  # the unweighted (GRPO) update's flow, summed over the step
        self.step_off_task: FlowStats | None = None  # its part sampled outside the task's tokens

    def needs_vocab_stats(self, state: MicroBatchState | None) -> bool:
        """Whether the loss forward's `full` statistics are needed (the rollout pass did not compute them)."""
        deferred = state is not None and state.deferred
        return self.estimate == "full" and (deferred or (self.diagnostics and not self.rollout_flow))

    def loss_call(self, inputs: dict) -> LossCall:
        return LossCall(self, inputs)

    def apply(self, call: LossCall, logps: torch.Tensor, entropies: torch.Tensor, vocab: tuple) -> None:
        """The method's weights and extra loss for the micro-batch, from the training forward's log pi_t and H_t."""
        inputs, state = call.inputs, call.state
        deferred = state is not None and state.deferred
        logps_detached, entropies = logps.detach(), entropies.detach()
        original = per_token(inputs["advantages"], logps_detached).float() if state is None else state.advantages
        if state is not None and not deferred:  # computed for the whole rollout batch
            unit, factor = state.unit_flow, state.factor
            assert factor is not None  # the rollout pass sets both
        else:
            factor = self.loss.factor(inputs, logps_detached, entropies, inputs["advantages"])
            unit = None
            if deferred or (self.diagnostics and self.estimate in TABULAR_ESTIMATES):
                unit = flow_per_unit_advantage(logps_detached, entropies, self.estimate, *vocab)
        advantages = per_token(inputs["advantages"], logps_detached)
        old_logps = inputs.get("old_per_token_logps")
        if deferred:
            assert unit is not None  # computed above for the deferred weights
            rollout = TokenBatch(logps_detached, entropies, original, factor, original * unit, old_logps)
            weights = decide_rollout_weights(self.method, rollout, self.context).weights
            if weights is not None:  # None: unweighted, as in RolloutWeigher.weigh
                advantages = advantages * weights
            call.weighted = True
        batch = TokenBatch(
            logps_detached, entropies, advantages, factor, None if unit is None else advantages * unit, old_logps
        )
        terms = self.method.micro_batch_terms(batch, logps, self.context)
        if terms.weights is not None:
            advantages = advantages * terms.weights
        if terms.factor_loss is not None:  # f_t at the current parameters: TRL's masks read this forward's ratio
            now = factor if state is None or deferred else self.loss.factor(inputs, logps_detached, entropies, original)
            call.factor_loss = terms.factor_loss * now * self.loss.num_processes  # DDP averages the ranks' losses
        inputs["advantages"] = advantages
        call.extra_loss, call.logps, call.factor = terms.extra_loss, logps, factor
        if unit is not None and self.diagnostics:
            stats = flow_stats(original * unit, factor)
            self.step_flow = stats if self.step_flow is None else self.step_flow + stats
            if self.task_tokens is not None:
                off_task = ~torch.isin(inputs["completion_ids"], self.task_tokens)
                stats = flow_stats(original * unit, factor * off_task)
                self.step_off_task = stats if self.step_off_task is None else self.step_off_task + stats
        if state is not None and state.audit_entropies is not None:
            call.entropies_before, call.full_precision = state.audit_entropies, True
        else:
            call.entropies_before = entropies

    def finish(self, call: LossCall, loss: torch.Tensor) -> torch.Tensor:
        """TRL's loss plus the method's extra per-token losses (aggregated like TRL's loss, or weighted by f_t)."""
        if call.state is not None and call.state.deferred and not call.weighted:
            raise RuntimeError(
                "OPEFOTrainer: the rollout weights were deferred to the training forward but never applied; the loss "
                "did not score completions through _get_per_token_logps_and_entropies (unsupported TRL code path)."
            )
        if self.check_mirror and call.logps is not None and call.factor is not None:
            self.check_mirror = False  # once: the first micro-batch's TRL loss, before the method's own terms
            self.mirror_difference = self.loss.check_against_trl(loss, call.logps, call.inputs, call.factor)
        call.logps = None
        if call.extra_loss is not None:
            loss = loss + self.loss.aggregate(call.extra_loss, call.inputs)
        if call.factor_loss is not None:
            loss = loss + call.factor_loss.sum()
        if call.state is not None and call.state.gradient is not None:  # a stand-in for TRL's backward (stand_ins.py)
            write_gradient(self.params(), call.state.gradient)
        return loss

    def end_optimizer_step(self) -> None:
        """After the last micro-batch of an optimizer step: controllers, then step-level metrics (all ranks)."""
        self.method.on_optimizer_step(self.context)
        self.log_metrics(self.method.pop_metrics())
        if self.step_flow is not None:
            step = FlowStats.from_tensor(self.context.reduce_sum(self.step_flow.to_tensor()))
            self.log_metrics(step.metrics())
            if self.step_off_task is not None:
                off_task = FlowStats.from_tensor(self.context.reduce_sum(self.step_off_task.to_tensor()))
                self.log_metrics(off_task.shares_of(step, "entropy_flow/off_task_"))
            self.step_flow, self.step_off_task = None, None
        message = self.method.regime_warning()
        if message and self.main_process:
            warnings.warn(message, stacklevel=3)
