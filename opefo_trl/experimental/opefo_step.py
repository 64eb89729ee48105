"""OPEFO's step balance and entropy setpoint (this library's, not the paper's; docs/algorithm.md section 4).

With ``opefo_balance="step"`` lambda is the root on [-1, 1] of F(lambda) - target, F the first-order change of the mean
token entropy the real next AdamW step makes when the rollout's tokens are weighted 1 + lambda * s_t (the context's
``step_change``, built by the `param` estimate): target 0 holds the entropy, ``opefo_entropy_target`` steers it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opefo_trl.experimental.step_model import solve_step_balance
from opefo_trl.maths.entropy_flow import BALANCES, check_choice
from opefo_trl.maths.options import off_policy_reasons, setting

if TYPE_CHECKING:  # opefo_trl.methods.opefo imports this module
    from opefo_trl.methods.base import MethodContext, StepChange


@dataclass
class StepBalanceSettings:
    """The step balance's options of ``method="opefo"``."""

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

    def check_step_balance(self, opefo_lambda: float | None, opefo_sides: str) -> None:
        """The step balance's own ranges, and what of the paper's options it cannot run with."""
        check_choice("opefo_balance", self.opefo_balance, BALANCES)
        if self.opefo_balance == "step" and opefo_lambda is not None:
            raise ValueError(
                "opefo_balance='step' chooses lambda every step, which a fixed opefo_lambda overrides. Remove one."
            )
        if self.opefo_balance == "step" and opefo_sides != "both":
            raise ValueError(
                "opefo_balance='step' solves for lambda with both sets rescaled, so "
                f"opefo_sides={opefo_sides!r} would not balance the step. Use opefo_sides='both', or "
                "opefo_balance='batch' for the paper's ablation."
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


def check_step_config(args: Any) -> None:
    """The step balance needs the `param` estimate with the Adam preconditioner, no KL term or entropy bonus, and one
    optimizer step per rollout batch."""
    if args.opefo_balance != "step":
        return
    if args.entropy_flow_estimate != "param" or args.entropy_flow_preconditioner != "adam":
        raise ValueError(
            "opefo_balance='step' offsets what Adam's momentum carries into the step, which only the 'param' "
            f"estimate with the 'adam' preconditioner measures; got entropy_flow_estimate="
            f"{args.entropy_flow_estimate!r}, entropy_flow_preconditioner={args.entropy_flow_preconditioner!r}. "
            "Set entropy_flow_estimate='param' and entropy_flow_preconditioner='adam', or opefo_balance='batch'."
        )
    if args.beta != 0 or args.entropy_coef != 0 or args.use_adaptive_entropy:
        raise ValueError(
            f"opefo_balance='step' zeroes the first-order entropy change of the policy-gradient step, but the "
            f"loss also has a KL term (beta={args.beta}) or an entropy bonus (entropy_coef={args.entropy_coef}, "
            f"use_adaptive_entropy={args.use_adaptive_entropy}) whose gradients move the entropy outside the "
            "balance. Set beta=0, entropy_coef=0 and use_adaptive_entropy=False (the paper's setup), or use "
            "opefo_balance='batch'."
        )
    reasons = off_policy_reasons(args)
    if reasons:
        raise ValueError(
            f"opefo_balance='step' offsets the momentum of the one optimizer step its rollout batch is used for, "
            f"but this configuration has {' and '.join(reasons)}; allow_off_policy does not extend to it. Set "
            "num_iterations=1 and leave steps_per_generation unset, or use opefo_balance='batch'."
        )


class StepBalance:
    """Solves F(lambda) = target for OPEFO's lambda, each rollout batch; warns once when no lambda in [-1, 1] does."""

    def __init__(self, settings: StepBalanceSettings) -> None:
        self.settings = settings
        self._warned_unbalanced = False

    def solve(self, change: StepChange, context: MethodContext, metrics: dict[str, float]) -> float:
        """lambda, with F(lambda) = target to first order (or the end point closer to it); its metrics added."""
        target = self.target(context)
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
                stacklevel=3,
            )
        return lam

    def target(self, context: MethodContext) -> float:
        """The first-order entropy change the step balance solves for: 0, or a share of the gap to the setpoint."""
        if self.settings.opefo_entropy_target is None:
            return 0.0
        if context.entropy is None:
            raise ValueError("opefo_entropy_target needs the entropy the step model measures (MethodContext.entropy).")
        return self.settings.opefo_entropy_target_rate * (self.settings.opefo_entropy_target - context.entropy)
