"""Token-level methods: how each method of the paper's comparison weights or penalises a batch's tokens.

Pure torch, no TRL import. The trainer (``opefo_trl.trainer``) is the only glue; a method only sees tensors.

A method is a small object with up to three hooks, all optional:

- ``rollout_weights(batch, reduce_sum)``: once per rollout batch, before the first backward, on the whole local
  rollout batch. Returns detached (B, T) weights multiplied into the advantages (OPEFO: lambda* needs every token
  of the optimizer step). ``reduce_sum`` sums a tensor over data-parallel ranks.
- ``micro_batch_terms(batch, logps, reduce_sum)``: on every micro-batch inside the loss, with the current
  log-probs ``logps`` still attached to the graph. Returns ``TokenTerms``: weights for the advantages and/or an
  extra per-token loss term (aggregated by the trainer exactly like the policy loss).
- ``on_optimizer_step(reduce_sum)``: once per optimizer step, after the last micro-batch (controllers).

Because every weight is >= 0, scaling the per-token advantage by it is exactly the reweighted loss for every TRL
loss type, clipping included, and TRL's normalisation, KL term, entropy bonus and vLLM correction stay untouched.

Add a method by subclassing ``TokenMethod`` and decorating it with ``@register_token_method("name")``.

Example:
    >>> import torch
    >>> par = build_token_method("par", par_coef=0.5)
    >>> batch = TokenBatch(logps=torch.zeros(2, 3), entropies=torch.ones(2, 3),
    ...                    advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]), mask=torch.ones(2, 3))
    >>> par.micro_batch_terms(batch, batch.logps).weights[:, 0].tolist()
    [0.5, 1.0]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .entropy_flow import FLOW_ESTIMATES, SIDES, FlowStats, entropy_flow, flow_stats, token_weights

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class TokenBatch:
    """Detached per-token quantities of a (micro- or rollout) batch, all (B, T).

    ``logps``/``entropies`` are those of the current policy at the training temperature; ``advantages`` are the
    GRPO advantages broadcast per token; ``old_logps`` are the behaviour policy's when TRL tracks them (off-policy
    or vLLM correction), else None (strict on-policy: the ratio is 1). ``sum_sq_probs`` and
    ``sum_sq_probs_log_probs`` are filled only for the ``full`` entropy-flow estimate.
    """

    logps: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logps: torch.Tensor | None = None
    sum_sq_probs: torch.Tensor | None = None
    sum_sq_probs_log_probs: torch.Tensor | None = None

    def flow(self, estimate: str) -> torch.Tensor:
        """Per-token entropy flow d_t of this batch (SPEC.md section 1)."""
        return entropy_flow(
            self.logps, self.entropies, self.advantages, estimate, self.sum_sq_probs, self.sum_sq_probs_log_probs
        )


@dataclass
class TokenTerms:
    """What a method contributes to one micro-batch's loss: advantage weights and/or an extra per-token loss."""

    weights: torch.Tensor | None = None
    extra_loss: torch.Tensor | None = None


class TokenMethod:
    """Base class: plain GRPO (weights 1, no extra term). Subclasses override the hooks they need."""

    name: ClassVar[str] = "grpo"
    #: Needs statistics over the whole rollout batch before the first backward (one update per rollout batch).
    needs_rollout_pass: ClassVar[bool] = False
    #: Refuses off-policy configurations unless the user opts in.
    on_policy_only: ClassVar[bool] = False

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @classmethod
    def from_args(cls, args) -> TokenMethod:
        """Build from a config object (``OPEFOConfig``) by reading the attributes the method needs."""
        return cls()

    @property
    def needs_vocab_stats(self) -> bool:
        """Whether batches must carry ``sum_sq_probs`` / ``sum_sq_probs_log_probs``."""
        return False

    def rollout_weights(self, batch: TokenBatch, reduce_sum: ReduceSum = _identity) -> torch.Tensor | None:
        return None

    def micro_batch_terms(
        self, batch: TokenBatch, logps: torch.Tensor, reduce_sum: ReduceSum = _identity
    ) -> TokenTerms:
        return TokenTerms()

    def on_optimizer_step(self, reduce_sum: ReduceSum = _identity) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        """Metrics produced since the last call (already reduced over ranks)."""
        metrics, self.metrics = self.metrics, {}
        return metrics

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


