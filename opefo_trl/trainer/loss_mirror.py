"""What TRL's `GRPOTrainer._compute_loss` applies to a token's A_t grad log pi_t, mirrored: the one file to diff on a
TRL upgrade (TRL 1.16, `trl/trainer/grpo_trainer.py`).

- :meth:`LossMirror.mask`, :meth:`LossMirror.normaliser` and :meth:`LossMirror.aggregate`: TRL's loss mask and its
  aggregation of a per-token loss for each ``loss_type``;
- :meth:`LossMirror.factor`: f_t, the coefficient of A_t grad log pi_t in the (rank-averaged) gradient of TRL's loss
  at the rollout's parameters (ratio 1): masks, normalisation, the vLLM importance-sampling ratio (VESPO's gamma
  weights instead), the off-policy and high-entropy masks, CISPO's clamp (docs/algorithm.md section 2);
- :meth:`LossMirror.check_against_trl`: the one-time guard on the first micro-batch: the gradient of TRL's loss with
  respect to the scored log pi_t must be the one the mirror says (-W f_t A_t w_t, plus the KL term's), else training
  stops naming the options in effect that shape TRL's update;
- :func:`trl_scores_rollout`: whether TRL runs its own no-grad old-log-prob pass over a rollout batch.

Pinned by tests/trainer/test_loss_mirror.py against TRL's own loss, for every loss type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from opefo_trl.trainer.config import TRL_CHOICES

LOSS_TYPES = TRL_CHOICES["loss_type"]
#: GRPOConfig options (TRL 1.16) that change the update TRL's loss applies; the guard's error names those set away from
#: their defaults (docs/algorithm.md section 2, "Every option that changes the update").
UPDATE_OPTIONS = (
    "loss_type",
    "importance_sampling_level",
    "beta",
    "use_bias_correction_kl",
    "epsilon",
    "epsilon_high",
    "delta",
    "num_iterations",
    "steps_per_generation",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "entropy_coef",
    "use_adaptive_entropy",
    "mask_truncated_completions",
    "use_liger_kernel",
)
#: The guard's tolerance on |TRL's gradient - the mirror's|_1 / |the mirror's|_1 on the first micro-batch: float32
#: rounding of the two elementwise expressions is ~1e-7 relative; a token on the high-entropy mask's quantile boundary
#: whose entropy rounds differently in two forwards moves the sum by 1 / (loss tokens), well below 1e-2 for batches of
#: hundreds of tokens; the defects it exists for were 0.28 (no vLLM ratio) to 0.54 (sequence-level ratio).
GUARD_TOLERANCE = 1e-2


def options_in_effect(args: Any) -> list[str]:
    """``name=value`` of the :data:`UPDATE_OPTIONS` of a GRPOConfig that differ from GRPOConfig's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in UPDATE_OPTIONS}
    defaults["use_liger_kernel"] = False
    return [f"{name}={getattr(args, name)!r}" for name in UPDATE_OPTIONS if getattr(args, name) != defaults.get(name)]


class LossMirrorMismatch(RuntimeError):
    """TRL's loss applies an update the loss mirror does not model (found on the first micro-batch)."""


def trl_scores_rollout(args: Any, *, use_vllm: bool, importance_sampling_correction: bool) -> bool:
    """Whether `GRPOTrainer._generate_and_score_completions` (1.16) runs its no-grad old-log-prob pass over the rollout
    (its own condition: a rollout batch used for more than one optimizer step, or vLLM importance sampling)."""
    assert args.steps_per_generation is not None  # GRPOConfig.__post_init__ fills it
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or (use_vllm and importance_sampling_correction)


