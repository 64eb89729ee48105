"""STEER: each token weighted down by the size of its first-order entropy change (docs/algorithm.md section 11)."""

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

MAPPINGS = ("exp", "linear")


@register_token_method("steer")
class STEER(TokenMethod):
    """STEER: with Omega_t = |d_t|, the size of the token's first-order entropy change (the configured
    ``entropy_flow_estimate``), and Omega_max / Omega_min its largest / smallest over the rollout batch's tokens in the
    loss on every rank:

    - ``exp`` (default): w_t = max(exp(-k Omega_t), w_min), k = -ln(w_min) / max(Omega_max, floor): the token of
      largest change gets the floor w_min, a token of no change 1;
    - ``linear``: w_t = w_max - (Omega_t - Omega_min) (w_max - w_min) / (Omega_max - Omega_min), (w_min + w_max) / 2
      when every Omega is equal.
    """

    @dataclass
    class Settings:
        """Options of ``method="steer"``."""

        steer_mapping: str = setting(
            "exp", "STEER: 'exp' weights exp(-k |d_t|) down to the floor; 'linear' maps |d_t| onto [max, min] weight."
        )
        steer_weight_min: float = setting(
            0.8, "STEER: the floor w_min in (0, 1], the weight of the token of largest entropy change."
        )
        steer_weight_max: float = setting(
            1.2, "STEER, steer_mapping='linear': the weight w_max (>= steer_weight_min) of the token of least change."
        )
        steer_omega_floor: float = setting(
            0.02,
            "STEER, steer_mapping='exp': k = -ln(w_min) / max(largest |d_t|, this), so a batch whose changes are all "
            "small is not stretched to the floor.",
        )

        def __post_init__(self):
            check_choice("steer_mapping", self.steer_mapping, MAPPINGS)
            if not 0.0 < self.steer_weight_min <= 1.0:
                raise ValueError(f"steer_weight_min must lie in (0, 1]; got {self.steer_weight_min}.")
            if not (math.isfinite(self.steer_weight_max) and self.steer_weight_max >= self.steer_weight_min):
                raise ValueError(
                    f"steer_weight_max must be >= steer_weight_min={self.steer_weight_min}; got "
                    f"{self.steer_weight_max}."
                )
            if not (math.isfinite(self.steer_omega_floor) and self.steer_omega_floor > 0):
                raise ValueError(f"steer_omega_floor must be > 0; got {self.steer_omega_floor}.")

    settings: Settings
    summary = "tokens weighted down by the size of their entropy change"
    needs_rollout_pass = True
    table_rows = (
        (
            "STEER",
            '`method="steer"` ({defaults}); the size of the entropy change d_t from `entropy_flow_estimate` '
            "(`opefo`, `full`, `param`)",
        ),
    )

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> RolloutWeights:
        if batch.flow is None:
            raise ValueError("STEER needs the batch's entropy flow (TokenBatch.flow).")
        in_loss = batch.in_loss
        omega = batch.flow.detach().float().abs()
        tokens = int(context.reduce_sum(in_loss.sum().to(torch.float64)))
        if tokens == 0:
            self.metrics = {}
            return RolloutWeights(torch.ones_like(omega))
        largest = float(kth_largest(omega, in_loss, 1, context.reduce_sum))
        w_min, w_max = self.settings.steer_weight_min, self.settings.steer_weight_max
        if self.settings.steer_mapping == "exp":
            k = -math.log(w_min) / max(largest, self.settings.steer_omega_floor)
            weights = torch.exp(-k * omega.double()).clamp(min=w_min, max=1.0)
        else:
            smallest = float(kth_largest(omega, in_loss, tokens, context.reduce_sum))
            if largest > smallest:
                weights = w_max - (omega.double() - smallest) * ((w_max - w_min) / (largest - smallest))
            else:
                weights = torch.full_like(omega, (w_min + w_max) / 2, dtype=torch.float64)
            weights = weights.clamp(min=w_min, max=w_max)
        weights = weights.float()
        sums = context.reduce_sum(
            torch.stack([(weights.double() * in_loss).sum(), ((weights <= w_min) & in_loss).sum().double()])
        )
        self.metrics = {
            "steer/weight_mean": float(sums[0]) / tokens,
            "steer/floor_frac": float(sums[1]) / tokens,
            "steer/omega_max": largest,
        }
        return RolloutWeights(weights)
