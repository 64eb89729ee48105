"""A token's weight, made once per rollout batch (:class:`RolloutWeigher`) and applied in every loss forward TRL runs
(:class:`MicroBatchWeigher`).

**The rollout pass.** A method that needs the whole rollout batch before the first backward (``needs_rollout_pass``,
OPEFO's lambda*), or the `param` diagnostics, gets for every micro-batch TRL will train on log pi_t and H_t of the
current policy (from TRL's own no-grad old-log-prob pass when it runs one, else from generation's logits or one no-grad
pass of the trainer's, or, for a rollout batch that is a single micro-batch, the training forward itself), the
per-token factor f_t of the loss TRL applies, and the flow; the method turns them into detached fp32 token weights
(its sums reduced over ranks) and each micro-batch's ``advantages`` become ``advantages * weights``, (B, T). TRL
accepts (B, T) advantages everywhere, and since the weights are >= 0 this is exactly the reweighted loss for every loss
type.

**When.** Where a token's f_t does not depend on which micro-batch it lands in (every loss type but ``bnpo``, no
high-entropy mask; ``LossMirror.factor_is_per_sequence``) and the estimate is tabular, the rollout is weighed when
TRL's ``_generate_and_score_completions`` returns it: its ``advantages`` become (B, T) there, and each row's state
(unweighted advantages, f_t, u_t: ``CARRIED_STATE_KEYS``) rides along TRL's shuffle and split, as TRL's own
``old_per_token_logps`` does. Otherwise (``bnpo``, the high-entropy mask, the `param` estimate) it is weighed at the
first loss, over TRL's micro-batches (``RolloutWeigher.prepare``), and the log pi_t and H_t read while TRL generated
travel there in TRL's dict (``CARRIED_KEYS``). A rollout of one micro-batch without TRL's pass is weighed inside its
training forward (no forward of its own).

**The loss forward.** TRL's loss (`GRPOTrainer.compute_loss`) scores the micro-batch
(`_get_per_token_logps_and_entropies`) *before* it reads ``inputs["advantages"]``, so a method's weights that depend
on the training forward (a deferred rollout's, PAR's, Clip-Cov's) are written into the advantages inside that call
(pinned by ``test_trl_reads_the_advantages_after_the_scoring_call``). One :class:`LossCall` is one loss forward: it
works on a copy of TRL's dict (TRL reuses buffered micro-batches when ``num_iterations > 1``);
:class:`MicroBatchWeigher` applies the method there, adds its extra per-token loss aggregated like TRL's policy loss,
sums the step's entropy-flow diagnostics, and at the optimizer step's end runs the method's controllers and logs.

TRL's scoring calls inside the trainer's hooks reach this module directly: the hook in progress holds one
:class:`ScoringObserver` (a :class:`RolloutCapture` while TRL generates, a :class:`LossCall` in the loss forward),
which runs (or, with the step balance, serves: ``opefo_trl.experimental.stand_ins``) the call and sees its result.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from opefo_trl.experimental.stand_ins import served_scores, write_gradient
from opefo_trl.maths.entropy_flow import (
    TABULAR_ESTIMATES,
    FlowStats,
    flow_per_unit_advantage,
    flow_stats,
    on_policy_mean,
)
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods import MethodContext, TokenBatch, TokenMethod, decide_rollout_weights
from opefo_trl.trainer.batch_state import MULTIMODAL_KEYS, STATE_KEY, MicroBatchState, RolloutItem, Scores
from opefo_trl.trainer.loss_mirror import LossMirror, LossMirrorMismatch
from opefo_trl.trainer.scoring import Scorer

if TYPE_CHECKING:  # the parts a weigher is handed (they import this module's data, not the weighers)
    from opefo_trl.experimental.entropy_audit import EntropyAudit
    from opefo_trl.experimental.param_estimate import ParamEstimate
    from opefo_trl.trainer.generation_stats import GenerationStats

#: The keys of TRL's rollout dict under which the rollout's captured log pi_t, H_t and surprise-gap moments travel to
#: its weighing, which takes them out: when TRL returns the rollout, or at its first loss, through TRL's shuffle and
#: split (``Scores``'s fields in order; the moments only where they are computed).
CARRIED_KEYS = ("opefo_logps", "opefo_entropies", "opefo_moment2", "opefo_moment3")

#: TRL's scoring call of the hook in progress, with entropies: () -> (logps, entropies, aux_loss).
TrlScoringCall = Callable[[], tuple]


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sequence-level advantages (B,) broadcast to the per-token shape of ``like``; (B, T) ones as they are."""
    return advantages.unsqueeze(1).expand_as(like) if advantages.dim() == 1 else advantages


