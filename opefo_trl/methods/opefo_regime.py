"""OPEFO's regime watch (this library's; docs/algorithm.md, "The regime guard"): where the reweighted flow sits, and a
warning, once each, when OPEFO runs far outside the regime the paper studied or a batch is one-sided."""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from opefo_trl.maths.entropy_flow import FlowStats
from opefo_trl.maths.ranks import ReduceSum
from opefo_trl.methods.base import TokenBatch, setting

#: The start of every regime-guard warning (docs/algorithm.md, "The regime guard").
REGIME_GUARD = "OPEFO regime guard: "


@dataclass
class RegimeSettings:
    """The regime watch's options of ``method="opefo"``."""

    opefo_low_prob: float = setting(
        0.01,
        "Tokens sampled with a probability below this are 'negligible' for opefo/low_prob_flow_share (the share "
        "of the reweighted entropy flow they carry) and for the regime guard's warning when, over the last 20 "
        "steps, they carry most of it: entropy held by tokens the policy almost never samples is not exploration.",
    )
    opefo_lambda_warn: float = setting(
        0.1,
        "Warn once when |lambda*| averaged over the last 20 optimizer steps exceeds this (before 20 steps: when "
        "the steps so far show it, from the third on, at 95 percent confidence): the paper's lambda* is "
        "~1e-3, and a large one means the entropy flow is far from balanced, so OPEFO's reweighting is no longer a "
        "small correction. Where the estimate's bias is computed (entropy_flow_bias_diagnostics), lambda* net of it "
        "(entropy_flow/lambda_net_of_bias) is judged, and the warning gives both parts.",
    )

    def check_regime(self) -> None:
        if not 0 < self.opefo_low_prob < 1:
            raise ValueError(f"opefo_low_prob is a probability in (0, 1); got {self.opefo_low_prob}.")
        if not self.opefo_lambda_warn > 0:
            raise ValueError(f"opefo_lambda_warn must be > 0; got {self.opefo_lambda_warn}.")


