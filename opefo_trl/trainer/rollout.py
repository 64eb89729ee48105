"""Once per rollout batch: every token's loss factor f_t and entropy flow u_t, and the method's rollout weights.

A method that needs the whole rollout batch before the first backward (``needs_rollout_pass``, OPEFO's lambda*), or
the `param` diagnostics, gets from :class:`RolloutWeigher`, for every micro-batch TRL will train on, log pi_t and H_t
of the current policy (from TRL's own no-grad old-log-prob pass when it runs one, else one no-grad pass of the
trainer's, or, for a rollout batch that is a single micro-batch, the training forward itself), the per-token factor of
the loss TRL applies, and the flow; the method turns them into detached fp32 token weights (its sums reduced over
ranks) and each micro-batch's ``advantages`` become ``advantages * weights``, (B, T). TRL accepts (B, T) advantages
everywhere, and since the weights are >= 0 this is exactly the reweighted loss for every loss type.

The weigher's state between TRL's generation and its split into micro-batches is one :class:`RolloutState`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from opefo_trl.maths.entropy_flow import TABULAR_ESTIMATES, flow_per_unit_advantage
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods import MethodContext, TokenBatch, TokenMethod, decide_rollout_weights
from opefo_trl.trainer.audit import EntropyAudit
from opefo_trl.trainer.batch_state import (
    MULTIMODAL_KEYS,
    ROLLOUT_ROW_KEY,
    STATE_KEY,
    MicroBatchState,
    RolloutItem,
    Scores,
    per_token,
)
from opefo_trl.trainer.generation_stats import GenerationStats
from opefo_trl.trainer.loss_mirror import LossMirror
from opefo_trl.trainer.param_estimate import ParamEstimate
from opefo_trl.trainer.scoring import Scorer


@dataclass
class RolloutCapture:
    """Observes TRL's old-log-prob pass over a rollout being generated: the first scoring call on the policy (the
    reference pass, when there is one, comes after it; with PEFT it runs on the policy with its adapter off)."""

    ref_model: Any
    needs_vocab_stats: bool
    scores: Scores | None = None

    def accepts(self, model: Any) -> bool:
        return self.scores is None and model is not self.ref_model

    def observe(self, logps: torch.Tensor, entropies: torch.Tensor, vocab: tuple) -> None:
        self.scores = Scores(logps.detach(), entropies.detach(), *vocab)

    def served(self) -> None:
        return None  # TRL's pass runs


@dataclass
class RolloutState:
    """Between TRL's generation of a rollout batch and its split into micro-batches (``RolloutWeigher.prepare``)."""

    pending: bool = False  # a rollout batch was generated and awaits its weights
    captured: Scores | None = None  # TRL's old-log-prob pass over it, by rollout row