def carried_scores(batch: dict, pop: bool = False) -> Scores | None:
    """The captured statistics a (rollout or micro-batch) dict carries (``CARRIED_KEYS``), taken out with ``pop``;
    None when it carries none."""
    take = batch.pop if pop else batch.get
    logps, entropies, moment2, moment3 = (take(key, None) for key in CARRIED_KEYS)
    if logps is None or entropies is None:
        return None
    return Scores(logps, entropies, moment2, moment3)


def unit_bias(estimate: str, scores: Scores) -> torch.Tensor:
    """E_pi[u_t] at each position (``entropy_flow.on_policy_mean``) of an estimate whose on-policy mean is not zero
    (``BIASED_ESTIMATES``; the others' is 0 exactly and is not logged), from the moments."""
    moment2, moment3 = scores.moments
    assert moment2 is not None and moment3 is not None  # the bias diagnostic turns the vocabulary pass on
    return on_policy_mean(estimate, moment2, moment3)


#: The keys under which a rollout weighed before TRL's split carries its ``MicroBatchState`` (advantages, factor,
#: unit flow, unit bias where computed; (B, T) each) through TRL's shuffle and split.
CARRIED_STATE_KEYS = ("opefo_advantages", "opefo_factor", "opefo_unit_flow", "opefo_unit_bias")


def carry_state(batch: dict, state: MicroBatchState) -> None:
    """Write a rollout's state into TRL's rollout dict before its shuffle and split (``CARRIED_STATE_KEYS``): only
    per-row tensors travel there, so only a state made of them."""
    if state.deferred or state.audit_entropies is not None or state.served is not None or state.gradient is not None:
        raise ValueError("Only advantages, factor and unit flow travel through TRL's split; weigh after the split.")
    values = (state.advantages, state.factor, state.unit_flow, state.unit_bias)
    batch.update((key, value) for key, value in zip(CARRIED_STATE_KEYS, values, strict=True) if value is not None)


def micro_batch_state(batch: dict, pop: bool = False) -> MicroBatchState | None:
    """A micro-batch's state: under ``STATE_KEY`` (weighed after TRL's split) or carried (``CARRIED_STATE_KEYS``,
    taken out with ``pop``); None when it has none.

    >>> batch = {"completion_mask": torch.ones(2, 3)}
    >>> carry_state(batch, MicroBatchState(torch.ones(2, 3), torch.full((2, 3), 0.5), torch.zeros(2, 3)))
    >>> micro_batch_state(batch, pop=True).factor[0].tolist(), sorted(batch)
    ([0.5, 0.5, 0.5], ['completion_mask'])
    """
    if STATE_KEY in batch:
        return batch[STATE_KEY]
    take = batch.pop if pop else batch.get
    advantages, factor, unit_flow, bias = (take(key, None) for key in CARRIED_STATE_KEYS)
    return None if advantages is None else MicroBatchState(advantages, factor, unit_flow, bias)


class ScoringObserver(Protocol):
    """What one of the trainer's hooks hands TRL's scoring calls to (`RolloutCapture`, `LossCall`)."""

    def accepts(self, model: Any) -> bool: ...

    def scored(self, trl_score: TrlScoringCall, logits_to_keep: int) -> tuple:
        """TRL's result of the call (or what serves it), seen by the observer."""


