"""OPEFO, as in the paper: rescale the entropy-increasing and entropy-decreasing tokens by 1 +/- lambda so that the
batch's net first-order entropy flow is zero (docs/algorithm.md section 3).

This library's extensions: the step balance and entropy setpoint (``opefo_trl.experimental.opefo_step``: lambda
zeroes, or sets, the real next AdamW step's first-order entropy change, section 4) and, beside it, the regime watch
(``opefo_regime``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opefo_trl.experimental.opefo_step import StepBalance, StepBalanceSettings, check_step_config
from opefo_trl.maths.entropy_flow import SIDES, FlowStats, check_choice, flow_stats, weight_signs
from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    RolloutWeights,
    TokenBatch,
    TokenMethod,
    off_policy_reasons,
    options_are_fields,
    register_token_method,
    setting,
)
from opefo_trl.methods.opefo_regime import RegimeSettings, RegimeWatch


@dataclass
class PaperSettings:
    """The paper's options of ``method="opefo"``."""

    opefo_lambda: float | None = setting(
        None, "Fixed lambda in [-1, 1] instead of the balancing lambda* (the paper's static-lambda ablation)."
    )
    opefo_sides: str = setting(
        "both", "Which set OPEFO rescales: 'both', 'increase_only' (S+) or 'decrease_only' (S-) (paper ablations)."
    )