class RolloutWeigher:
    """Args:
    method: the token method.
    estimate: ``entropy_flow_estimate``.
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
        are still logged; ``opefo_trl.trainer.stand_ins``).
    generation: reads log pi_t and H_t from the logits of generation (``GenerationStats``), where they would
        otherwise take a scoring pass of their own.
    """

    def __init__(
        self,
        method: TokenMethod,
        estimate: str,
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
        self.param, self.audit, self.reduce_sum = param, audit, reduce_sum
        self.num_iterations, self.trl_scores_rollout = num_iterations, trl_scores_rollout
        self.writes_gradient, self.generation = writes_gradient, generation
        self.state = RolloutState()

    def capture(self, ref_model: Any) -> RolloutCapture | None:
        """What observes TRL's old-log-prob pass of the rollout about to be generated (None: TRL runs none)."""
        return RolloutCapture(ref_model, self.estimate == "full") if self.trl_scores_rollout else None

    def recording(self, model: Any) -> AbstractContextManager:
        """The block in which TRL generates the rollout: generation's logits are read there (``generation``)."""
        return nullcontext() if self.generation is None else self.generation.recording(model)

    def generated(self, output: dict, capture: RolloutCapture | None) -> dict:
        """TRL's rollout batch, with each completion's row when TRL's pass was captured (found again after TRL's
        shuffle)."""
        if capture is not None and capture.scores is not None:
            old_logps = output.get("old_per_token_logps")
            if old_logps is None or not torch.equal(capture.scores.logps, old_logps):
                raise RuntimeError(
                    "OPEFOTrainer captured a scoring pass that is not TRL's old-log-prob pass; this TRL version's "
                    "_generate_and_score_completions differs from the supported one."
                )
            self.state.captured = capture.scores
        elif self.generation is not None:
            self.state.captured = self.generation.scores(output["completion_ids"])
        if self.state.captured is not None:
            rows = len(output["completion_ids"])
            output[ROLLOUT_ROW_KEY] = torch.arange(rows, device=output["completion_ids"].device)
        self.state.pending = True
        return output

    def prepare(self, batches: list[dict]) -> None:
        """Weigh the micro-batches of the rollout TRL has just generated and split (a no-op between rollouts)."""
        if self.state.pending:
            captured, self.state = self.state.captured, RolloutState()
            self.weigh(batches, captured)

    def weigh(self, batches: list[dict], captured: Scores | None = None) -> None:
        """Factor, flow and weights of every micro-batch of a rollout batch, in place (each gets its
        ``MicroBatchState``); ``captured``: TRL's old-log-prob pass over it, by rollout row (``ROLLOUT_ROW_KEY``)."""
        items = [
            RolloutItem(
                batch,
                per_token(batch["advantages"], batch["completion_mask"]).float(),
                None if captured is None else captured.rows(batch.pop(ROLLOUT_ROW_KEY)),
            )
            for batch in batches
        ]
        if captured is None:
            if len(items) == 1 and self.num_iterations == 1 and self.estimate in TABULAR_ESTIMATES:
                # The rollout batch is one micro-batch scored by the training forward with the same parameters:
                # its weights are computed there, which saves a forward pass.
                items[0].batch[STATE_KEY] = MicroBatchState(items[0].advantages, deferred=True)
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
        elif captured is None:
            for item in items:
                item.scores = self.scorer.score(item.batch, vocab=self.estimate == "full").detached()
        token_batches = [self._flow(item, None if flow is None else flow.alignment[i]) for i, item in enumerate(items)]
        whole = _joined(token_batches)
        decided = decide_rollout_weights(self.method, whole, context)
        gradient = None if self.param is None else self.param.finish(decided, self.writes_gradient)
        weights = decided.weights
        parts = [None] * len(items) if weights is None else weights.split([len(b.logps) for b in token_batches])
        for i, (item, part) in enumerate(zip(items, parts, strict=True)):
            if part is not None:
                item.batch["advantages"] = item.advantages * part
            item.batch[STATE_KEY] = MicroBatchState(
                item.advantages,
                item.factor,
                item.unit_flow,
                audit_entropies=item.audit_entropies,
                served=None if gradient is None else item.scores,  # stand-ins for TRL's pass (stand_ins.py)
                gradient=gradient if i == 0 else None,
            )
        if flow is not None:
            self.audit.keep_param_flow(flow)

    def _flow(self, item: RolloutItem, alignment: torch.Tensor | None) -> TokenBatch:
        """The micro-batch's f_t and u_t (kept on the item) and its TokenBatch with the flow d_t = A_t u_t."""
        scores = item.scores
        assert scores is not None  # TRL's pass, the `param` estimate or the scoring pass above gave them
        if item.factor is None:
            item.factor = self.loss.factor(item.batch, scores.logps, scores.entropies, item.advantages)
        item.unit_flow = flow_per_unit_advantage(
            scores.logps, scores.entropies, self.estimate, *scores.vocab, alignment
        )
        return TokenBatch(
            logps=scores.logps,
            entropies=scores.entropies,
            advantages=item.advantages,
            factor=item.factor,
            flow=item.advantages * item.unit_flow,
            old_logps=item.batch.get("old_per_token_logps"),
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
    )