def nonlinear_terms(trainer: GRPOTrainer) -> tuple[str, ...]:
    """What a built trainer's TRL pass adds to -sum_t f_t A_t w_t grad log pi_t, from TRL's own flags."""
    args: Any = trainer.args
    terms = []
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        terms.append(
            f"off-policy updates (num_iterations={args.num_iterations}, steps_per_generation="
            f"{args.steps_per_generation}): the ratio is not 1 after the first"
        )
    if trainer.beta != 0.0:
        terms.append(f"the KL term (beta={trainer.beta})")
    if trainer._entropy_bonus_enabled:
        terms.append(
            f"TRL's entropy bonus (entropy_coef={args.entropy_coef}, use_adaptive_entropy={args.use_adaptive_entropy})"
        )
    if trainer.aux_loss_enabled:
        terms.append(
            f"the MoE router's auxiliary loss (router_aux_loss_coef={trainer.router_aux_loss_coef}; set "
            "router_aux_loss_coef=0.0 to train without it)"
        )
    if args.use_liger_kernel:
        terms.append("the Liger kernel path (use_liger_kernel=True)")
    if args.delta is not None and args.delta < 1.0:
        terms.append(f"a two-sided clip below ratio 1 (delta={args.delta})")
    if args.importance_sampling_level != "token":
        terms.append(f"importance_sampling_level={args.importance_sampling_level!r}")
    return tuple(terms)


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
    beta: float = 0.0
    bias_correction_kl: bool = True  # TRL's use_bias_correction_kl
    #: What TRL's loss gradient has besides -sum_t f_t A_t w_t grad log pi_t (linear in the token weights w_t), as
    #: TRL's own flags decide it: off-policy ratios, the KL term, the entropy bonus (static or adaptive), the MoE
    #: router's auxiliary loss, the Liger path, a two-sided clip below ratio 1. Empty: TRL's pass computes exactly
    #: the gradient the rollout pass can write.
    nonlinear_terms: tuple[str, ...] = ()
    #: The non-default options of :data:`UPDATE_OPTIONS`, named by the guard's error.
    options: tuple[str, ...] = ()

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Loss type {self.loss_type!r} is not supported by OPEFOTrainer.")

    @property
    def gradient_is_linear(self) -> bool:
        """The gradient of TRL's loss is exactly -sum_t f_t A_t w_t grad log pi_t (nothing in ``nonlinear_terms``)."""
        return not self.nonlinear_terms

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
            beta=trainer.beta,
            bias_correction_kl=args.use_bias_correction_kl,
            nonlinear_terms=nonlinear_terms(trainer),
            options=tuple(options_in_effect(args)),
        )

    def check_against_trl(
        self, loss: torch.Tensor, logps: torch.Tensor, batch: dict, factor: torch.Tensor
    ) -> float | None:
        """Stop if TRL's ``loss`` (one micro-batch, before any method term) does not have the gradient in log pi_t the
        mirror says: -W f_t A_t w_t (``batch["advantages"]``, weighted as TRL read them) plus the KL term's. One
        backward through the loss's elementwise operations only (no parameter is reached). Returns the relative L1
        difference (None where TRL's log pi_t carries no gradient)."""
        if not logps.requires_grad:
            return None
        (trl_gradient,) = torch.autograd.grad(loss, logps, retain_graph=True, allow_unused=True)
        with torch.no_grad():
            advantages = batch["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            expected = -factor.double() * self.num_processes * advantages.double()
            if self.beta != 0.0:
                expected = expected + self.beta * self._kl_gradient(batch, logps.detach().double())
            found = torch.zeros_like(expected) if trl_gradient is None else trl_gradient.double()
            difference = float((found - expected).abs().sum() / expected.abs().sum().clamp(min=1e-300))
        if difference > GUARD_TOLERANCE:
            raise LossMirrorMismatch(
                "OPEFOTrainer: on the first micro-batch the gradient of TRL's loss in each token's log-probability "
                f"differs from the per-token factor OPEFO models by {difference:.3g} (relative L1; the factor is what "
                "the entropy flow, lambda* and opefo/weighted_net are computed for), so the balance logged would not "
                "be the update applied. Options in effect that shape TRL's update: "
                f"{', '.join(self.options) or 'none besides the defaults'}. Set the option that is not modelled back "
                "to its default (docs/algorithm.md section 2 lists which are modelled), or use method='grpo' with "
                "entropy_flow_diagnostics=False."
            )
        return difference

    def _kl_gradient(self, batch: dict, logps: torch.Tensor) -> torch.Tensor:
        """d/d log pi_t of TRL's KL term (KL_t, times r_t with ``use_bias_correction_kl``) aggregated with m_t c_t;
        the caller multiplies by beta."""
        mask = self.mask(batch).double()
        ref = batch["ref_per_token_logps"].double()
        kl_gradient = 1 - torch.exp(ref - logps)
        if self.bias_correction_kl:  # KL_t * r_t, r_t = exp(log pi_t - old log pi_t)
            old = batch.get("old_per_token_logps")
            ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old.double())
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            kl_gradient = (kl_gradient + kl) * ratio
        return kl_gradient * mask * self.normaliser(mask, batch).double()

    @staticmethod
    def mask(batch: dict) -> torch.Tensor:
        """The tokens TRL's loss averages over: the completion mask, times the tool mask where there is one."""
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    @property
    def factor_is_per_sequence(self) -> bool:
        """Whether a token's f_t is the same whichever of TRL's micro-batches it lands in (given their row count), so
        that it can be computed before TRL's shuffle and split: every loss type but ``bnpo`` (normalised by the
        micro-batch's token count), and no high-entropy mask (a quantile over the micro-batch's tokens)."""
        return self.loss_type != "bnpo" and self.top_entropy_quantile >= 1.0

    def normaliser(self, mask: torch.Tensor, batch: dict, rows: int | None = None) -> torch.Tensor:
        """c with TRL's policy loss = sum_t per_token_loss_t * mask_t * c_t for the loss type (broadcasts to (B, T));
        ``rows``: the rows of the micro-batch TRL's loss sees ``batch``'s tokens in (None: ``batch``'s own)."""
        accumulation = self.accumulation_steps()
        batch_size = mask.size(0) if rows is None else rows
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
        self,
        batch: dict,
        logps: torch.Tensor,
        entropies: torch.Tensor,
        advantages: torch.Tensor,
        rows: int | None = None,
    ) -> torch.Tensor:
        """f_t of TRL's loss at the rollout's parameters, (B, T) fp32; ``advantages`` are the unweighted ones, (B,) or
        (B, T) (the off-policy mask and VESPO's weights read their sign). ``batch`` is a micro-batch of TRL's, or
        (``rows``: the row count of TRL's micro-batches) a whole rollout before TRL splits it, which only a factor
        that is the same in every micro-batch (``factor_is_per_sequence``) may be computed for."""
        if rows is not None and not self.factor_is_per_sequence:
            raise ValueError(
                f"loss_type={self.loss_type!r}, top_entropy_quantile={self.top_entropy_quantile}: f_t depends on "
                "TRL's split into micro-batches, so it is computed per micro-batch, after the split."
            )
        mask = self.mask(batch).float()
        factor = mask * self.normaliser(mask, batch, rows) / self.num_processes
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
