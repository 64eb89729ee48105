"""What TRL's `GRPOTrainer._compute_loss` applies to a token's A_t grad log pi_t, mirrored: the one file to diff on a
TRL upgrade (TRL 1.16, `trl/trainer/grpo_trainer.py`).

- :meth:`LossMirror.mask`, :meth:`LossMirror.normaliser` and :meth:`LossMirror.aggregate`: TRL's loss mask and its
  aggregation of a per-token loss for each ``loss_type``;
- :meth:`LossMirror.factor`: f_t, the coefficient of A_t grad log pi_t in the (rank-averaged) gradient of TRL's loss
  at the rollout's parameters (ratio 1): masks, normalisation, the vLLM importance-sampling ratio (VESPO's gamma
  weights instead), the off-policy and high-entropy masks, CISPO's clamp (docs/algorithm.md section 2);
- :func:`trl_scores_rollout`: whether TRL runs its own no-grad old-log-prob pass over a rollout batch.

Pinned by tests/trainer/test_loss_mirror.py against TRL's own loss, for every loss type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

from opefo_trl.trainer.config import TRL_CHOICES

LOSS_TYPES = TRL_CHOICES["loss_type"]


def trl_scores_rollout(args: Any, *, use_vllm: bool, importance_sampling_correction: bool) -> bool:
    """Whether `GRPOTrainer._generate_and_score_completions` (1.16) runs its no-grad old-log-prob pass over the rollout
    (its own condition: a rollout batch used for more than one optimizer step, or vLLM importance sampling)."""
    assert args.steps_per_generation is not None  # GRPOConfig.__post_init__ fills it
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or (use_vllm and importance_sampling_correction)


@dataclass
class LossMirror:
    """TRL's per-token loss factor and aggregation for one trainer's configuration.

    ``accumulation_steps()`` is the Trainer's ``current_gradient_accumulation_steps`` (it can change at an epoch's
    end); ``high_entropy_mask`` is TRL's ``GRPOTrainer.get_high_entropy_mask`` (a collective over ranks).
    """

    loss_type: str
    num_processes: int
    accumulation_steps: Callable[[], int]
    steps_per_generation: int
    max_completion_length: int | None = None
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    high_entropy_mask: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    importance_sampling_correction: bool = False
    epsilon_high: float = 0.2
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg
    #: The gradient of TRL's loss is exactly -sum_t f_t A_t w_t grad log pi_t, linear in token weights w_t: strictly
    #: on-policy (ratio 1, where every loss type's gradient is that of its factor), no KL term, no entropy bonus, no
    #: router aux loss, no Liger loss path, and no two-sided clip below ratio 1.
    gradient_is_linear: bool = False

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Loss type {self.loss_type!r} is not supported by OPEFOTrainer.")

    @classmethod
    def of(cls, trainer: GRPOTrainer) -> LossMirror:
        """The mirror of a built `GRPOTrainer`'s loss (its options as TRL 1.16 names them)."""
        args: Any = trainer.args  # a GRPOConfig
        assert args.steps_per_generation is not None  # GRPOConfig.__post_init__ fills it
        return cls(
            loss_type=trainer.loss_type,
            num_processes=trainer.accelerator.num_processes,
            accumulation_steps=lambda: trainer.current_gradient_accumulation_steps,
            steps_per_generation=args.steps_per_generation,
            max_completion_length=trainer.max_completion_length,
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            top_entropy_quantile=trainer.top_entropy_quantile,
            high_entropy_mask=trainer.get_high_entropy_mask,
            importance_sampling_correction=trainer.use_vllm and trainer.vllm_importance_sampling_correction,
            epsilon_high=trainer.epsilon_high,
            vespo=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            gradient_is_linear=(
                args.num_iterations == 1
                and args.steps_per_generation == args.gradient_accumulation_steps
                and trainer.beta == 0.0
                and not trainer._entropy_bonus_enabled
                and not trainer.aux_loss_enabled
                and not args.use_liger_kernel
                and (args.delta is None or args.delta >= 1.0)
            ),
        )

    @staticmethod
    def mask(batch: dict) -> torch.Tensor:
        """The tokens TRL's loss averages over: the completion mask, times the tool mask where there is one."""
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    def normaliser(self, mask: torch.Tensor, batch: dict) -> torch.Tensor:
        """c with TRL's policy loss = sum_t per_token_loss_t * mask_t * c_t for the loss type (broadcasts to (B, T))."""
        accumulation = self.accumulation_steps()
        batch_size = mask.size(0)
        one = torch.ones((), device=mask.device)
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / (mask.sum(-1, keepdim=True).clamp(min=1.0) * batch_size * accumulation)
        if self.loss_type == "bnpo":
            return one / (mask.sum().clamp(min=1.0) * accumulation)
        if self.loss_type == "dr_grpo":
            assert self.max_completion_length is not None, "loss_type='dr_grpo' normalises by max_completion_length"
            return one / (batch_size * self.max_completion_length * accumulation)
        if self.loss_type in ("cispo", "dapo", "vespo"):
            normaliser = batch["num_items_in_batch"].clamp(min=1.0) / self.num_processes
            return one / (normaliser * accumulation / self.steps_per_generation)
        return one / (batch_size * accumulation)  # luspo

    def aggregate(self, per_token: torch.Tensor, batch: dict) -> torch.Tensor:
        """A per-token loss term reduced exactly as TRL reduces the policy loss."""
        mask = self.mask(batch)
        return (per_token * mask * self.normaliser(mask, batch)).sum()

    @torch.no_grad()
    def factor(
        self, batch: dict, logps: torch.Tensor, entropies: torch.Tensor, advantages: torch.Tensor
    ) -> torch.Tensor:
        """f_t of TRL's loss at the rollout's parameters, (B, T) fp32; ``advantages`` are the unweighted ones, (B,) or
        (B, T) (the off-policy mask and VESPO's weights read their sign)."""
        mask = self.mask(batch).float()
        factor = mask * self.normaliser(mask, batch) / self.num_processes
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old_logps = batch.get("old_per_token_logps")
        old_logps = logps if old_logps is None else old_logps
        if self.off_policy_mask_threshold is not None:
            sampling_logps = batch.get("sampling_per_token_logps", old_logps)
            factor = factor * GRPOTrainer.get_off_policy_mask(
                advantages, logps, sampling_logps, mask, self.off_policy_mask_threshold
            )
        if self.top_entropy_quantile < 1.0:
            assert self.high_entropy_mask is not None, "top_entropy_quantile < 1 needs TRL's high-entropy mask"
            factor = factor * self.high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.loss_type == "vespo":
            factor = factor * GRPOTrainer.get_gamma_weights(
                advantages, logps - old_logps, mask, batch.get("importance_sampling_ratio"), *self.vespo
            )
        elif self.importance_sampling_correction:
            factor = factor * batch["importance_sampling_ratio"]
        if self.loss_type == "cispo":
            factor = factor * (logps - old_logps).exp().clamp(max=self.epsilon_high)
        return factor.float().expand_as(logps)
