"""CE-GPPO: the gradient of the tokens PPO's clip removes, kept bounded and scaled (docs/algorithm.md section 11)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    ClipRangeMethod,
    MethodContext,
    TokenBatch,
    TokenTerms,
    off_policy_reasons,
    register_token_method,
    setting,
)

#: TRL's loss types whose per-token loss is PPO's clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).
PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@register_token_method("ce_gppo")
class CEGPPO(ClipRangeMethod):
    """CE-GPPO: a token PPO's clip removes from the gradient keeps one of fixed size. With r the ratio,
    negative-advantage tokens below 1 - eps_low get the gradient of beta1 (1 - eps_low) A log pi, positive-advantage
    tokens above 1 + eps_high that of beta2 (1 + eps_high) A log pi; every other token is left to TRL's loss.

    The term is a per-token loss of value 0, -c A (log pi - sg(log pi)), weighted by each token's factor f_t like TRL's
    own policy gradient (``TokenTerms.factor_loss``: normalisation, masks, vLLM importance ratio). Strictly on-policy
    the ratio is 1, nothing is clipped and CE-GPPO is plain GRPO.

    With ``ce_gppo_positive_nll_coef`` = c > 0 (the authors' scripts: 0.1), the authors' NLL term on correct responses
    is added: c times the mean -log pi over the micro-batch's tokens of positive advantage (``positive_nll``).
    """

    @dataclass
    class Settings:
        """Options of ``method="ce_gppo"``."""

        ce_gppo_beta1: float = setting(
            0.75,
            "CE-GPPO: scale of the kept gradient of negative-advantage tokens clipped below 1 - epsilon (their "
            "gradient is beta1 (1 - epsilon) A grad log pi).",
        )
        ce_gppo_beta2: float = setting(
            1.0,
            "CE-GPPO: scale of the kept gradient of positive-advantage tokens clipped above 1 + epsilon_high (their "
            "gradient is beta2 (1 + epsilon_high) A grad log pi).",
        )

        ce_gppo_positive_nll_coef: float = setting(
            0.0,
            "CE-GPPO: coefficient c of the authors' NLL term on correct responses (their scripts: 0.1; 0: off): "
            "c times the mean -log pi over the micro-batch's tokens of positive advantage, added to the loss so that, "
            "with loss_type='dapo', it weighs against the policy loss as in the authors' code (token means over the "
            "micro-batch). The authors' set is the correct responses; with their dynamic sampling every group is "
            "mixed and these are exactly the responses of positive advantage.",
        )

        def __post_init__(self):
            for name in ("ce_gppo_beta1", "ce_gppo_beta2"):
                value = getattr(self, name)
                if not 0.0 <= value <= 10.0:
                    raise ValueError(f"{name} scales a kept gradient and must lie in [0, 10]; got {value}.")
            if not (math.isfinite(self.ce_gppo_positive_nll_coef) and self.ce_gppo_positive_nll_coef >= 0):
                raise ValueError(
                    f"ce_gppo_positive_nll_coef must be >= 0 (0: no NLL term); got {self.ce_gppo_positive_nll_coef}."
                )

    settings: Settings
    summary = "keeps a bounded gradient of the tokens PPO's clip removes"
    table_rows = (("CE-GPPO", '`method="ce_gppo"` ({defaults}; acts only off-policy, as Clip-higher; warned)'),)

    @classmethod
    def check_config(cls, args: Any) -> None:
        """PPO's clipped loss types only, token-level ratios; warns that it is inert strictly on-policy."""
        if args.loss_type not in PPO_CLIP_LOSS_TYPES:
            raise ValueError(
                f"method='ce_gppo' changes the gradient of the tokens PPO's clip removes, but loss_type="
                f"{args.loss_type!r} has no such clip. Use one of {PPO_CLIP_LOSS_TYPES}."
            )
        if args.importance_sampling_level != "token":
            raise ValueError(
                "method='ce_gppo' clips per-token ratios; importance_sampling_level="
                f"{args.importance_sampling_level!r} clips a sequence's. Set importance_sampling_level='token'."
            )
        if not off_policy_reasons(args):
            warnings.warn(
                "method='ce_gppo' in a strict on-policy configuration is inert: the ratio is 1, PPO's clip removes no "
                "token, and training is plain GRPO. CE-GPPO's published runs take 8 updates per rollout "
                "(steps_per_generation = 8 * gradient_accumulation_steps).",
                stacklevel=2,
            )

    def clipped(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean (B, T) masks of the tokens PPO's clip removes: (negative advantage, ratio below 1 - eps_low) and
        (positive advantage, ratio above 1 + eps_high); empty on-policy."""
        if batch.old_logps is None:
            none = torch.zeros_like(batch.in_loss)
            return none, none
        ratio = (batch.logps.double() - batch.old_logps.double()).exp()
        low = batch.in_loss & (batch.advantages < 0) & (ratio < 1 - self.epsilon_low)
        high = batch.in_loss & (batch.advantages > 0) & (ratio > 1 + self.epsilon_high)
        return low, high

    def positive_nll(self, batch: TokenBatch, logps: torch.Tensor) -> torch.Tensor:
        """The NLL term per token, (B, T), attached to ``logps``: -c log pi_t n / n+ on the n+ tokens of positive
        advantage among the n in the loss of the micro-batch, 0 elsewhere. Aggregated like TRL's policy loss (mean
        over the micro-batch's tokens with ``loss_type='dapo'`` and one micro-batch) it is c * mean over the positive
        tokens of -log pi, the authors' term."""
        positive = batch.in_loss & (batch.advantages > 0)
        count, positives = batch.in_loss.sum(), positive.sum()
        if positives == 0:
            return torch.zeros_like(logps)
        scale = self.settings.ce_gppo_positive_nll_coef * float(count) / float(positives)
        return -scale * logps * positive

    def micro_batch_terms(self, batch, logps, context: MethodContext = SINGLE_PROCESS) -> TokenTerms:
        low, high = self.clipped(batch)
        scale = (
            torch.zeros_like(logps.detach())
            .masked_fill(low, self.settings.ce_gppo_beta1 * (1 - self.epsilon_low))
            .masked_fill(high, self.settings.ce_gppo_beta2 * (1 + self.epsilon_high))
        )
        positive = batch.in_loss & (batch.advantages > 0)
        counts = context.reduce_sum(
            torch.stack(
                [
                    low.sum().double(),
                    high.sum().double(),
                    batch.in_loss.sum().double(),
                    positive.sum().double(),
                    -(batch.logps.double() * positive).sum(),
                ]
            )
        )
        tokens = float(counts[2].clamp(min=1))
        self.metrics = {"ce_gppo/low_frac": float(counts[0]) / tokens, "ce_gppo/high_frac": float(counts[1]) / tokens}
        if self.settings.ce_gppo_positive_nll_coef > 0:  # the positive tokens' mean NLL at this forward's log-probs
            self.metrics["ce_gppo/positive_nll"] = float(counts[4]) / float(counts[3].clamp(min=1))
        # Value 0, gradient -scale * A * grad log pi: the clipped token's gradient, which TRL's clip zeroed. Returned
        # also when nothing is clipped, so every rank computes the same factors (TRL's entropy mask is a collective).
        kept = -scale * batch.advantages.to(logps.dtype) * (logps - logps.detach())
        if self.settings.ce_gppo_positive_nll_coef == 0:
            return TokenTerms(factor_loss=kept)
        return TokenTerms(factor_loss=kept, extra_loss=self.positive_nll(batch, logps))