def scoring_call(
    scorer: Scorer, trl_score: TrlScoringCall, logits_to_keep: int, moments: bool, served: tuple | None = None
) -> tuple[tuple, tuple]:
    """TRL's scoring call (``served`` instead, when given), and with ``moments`` the surprise-gap moments S_2, S_3 from
    the hidden states of its forward ((None, None) without)."""
    if not moments:
        return served or trl_score(), (None, None)
    with scorer.capture_hidden_states(True) as hidden:
        result = served or trl_score()
    return result, scorer.moments(hidden, logits_to_keep)


@dataclass
class RolloutCapture:
    """Observes TRL's old-log-prob pass over a rollout being generated: the first scoring call on the policy (the
    reference pass, when there is one, comes after it; with PEFT it runs on the policy with its adapter off)."""

    ref_model: Any
    scorer: Scorer
    needs_moments: bool
    scores: Scores | None = None

    def accepts(self, model: Any) -> bool:
        return self.scores is None and model is not self.ref_model

    def scored(self, trl_score: TrlScoringCall, logits_to_keep: int) -> tuple:
        result, moments = scoring_call(self.scorer, trl_score, logits_to_keep, self.needs_moments)
        self.scores = Scores(result[0].detach(), result[1].detach(), *moments)
        return result  # TRL's pass runs as it would