TOKEN_METHODS: dict[str, type[TokenMethod]] = {}


def register_token_method(name: str):
    """Class decorator adding a ``TokenMethod`` to the registry under ``name``."""

    def register(cls: type[TokenMethod]) -> type[TokenMethod]:
        if name in TOKEN_METHODS:
            raise ValueError(f"A token method named {name!r} is already registered ({TOKEN_METHODS[name].__name__}).")
        cls.name = name
        TOKEN_METHODS[name] = cls
        return cls

    return register


def get_token_method_class(name: str) -> type[TokenMethod]:
    if name not in TOKEN_METHODS:
        raise ValueError(f"Unknown method {name!r}. Valid methods: {', '.join(sorted(TOKEN_METHODS))}.")
    return TOKEN_METHODS[name]


def build_token_method(name: str, **kwargs) -> TokenMethod:
    """Instantiate a registered method by name, e.g. ``build_token_method("opefo", estimate="full")``."""
    return get_token_method_class(name)(**kwargs)


register_token_method("grpo")(TokenMethod)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def covariance_scores(batch: TokenBatch) -> torch.Tensor:
    """cov_t = (A_t - mean A)(log pi_t - mean log pi), means over the valid tokens of the micro-batch (detached)."""
    mask = batch.mask.float()
    adv = batch.advantages.float()
    logps = batch.logps.float()
    return (adv - _masked_mean(adv, mask)) * (logps - _masked_mean(logps, mask))


# --------------------------------------------------------------------------------------------------------------------
# OPEFO (SPEC.md section 2)
# --------------------------------------------------------------------------------------------------------------------


@register_token_method("opefo")
class OPEFO(TokenMethod):
    """On-Policy Entropy Flow Optimization: rescale S+ / S- by 1 +/- lambda* so the batch's net entropy flow is 0.

    Args:
        estimate: per-token entropy-flow estimate (``FLOW_ESTIMATES``).
        fixed_lambda: use this lambda instead of lambda* (the paper's static-lambda ablation); None for lambda*.
        sides: ``both``, or rescale only one set (``increase_only`` / ``decrease_only``).
    """

    needs_rollout_pass = True
    on_policy_only = True

    def __init__(self, estimate: str = "opefo", fixed_lambda: float | None = None, sides: str = "both") -> None:
        super().__init__()
        if estimate not in FLOW_ESTIMATES:
            raise ValueError(f"Unknown entropy-flow estimate {estimate!r}; choose one of {FLOW_ESTIMATES}.")
        if sides not in SIDES:
            raise ValueError(f"Unknown opefo_sides {sides!r}; choose one of {SIDES}.")
        if fixed_lambda is not None and not -1.0 <= fixed_lambda <= 1.0:
            raise ValueError(
                f"opefo_lambda must lie in [-1, 1] (token weights 1 +/- lambda must stay >= 0); got {fixed_lambda}."
            )
        self.estimate, self.fixed_lambda, self.sides = estimate, fixed_lambda, sides

    @classmethod
    def from_args(cls, args) -> OPEFO:
        return cls(args.entropy_flow_estimate, args.opefo_lambda, args.opefo_sides)

    @property
    def needs_vocab_stats(self) -> bool:
        return self.estimate == "full"

    def rollout_weights(self, batch: TokenBatch, reduce_sum: ReduceSum = _identity) -> torch.Tensor:
        flow = batch.flow(self.estimate)
        stats = FlowStats.from_tensor(reduce_sum(flow_stats(flow, batch.mask).to_tensor()))
        lam = stats.lambda_star if self.fixed_lambda is None else torch.tensor(self.fixed_lambda)
        weights = token_weights(flow, lam.float(), self.sides)
        weighted = reduce_sum(flow_stats(flow * weights, batch.mask).to_tensor())
        self.metrics = {
            **stats.metrics(),
            "opefo/lambda_applied": float(lam),
            "opefo/weighted_net": float(FlowStats.from_tensor(weighted).net),
        }
        return weights


