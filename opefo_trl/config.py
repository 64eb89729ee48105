"""`OPEFOConfig`: TRL's `GRPOConfig` plus the token-method settings (OPEFO, PAR, Clip-Cov, KL-Cov, diagnostics)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ._compat import check_trl_version

check_trl_version()

from trl import GRPOConfig  # noqa: E402

from .entropy_flow import FLOW_ESTIMATES  # noqa: E402
from .methods import TOKEN_METHODS, get_token_method_class  # noqa: E402

#: Free-text GRPOConfig options and the values TRL 1.16 accepts for them.
TRL_CHOICES = {
    "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"),
    "scale_rewards": ("group", "batch", "none"),
    "vllm_mode": ("colocate", "server"),
    "importance_sampling_level": ("token", "sequence"),
}


@dataclass
class OPEFOConfig(GRPOConfig):
    r"""
    Configuration for [`OPEFOTrainer`]: every [`~trl.GRPOConfig`] option, plus the method that weights or penalises
    tokens and its settings. The defaults give OPEFO as in the paper (strict on-policy, lambda* from the `opefo`
    entropy-flow estimate over the whole rollout batch, both sets rescaled).

    Baselines of the paper's comparison are configurations, not new trainers:

    | method | settings |
    |---|---|
    | GRPO (8 updates per rollout) | `method="grpo"`, `steps_per_generation=8 * gradient_accumulation_steps` |
    | strict on-policy GRPO | `method="grpo"` |
    | Entropy-Reg | `method="grpo"`, `entropy_coef=1e-3` (or `use_adaptive_entropy=True`) |
    | Clip-higher | `method="grpo"`, `epsilon_high=0.28` (active only off-policy) |
    | Clip-Cov / KL-Cov | `method="clip_cov"` / `method="kl_cov"` |
    | PAR | `method="par"` (entropy-guided) or `par_coef=<c>` |
    | OPEFO ablations | `opefo_lambda=0.001`, `opefo_sides="increase_only"` / `"decrease_only"` |

    Example:
        >>> from opefo_trl import OPEFOConfig
        >>> args = OPEFOConfig(output_dir="out", method="opefo", entropy_flow_estimate="opefo")  # doctest: +SKIP
    """

    method: str = field(
        default="opefo",
        metadata={
            "help": "Token-level method: 'opefo' (entropy-flow balancing), 'grpo' (plain GRPO; with TRL options also "
            "Entropy-Reg and Clip-higher), 'par' (positive-advantage reweighting), 'clip_cov', 'kl_cov'.",
        },
    )
    entropy_flow_estimate: str = field(
        default="opefo",
        metadata={
            "help": "Per-token first-order entropy-change estimate used by OPEFO and the diagnostics: 'opefo' "
            "(-A (1-pi)^2 (log pi + H)), 'onaction', 'sign', or 'full' (exact first order; needs two extra "
            "vocabulary reductions per token, computed in a chunked pass over the LM head).",
        },
    )
    opefo_lambda: float | None = field(
        default=None,
        metadata={"help": "Fixed lambda in [-1, 1] instead of the balancing lambda* (static-lambda ablation)."},
    )
    opefo_sides: str = field(
        default="both",
        metadata={"help": "Which set OPEFO rescales: 'both', 'increase_only' (S+) or 'decrease_only' (S-)."},
    )
    allow_off_policy: bool = field(
        default=False,
        metadata={
            "help": "OPEFO is strictly on-policy (one optimizer step per rollout batch: num_iterations=1 and "
            "steps_per_generation == gradient_accumulation_steps). Set True to run it off-policy anyway.",
        },
    )
    entropy_flow_diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Log the entropy flow every batch produces (entropy_flow/lambda, increase, decrease, net, token "
            "fractions) for every method. Cheap for the log-prob based estimates.",
        },
    )
    vocab_stats_token_chunk_size: int = field(
        default=512, metadata={"help": "Tokens per tile of the `full` estimate's vocabulary pass."}
    )
    vocab_stats_vocab_chunk_size: int = field(
        default=16384, metadata={"help": "Vocabulary entries per tile of the `full` estimate's vocabulary pass."}
    )
    par_coef: float | None = field(
        default=None,
        metadata={"help": "PAR: constant weight in [0, 1] of positive-advantage tokens; None for the controller."},
    )
    par_coef_init: float = field(default=0.0, metadata={"help": "PAR controller: initial coefficient in [0, 1]."})
    par_entropy_target: float = field(
        default=0.2, metadata={"help": "PAR controller: target mean token entropy of an optimizer step."}
    )
    par_coef_step: float = field(
        default=0.05, metadata={"help": "PAR controller: change of the coefficient per optimizer step."}
    )
    clip_cov_ratio: float = field(
        default=2e-4, metadata={"help": "Clip-Cov: fraction of valid tokens whose gradient is dropped."}
    )
    clip_cov_lb: float = field(default=1.0, metadata={"help": "Clip-Cov: lower bound of the covariance window."})
    clip_cov_ub: float = field(default=5.0, metadata={"help": "Clip-Cov: upper bound of the covariance window."})
    kl_cov_ratio: float = field(
        default=2e-3, metadata={"help": "KL-Cov: fraction of valid tokens (top by covariance) given the KL penalty."}
    )
    kl_cov_coef: float = field(default=1.0, metadata={"help": "KL-Cov: coefficient of the |log ratio| penalty."})

    def __post_init__(self):
        super().__post_init__()
        # GRPOConfig only rejects some of these when the first batch reaches them: fail at configuration time.
        for name, valid in TRL_CHOICES.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"Unknown {name} {getattr(self, name)!r}; choose one of {valid}.")
        method_class = get_token_method_class(self.method)  # unknown name: error listing the valid ones
        if self.entropy_flow_estimate not in FLOW_ESTIMATES:
            raise ValueError(
                f"Unknown entropy_flow_estimate {self.entropy_flow_estimate!r}; choose one of {FLOW_ESTIMATES}."
            )
        if self.vocab_stats_token_chunk_size < 1 or self.vocab_stats_vocab_chunk_size < 1:
            raise ValueError("vocab_stats_token_chunk_size and vocab_stats_vocab_chunk_size must be >= 1.")
        if self.use_liger_kernel:
            raise ValueError(
                "use_liger_kernel=True is not supported by OPEFOTrainer: the token methods act on TRL's per-token "
                "loss path, which the Liger integration replaces. Set use_liger_kernel=False."
            )
        off_policy = []
        if self.num_iterations > 1:
            off_policy.append(f"num_iterations={self.num_iterations} (several updates per rollout batch)")
        if self.steps_per_generation != self.gradient_accumulation_steps:
            off_policy.append(
                f"steps_per_generation={self.steps_per_generation} != gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} (a rollout batch is not exactly one optimizer step)"
            )
        if off_policy and method_class.on_policy_only and not self.allow_off_policy:
            raise ValueError(
                f"method={self.method!r} is strictly on-policy: lambda* is computed over one rollout batch and applied "
                f"in exactly one optimizer step, but this configuration has {' and '.join(off_policy)}. Fix: set "
                "num_iterations=1 and leave steps_per_generation unset (it then equals gradient_accumulation_steps), "
                "or set allow_off_policy=True to run it off-policy deliberately."
            )
        # Build every method once so that each one's settings are checked at configuration time (whichever method
        # is selected: a bad value is never silently ignored), not mid-training.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for registered in TOKEN_METHODS.values():
                registered.from_args(self)


__all__ = ["OPEFOConfig", "TOKEN_METHODS"]