class RolloutWeigher:
    """Args:
    method: the token method.
    estimate: ``entropy_flow_estimate``.
    moments: the flow needs the surprise-gap moments (``config.needs_moments``).
    bias: the flow's on-policy mean is computed (``entropy_flow_bias_diagnostics``, a tabular estimate).
    loss: TRL's loss factor; ``scorer``: the trainer's scoring forwards.
    param: the `param` estimate (None with a tabular estimate).
    audit: keeps the `param` estimate of an audited step.
    reduce_sum: sums a tensor over ranks.
    num_iterations: TRL's updates per rollout batch.
    trl_scores_rollout: whether TRL runs its own old-log-prob pass over a rollout.
    writes_gradient: TRL's loss gradient is linear in the token weights (``LossMirror.gradient_is_linear``) and the
        method adds no micro-batch terms: where the method declares its weights 1 + lambda * s_t with the signs of the
        step model it built (``RolloutWeights``), the rollout pass has the gradient TRL's training pass would compute,
        a + lambda b, and TRL's pass is skipped (the loss is computed from the estimate's scores, so TRL's metrics
        are still logged; ``opefo_trl.experimental.stand_ins``).
    generation: reads log pi_t and H_t from the logits of generation (``GenerationStats``), where they would
        otherwise take a scoring pass of their own.
    """

    def __init__(
        self,
        method: TokenMethod,
        estimate: str,
        moments: bool,
        bias: bool,
        loss: LossMirror,
        scorer: Scorer,
        param: ParamEstimate | None,
        audit: EntropyAudit,
        reduce_sum: ReduceSum,
        num_iterations: int,
        trl_scores_rollout: bool,
        writes_gradient: bool = False,
        generation: GenerationStats | None = None,
    ):
        self.method, self.estimate, self.loss, self.scorer = method, estimate, loss, scorer
        self.moments, self.bias = moments, bias
        self.param, self.audit, self.reduce_sum = param, audit, reduce_sum
        self.num_iterations, self.trl_scores_rollout = num_iterations, trl_scores_rollout
        self.writes_gradient, self.generation = writes_gradient, generation
        self.pending = False  # a rollout batch was generated and awaits its weights (``prepare``)

    @property
    def defers_to_training_forward(self) -> bool:
        """Without TRL's pass, a rollout batch that is one micro-batch, trained on once, is weighed in its training
        forward (the same parameters): no forward of its own."""
        return (
            not self.trl_scores_rollout
            and self.loss.steps_per_generation == 1
            and self.num_iterations == 1
            and self.estimate in TABULAR_ESTIMATES
        )

    @property
    def weighs_before_split(self) -> bool:
        """Whether a rollout is weighed when TRL's ``_generate_and_score_completions`` returns, as (B, T) advantages
        TRL then shuffles and splits: wherever a token's f_t does not depend on the split. Else it is weighed at the
        first loss, over TRL's micro-batches (``prepare``)."""
        return self.loss.factor_is_per_sequence and self.param is None and not self.defers_to_training_forward

    def capture(self, ref_model: Any) -> RolloutCapture | None:
        """What observes TRL's old-log-prob pass of the rollout about to be generated (None: TRL runs none)."""
        if not self.trl_scores_rollout:
            return None
        return RolloutCapture(ref_model, self.scorer, needs_moments=self.moments)

    def recording(self, model: Callable[[], Any]) -> AbstractContextManager:
        """The block in which TRL generates the rollout: generation's logits are read there (``generation``) from the
        policy ``model()``."""
        return nullcontext() if self.generation is None else self.generation.recording(model())

    def generated(self, output: dict, capture: RolloutCapture | None) -> dict:
        """TRL's rollout batch, weighed (``weighs_before_split``), or carrying the log pi_t and H_t captured while it
        was generated (``CARRIED_KEYS``) to its weighing at the first loss (``prepare``)."""
        captured = None
        if capture is not None and capture.scores is not None:
            old_logps = output.get("old_per_token_logps")
            if old_logps is None or not torch.equal(capture.scores.logps, old_logps):
                raise RuntimeError(
                    "OPEFOTrainer captured a scoring pass that is not TRL's old-log-prob pass; this TRL version's "
                    "_generate_and_score_completions differs from the supported one."
                )
            captured = capture.scores
        elif self.generation is not None:
            captured = self.generation.scores(output["completion_ids"])
        if captured is not None:
            values = (captured.logps, captured.entropies, *captured.moments)
            output.update((key, value) for key, value in zip(CARRIED_KEYS, values, strict=True) if value is not None)
        if self.weighs_before_split:
            self.weigh([output], split_into=self.loss.steps_per_generation)
        else:
            self.pending = True
        return output

    def prepare(self, batches: list[dict], first: dict) -> None:
        """Weigh the micro-batches of the rollout TRL has generated and split (TRL's ``_buffered_inputs``), at the
        loss of the ``first`` of them to be trained on (a no-op between rollouts)."""
        if not self.pending:
            return
        if not any(batch is first for batch in batches):  # weights written elsewhere would never be trained on
            raise RuntimeError(
                "OPEFOTrainer: the micro-batch TRL trains on is not one of its buffered rollout micro-batches "
                "(_buffered_inputs); this TRL version's _prepare_inputs differs from the supported one."
            )
        self.pending = False
        self.weigh(batches)

    def weigh(self, batches: list[dict], split_into: int | None = None) -> None:
        """Factor, flow and weights of every micro-batch of a rollout batch, in place (each gets its
        ``MicroBatchState``), from the statistics the micro-batches carry (``CARRIED_KEYS``) or, without, a scoring
        pass of the trainer's. ``split_into``: ``batches`` is TRL's one rollout dict, which TRL will split into that
        many micro-batches (the states then travel as tensors, ``carry_state``); None: TRL's micro-batches."""
        items = [
            RolloutItem(
                batch,
                per_token(batch["advantages"], batch["completion_mask"]).float(),
                carried_scores(batch, pop=True),
            )
            for batch in batches
        ]
        captured = items[0].scores is not None
        if not captured:
            if self.defers_to_training_forward:
                (item,) = items
                item.batch[STATE_KEY] = MicroBatchState(item.advantages, deferred=True)
                return
            multimodal = sorted(k for k in MULTIMODAL_KEYS if batches[0].get(k) is not None)
            if multimodal:
                raise NotImplementedError(
                    f"OPEFOTrainer's own scoring passes are text-only, but this rollout has {multimodal}. Use one "
                    "micro-batch per rollout (gradient_accumulation_steps=1) with a log-prob estimate, or vLLM with "
                    "importance-sampling correction, whose scoring pass TRL runs with the images and OPEFO reuses."
                )
        context = MethodContext(self.reduce_sum)
        flow = None
        if self.param is not None:
            estimator, flow = self.param.estimate(items)
            context.step_model = partial(self.param.step_change, estimator, flow, items)
            context.entropy = flow.entropy
            for (probe, _), entropies in zip(self.param.probe, flow.probe_entropies, strict=True):
                self.audit.keep_batch(probe.batch, entropies, full_precision=True)  # the audit measures the probe too
        elif not captured:
            for item in items:
                item.scores = self.scorer.score(item.batch, vocab=self.moments).detached()
        rows = None if split_into is None else len(items[0].advantages) // split_into
        token_batches = [
            self._flow(item, None if flow is None else flow.alignment[i], rows) for i, item in enumerate(items)
        ]
        decided = decide_rollout_weights(self.method, _joined(token_batches), context)
        gradient = None if self.param is None else self.param.finish(decided, self.writes_gradient)
        weights = decided.weights
        parts = [None] * len(items) if weights is None else weights.split([len(b.logps) for b in token_batches])
        for i, (item, part) in enumerate(zip(items, parts, strict=True)):
            if part is not None:
                item.batch["advantages"] = item.advantages * part
            state = MicroBatchState(
                item.advantages,
                item.factor,
                item.unit_flow,
                item.unit_bias,
                audit_entropies=item.audit_entropies,
                served=None if gradient is None else item.scores,  # stand-ins for TRL's pass (stand_ins.py)
                gradient=gradient if i == 0 else None,
            )
            if split_into is None:
                item.batch[STATE_KEY] = state
            else:
                carry_state(item.batch, state)
        if flow is not None:
            self.audit.keep_param_flow(flow)

    def _flow(self, item: RolloutItem, alignment: torch.Tensor | None, rows: int | None) -> TokenBatch:
        """The micro-batch's f_t and u_t (kept on the item) and its TokenBatch with the flow d_t = A_t u_t (``rows``:
        the rows of TRL's micro-batches when the item is the whole rollout)."""
        scores = item.scores
        assert scores is not None  # carried, from the `param` estimate or from the scoring pass above
        if item.factor is None:
            item.factor = self.loss.factor(item.batch, scores.logps, scores.entropies, item.advantages, rows)
        item.unit_flow = flow_per_unit_advantage(
            scores.logps, scores.entropies, self.estimate, *scores.moments, alignment
        )
        if self.bias:
            item.unit_bias = unit_bias(self.estimate, scores)
        return TokenBatch(
            logps=scores.logps,
            entropies=scores.entropies,
            advantages=item.advantages,
            factor=item.factor,
            flow=item.advantages * item.unit_flow,
            old_logps=item.batch.get("old_per_token_logps"),
            flow_bias=None if item.unit_bias is None else item.advantages * item.unit_bias,
        )


