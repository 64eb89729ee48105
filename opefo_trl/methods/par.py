"""Positive-Advantage Reweighting: the tokens of positive advantage weighted by a coefficient in [0, 1], constant or set
by an entropy-guided controller (docs/algorithm.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    TokenMethod,
    TokenTerms,
    register_token_method,
    setting,
)


@register_token_method("par")
class PAR(TokenMethod):
    """Positive-Advantage Reweighting: tokens with A_t > 0 are weighted by c in [0, 1], the rest by 1.

    With ``par_coef=None`` an entropy-guided controller sets c once per optimizer step from the global mean token
    entropy H of that step (over the tokens in the loss): c <- clip(c - step, 0, 1) if H < target, else
    clip(c + step, 0, 1).
    """

    @dataclass
    class Settings:
        """Options of ``method="par"``."""

        par_coef: float | None = setting(
            None, "PAR: constant weight in [0, 1] of positive-advantage tokens; None for the entropy-guided controller."
        )
        par_coef_init: float = setting(0.0, "PAR controller: initial coefficient in [0, 1].")
        par_entropy_target: float = setting(0.2, "PAR controller: target mean token entropy of an optimizer step.")
        par_coef_step: float = setting(0.05, "PAR controller: change of the coefficient per optimizer step.")

        def __post_init__(self):
            for name in ("par_coef", "par_coef_init"):
                value = getattr(self, name)
                if value is not None and not 0.0 <= value <= 1.0:
                    raise ValueError(f"{name} must lie in [0, 1]; got {value}.")
            if not self.par_coef_step > 0:
                raise ValueError(f"par_coef_step must be > 0; got {self.par_coef_step}.")

    settings: Settings
    summary = "positive-advantage reweighting"
    table_rows = (("PAR", '`method="par"` (entropy-guided coefficient, state saved in checkpoints) or `par_coef=c`'),)

    def __init__(self, settings: Settings | None = None, **values) -> None:
        super().__init__(settings, **values)
        self.adaptive = self.settings.par_coef is None
        self.coef = self.settings.par_coef_init if self.settings.par_coef is None else self.settings.par_coef
        self._entropy_sums: torch.Tensor | None = None  # this step's sum of H over tokens in the loss, and count

    def micro_batch_terms(self, batch, logps, context: MethodContext = SINGLE_PROCESS) -> TokenTerms:
        in_loss = batch.in_loss.float()
        sums = torch.stack([(batch.entropies.float() * in_loss).sum(), in_loss.sum()]).double()
        self._entropy_sums = sums if self._entropy_sums is None else self._entropy_sums + sums
        ones = torch.ones_like(batch.advantages, dtype=torch.float32)
        return TokenTerms(weights=torch.where(batch.advantages > 0, ones * self.coef, ones))

    def on_optimizer_step(self, context: MethodContext = SINGLE_PROCESS) -> None:
        if self._entropy_sums is None:  # no micro-batch seen this step
            return
        total, self._entropy_sums = context.reduce_sum(self._entropy_sums), None
        entropy = float(total[0] / total[1].clamp(min=1))
        self.metrics = {"par/coef": self.coef, "par/entropy": entropy}
        if self.adaptive:
            delta = (
                -self.settings.par_coef_step
                if entropy < self.settings.par_entropy_target
                else self.settings.par_coef_step
            )
            self.coef = min(1.0, max(0.0, self.coef + delta))

    def state_dict(self) -> dict:
        return {"coef": self.coef, "adaptive": self.adaptive}

    def load_state_dict(self, state: dict) -> None:
        # Only the controller's coefficient is state; a constant par_coef is configuration and the new run's wins.
        if self.adaptive and state.get("adaptive", True):
            self.coef = float(state["coef"])