@register_token_method("opefo")
class OPEFO(TokenMethod):
    """On-Policy Entropy Flow Optimization: rescale S+ / S- by 1 +/- lambda* so the batch's net entropy flow is 0.

    The flow d_t comes with the batch (the trainer computes it with ``entropy_flow_estimate``) and every sum is weighted
    by the batch's ``factor``, so lambda* balances the update the loss really applies. With ``opefo_balance="step"``
    lambda is instead the root of the context's ``step_change`` on [-1, 1] (``experimental.opefo_step``).
    """

    @dataclass
    class Settings(RegimeSettings, StepBalanceSettings, PaperSettings):
        """Options of ``method="opefo"``: the paper's, the step balance's (``experimental.opefo_step``), the regime
        watch's (``opefo_regime``)."""

        def __post_init__(self):
            check_choice("opefo_sides", self.opefo_sides, SIDES)
            self.check_step_balance(self.opefo_lambda, self.opefo_sides)
            if self.opefo_lambda is not None and not -1.0 <= self.opefo_lambda <= 1.0:
                raise ValueError(
                    "opefo_lambda must lie in [-1, 1] (token weights 1 +/- lambda must stay >= 0); "
                    f"got {self.opefo_lambda}."
                )
            self.check_regime()

    settings: Settings
    summary = "entropy-flow balancing, the default"
    needs_rollout_pass = True
    table_rows = (
        (
            "OPEFO (default)",
            '`method="opefo"`; `entropy_flow_estimate` in `opefo` (default; the paper\'s, as reconstructed), '
            "`opefo_centered` (the same less its on-policy mean), `onaction`, `sign`, `full`, `param`",
        ),
        ("OPEFO ablations", '`opefo_lambda=0.001` (static λ), `opefo_sides="increase_only"` / `"decrease_only"`'),
        (
            "OPEFO, whole AdamW step balanced (ours)",
            '`entropy_flow_estimate="param"`, `opefo_balance="step"`: λ also offsets what Adam\'s momentum carries',
        ),
        (
            "OPEFO, probe balance / entropy setpoint (ours)",
            "with `param`: `entropy_flow_probe_rollouts=4` (the entropy of the last 4 rollouts is balanced); with the "
            "step balance: `opefo_entropy_target=0.5` (steered toward a level)",
        ),
        (
            "OPEFO, balance of the task's tokens' entropy (ours)",
            'with `param`: `entropy_flow_entropy="task_tokens"`, `entropy_flow_task_tokens=[...]` (the entropy '
            "renormalised over the answer's tokens, which junk tokens cannot raise)",
        ),
    )

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        flow_estimate: str = "opefo",
        lambda_star_logged: bool = False,
        **values,
    ) -> None:
        """``lambda_star_logged``: the trainer's diagnostics log the lambda* this method would apply, as
        ``entropy_flow/lambda`` (diagnostics on, one optimizer step per rollout batch); ``opefo/lambda_applied`` is
        then logged only when the lambda applied is another (``opefo_lambda``, the step balance)."""
        super().__init__(settings, **values)
        self.logs_applied_lambda = (
            not lambda_star_logged or self.settings.opefo_lambda is not None or self.settings.opefo_balance == "step"
        )
        self.step_balance = StepBalance(self.settings)
        self.watch = RegimeWatch(self.settings, flow_estimate)
        self._rollout_metrics: dict[str, float] = {}
        #: The last rollout batch's lambda*, summed over ranks (what `entropy_flow/lambda` logs, on-policy).
        self.lambda_star: float | None = None
        #: The last rollout batch, its flow, weights and flow sums, until the regime watch sees them.
        self._watched: tuple[TokenBatch, torch.Tensor, torch.Tensor, FlowStats] | None = None

    @classmethod
    def from_config(cls, config) -> OPEFO:
        return cls(
            cls.settings_from(config),
            flow_estimate=config.entropy_flow_estimate,
            lambda_star_logged=config.entropy_flow_diagnostics and not off_policy_reasons(config),
        )

    @property
    def balances_the_step(self) -> bool:
        return self.settings.opefo_balance == "step"

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> RolloutWeights:
        """w_t = 1 + lambda s_t, s_t = +1 on S+ (d_t > 0), -1 on S- (one set only with ``opefo_sides``), and lambda =
        lambda* = (N - P) / (N + P), P and N the factor-weighted flows of S+ and S- over the rollout batch, summed
        over ranks: the reweighted flow sums to 0."""
        flow = _flow(batch)
        stats = FlowStats.from_tensor(context.reduce_sum(flow_stats(flow, batch.factor, batch.flow_bias).to_tensor()))
        signs = weight_signs(flow, self.settings.opefo_sides)
        self.lambda_star = float(stats.lambda_star)
        metrics: dict[str, float] = {}
        if self.settings.opefo_lambda is not None:  # the paper's static-lambda ablation
            lam = float(self.settings.opefo_lambda)
        elif self.settings.opefo_balance == "step":  # this library's: the real next step's entropy change
            lam = self.step_balance.solve(context.step_change(signs), context, metrics)
        else:
            lam = self.lambda_star
        decided = RolloutWeights.affine(lam, signs)
        assert decided.weights is not None  # affine weights
        weighted = FlowStats.from_tensor(
            context.reduce_sum(flow_stats(flow * decided.weights, batch.factor).to_tensor())
        )
        if self.logs_applied_lambda:  # else it is lambda*, which entropy_flow/lambda logs
            metrics["opefo/lambda_applied"] = lam
        self._rollout_metrics = {**metrics, "opefo/weighted_net": float(weighted.net)}
        self._watched = (batch, flow, decided.weights, stats)  # for the regime watch, at the step's end
        return decided

    def on_optimizer_step(self, context: MethodContext = SINGLE_PROCESS) -> None:
        if self._watched is not None:  # the regime watch sees each rollout batch once
            batch, flow, weights, stats = self._watched
            self._watched = None
            self.watch.warn_if_one_sided(stats)
            self._rollout_metrics["opefo/low_prob_flow_share"] = self.watch.observe(
                batch, flow, weights, stats, context.reduce_sum
            )
        # Logged on every optimizer step, also when one rollout batch serves several (off-policy opt-in).
        self.metrics = dict(self._rollout_metrics)

    def regime_warning(self) -> str | None:
        return self.watch.regime_warning()

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Strictly on-policy unless ``allow_off_policy``; the step balance's requirements (``check_step_config``)."""
        check_step_config(args)
        reasons = off_policy_reasons(args)
        if reasons and not args.allow_off_policy:
            if options_are_fields(args):  # refused while it is built (also by opefo-train): the fix is an argument
                grpo_fix = "`OPEFOConfig(..., method='grpo')` (opefo-train: --method grpo)"
                off_policy_fix = "`OPEFOConfig(..., allow_off_policy=True)` (opefo-train: --allow_off_policy true)"
            else:  # given the OPEFO options by OPEFOTrainer, which keeps the attributes set on the object
                grpo_fix = f'set `args.method = "grpo"` on this {type(args).__name__} before passing it'
                off_policy_fix = "set `args.allow_off_policy = True` on it"
            raise ValueError(
                f"method={args.method!r} is strictly on-policy: lambda* is computed over one rollout batch and applied "
                f"in exactly one optimizer step, but this configuration has {' and '.join(reasons)}. Fix: set "
                "num_iterations=1 and leave steps_per_generation unset (it then equals gradient_accumulation_steps); "
                f"or, for plain GRPO, {grpo_fix}; or, to run {args.method} off-policy deliberately, {off_policy_fix}."
            )


def _flow(batch: TokenBatch) -> torch.Tensor:
    """The batch's entropy flow d_t, which OPEFO needs."""
    if batch.flow is None:
        raise ValueError("OPEFO needs the batch's entropy flow (TokenBatch.flow).")
    return batch.flow
