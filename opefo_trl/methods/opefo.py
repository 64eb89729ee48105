"""OPEFO: rescale the entropy-increasing and entropy-decreasing tokens by 1 +/- lambda so that the batch's net
first-order entropy flow (``opefo_balance="batch"``, the paper's) or the real next AdamW step's first-order entropy
change (``opefo_balance="step"``, this library's) is zero (docs/algorithm.md sections 3 and 4)."""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from opefo_trl.maths.entropy_flow import (
    BALANCES,
    SIDES,
    FlowStats,
    check_choice,
    flow_stats,
    token_weights,
    weight_signs,
)
from opefo_trl.maths.step_model import solve_step_balance
from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    TokenBatch,
    TokenMethod,
    off_policy_reasons,
    options_are_fields,
    register_token_method,
    setting,
)

#: The start of every regime-guard warning (docs/algorithm.md, "The regime guard").
REGIME_GUARD = "OPEFO regime guard: "


def _flow(batch: TokenBatch) -> torch.Tensor:
    """The batch's entropy flow d_t, which OPEFO needs."""
    if batch.flow is None:
        raise ValueError("OPEFO needs the batch's entropy flow (TokenBatch.flow).")
    return batch.flow


@register_token_method("opefo")
class OPEFO(TokenMethod):
    """On-Policy Entropy Flow Optimization: rescale S+ / S- by 1 +/- lambda* so the batch's net entropy flow is 0.

    The flow d_t comes with the batch (the trainer computes it with ``entropy_flow_estimate``) and every sum is
    weighted by the batch's ``factor``, so lambda* balances the update the loss really applies. With
    ``opefo_balance="step"`` lambda is instead the root of the context's ``step_change`` on [-1, 1]: the real next
    optimizer step then leaves the mean token entropy unchanged to first order.
    """

    @dataclass
    class Settings:
        """Options of ``method="opefo"``."""

        opefo_lambda: float | None = setting(
            None, "Fixed lambda in [-1, 1] instead of the balancing lambda* (the paper's static-lambda ablation)."
        )
        opefo_sides: str = setting(
            "both", "Which set OPEFO rescales: 'both', 'increase_only' (S+) or 'decrease_only' (S-) (paper ablations)."
        )
        opefo_balance: str = setting(
            "batch",
            "What lambda balances. 'batch' (the paper's): the reweighted batch's own first-order entropy flow sums to "
            "0. 'step' (this library's): the first-order entropy change of the real next AdamW step is 0 (its moments, "
            "bias correction, eps, weight decay and the gradient clip included), lambda found by a 1-D root search; "
            "needs entropy_flow_estimate='param' with entropy_flow_preconditioner='adam'.",
        )
        opefo_entropy_target: float | None = setting(
            None,
            "opefo_balance='step': steer the mean token entropy the balance measures (the batch's, or the probe's "
            "with entropy_flow_probe_rollouts) toward this level instead of holding it: lambda makes the real step's "
            "first-order entropy change opefo_entropy_target_rate * (opefo_entropy_target - H). TRL's "
            "use_adaptive_entropy / entropy_target goal, through the exact step model instead of a tuned coefficient. "
            "None: a zero change (hold).",
        )
        opefo_entropy_target_rate: float = setting(
            0.1, "With opefo_entropy_target: the fraction of the entropy gap each optimizer step is asked to close."
        )
        opefo_low_prob: float = setting(
            0.01,
            "Tokens sampled with a probability below this are 'negligible' for opefo/low_prob_flow_share (the share "
            "of the reweighted entropy flow they carry) and for the regime guard's warning when, over the last 20 "
            "steps, they carry most of it: entropy held by tokens the policy almost never samples is not exploration.",
        )
        opefo_lambda_warn: float = setting(
            0.1,
            "Warn once when |lambda*| averaged over the last 20 optimizer steps exceeds this: the paper's lambda* is "
            "~1e-3, and a large one means the entropy flow is far from balanced, so OPEFO's reweighting is no longer a "
            "small correction.",
        )

        def __post_init__(self):
            check_choice("opefo_sides", self.opefo_sides, SIDES)
            check_choice("opefo_balance", self.opefo_balance, BALANCES)
            if self.opefo_balance == "step" and self.opefo_lambda is not None:
                raise ValueError(
                    "opefo_balance='step' chooses lambda every step, which a fixed opefo_lambda overrides. Remove one."
                )
            if self.opefo_balance == "step" and self.opefo_sides != "both":
                raise ValueError(
                    "opefo_balance='step' solves for lambda with both sets rescaled, so "
                    f"opefo_sides={self.opefo_sides!r} would not balance the step. Use opefo_sides='both', or "
                    "opefo_balance='batch' for the paper's ablation."
                )
            if self.opefo_lambda is not None and not -1.0 <= self.opefo_lambda <= 1.0:
                raise ValueError(
                    "opefo_lambda must lie in [-1, 1] (token weights 1 +/- lambda must stay >= 0); "
                    f"got {self.opefo_lambda}."
                )
            if self.opefo_entropy_target is not None:
                if self.opefo_balance != "step":
                    raise ValueError(
                        "opefo_entropy_target sets the first-order entropy change of the real optimizer step, which "
                        "only opefo_balance='step' solves for. Set opefo_balance='step' (with "
                        "entropy_flow_estimate='param'), or remove opefo_entropy_target."
                    )
                if not (math.isfinite(self.opefo_entropy_target) and self.opefo_entropy_target >= 0):
                    raise ValueError(
                        f"opefo_entropy_target is a mean token entropy (nats, >= 0); got {self.opefo_entropy_target}."
                    )
            if not 0 < self.opefo_entropy_target_rate <= 1:
                raise ValueError(
                    "opefo_entropy_target_rate is the fraction of the entropy gap closed per step, in (0, 1]; got "
                    f"{self.opefo_entropy_target_rate}."
                )
            if not 0 < self.opefo_low_prob < 1:
                raise ValueError(f"opefo_low_prob is a probability in (0, 1); got {self.opefo_low_prob}.")
            if not self.opefo_lambda_warn > 0:
                raise ValueError(f"opefo_lambda_warn must be > 0; got {self.opefo_lambda_warn}.")

    settings: Settings
    summary = "entropy-flow balancing, the default"
    needs_rollout_pass = True
    table_rows = (
        (
            "OPEFO (default)",
            '`method="opefo"`; `entropy_flow_estimate` in `opefo` (default), `onaction`, `sign`, `full`, `param`',
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
    #: Optimizer steps over which the regime guard averages |lambda*|.
    REGIME_WINDOW = 20
    #: The regime guard also warns once when a rollout's mean token entropy exceeds this multiple of the first
    #: rollout's: on the demo's digit-sum task healthy OPEFO runs peaked at 1.14x their start, and a run on its way to
    #: a uniform policy (reward 0) crossed 1.2x two steps before it died, with |lambda*| averaging only 0.04.
    ENTROPY_RISE_WARN = 1.2
    #: The regime guard warns once when negligible-probability tokens carry more than this share of the reweighted
    #: flow on average over its window.
    LOW_PROB_WARN = 0.5

    def __init__(self, settings: Settings | None = None, *, flow_estimate: str = "opefo", **values) -> None:
        super().__init__(settings, **values)
        self.flow_estimate = flow_estimate  # for the regime guard's advice
        self._recent_lambdas: deque[float] = deque(maxlen=self.REGIME_WINDOW)
        self._recent_low_prob: deque[float] = deque(maxlen=self.REGIME_WINDOW)
        self._rollout_metrics: dict[str, float] = {}
        self._first_entropy: float | None = None
        self._pending_warnings: list[str] = []
        self._warned: set[str] = set()
        self._warned_one_sided = False
        self._warned_unbalanced = False

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Strictly on-policy unless ``allow_off_policy``; the step balance needs the `param` estimate with the Adam
        preconditioner, no KL term or entropy bonus, and one optimizer step per rollout batch."""
        step = args.opefo_balance == "step"
        if step and (args.entropy_flow_estimate != "param" or args.entropy_flow_preconditioner != "adam"):
            raise ValueError(
                "opefo_balance='step' offsets what Adam's momentum carries into the step, which only the 'param' "
                f"estimate with the 'adam' preconditioner measures; got entropy_flow_estimate="
                f"{args.entropy_flow_estimate!r}, entropy_flow_preconditioner={args.entropy_flow_preconditioner!r}. "
                "Set entropy_flow_estimate='param' and entropy_flow_preconditioner='adam', or opefo_balance='batch'."
            )
        if step and (args.beta != 0 or args.entropy_coef != 0 or args.use_adaptive_entropy):
            raise ValueError(
                f"opefo_balance='step' zeroes the first-order entropy change of the policy-gradient step, but the "
                f"loss also has a KL term (beta={args.beta}) or an entropy bonus (entropy_coef={args.entropy_coef}, "
                f"use_adaptive_entropy={args.use_adaptive_entropy}) whose gradients move the entropy outside the "
                "balance. Set beta=0, entropy_coef=0 and use_adaptive_entropy=False (the paper's setup), or use "
                "opefo_balance='batch'."
            )
        reasons = off_policy_reasons(args)
        if reasons and step:
            raise ValueError(
                f"opefo_balance='step' offsets the momentum of the one optimizer step its rollout batch is used for, "
                f"but this configuration has {' and '.join(reasons)}; allow_off_policy does not extend to it. Set "
                "num_iterations=1 and leave steps_per_generation unset, or use opefo_balance='batch'."
            )
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

    @property
    def balances_the_step(self) -> bool:
        return self.settings.opefo_balance == "step"

    @classmethod
    def from_config(cls, config) -> OPEFO:
        return cls(cls.settings_from(config), flow_estimate=config.entropy_flow_estimate)

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> torch.Tensor:
        flow = _flow(batch)
        reduce_sum = context.reduce_sum
        stats = FlowStats.from_tensor(reduce_sum(flow_stats(flow, batch.factor).to_tensor()))
        self._warn_if_one_sided(stats)
        metrics = {"opefo/lambda": float(stats.lambda_star)}
        if self.settings.opefo_lambda is not None:
            lam = float(self.settings.opefo_lambda)
        elif self.settings.opefo_balance == "step":
            change, target = context.step_change(weight_signs(flow, self.settings.opefo_sides)), self._target(context)
            balance = solve_step_balance(lambda lam: change(lam) - target)
            lam = balance.lam
            metrics.update(
                {
                    "opefo/step_change": balance.residual + target,
                    "opefo/step_change_unweighted": balance.unweighted + target,
                }
            )
            if self.settings.opefo_entropy_target is not None:
                metrics["opefo/step_target"] = target
            if not balance.bracketed and not self._warned_unbalanced:
                self._warned_unbalanced = True
                warnings.warn(
                    "opefo_balance='step': no lambda in [-1, 1] gives this step the first-order entropy change "
                    f"asked for ({target:.3g}; without reweighting {balance.unweighted + target:.3g}, at "
                    f"lambda={lam:g} {balance.residual + target:.3g}): reweighting this batch's sets cannot offset "
                    "what the optimizer's moments carry. lambda is set to the end point closer to it (warned once; "
                    "opefo/step_change logs the change every step).",
                    stacklevel=2,
                )
        else:
            lam = float(stats.lambda_star)
        weights = token_weights(flow, lam, self.settings.opefo_sides)
        weighted = FlowStats.from_tensor(reduce_sum(flow_stats(flow * weights, batch.factor).to_tensor()))
        self._recent_lambdas.append(abs(float(stats.lambda_star)))
        in_loss = batch.in_loss.double()
        # Where the reweighted flow sits: the share of it carried by tokens sampled with negligible probability.
        moved = (batch.factor.double() * flow.double() * weights.double()).abs()
        negligible = (batch.logps.exp() < self.settings.opefo_low_prob).double()
        sums = reduce_sum(
            torch.stack(
                [(batch.entropies.double() * in_loss).sum(), in_loss.sum(), (moved * negligible).sum(), moved.sum()]
            )
        )
        low_prob_share = float(sums[2] / sums[3]) if float(sums[3]) > 0 else 0.0
        self._recent_low_prob.append(low_prob_share)
        self._watch_regime(float(sums[0] / sums[1].clamp(min=1)))
        self._rollout_metrics = {
            **metrics,
            "opefo/lambda_applied": lam,
            "opefo/weighted_net": float(weighted.net),
            "opefo/low_prob_flow_share": low_prob_share,
        }
        return weights

    def _target(self, context: MethodContext) -> float:
        """The first-order entropy change the step balance solves for: 0, or a share of the gap to the setpoint."""
        if self.settings.opefo_entropy_target is None:
            return 0.0
        if context.entropy is None:
            raise ValueError("opefo_entropy_target needs the entropy the step model measures (MethodContext.entropy).")
        return self.settings.opefo_entropy_target_rate * (self.settings.opefo_entropy_target - context.entropy)

    def _warn_if_one_sided(self, stats: FlowStats) -> None:
        """P = 0 or N = 0 with flow on the other side: lambda* = +/-1 zeroes every token of that side (warned once)."""
        one_sided = (float(stats.increase) == 0.0) != (float(stats.decrease) == 0.0)
        if not one_sided or self._warned_one_sided:
            return
        self._warned_one_sided = True
        empty, other = ("S+", "S-") if float(stats.increase) == 0.0 else ("S-", "S+")
        warnings.warn(
            f"OPEFO: this rollout batch has no entropy-{'increasing' if empty == 'S+' else 'decreasing'} token "
            f"({empty} is empty: P={float(stats.increase):.3g}, N={float(stats.decrease):.3g}, "
            f"{int(stats.increase_tokens)} / {int(stats.decrease_tokens)} tokens in S+ / S- of "
            f"{int(stats.tokens)}), so "
            f"lambda* = {float(stats.lambda_star):+g} gives every {other} token weight 0: only tokens with zero flow "
            "keep weight 1, and the policy-gradient step is (nearly) empty. This happens when almost every token "
            "moves entropy the same way (e.g. a batch of mostly EOS or forced tokens). Warned once; opefo/lambda logs "
            "lambda* every step.",
            stacklevel=2,
        )

    def on_optimizer_step(self, context: MethodContext = SINGLE_PROCESS) -> None:
        # Logged on every optimizer step, also when one rollout batch serves several (off-policy opt-in).
        self.metrics = dict(self._rollout_metrics)

    def _advice(self) -> str:
        if self.settings.opefo_balance == "step":
            return "compare it with method='grpo' on the same data before trusting the balance."
        if self.flow_estimate == "param":
            return (
                "the per-batch balance does not offset what Adam's momentum carries: try opefo_balance='step', which "
                "zeroes the real step's first-order entropy change."
            )
        return (
            f"with entropy_flow_estimate={self.flow_estimate!r} and the per-batch balance this can mislead: the "
            "estimate gives a sampled token of tiny probability a flow of |A| |log pi + H| (no factor pi), so a few "
            "rare tokens can make a batch look entropy-decreasing and OPEFO then raises entropy more than the network "
            "needs, and Adam's momentum, which the per-batch balance does not offset, adds to it. Entropy can then "
            "climb until the policy is uniform and every reward is 0 (seen on the demo's digit_sum task with "
            "|lambda*| under 0.1). Watch entropy_flow/measured_delta (entropy_flow_audit_steps=1); if it stays "
            "positive and entropy climbs above its start, use entropy_flow_estimate='param' with "
            "opefo_balance='step'."
        )

    def _watch_regime(self, entropy: float) -> None:
        """Queue each of the guard's two warnings once: |lambda*| large on average, or entropy far above its start."""
        if self._first_entropy is None:
            self._first_entropy = entropy
        window = len(self._recent_lambdas)
        mean = sum(self._recent_lambdas) / max(window, 1)
        if "lambda" not in self._warned and window == self.REGIME_WINDOW and mean > self.settings.opefo_lambda_warn:
            self._warned.add("lambda")
            self._pending_warnings.append(
                f"{REGIME_GUARD}|lambda*| averaged over the last {self.REGIME_WINDOW} optimizer steps is {mean:.3g} "
                f"(> opefo_lambda_warn={self.settings.opefo_lambda_warn:g}); in the OPEFO paper lambda* stays around "
                f"2.5e-4..1.75e-3, while balancing these batches takes token weights of 1 +/- {mean:.2f}, which can "
                f"fight the learning signal instead of gently correcting it. {self._advice()} docs/algorithm.md ('The "
                "regime') explains when OPEFO applies."
            )
        low_prob = sum(self._recent_low_prob) / max(len(self._recent_low_prob), 1)
        if "low_prob" not in self._warned and window == self.REGIME_WINDOW and low_prob > self.LOW_PROB_WARN:
            self._warned.add("low_prob")
            self._pending_warnings.append(
                f"{REGIME_GUARD}over the last {self.REGIME_WINDOW} optimizer steps, {low_prob:.0%} of the reweighted "
                f"entropy flow was carried by tokens sampled with probability < opefo_low_prob="
                f"{self.settings.opefo_low_prob:g} (opefo/low_prob_flow_share): the balance rests on tokens the policy "
                "almost never samples, so the entropy it holds may sit on junk rather than on the task's choices. "
                "Sample completions and look; docs/algorithm.md ('Where the entropy sits') explains the metric."
            )
        rise = entropy / self._first_entropy if self._first_entropy > 0 else 1.0
        if "entropy" not in self._warned and rise > self.ENTROPY_RISE_WARN:
            self._warned.add("entropy")
            self._pending_warnings.append(
                f"{REGIME_GUARD}the rollout's mean token entropy is {entropy:.3g}, {rise:.2f}x the first rollout's "
                f"({self._first_entropy:.3g}; warned above {self.ENTROPY_RISE_WARN:g}x, |lambda*| averaged over the "
                f"last {window} optimizer steps {mean:.3g}): OPEFO is meant to hold entropy, not raise it. "
                f"{self._advice()}"
            )

    def regime_warning(self) -> str | None:
        return self._pending_warnings.pop(0) if self._pending_warnings else None
