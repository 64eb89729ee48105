"""A token method added the way CONTRIBUTING.md's "Add a method" describes: this one file, nothing else.

``method="damp_negative"`` weights the tokens of negative advantage by ``damp_negative_weight`` (a made-up method,
the example of tests/methods/test_example_method.py; it is registered only there, when the test imports it).
"""

from dataclasses import dataclass

import torch

from opefo_trl.methods import SINGLE_PROCESS, MethodContext, TokenMethod, TokenTerms, register_token_method, setting


@register_token_method("damp_negative")
class DampNegative(TokenMethod):
    """Tokens with A_t < 0 weighted by a constant in [0, 1], the rest by 1."""

    @dataclass
    class Settings:
        damp_negative_weight: float = setting(0.5, "Weight in [0, 1] of the tokens of negative advantage.")

        def __post_init__(self):
            if not 0.0 <= self.damp_negative_weight <= 1.0:
                raise ValueError(f"damp_negative_weight must lie in [0, 1]; got {self.damp_negative_weight}.")

    settings: Settings
    summary = "negative-advantage tokens damped"

    def micro_batch_terms(self, batch, logps, context: MethodContext = SINGLE_PROCESS) -> TokenTerms:
        damped = batch.in_loss & (batch.advantages < 0)
        counts = context.reduce_sum(torch.stack([damped.sum(), batch.in_loss.sum()]).double())
        self.metrics = {"damp_negative/frac": float(counts[0] / counts[1].clamp(min=1))}
        ones = torch.ones_like(batch.advantages, dtype=torch.float32)
        return TokenTerms(weights=torch.where(batch.advantages < 0, ones * self.settings.damp_negative_weight, ones))