# --------------------------------------------------------------------------------------------------------------------
# Positive-Advantage Reweighting (SPEC.md section 3)
# --------------------------------------------------------------------------------------------------------------------


@register_token_method("par")
class PAR(TokenMethod):
    """Positive-Advantage Reweighting: tokens with A_t > 0 are weighted by c in [0, 1], the rest by 1.

    With ``coef=None`` an entropy-guided controller sets c once per optimizer step from the global mean token
    entropy H of that step: c <- clip(c - step, 0, 1) if H < target else clip(c + step, 0, 1).
    """

    def __init__(
        self, coef: float | None = None, coef_init: float = 0.0, entropy_target: float = 0.2, coef_step: float = 0.05
    ) -> None:
        super().__init__()
        for name, value in (("par_coef", coef), ("par_coef_init", coef_init)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1]; got {value}.")
        if coef_step <= 0:
            raise ValueError(f"par_coef_step must be > 0; got {coef_step}.")
        self.adaptive = coef is None
        self.coef = coef_init if coef is None else coef
        self.entropy_target, self.coef_step = entropy_target, coef_step
        self._entropy_sums: torch.Tensor | None = None  # this step's sum of H over valid tokens, and token count

    @classmethod
    def from_args(cls, args) -> PAR:
        return cls(args.par_coef, args.par_coef_init, args.par_entropy_target, args.par_coef_step)

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        mask = batch.mask.float()
        sums = torch.stack([(batch.entropies.float() * mask).sum(), mask.sum()]).double()
        self._entropy_sums = sums if self._entropy_sums is None else self._entropy_sums + sums
        ones = torch.ones_like(batch.advantages, dtype=torch.float32)
        return TokenTerms(weights=torch.where(batch.advantages > 0, ones * self.coef, ones))

    def on_optimizer_step(self, reduce_sum=_identity) -> None:
        if self._entropy_sums is None:  # no micro-batch seen this step
            return
        total, self._entropy_sums = reduce_sum(self._entropy_sums), None
        entropy = float(total[0] / total[1].clamp(min=1))
        self.metrics = {"par/coef": self.coef, "par/entropy": entropy}
        if self.adaptive:
            delta = -self.coef_step if entropy < self.entropy_target else self.coef_step
            self.coef = min(1.0, max(0.0, self.coef + delta))

    def state_dict(self) -> dict:
        return {"coef": self.coef, "adaptive": self.adaptive}

    def load_state_dict(self, state: dict) -> None:
        # Only the controller's coefficient is state; a constant par_coef is configuration and the new run's wins.
        if self.adaptive and state.get("adaptive", True):
            self.coef = float(state["coef"])


# --------------------------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (SPEC.md section 4)
# --------------------------------------------------------------------------------------------------------------------


def _count(fraction: float, n_valid: torch.Tensor) -> int:
    return max(1, int(fraction * int(n_valid)))


