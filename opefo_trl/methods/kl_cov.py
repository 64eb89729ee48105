"""KL-Cov: a |log ratio| penalty on the top-k tokens by covariance score (docs/algorithm.md section 6)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    MethodContext,
    TokenBatch,
    TokenMethod,
    TokenTerms,
    off_policy_reasons,
    register_token_method,
    setting,
)
from opefo_trl.methods.clip_cov import count_of, covariance_scores

#: An epsilon this large makes TRL's clip range [1 - eps, 1 + eps] contain every ratio: no clipping.
KL_COV_NO_CLIP = 1e9


@register_token_method("kl_cov")
class KLCov(TokenMethod):
    """KL-Cov: add ``coef * |log r_t|`` to the loss of the top-k tokens by covariance score.

    k = max(1, int(ratio * n)), with n and the covariance means taken over each micro-batch on its own rank (the
    authors' code picks per micro-batch too), so the penalised set depends on ``per_device_train_batch_size``. The
    published baselines take 8 updates per rollout batch. Strictly on-policy the penalty's gradient is
    coef * sign(log r_t) grad log pi_t on the chosen tokens: 0 where TRL keeps no old log-probs (log r = 0 exactly,
    and |x| has zero gradient at 0: plain GRPO), but +-coef per chosen token, of random sign, wherever TRL's
    separately re-scored ``old_per_token_logps`` (vLLM importance-sampling correction) differ from the training
    forward's at all.
    """

    @dataclass
    class Settings:
        """Options of ``method="kl_cov"``."""

        kl_cov_ratio: float = setting(
            2e-3, "KL-Cov: fraction of the tokens in the loss (top by covariance) given the KL penalty."
        )
        kl_cov_coef: float = setting(1.0, "KL-Cov: coefficient of the |log ratio| penalty.")

        def __post_init__(self):
            if not 0.0 < self.kl_cov_ratio <= 1.0:
                raise ValueError(f"kl_cov_ratio must lie in (0, 1]; got {self.kl_cov_ratio}.")
            if self.kl_cov_coef < 0:
                raise ValueError(f"kl_cov_coef must be >= 0; got {self.kl_cov_coef}.")

    settings: Settings
    summary = "a |log ratio| penalty on the tokens of highest covariance"
    table_rows = (
        (
            "KL-Cov",
            '`method="kl_cov"` ({defaults}; on-policy inert, or random-sign noise with vLLM importance-sampling '
            "correction, warned)",
        ),
    )

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Runs anywhere; warns where it cannot be the published KL-Cov (on-policy: inert, or noise where TRL
        re-scores the old log-probs; PPO's clip: kept)."""
        if not off_policy_reasons(args):
            if args.use_vllm and args.vllm_importance_sampling_correction:
                warnings.warn(
                    "method='kl_cov' in a strict on-policy configuration with vLLM importance-sampling correction is "
                    "not the published KL-Cov: TRL re-scores old_per_token_logps in a separate no-grad pass, and "
                    "wherever it differs from the training forward's log-probs at all (batch shapes, kernels, bf16; "
                    "even by 1e-6), the |log r| penalty gives each penalised token a gradient of +-kl_cov_coef (in "
                    "units of the loss normaliser) of random sign; where the two passes agree bit for bit it has no "
                    "gradient (measured on vLLM's CPU build with a tiny model: 191 of 191 tokens agreed bit for bit, "
                    "so the penalty did nothing). The published KL-Cov baselines take 8 updates per rollout "
                    "(steps_per_generation = 8 * gradient_accumulation_steps).",
                    stacklevel=2,
                )
            else:
                warnings.warn(
                    "method='kl_cov' in a strict on-policy configuration is inert: TRL keeps no old log-probs, log r "
                    "= 0 exactly, the |log r| penalty has no gradient and training is plain GRPO. The published KL-Cov "
                    "baselines take 8 updates per rollout (steps_per_generation = 8 * gradient_accumulation_steps).",
                    stacklevel=2,
                )
        if args.epsilon < KL_COV_NO_CLIP:
            warnings.warn(
                f"method='kl_cov' runs on TRL's clipped loss (epsilon={args.epsilon}); the published KL-Cov has no "
                f"PPO clipping (pg = -A r). Set epsilon and epsilon_high to {KL_COV_NO_CLIP:g} or more to switch it "
                "off.",
                stacklevel=2,
            )

    def select(self, batch: TokenBatch) -> torch.Tensor:
        """Boolean (B, T) mask of the top-k tokens in the loss by covariance score."""
        in_loss = batch.in_loss
        cov = covariance_scores(batch).masked_fill(~in_loss, float("-inf")).flatten()
        k = min(count_of(self.settings.kl_cov_ratio, in_loss.sum()), int(in_loss.sum()))
        chosen = torch.zeros_like(in_loss)
        if k > 0:
            chosen.view(-1)[cov.topk(k).indices] = True
        return chosen

    def micro_batch_terms(self, batch, logps, context: MethodContext = SINGLE_PROCESS) -> TokenTerms:
        chosen = self.select(batch)
        old = batch.logps if batch.old_logps is None else batch.old_logps
        penalty = self.settings.kl_cov_coef * (logps - old).abs() * chosen
        counts = context.reduce_sum(torch.stack([chosen.sum(), batch.in_loss.sum()]).double())
        self.metrics = {"kl_cov/penalised_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(extra_loss=penalty)