class RegimeWatch:
    """Watches OPEFO's rollout batches: ``settings`` are OPEFO's (the watch's own, and ``opefo_balance`` for its
    advice), ``flow_estimate`` the ``entropy_flow_estimate`` (also for its advice)."""

    #: Optimizer steps over which the regime guard averages |lambda*|.
    WINDOW = 20
    #: The regime guard also warns once when a rollout's mean token entropy exceeds this multiple of the first
    #: rollout's: on the demo's digit-sum task healthy OPEFO runs peaked at 1.14x their start, and a run on its way to
    #: a uniform policy (reward 0) crossed 1.2x two steps before it died, with |lambda*| averaging only 0.04.
    ENTROPY_RISE_WARN = 1.2
    #: The regime guard warns once when negligible-probability tokens carry more than this share of the reweighted
    #: flow on average over its window.
    LOW_PROB_WARN = 0.5
    #: Before its window is full, the guard judges the steps seen so far, from this many on: it warns when the one-sided
    #: 95% lower confidence bound of their mean (Student's t) exceeds the threshold. On SmolLM2-135M-Instruct a step
    #: takes minutes on a CPU and |lambda*| of the paper's estimate was 0.19-0.62 from the first step
    #: (docs/algorithm.md, "On a real pretrained model"): a full window of 20 steps said nothing in a shorter run, and
    #: nothing for the first 20 steps of a longer one.
    EARLY_STEPS = 3
    #: One-sided 95% quantiles of Student's t by degrees of freedom (n - 1 for n steps), for the early verdict.
    T95 = {
        2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740, 18: 1.734,
    }  # fmt: skip

    def __init__(self, settings: Any, flow_estimate: str) -> None:
        self.settings, self.flow_estimate = settings, flow_estimate
        self._recent_lambdas: deque[float] = deque(maxlen=self.WINDOW)
        self._recent_bias: deque[float] = deque(maxlen=self.WINDOW)  # |lambda_bias|, where computed
        self._net_of_bias = False  # whether _recent_lambdas holds lambda* net of the estimate's bias
        self._recent_low_prob: deque[float] = deque(maxlen=self.WINDOW)
        self._first_entropy: float | None = None
        self._pending_warnings: list[str] = []
        self._warned: set[str] = set()
        self._warned_one_sided = False

    def observe(
        self,
        batch: TokenBatch,
        flow: torch.Tensor,
        weights: torch.Tensor,
        stats: FlowStats,
        reduce_sum: ReduceSum,
    ) -> float:
        """Record a weighed rollout batch and its flow sums (over ranks); returns the share of its reweighted flow
        carried by negligible-probability tokens (opefo/low_prob_flow_share)."""
        lambda_bias = stats.lambda_bias
        self._net_of_bias = lambda_bias is not None
        if lambda_bias is None:
            self._recent_lambdas.append(abs(float(stats.lambda_star)))
        else:
            self._recent_lambdas.append(abs(float(stats.lambda_star - lambda_bias)))
            self._recent_bias.append(abs(float(lambda_bias)))
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
        self._watch(float(sums[0] / sums[1].clamp(min=1)))
        return low_prob_share

    def warn_if_one_sided(self, stats: FlowStats) -> None:
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
            "moves entropy the same way (e.g. a batch of mostly EOS or forced tokens). Warned once; "
            "entropy_flow/lambda logs lambda* every step (entropy_flow_diagnostics).",
            stacklevel=3,
        )

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

    def _verdict(self, values: deque[float], threshold: float) -> tuple[bool, str]:
        """Whether the per-step ``values`` exceed ``threshold`` on average, and over which steps that was judged: over a
        full window, their mean; before, from ``EARLY_STEPS`` steps on, the one-sided 95% lower confidence bound of the
        mean of the steps so far, so that a few noisy steps do not warn but a run that is out of the regime from its
        start is told so within its first steps."""
        steps = len(values)
        mean = sum(values) / max(steps, 1)
        if steps == self.WINDOW:
            return mean > threshold, f"over the last {steps} optimizer steps"
        if steps < self.EARLY_STEPS:
            return False, ""
        bound = mean - self.T95[steps - 1] * statistics.stdev(values) / math.sqrt(steps)
        return bound > threshold, f"over the first {steps} optimizer steps (one-sided 95% lower bound {bound:.3g})"

    def _watch(self, entropy: float) -> None:
        """Queue each of the guard's warnings once: |lambda*| large on average, the flow on negligible tokens, or
        entropy far above its start."""
        if self._first_entropy is None:
            self._first_entropy = entropy
        window = len(self._recent_lambdas)
        mean = sum(self._recent_lambdas) / max(window, 1)
        large, steps = self._verdict(self._recent_lambdas, self.settings.opefo_lambda_warn)
        if "lambda" not in self._warned and large:
            self._warned.add("lambda")
            if self._net_of_bias:
                bias = sum(self._recent_bias) / max(len(self._recent_bias), 1)
                judged = (
                    f"|lambda*| net of the estimate's on-policy bias (entropy_flow/lambda_net_of_bias; the bias's own "
                    f"part, entropy_flow/lambda_bias, averaged {bias:.3g} in absolute value)"
                )
            else:
                judged = (
                    "|lambda*| (with any bias of the estimate in it: entropy_flow_bias_diagnostics is off or the "
                    "estimate has none to compute)"
                )
            self._pending_warnings.append(
                f"{REGIME_GUARD}{judged} averaged {steps} is {mean:.3g} "
                f"(> opefo_lambda_warn={self.settings.opefo_lambda_warn:g}); in the OPEFO paper lambda* stays around "
                f"2.5e-4..1.75e-3, while balancing these batches takes token weights of 1 +/- {mean:.2f}, which can "
                f"fight the learning signal instead of gently correcting it. {self._advice()} docs/algorithm.md ('The "
                "regime') explains when OPEFO applies."
            )
        low_prob = sum(self._recent_low_prob) / max(len(self._recent_low_prob), 1)
        large, steps = self._verdict(self._recent_low_prob, self.LOW_PROB_WARN)
        if "low_prob" not in self._warned and large:
            self._warned.add("low_prob")
            self._pending_warnings.append(
                f"{REGIME_GUARD}{steps}, {low_prob:.0%} of the reweighted "
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