@register_token_method("clip_cov")
class ClipCov(TokenMethod):
    """Clip-Cov: drop the gradient of a few random tokens whose covariance score lies in (lb, ub).

    ``max(1, int(ratio * n_valid))`` tokens are picked uniformly among valid, not PPO-clipped tokens with
    lb < cov_t < ub (all of them if fewer qualify); their loss weight is 0.
    """

    def __init__(
        self,
        ratio: float = 2e-4,
        lower: float = 1.0,
        upper: float = 5.0,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
    ) -> None:
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"clip_cov_ratio must lie in (0, 1]; got {ratio}.")
        if not lower < upper:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub; got {lower} >= {upper}.")
        self.ratio, self.lower, self.upper = ratio, lower, upper
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high

    @classmethod
    def from_args(cls, args) -> ClipCov:
        # TRL leaves epsilon_high None to mean "same as epsilon".
        epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        return cls(args.clip_cov_ratio, args.clip_cov_lb, args.clip_cov_ub, args.epsilon, epsilon_high)

    def ppo_clipped(self, batch: TokenBatch) -> torch.Tensor:
        """Tokens whose gradient PPO's clip already removes (ratio outside the trust region, clipped direction)."""
        if batch.old_logps is None:
            return torch.zeros_like(batch.mask, dtype=torch.bool)
        ratio = (batch.logps - batch.old_logps).exp()
        low = (ratio < 1 - self.epsilon_low) & (batch.advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (batch.advantages > 0)
        return low | high

    def select(self, batch: TokenBatch) -> torch.Tensor:
        """Boolean (B, T) mask of the tokens whose gradient is dropped."""
        valid = batch.mask.bool()
        cov = covariance_scores(batch)
        candidates = valid & ~self.ppo_clipped(batch) & (cov > self.lower) & (cov < self.upper)
        chosen = torch.zeros_like(valid)
        index = candidates.flatten().nonzero().squeeze(1)
        if index.numel() > 0:
            keep = index[torch.randperm(index.numel(), device=index.device)[: _count(self.ratio, valid.sum())]]
            chosen.view(-1)[keep] = True
        return chosen

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        dropped = self.select(batch)
        counts = reduce_sum(torch.stack([dropped.sum(), batch.mask.bool().sum()]).double())
        self.metrics = {"clip_cov/dropped_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(weights=(~dropped).float())


#: An epsilon this large makes TRL's clip range [1 - eps, 1 + eps] contain every ratio: no clipping.
KL_COV_NO_CLIP = 1e9


@register_token_method("kl_cov")
class KLCov(TokenMethod):
    """KL-Cov: add ``coef * |log r_t|`` to the loss of the top-k tokens by covariance score.

    k = max(1, int(ratio * n_valid)). Under strict on-policy training log r = 0 and |x| has zero gradient at 0,
    so KL-Cov is plain GRPO there; the published baselines take 8 updates per rollout batch.
    """

    def __init__(self, ratio: float = 2e-3, coef: float = 1.0) -> None:
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"kl_cov_ratio must lie in (0, 1]; got {ratio}.")
        if coef < 0:
            raise ValueError(f"kl_cov_coef must be >= 0; got {coef}.")
        self.ratio, self.coef = ratio, coef

    @classmethod
    def from_args(cls, args) -> KLCov:
        strict = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
        if strict:
            warnings.warn(
                "method='kl_cov' in a strict on-policy configuration is inert: log r = 0 (up to sampler noise with "
                "vLLM), so the |log r| penalty has no gradient and training is plain GRPO. The published KL-Cov "
                "baselines take 8 updates per rollout (steps_per_generation = 8 * gradient_accumulation_steps).",
                stacklevel=2,
            )
        if args.epsilon < KL_COV_NO_CLIP:
            warnings.warn(
                f"method='kl_cov' runs on TRL's clipped loss (epsilon={args.epsilon}); the published KL-Cov has no PPO "
                f"clipping (pg = -A r). Set epsilon and epsilon_high to {KL_COV_NO_CLIP:g} or more to switch it off.",
                stacklevel=2,
            )
        return cls(args.kl_cov_ratio, args.kl_cov_coef)

    def select(self, batch: TokenBatch) -> torch.Tensor:
        """Boolean (B, T) mask of the top-k valid tokens by covariance score."""
        valid = batch.mask.bool()
        cov = covariance_scores(batch).masked_fill(~valid, float("-inf")).flatten()
        k = min(_count(self.ratio, valid.sum()), int(valid.sum()))
        chosen = torch.zeros_like(valid)
        if k > 0:
            chosen.view(-1)[cov.topk(k).indices] = True
        return chosen

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        chosen = self.select(batch)
        old = batch.logps if batch.old_logps is None else batch.old_logps
        penalty = self.coef * (logps - old).abs() * chosen
        counts = reduce_sum(torch.stack([chosen.sum(), batch.mask.bool().sum()]).double())
        self.metrics = {"kl_cov/penalised_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(extra_loss=penalty)
