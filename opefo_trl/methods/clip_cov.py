"""Clip-Cov: drop the gradient of a few random tokens whose covariance score lies in a window (docs/algorithm.md
section 6); ``covariance_scores`` is shared with KL-Cov."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    ClipRangeMethod,
    MethodContext,
    TokenBatch,
    TokenTerms,
    register_token_method,
    setting,
)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def covariance_scores(batch: TokenBatch) -> torch.Tensor:
    """cov_t = (A_t - mean A)(log pi_t - mean log pi), means over the micro-batch's tokens in the loss (detached)."""
    mask = batch.in_loss.float()
    adv = batch.advantages.float()
    logps = batch.logps.float()
    return (adv - _masked_mean(adv, mask)) * (logps - _masked_mean(logps, mask))


def count_of(fraction: float, n_valid: torch.Tensor) -> int:
    return max(1, int(fraction * int(n_valid)))


@register_token_method("clip_cov")
class ClipCov(ClipRangeMethod):
    """Clip-Cov: drop the gradient of a few random tokens whose covariance score lies in (lb, ub).

    ``max(1, int(ratio * n))`` tokens (n: tokens in the loss) are picked uniformly among the tokens in the loss that
    PPO's clip has not already removed, with lb < cov_t < ub (all of them if fewer qualify); their loss weight is 0.
    n, the covariance means and the pick are each micro-batch's on its own rank (the authors' code picks per
    micro-batch too), so the dropped share depends on ``per_device_train_batch_size``: with fewer than 1 / ratio
    tokens in a micro-batch the "at least 1" rule drops more than ``ratio`` of them.
    ``epsilon_low`` / ``epsilon_high`` are TRL's clip range (``epsilon``, ``epsilon_high``).
    """

    @dataclass
    class Settings:
        """Options of ``method="clip_cov"``."""

        clip_cov_ratio: float = setting(2e-4, "Clip-Cov: fraction of the tokens in the loss whose gradient is dropped.")
        clip_cov_lb: float = setting(1.0, "Clip-Cov: lower bound of the covariance window.")
        clip_cov_ub: float = setting(5.0, "Clip-Cov: upper bound of the covariance window.")

        def __post_init__(self):
            if not 0.0 < self.clip_cov_ratio <= 1.0:
                raise ValueError(f"clip_cov_ratio must lie in (0, 1]; got {self.clip_cov_ratio}.")
            if not self.clip_cov_lb < self.clip_cov_ub:
                raise ValueError(f"clip_cov_lb must be < clip_cov_ub; got {self.clip_cov_lb} >= {self.clip_cov_ub}.")

    settings: Settings
    summary = "drops the gradient of a few tokens of high covariance"
    table_rows = (("Clip-Cov", '`method="clip_cov"` ({defaults})'),)

    def ppo_clipped(self, batch: TokenBatch) -> torch.Tensor:
        """Tokens whose gradient PPO's clip already removes (ratio outside the trust region, clipped direction)."""
        if batch.old_logps is None:
            return torch.zeros_like(batch.in_loss)
        ratio = (batch.logps - batch.old_logps).exp()
        low = (ratio < 1 - self.epsilon_low) & (batch.advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (batch.advantages > 0)
        return low | high

    def select(self, batch: TokenBatch) -> torch.Tensor:
        """Boolean (B, T) mask of the tokens whose gradient is dropped."""
        in_loss = batch.in_loss
        cov = covariance_scores(batch)
        window = (cov > self.settings.clip_cov_lb) & (cov < self.settings.clip_cov_ub)
        candidates = in_loss & ~self.ppo_clipped(batch) & window
        chosen = torch.zeros_like(in_loss)
        index = candidates.flatten().nonzero().squeeze(1)
        if index.numel() > 0:
            count = count_of(self.settings.clip_cov_ratio, in_loss.sum())
            keep = index[torch.randperm(index.numel(), device=index.device)[:count]]
            chosen.view(-1)[keep] = True
        return chosen

    def micro_batch_terms(self, batch, logps, context: MethodContext = SINGLE_PROCESS) -> TokenTerms:
        dropped = self.select(batch)
        counts = context.reduce_sum(torch.stack([dropped.sum(), batch.in_loss.sum()]).double())
        self.metrics = {"clip_cov/dropped_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(weights=(~dropped).float())