def _joined(parts: list[TokenBatch]) -> TokenBatch:
    """The micro-batches' TokenBatches as one, their rows in order (the rollout batch a method weighs at once)."""

    def rows(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if tensors[0] is None else torch.cat(cast(list[torch.Tensor], tensors))

    return TokenBatch(
        logps=torch.cat([part.logps for part in parts]),
        entropies=torch.cat([part.entropies for part in parts]),
        advantages=torch.cat([part.advantages for part in parts]),
        factor=torch.cat([part.factor for part in parts]),
        flow=rows([part.flow for part in parts]),
        old_logps=rows([part.old_logps for part in parts]),
        flow_bias=rows([part.flow_bias for part in parts]),
    )


class LossCall:
    """One micro-batch's loss forward: TRL's dict copied, its state, and what the method made of it; it observes the
    forward's scoring call (``OPEFOTrainer._get_per_token_logps_and_entropies``)."""

    def __init__(self, weigher: MicroBatchWeigher, inputs: dict):
        self.weigher = weigher
        self.inputs = dict(inputs)
        self.state: MicroBatchState | None = micro_batch_state(self.inputs, pop=True)
        self.needs_moments = weigher.needs_moments(self.state)
        self.extra_loss: torch.Tensor | None = None
        self.factor_loss: torch.Tensor | None = None  # per token, already weighted by f_t (times the ranks)
        self.weighted = False  # the deferred rollout weights were applied
        self.entropies_before: torch.Tensor | None = None  # for the audit
        self.logps: torch.Tensor | None = None  # TRL's scored log pi_t, attached, and the factor used for them
        self.factor: torch.Tensor | None = None
        self.full_precision = False  # the precision entropies_before were taken in

    def accepts(self, model: Any) -> bool:
        return True  # the loss scores only the policy (possibly DDP/DeepSpeed-wrapped)

    def scored(self, trl_score: TrlScoringCall, logits_to_keep: int) -> tuple:
        """TRL's scoring of the micro-batch, or, when the rollout pass already has the step's gradient, the estimate's
        scores standing in for it (``stand_ins.served_scores`` says when that is exact); the method applied to it."""
        served = None if self.state is None or self.state.served is None else served_scores(self.state.served)
        result, moments = scoring_call(self.weigher.scorer, trl_score, logits_to_keep, self.needs_moments, served)
        self.weigher.apply(self, result[0], result[1], moments)
        return result


class MicroBatchWeigher:
    """Args:
    method: the token method.
    estimate: ``entropy_flow_estimate``; ``diagnostics``: ``entropy_flow_diagnostics``.
    moments, bias: as for ``RolloutWeigher``.
    rollout_flow: the rollout pass computes factor and flow (then the loss reads them from the micro-batch's state).
    loss: TRL's loss factor and aggregation; ``scorer``: the `full` estimate's vocabulary pass over the forward.
    reduce_sum: sums a tensor over ranks; ``log_metrics``: where metrics go; ``main_process``: warnings go there.
    params: the trainable parameters, whose ``.grad`` a rollout's written gradient goes into
        (``experimental.stand_ins``).
    task_tokens: ``entropy_flow_task_tokens``: the diagnostics also log the shares of the flow sampled outside them.
    check_mirror: the factor is used (flows, weights): the first micro-batch's TRL loss is checked against it once
        (``LossMirror.check_against_trl``).
    """

    def __init__(
        self,
        method: TokenMethod,
        estimate: str,
        moments: bool,
        bias: bool,
        diagnostics: bool,
        rollout_flow: bool,
        loss: LossMirror,
        scorer: Scorer,
        reduce_sum: ReduceSum,
        log_metrics: Callable[[dict[str, float]], None],
        main_process: bool,
        params: Callable[[], list[torch.Tensor]] = list,
        task_tokens: torch.Tensor | None = None,
        check_mirror: bool = True,
    ):
        self.method, self.estimate, self.diagnostics, self.rollout_flow = method, estimate, diagnostics, rollout_flow
        self.moments, self.bias = moments, bias
        self.loss, self.scorer, self.log_metrics, self.main_process = loss, scorer, log_metrics, main_process
        self.params, self.task_tokens, self.check_mirror = params, task_tokens, check_mirror
        self.mirror_difference: float | None = None  # what the one-time check found
        self.context = MethodContext(reduce_sum)
        self.step_flow: FlowStats | None = None  # the unweighted (GRPO) update's flow, summed over the step
        self.step_off_task: FlowStats | None = None  # its part sampled outside the task's tokens

    def needs_moments(self, state: MicroBatchState | None) -> bool:
        """Whether the loss forward's surprise-gap moments are needed (the rollout pass did not compute them)."""
        deferred = state is not None and state.deferred
        return self.moments and (deferred or (state is None and self.diagnostics))

    def loss_call(self, inputs: dict) -> LossCall:
        return LossCall(self, inputs)

    def apply(self, call: LossCall, logps: torch.Tensor, entropies: torch.Tensor, moments: tuple) -> None:
        """The method's weights and extra loss for the micro-batch, from the training forward's log pi_t and H_t."""
        inputs, state = call.inputs, call.state
        deferred = state is not None and state.deferred
        logps_detached, entropies = logps.detach(), entropies.detach()
        original = per_token(inputs["advantages"], logps_detached).float() if state is None else state.advantages
        if state is not None and not deferred:  # computed for the whole rollout batch
            unit, bias, factor = state.unit_flow, state.unit_bias, state.factor
            assert factor is not None  # the rollout pass sets both
        else:
            factor = self.loss.factor(inputs, logps_detached, entropies, inputs["advantages"])
            unit = bias = None
            if deferred or (self.diagnostics and self.estimate in TABULAR_ESTIMATES):
                unit = flow_per_unit_advantage(logps_detached, entropies, self.estimate, *moments)
                if self.bias:
                    bias = unit_bias(self.estimate, Scores(logps_detached, entropies, *moments))
        advantages = per_token(inputs["advantages"], logps_detached)
        old_logps = inputs.get("old_per_token_logps")
        if deferred:
            assert unit is not None  # computed above for the deferred weights
            rollout = TokenBatch(
                logps_detached,
                entropies,
                original,
                factor,
                original * unit,
                old_logps,
                None if bias is None else original * bias,
            )
            weights = decide_rollout_weights(self.method, rollout, self.context).weights
            if weights is not None:  # None: unweighted, as in RolloutWeigher.weigh
                advantages = inputs["advantages"] = advantages * weights
            call.weighted = True
        batch = TokenBatch(
            logps_detached, entropies, advantages, factor, None if unit is None else advantages * unit, old_logps
        )
        terms = self.method.micro_batch_terms(batch, logps, self.context)
        if terms.weights is not None:
            advantages = inputs["advantages"] = advantages * terms.weights
        if terms.factor_loss is not None:  # f_t at the current parameters: TRL's masks read this forward's ratio
            now = factor if state is None or deferred else self.loss.factor(inputs, logps_detached, entropies, original)
            call.factor_loss = terms.factor_loss * now * self.loss.num_processes  # DDP averages the ranks' losses
        call.extra_loss, call.logps, call.factor = terms.extra_loss, logps, factor
        if unit is not None and self.diagnostics:
            stats = flow_stats(original * unit, factor, None if bias is None else original * bias)
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
            self._check_mirror(loss, call)
        call.logps = None
        if call.extra_loss is not None:
            loss = loss + self.loss.aggregate(call.extra_loss, call.inputs)
        if call.factor_loss is not None:
            loss = loss + call.factor_loss.sum()
        if call.state is not None and call.state.gradient is not None:  # a stand-in for TRL's backward (stand_ins.py)
            write_gradient(self.params(), call.state.gradient)
        return loss

    def _check_mirror(self, loss: torch.Tensor, call: LossCall) -> None:
        """The one-time guard. A mismatch stops a method that weighs tokens by the factor; where only the diagnostics
        read it (plain GRPO's drop-in), they are switched off on every rank with one warning, and training goes on."""
        assert call.logps is not None and call.factor is not None
        try:
            self.mirror_difference = self.loss.check_against_trl(loss, call.logps, call.inputs, call.factor)
            mismatch: LossMirrorMismatch | None = None
        except LossMirrorMismatch as error:
            if type(self.method).weighs_tokens():
                raise
            mismatch = error
        if not self.diagnostics:
            return
        # Every rank runs the step's flow reduction or none does: off where any rank's check failed.
        failed = self.context.reduce_sum(torch.tensor([float(mismatch is not None)], device=call.logps.device))
        if float(failed[0]) == 0:
            return
        self.diagnostics, self.step_flow, self.step_off_task = False, None, None
        if self.main_process:
            warnings.warn(
                "OPEFOTrainer: TRL's loss applies an update the per-token factor does not model (options in effect: "
                f"{', '.join(self.loss.options) or 'none besides the defaults'}), so the entropy flow would describe "
                "another update: the entropy-flow diagnostics are switched off for this run. Training goes on as "
                "GRPOTrainer's.",
                stacklevel=4,
            )

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
