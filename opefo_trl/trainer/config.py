"""`OPEFOConfig`: TRL's `GRPOConfig` plus the entropy-flow settings and the token methods' settings.

Each option is declared once, with its default and help: the entropy-flow options in `EntropyFlowSettings` below,
each method's in the `Settings` of its class in `opefo_trl.methods`. `OPEFOConfig` inherits them all (those of
every built-in method; `config_class` adds those of any other registered method the same way), so `TrlParser`,
recipes and `--help` see every one. `validate_opefo_settings` checks them (also on a plain `GRPOConfig` that
`OPEFOTrainer` was given, see `with_opefo_settings`): what every method shares here, the selected method's own checks
by its class (`TokenMethod.check_config`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import cast

from opefo_trl._compat import check_installed_trl

check_installed_trl()

from trl import GRPOConfig  # noqa: E402

from opefo_trl.experimental.task_tokens import check_task_tokens  # noqa: E402
from opefo_trl.maths.entropy_flow import (  # noqa: E402
    BIASED_ESTIMATES,
    FLOW_ESTIMATES,
    VOCABULARY_ESTIMATES,
    check_choice,
)
from opefo_trl.methods import (  # noqa: E402
    BUILTIN_METHODS,
    DEFAULT_METHOD,
    TOKEN_METHODS,
    TokenMethod,
    get_token_method_class,
    method_choices,
    setting,
    settings_classes,
)

#: Free-text GRPOConfig options and the values TRL 1.16 accepts for them.
TRL_CHOICES = {
    "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"),
    "scale_rewards": ("group", "batch", "none"),
    "vllm_mode": ("colocate", "server"),
    "importance_sampling_level": ("token", "sequence"),
}
PRECONDITIONERS = ("adam", "none")
ENTROPIES = ("vocabulary", "task_tokens")
#: TrainingArguments.optim values whose optimizer each `param` preconditioner models exactly (torch's own).
PRECONDITIONER_OPTIMS = {"adam": ("adamw_torch", "adamw_torch_fused"), "none": ("sgd",)}


@dataclass
class EntropyFlowSettings:
    """How the per-token entropy flow is estimated, logged and checked (every method; OPEFO balances it)."""

    entropy_flow_estimate: str = setting(
        "opefo",
        "Per-token first-order entropy-change estimate used by OPEFO and the diagnostics: 'opefo' "
        "(-A (1-pi)^2 (log pi + H), our reconstruction of the paper's; its on-policy mean is not zero), "
        "'opefo_centered' (the same less its on-policy mean 2 S_2 - S_3 at each position; a vocabulary pass), "
        "'onaction', 'sign', 'full' (exact first order of a tabular softmax; a vocabulary pass), or 'param' (exact "
        "first order through the network's trainable parameters by forward-mode AD: per micro-batch a gradient "
        "forward with two backwards and a forward-mode pass, in the parameters' precision).",
    )
    entropy_flow_preconditioner: str = setting(
        "adam",
        "'param' estimate: the optimizer's diagonal preconditioner D in d_t = c_t A_t <D grad Hbar, grad log pi_t>. "
        "'adam': torch Adam/AdamW's next step, its bias-corrected second moments including this batch's clipped "
        "gradient (computed in the same pass); 'none': plain SGD (optim='sgd', no momentum). Each is refused with "
        "the other family's optimizer.",
    )
    entropy_flow_probe_rollouts: int = setting(
        1,
        "'param' estimate: the entropy whose first-order change the flow measures (and OPEFO balances) is the mean "
        "token entropy of this rollout batch and the K - 1 rollout batches before it, re-scored under the current "
        "parameters. 1: this rollout batch only (the paper's). The update stays strictly on-policy: only the entropy "
        "direction D grad Hbar changes. Each earlier micro-batch adds a forward+backward and a forward-mode pass per "
        "step; the earlier batches are not checkpointed (after a resume the probe refills over K - 1 steps).",
    )
    entropy_flow_diagnostics: bool = setting(
        True,
        "Log the entropy flow every optimizer step produces (entropy_flow/lambda, increase, decrease, net, token "
        "fractions) for every method. Cheap for the log-prob based estimates.",
    )
    entropy_flow_bias_diagnostics: bool = setting(
        True,
        "With the diagnostics (and in OPEFO's regime guard), also log the part of the net flow and of lambda* that "
        "the estimate's on-policy mean accounts for: entropy_flow/bias_net (sum of f_t A_t E_pi[u_t]), "
        "entropy_flow/lambda_bias and entropy_flow/lambda_net_of_bias (docs/metrics.md). For 'opefo' and 'onaction', "
        "whose on-policy mean is not zero, it takes the vocabulary pass 'full' takes; for 'opefo_centered', 'full' and "
        "'sign' it is 0 exactly and not logged; 'param' has none.",
    )
    entropy_flow_task_tokens: list[int] | None = setting(
        None,
        "Token ids the task's answers are written in (e.g. the digit tokens of numeric answers). With the diagnostics, "
        "each optimizer step also logs entropy_flow/off_task_{increase_share,decrease_share,token_frac}: the shares "
        "of the increase flow, of the decrease flow and of the tokens carried by sampled tokens outside this set. "
        "entropy_flow_entropy='task_tokens' measures the entropy over them.",
    )
    entropy_flow_entropy: str = setting(
        "vocabulary",
        "'param' estimate: the token entropy whose first-order change the flow measures, OPEFO balances and the "
        "audit re-measures. 'vocabulary': the policy's entropy over the whole vocabulary (the paper's); "
        "'task_tokens': the entropy of the policy renormalised over entropy_flow_task_tokens, which probability "
        "moved onto other tokens cannot raise.",
    )
    entropy_flow_audit_steps: int = setting(
        0,
        "Every k-th optimizer step (0: never), re-score that step's batch after the update without gradients and log "
        "entropy_flow/measured_delta, the measured change of its mean token entropy (per-token differences summed in "
        "float64). For 'param' also entropy_flow/predicted_delta (the first-order change of the step from its real "
        "gradient and the optimizer's state) and entropy_flow/step_first_order (from the real parameter change); with "
        "entropy_flow_probe_rollouts > 1 the measured tokens are the probe's (this batch and the earlier ones). One "
        "no-grad forward per audited step.",
    )
    vocab_stats_token_chunk_size: int = setting(512, "Tokens per tile of the vocabulary pass (S_2, S_3).")
    vocab_stats_vocab_chunk_size: int = setting(16384, "Vocabulary entries per tile of the vocabulary pass (S_2, S_3).")


# The settings of every built-in method are bases, so that registering a built-in method in opefo_trl.methods is
# all it takes to make its options fields here (mypy cannot follow a computed base list: the fields it does not see
# are checked by the tests, tests/trainer/test_config.py).
@dataclass
class OPEFOConfig(GRPOConfig, EntropyFlowSettings, *settings_classes(BUILTIN_METHODS)):  # type: ignore[misc]
    r"""
    Configuration for [`OPEFOTrainer`]: every [`~trl.GRPOConfig`] option, plus the method that weights or penalises
    tokens, its settings, and the entropy-flow settings. The defaults give OPEFO as in the paper (strict on-policy,
    lambda* from the `opefo` entropy-flow estimate over the whole rollout batch, both sets rescaled).

    Baselines of the paper's comparison are configurations, not new trainers: the methods table
    (`opefo_trl.methods.methods_table()`, in the README) says how to configure each one.

    Example:
        >>> from opefo_trl import OPEFOConfig
        >>> args = OPEFOConfig(output_dir="out", method="par", par_coef=0.5, use_cpu=True, bf16=False)
        >>> args.method, args.par_coef, args.entropy_flow_estimate
        ('par', 0.5, 'opefo')
    """

    method: str = setting(
        DEFAULT_METHOD,
        f"Token-level method: {method_choices(BUILTIN_METHODS)}; or a method registered with "
        "opefo_trl.methods.register_token_method (its options: opefo_trl.trainer.config.config_class).",
    )
    cast_lm_head_to_fp32: bool = setting(
        True,
        "TRL's option, with another default here: project the LM head in float32, so that the log-probs and "
        "entropies the entropy-flow statistics (and the loss) are computed from are not rounded to bf16. Measured on "
        "a peaked model with Qwen's 151,936-token vocabulary, bf16 logits moved lambda* by up to 5.8e-4 per 4,096 "
        "tokens (the paper's lambda* is ~1e-3); with the float32 head under bf16 autocast, at most 1.3e-4 "
        "(benchmarks/README.md). No effect on float32 training; a float64 model keeps its float64 head (the option is "
        "set False for it). Set False for GRPOConfig's default.",
    )
    allow_off_policy: bool = setting(
        False,
        "OPEFO is strictly on-policy (one optimizer step per rollout batch: num_iterations=1 and "
        "steps_per_generation == gradient_accumulation_steps). Set True to run it off-policy anyway.",
    )

    def __post_init__(self):
        if isinstance(self.num_generations, int) and self.num_generations < 2:  # GRPOConfig divides by it first
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO compares each completion with the others of its "
                "prompt's group, so it needs at least 2 completions per prompt (e.g. 8)."
            )
        super().__post_init__()
        validate_opefo_settings(self)


def config_class(*methods: type[TokenMethod], base: type = OPEFOConfig) -> type:
    """A config class with the options of ``methods`` as fields on top of ``base``'s: how a method registered outside
    this package gets its options, as the built-in ones are ``OPEFOConfig``'s (``TrlParser([config_class(MyMethod),
    ...])`` parses them like any other option).

    Example:
        >>> from opefo_trl.methods import PAR
        >>> config_class(PAR) is OPEFOConfig  # a built-in method's options are OPEFOConfig's already
        True
    """
    extra = tuple(s for s in settings_classes(methods) if not issubclass(base, s))
    if not extra:
        return base
    name = base.__name__ + "With" + "".join(m.__name__ for m in methods)
    return dataclass(type(name, (base, *extra), {"__module__": base.__module__}))


def _opefo_fields() -> list[dataclasses.Field]:
    """The fields OPEFOConfig adds to GRPOConfig."""
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(OPEFOConfig) if f.name not in inherited]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _uses_deepspeed(args) -> bool:
    return bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _uses_fsdp(args) -> bool:
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_estimate_backend(estimate: str, *, deepspeed: bool, fsdp: bool, compiled: bool = False) -> None:
    """Refuse an entropy-flow estimate the training backend cannot run, naming what to use instead (called with the
    configuration's flags and again by the trainer with accelerate's state)."""
    if estimate in VOCABULARY_ESTIMATES and compiled:
        raise ValueError(
            f"entropy_flow_estimate={estimate!r} reads the backbone's hidden states through a forward hook, which a "
            "compiled model does not run. Set torch_compile=False, or use a log-prob estimate ('opefo', 'onaction', "
            "'sign')."
        )
    if (estimate in VOCABULARY_ESTIMATES or estimate == "param") and fsdp:
        raise ValueError(
            f"entropy_flow_estimate={estimate!r} is not supported under FSDP (the LM head and the parameters are "
            "sharded outside the forward). Use DDP (recipes/accelerate/ddp.yaml), DeepSpeed ZeRO-3 for 'full' or "
            "'opefo_centered', or a log-prob estimate ('opefo', 'onaction', 'sign')."
        )
    if estimate == "param" and deepspeed:
        raise ValueError(
            "entropy_flow_estimate='param' perturbs the trainable parameters in float32, which DeepSpeed holds as "
            "bf16 copies of fp32 master weights (ZeRO-3 also partitions them). Use DDP (recipes/accelerate/ddp.yaml, "
            "e.g. with LoRA), or 'full' / a log-prob estimate under DeepSpeed."
        )


def uses_loss_factor(args, method_class: type[TokenMethod]) -> bool:
    """Whether a configuration relies on TRL's per-token loss factor (``LossMirror.factor``): the method weighs tokens,
    or the entropy flow is computed."""
    return method_class.weighs_tokens() or args.entropy_flow_diagnostics


def _refuse_unmodelled_updates(args, method_class: type[TokenMethod]) -> None:
    """The GRPOConfig options whose update the per-token factor does not model (docs/algorithm.md section 2 lists every
    option that changes the update)."""
    if args.importance_sampling_level == "sequence":
        refuse_or_switch_off_diagnostics(
            args,
            method_class,
            "importance_sampling_level='sequence'",
            "TRL then weights each completion by exp(the mean of its tokens' log-ratios), so a token's weight moves "
            "the whole sequence's log-probabilities (1/n_i sum_s grad log pi_s) instead of its own, and the per-token "
            "factor, the entropy flow and the balance would describe an update that is not applied",
            "Set importance_sampling_level='token' (TRL's default)",
        )
    if args.delta is not None and args.delta < 1.0:
        refuse_or_switch_off_diagnostics(
            args,
            method_class,
            f"delta={args.delta}",
            "TRL's two-sided clip caps the ratio at delta, which below 1 removes the gradient of every "
            "positive-advantage token even on-policy",
            "Set delta >= 1 (TRL recommends > 1 + epsilon) or None",
        )


#: TRL's loss types that clip the ratio to [1 - epsilon, 1 + epsilon_high].
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _check_clip_range(args) -> None:
    """The clip range [1 - epsilon, 1 + epsilon_high] of the clipped loss types: epsilon <= 0 clips every token's
    ratio to 1 (nothing trains off the first micro-batch), a negative one turns the clip inside out, and an
    epsilon_high below epsilon is a typo for clip-higher (DAPO: epsilon_high > epsilon)."""
    if args.loss_type not in CLIPPED_LOSS_TYPES:
        return
    if args.epsilon <= 0:
        raise ValueError(
            f"epsilon={args.epsilon}: the clip range [1 - epsilon, 1 + epsilon_high] needs epsilon > 0 (TRL's default "
            "0.2)."
        )
    if args.epsilon_high is not None and args.epsilon_high < args.epsilon:
        raise ValueError(
            f"epsilon_high={args.epsilon_high} is below epsilon={args.epsilon}: the clip range is [1 - epsilon, "
            "1 + epsilon_high], and clip-higher (DAPO) raises its upper end (e.g. epsilon_high=0.28 with "
            "epsilon=0.2). Set epsilon_high >= epsilon, or leave it unset (= epsilon)."
        )


def refuse_or_switch_off_diagnostics(args, method_class: type[TokenMethod], option: str, why: str, fix: str) -> None:
    """An option (``option``, e.g. ``"neftune_noise_alpha=5.0"``) under which TRL's training pass is not the pass
    the per-token factor and the flows describe (``why``; ``fix``: how to train as they describe): refused by a method
    that weighs tokens (its update would be wrong); under one that does not (plain GRPO's drop-in), the entropy-flow
    diagnostics, which would describe another update, are switched off with one warning, and training goes on as
    GRPOTrainer's would."""
    if method_class.weighs_tokens():
        raise ValueError(
            f"{option} is not modelled by OPEFOTrainer: {why}, and method={args.method!r} would weigh tokens for an "
            f"update that is not the one applied. {fix}, or use method='grpo' (TRL's own update)."
        )
    if args.entropy_flow_diagnostics:
        args.entropy_flow_diagnostics = False
        warnings.warn(
            f"{option} is not modelled by OPEFOTrainer: {why}. The entropy-flow diagnostics, which would describe "
            f"another update, are switched off for this run (entropy_flow_diagnostics=False); method={args.method!r} "
            "trains as GRPOTrainer would.",
            stacklevel=2,
        )


def _check_noise(args, method_class: type[TokenMethod]) -> None:
    alpha = getattr(args, "neftune_noise_alpha", None)
    if alpha is not None:
        refuse_or_switch_off_diagnostics(
            args,
            method_class,
            f"neftune_noise_alpha={alpha}",
            "NEFTune adds noise to the input embeddings in TRL's training pass, so its gradient is taken at other "
            "log-probabilities than the rollout was scored with",
            "Remove neftune_noise_alpha",
        )


def validate_opefo_settings(args) -> None:
    """Check the OPEFO options of ``args`` (an OPEFOConfig, or a GRPOConfig given them by `with_opefo_settings`).

    Raises ValueError naming the option and a fix that works for the object the user passed; nothing that can be
    checked without the model waits for training. The selected method checks its own settings (built here) and what
    it cannot run with (`check_config`); what every method shares is checked here.
    """
    # GRPOConfig only rejects some of these when the first batch reaches them: fail at configuration time.
    for name, valid in TRL_CHOICES.items():
        check_choice(name, getattr(args, name), valid)
    _check_clip_range(args)
    method_class = get_token_method_class(args.method)  # unknown name: error listing the valid ones
    method_class.settings_from(args)  # the selected method's settings validate on construction
    _refuse_settings_of_other_methods(args, method_class)
    method_class.check_config(args)
    _refuse_unmodelled_updates(args, method_class)
    _check_noise(args, method_class)
    check_choice("entropy_flow_estimate", args.entropy_flow_estimate, FLOW_ESTIMATES)
    check_choice("entropy_flow_preconditioner", args.entropy_flow_preconditioner, PRECONDITIONERS)
    check_choice("entropy_flow_entropy", args.entropy_flow_entropy, ENTROPIES)
    check_task_tokens(args, method_class)
    if args.entropy_flow_audit_steps < 0:
        raise ValueError(f"entropy_flow_audit_steps must be >= 0 (0: off); got {args.entropy_flow_audit_steps}.")
    if args.vocab_stats_token_chunk_size < 1 or args.vocab_stats_vocab_chunk_size < 1:
        raise ValueError("vocab_stats_token_chunk_size and vocab_stats_vocab_chunk_size must be >= 1.")
    if args.entropy_flow_probe_rollouts < 1:
        raise ValueError(
            "entropy_flow_probe_rollouts must be >= 1 (1: this rollout batch only); got "
            f"{args.entropy_flow_probe_rollouts}."
        )
    computes_flow = method_class.needs_rollout_pass or args.entropy_flow_diagnostics
    if args.entropy_flow_probe_rollouts > 1 and not (computes_flow and args.entropy_flow_estimate == "param"):
        raise ValueError(
            f"entropy_flow_probe_rollouts={args.entropy_flow_probe_rollouts} sets the entropy the 'param' estimate "
            f"measures, but this configuration computes no 'param' flow (entropy_flow_estimate="
            f"{args.entropy_flow_estimate!r}, method={args.method!r}, entropy_flow_diagnostics="
            f"{args.entropy_flow_diagnostics}). Set entropy_flow_estimate='param', or remove the option."
        )
    if computes_flow:
        if args.entropy_flow_estimate == "param":
            _check_param_optimizer(args)
        check_estimate_backend(
            args.entropy_flow_estimate,
            deepspeed=_uses_deepspeed(args),
            fsdp=_uses_fsdp(args),
            compiled=args.torch_compile,
        )
        _check_bias_backend(args)


def needs_moments(args) -> bool:
    """Whether the flow needs the surprise-gap moments S_2, S_3 (a vocabulary pass): the estimate does, or its bias
    diagnostic does (an estimate whose on-policy mean is not zero)."""
    estimate = args.entropy_flow_estimate
    return estimate in VOCABULARY_ESTIMATES or (args.entropy_flow_bias_diagnostics and estimate in BIASED_ESTIMATES)


def _check_bias_backend(args) -> None:
    """The bias diagnostic of a log-prob estimate needs the vocabulary pass: where the backend cannot run it (FSDP, a
    compiled model) it is switched off with one warning, and training goes on."""
    if not (args.entropy_flow_bias_diagnostics and args.entropy_flow_estimate in BIASED_ESTIMATES):
        return
    backend = "FSDP" if _uses_fsdp(args) else "torch_compile=True" if args.torch_compile else None
    if backend is None:
        return
    args.entropy_flow_bias_diagnostics = False
    warnings.warn(
        f"entropy_flow_bias_diagnostics needs a vocabulary pass over the LM head, which {backend} does not allow: the "
        f"bias part of lambda* (entropy_flow/lambda_bias) is not logged for entropy_flow_estimate="
        f"{args.entropy_flow_estimate!r} in this run (entropy_flow_bias_diagnostics=False). Training goes on.",
        stacklevel=3,
    )


def _check_param_optimizer(args) -> None:
    """The `param` preconditioner must describe the optimizer that will step (a custom optimizer passed to the
    trainer is checked again when it is created)."""
    optim = str(getattr(args.optim, "value", args.optim))
    preconditioner = args.entropy_flow_preconditioner
    if optim not in PRECONDITIONER_OPTIMS[preconditioner]:
        other = "none" if preconditioner == "adam" else "adam"
        raise ValueError(
            f"entropy_flow_preconditioner={preconditioner!r} models the update of "
            f"{' / '.join(PRECONDITIONER_OPTIMS[preconditioner])}, but optim={optim!r}: lambda would balance a step "
            f"that never happens and entropy_flow/predicted_delta would describe it. Set optim="
            f"{PRECONDITIONER_OPTIMS[preconditioner][0]!r}, or entropy_flow_preconditioner={other!r} with optim="
            f"{PRECONDITIONER_OPTIMS[other][0]!r}."
        )


def _refuse_settings_of_other_methods(args, method_class) -> None:
    """A non-default setting of a method that is not selected would be silently ignored: refuse it."""
    own = {f.name for f in dataclasses.fields(method_class.Settings)}
    for name, other in TOKEN_METHODS.items():
        if other is method_class:
            continue
        for f in dataclasses.fields(other.Settings):
            if f.name in own or not hasattr(args, f.name):
                continue
            if getattr(args, f.name) != _default(f):
                raise ValueError(
                    f"{f.name}={getattr(args, f.name)!r} is a setting of method={name!r} and has no effect with "
                    f"method={args.method!r}. Remove it, or set method={name!r}."
                )


def with_opefo_settings(args: GRPOConfig) -> OPEFOConfig:
    """Give a plain `GRPOConfig` (or a user's subclass) the OPEFO options, in place, and validate them (an
    `OPEFOConfig` is validated again: its fields may have been set after it was built).

    The object keeps its class, its identity and its own extra fields, as `GRPOTrainer` keeps the config it is
    given; options it already has as attributes (e.g. ``args.method = "grpo"`` set by the user) are kept.

    >>> from trl import GRPOConfig
    >>> args = GRPOConfig(output_dir="out", use_cpu=True, bf16=False)
    >>> with_opefo_settings(args) is args, args.method, type(args).__name__
    (True, 'opefo', 'GRPOConfig')
    """
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"OPEFOTrainer expects an OPEFOConfig or a GRPOConfig, got {type(args).__name__}.")
    if not isinstance(args, OPEFOConfig):
        for f in _opefo_fields():
            if not hasattr(args, f.name):
                setattr(args, f.name, _default(f))
    # Also an OPEFOConfig, checked when built: an option set on it since (e.g. importance_sampling_level="sequence")
    # is seen here, from TRL's own fields, before the trainer is built.
    validate_opefo_settings(args)
    # Typed as an OPEFOConfig: it now has every attribute of one, whatever its class.
    return cast(OPEFOConfig, args)


__all__ = [
    "EntropyFlowSettings",
    "OPEFOConfig",
    "TOKEN_METHODS",
    "check_estimate_backend",
    "config_class",
    "validate_opefo_settings",
    "with_opefo_settings",
]
