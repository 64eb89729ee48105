"""STARE: surprisal-guided token-level advantage reweighting, gated on the batch's entropy (docs/algorithm.md
section 11)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opefo_trl.maths.entropy_flow import check_choice
from opefo_trl.maths.order_stats import kth_largest
from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    RolloutWeights,
    TokenBatch,
    TokenMethod,
    register_token_method,
    setting,
)

VARIANTS = ("O1", "C2")


def top_surprisal(batch: TokenBatch, group: torch.Tensor, share: float, context: MethodContext) -> torch.Tensor:
    """Boolean (B, T): the ceil(share * n) tokens of highest surprisal -log pi among the ``group``'s n tokens over every
    rank (ties at the cut all kept); empty when the group is."""
    count = int(context.reduce_sum(group.sum().to(torch.float64)))
    if count == 0:
        return torch.zeros_like(group)
    surprisal = (-batch.logps.detach().float()).clamp(min=0)
    cut = kth_largest(surprisal, group, max(1, math.ceil(share * count)), context.reduce_sum)
    return group & (surprisal >= cut)


@register_token_method("stare")
class STARE(TokenMethod):
    """STARE: while the rollout batch's mean token entropy is below a target, the top share of positive-advantage
    tokens by surprisal -log pi get weight W (> 1), and with variant ``C2`` the top share of negative-advantage tokens
    weight M (< 1); every other token, and every token once the entropy reaches the target, weight 1.

    The shares and the entropy are taken over the whole rollout batch's tokens in the loss, summed over ranks.
    """

    @dataclass
    class Settings:
        """Options of ``method="stare"``."""

        stare_variant: str = setting(
            "O1", "STARE: 'O1' weights the top positive-advantage tokens only; 'C2' also the top negative ones."
        )
        stare_top_ratio: float = setting(
            0.1, "STARE: share of each advantage-sign group (by highest surprisal -log pi) that is reweighted."
        )
        stare_weight_positive: float = setting(
            1.1, "STARE: weight W (>= 1) of the top-surprisal positive-advantage tokens."
        )
        stare_weight_negative: float = setting(
            0.9, "STARE, variant C2: weight M in [0, 1] of the top-surprisal negative-advantage tokens."
        )
        stare_target_entropy: float = setting(
            0.3, "STARE: reweight only while the rollout batch's mean token entropy is below this (nats)."
        )

        def __post_init__(self):
            check_choice("stare_variant", self.stare_variant, VARIANTS)
            if not 0.0 < self.stare_top_ratio <= 1.0:
                raise ValueError(f"stare_top_ratio must lie in (0, 1]; got {self.stare_top_ratio}.")
            if not (math.isfinite(self.stare_weight_positive) and self.stare_weight_positive >= 1.0):
                raise ValueError(
                    f"stare_weight_positive is W, which amplifies, so >= 1; got {self.stare_weight_positive}."
                )
            if not 0.0 <= self.stare_weight_negative <= 1.0:
                raise ValueError(
                    f"stare_weight_negative is M, which attenuates, in [0, 1]; got {self.stare_weight_negative}."
                )
            if not (math.isfinite(self.stare_target_entropy) and self.stare_target_entropy >= 0):
                raise ValueError(
                    f"stare_target_entropy is a mean token entropy (nats, >= 0); got {self.stare_target_entropy}."
                )

    settings: Settings
    summary = "top-surprisal tokens reweighted by advantage sign while entropy is below a target"
    needs_rollout_pass = True
    table_rows = (("STARE", '`method="stare"` ({defaults}; `stare_variant="C2"` also damps negative tokens)'),)

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> RolloutWeights:
        in_loss = batch.in_loss
        sums = context.reduce_sum(torch.stack([(batch.entropies.double() * in_loss).sum(), in_loss.sum().double()]))
        entropy = float(sums[0] / sums[1].clamp(min=1))
        gate_on = entropy < self.settings.stare_target_entropy
        share = self.settings.stare_top_ratio
        # Every rank takes part in the same reductions whatever the gate says (it is the same on every rank).
        positive = top_surprisal(batch, in_loss & (batch.advantages > 0), share, context)
        negative = (
            top_surprisal(batch, in_loss & (batch.advantages < 0), share, context)
            if self.settings.stare_variant == "C2"
            else torch.zeros_like(in_loss)
        )
        weights = torch.ones_like(batch.advantages, dtype=torch.float32)
        if gate_on:
            weights = weights.masked_fill(positive, self.settings.stare_weight_positive)
            weights = weights.masked_fill(negative, self.settings.stare_weight_negative)
        counts = context.reduce_sum(torch.stack([positive.sum(), negative.sum()]).double())
        tokens = float(sums[1].clamp(min=1))
        self.metrics = {
            "stare/gate_on": float(gate_on),
            "stare/entropy": entropy,
            "stare/positive_frac": float(counts[0]) / tokens,
            "stare/negative_frac": float(counts[1]) / tokens,
        }
        return RolloutWeights(weights)
