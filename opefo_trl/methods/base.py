"""The token-method protocol: what a method sees (`TokenBatch`, `MethodContext`), what it returns (`RolloutWeights`,
`TokenTerms`), the base class `TokenMethod` (plain GRPO) and the registry.

Pure torch, no TRL import. A method is one class, registered by name with ``@register_token_method("name")``:

- ``Settings``: a dataclass nested in the class whose fields are the method's options, each declared once with its
  default and its ``help``, its own ranges checked in ``__post_init__``. ``OPEFOConfig`` has the settings of every
  built-in method as fields (``config_bases``); the method is built from a config by keyword (``from_config``).
- ``summary`` and ``table_rows``: its one-line description (option help, CLI) and its rows of the methods table.
- ``check_config(args)``: what the method cannot run with in the rest of the configuration, refused (or warned
  about) when the config is built, before any model loads.
- ``needs_rollout_pass``: the method needs the whole rollout batch before the first backward; the trainer then
  computes every token's loss factor and entropy flow and calls ``rollout_weights`` once per rollout batch.
- ``rollout_weights(batch, context)``: what the method decided for the rollout batch, a ``RolloutWeights``: detached
  (B, T) weights multiplied into the advantages (or none), and, when they are 1 + lambda * s_t, ``lam`` and the signs
  s_t. Consumers read these fields and infer nothing: with ``lam`` and the signs of the step model the method built,
  the trainer writes the step's gradient itself (``opefo_trl.experimental.stand_ins``); without, TRL's pass computes it.
- ``micro_batch_terms(batch, logps, context)``: on every micro-batch inside the loss, with the current log-probs
  ``logps`` still attached to the graph: ``TokenTerms`` (advantage weights and/or an extra per-token loss, which the
  trainer aggregates exactly like TRL's policy loss).
- ``on_optimizer_step(context)``: once per optimizer step, after its last micro-batch (controllers, metrics).
- ``balances_the_step``: the weights come from ``context.step_change`` (the trainer then refuses any term TRL's pass
  adds to the gradient the step model assumes).
- ``metrics`` (already reduced over ranks), ``regime_warning()``, ``state_dict()`` / ``load_state_dict()``.

Because every weight is >= 0, scaling the per-token advantage by it is exactly the reweighted loss for every TRL
loss type, clipping included, and TRL's normalisation, KL term, entropy bonus and vLLM correction stay untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from opefo_trl.maths.options import off_policy_reasons, setting  # noqa: F401 (the methods import them from here)
from opefo_trl.maths.ranks import ReduceSum, single_process_sum

#: F(lambda): the first-order change of the mean token entropy the real next optimizer step makes when the rollout's
#: tokens are weighted 1 + lambda * s_t (``opefo_trl.experimental.step_model.StepModel.change``).
StepChange = Callable[[float], float]


@dataclass
class TokenBatch:
    """Detached per-token quantities of a (micro- or rollout) batch, all (B, T).

    ``logps``/``entropies`` are those of the current policy at the training temperature; ``advantages`` are the
    GRPO advantages broadcast per token (before this method's weights); ``factor`` is the per-token factor of the
    update TRL's loss applies to A_t grad log pi_t (loss and tool masks, loss normalisation, vLLM importance weights,
    off-policy and entropy masks; 0 for a token that is not in the loss). ``flow`` is d_t, the first-order entropy
    change of each token's update with the configured estimate (``opefo_trl.maths.entropy_flow``), when the method
    needs it. ``old_logps`` are the behaviour policy's when TRL tracks them (off-policy or vLLM correction), else None
    (strict on-policy: the ratio is 1). ``flow_bias`` is A_t E_pi[u_t], the part of d_t the estimate's on-policy mean
    accounts for (``entropy_flow.on_policy_mean``), where the bias diagnostic is computed, else None.
    """

    logps: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    factor: torch.Tensor
    flow: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    flow_bias: torch.Tensor | None = None

    @property
    def in_loss(self) -> torch.Tensor:
        """Boolean (B, T): the tokens the loss acts on (factor > 0); windows and counts are taken over these."""
        return self.factor > 0


@dataclass(frozen=True)
class RolloutWeights:
    """What a method's ``rollout_weights`` decided for a rollout batch.

    ``weights``: detached (B, T) weights >= 0 multiplied into the advantages, or None (the tokens are not reweighted).
    ``lam`` and ``signs`` are given exactly when the weights are 1 + lam * signs (``signs`` (B, T) in {-1, 0, 1}, as
    OPEFO's): when ``signs`` are those the method built the step model with (``context.step_change(signs)``), the
    gradient of the reweighted loss is a + lam b of that model. Weights of any other form (STEER's, STARE's) leave
    both None.

    >>> RolloutWeights.affine(0.5, torch.tensor([[1.0, -1.0, 0.0]])).weights.tolist()
    [[1.5, 0.5, 1.0]]
    """

    weights: torch.Tensor | None = None
    lam: float | None = None
    signs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.lam is None) != (self.signs is None):
            raise ValueError("RolloutWeights: give lam and signs together (weights 1 + lam * signs), or neither.")
        if self.lam is not None and self.weights is None:
            raise ValueError("RolloutWeights: lam and signs describe weights; give the weights 1 + lam * signs too.")

    @classmethod
    def affine(cls, lam: float, signs: torch.Tensor) -> RolloutWeights:
        """The weights 1 + lam * signs (fp32), with lam and signs."""
        return cls(1.0 + torch.as_tensor(lam, dtype=torch.float32, device=signs.device) * signs, lam, signs)


def decide_rollout_weights(method: TokenMethod, batch: TokenBatch, context: MethodContext) -> RolloutWeights:
    """``method.rollout_weights(batch, context)``, refused unless it is a ``RolloutWeights`` (a bare tensor says
    nothing about its form)."""
    decided = method.rollout_weights(batch, context)
    if not isinstance(decided, RolloutWeights):
        raise TypeError(
            f"{type(method).__name__}.rollout_weights returned {type(decided).__name__}; it must return a "
            "RolloutWeights: RolloutWeights(weights) for weights of any form, RolloutWeights.affine(lam, signs) for "
            "1 + lam * signs, RolloutWeights() for none (opefo_trl.methods.base)."
        )
    return decided


@dataclass
class TokenTerms:
    """What a method contributes to one micro-batch's loss: advantage weights and/or an extra per-token loss.

    ``extra_loss`` is aggregated like TRL's policy loss (its mask and normaliser). ``factor_loss`` is weighted by each
    token's factor f_t at the current parameters, the weight TRL's loss gives A_t grad log pi_t (also the off-policy
    and high-entropy masks and the vLLM importance ratio): a term that changes the policy gradient itself (CE-GPPO's).
    """

    weights: torch.Tensor | None = None
    extra_loss: torch.Tensor | None = None
    factor_loss: torch.Tensor | None = None


@dataclass
class MethodContext:
    """What the trainer offers a method's hooks: ``reduce_sum`` sums a tensor over data-parallel ranks (every rank must
    make the same calls in the same order), and ``step_change(signs)``, built only when called, returns F(lambda) for
    rollout weights 1 + lambda * signs (``signs`` (B, T) over the hook's whole batch); ``entropy`` is the mean token
    entropy F measures the change of (the batch's, or with ``entropy_flow_probe_rollouts`` the probe's; None without
    a step model). The default context is a single process without a step model."""

    reduce_sum: ReduceSum = single_process_sum
    step_model: Callable[[torch.Tensor], StepChange] | None = None
    entropy: float | None = None

    def step_change(self, signs: torch.Tensor) -> StepChange:
        if self.step_model is None:
            raise ValueError(
                "This method needs the step model of the real next optimizer step, which only "
                "entropy_flow_estimate='param' computes; set it (with entropy_flow_preconditioner='adam')."
            )
        return self.step_model(signs)


SINGLE_PROCESS = MethodContext()


@dataclass
class NoSettings:
    """A method without options."""


class TokenMethod:
    """Base class of every token method: weights 1 and no extra term (plain GRPO). Subclasses override the hooks
    they need.

    Build with the settings' fields as keywords (``PAR(par_coef=0.5)``) or from a config (``PAR.from_config(args)``).
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings
    #: One line naming what the method does (the ``method`` option's help and ``opefo-train --help``).
    summary: ClassVar[str] = ""
    #: Needs statistics over the whole rollout batch before the first backward (one update per rollout batch).
    needs_rollout_pass: ClassVar[bool] = False
    #: This class's own rows of the methods table (``methods_table``): (what, how to configure it); ``{defaults}``
    #: in the second is replaced by the settings' defaults. Read from the class itself, never inherited.
    table_rows: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, settings=None, **values) -> None:
        if settings is not None and values:
            raise TypeError("Pass either a settings object or its fields as keywords, not both.")
        if settings is not None and not isinstance(settings, self.Settings):
            raise TypeError(
                f"{type(self).__name__} takes a {class_name(self.Settings)} or its fields as keywords, got "
                f"{type(settings).__name__}; e.g. {type(self).__name__}(**{{'<field>': value}})."
            )
        self.settings = self.Settings(**values) if settings is None else settings  # validated on construction
        self.metrics: dict[str, float] = {}

    @classmethod
    def settings_from(cls, config):
        """This method's settings read, by name, from a config object (``OPEFOConfig`` or a user's subclass)."""
        names = [f.name for f in dataclasses.fields(cls.Settings)]
        missing = [name for name in names if not hasattr(config, name)]
        if missing:
            raise ValueError(
                f"method={cls.name!r} reads the settings {missing}, which {type(config).__name__} does not have. Give "
                "the config class these fields, e.g. `@dataclass class MyConfig(OPEFOConfig, "
                f"{class_name(cls.Settings)}): pass`."
            )
        return cls.Settings(**{name: getattr(config, name) for name in names})

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Refuse (ValueError naming the options and a fix), or warn about, what this method cannot run with in the
        rest of a configuration; called when the config is built, after the settings' own checks.

        ``args`` is an ``OPEFOConfig`` or a ``GRPOConfig`` given the OPEFO options by ``OPEFOTrainer``: every option
        is an attribute.
        """

    @classmethod
    def weighs_tokens(cls) -> bool:
        """Whether the method changes TRL's loss (weights or extra terms), i.e. relies on TRL's per-token factor."""
        return (
            cls.needs_rollout_pass
            or cls.rollout_weights is not TokenMethod.rollout_weights
            or cls.micro_batch_terms is not TokenMethod.micro_batch_terms
        )

    @property
    def balances_the_step(self) -> bool:
        """Whether the weights balance the step model (``context.step_change``), which models TRL's update as the
        gradient the rollout pass writes: the trainer then refuses a TRL pass that adds anything to it."""
        return False

    @classmethod
    def from_config(cls, config) -> TokenMethod:
        """Build from a config object; subclasses that also read TRL options (e.g. epsilon) override this."""
        return cls(cls.settings_from(config))

    def rollout_weights(self, batch: TokenBatch, context: MethodContext = SINGLE_PROCESS) -> RolloutWeights:
        return RolloutWeights()

    def micro_batch_terms(
        self, batch: TokenBatch, logps: torch.Tensor, context: MethodContext = SINGLE_PROCESS
    ) -> TokenTerms:
        return TokenTerms()

    def on_optimizer_step(self, context: MethodContext = SINGLE_PROCESS) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        """Metrics produced since the last call (already reduced over ranks)."""
        metrics, self.metrics = self.metrics, {}
        return metrics

    def regime_warning(self) -> str | None:
        """A message for the user, once, when the method runs far outside the regime it was designed for."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ClipRangeMethod(TokenMethod):
    """A token method that also reads TRL's PPO clip range: ``epsilon_low`` / ``epsilon_high`` are TRL's ``epsilon``
    and ``epsilon_high`` (Clip-Cov, CE-GPPO)."""

    def __init__(self, settings=None, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2, **values) -> None:
        super().__init__(settings, **values)
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high

    @classmethod
    def from_config(cls, config) -> TokenMethod:
        # TRL leaves epsilon_high None to mean "same as epsilon".
        epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
        return cls(cls.settings_from(config), epsilon_low=config.epsilon, epsilon_high=epsilon_high)


def class_name(cls: type) -> str:
    """How code names a class: ``OPEFO.Settings`` for a nested one, without a function's ``<locals>`` prefix."""
    return cls.__qualname__.rsplit("<locals>.", 1)[-1]


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


def build_token_method(name: str, **settings) -> TokenMethod:
    """Instantiate a registered method by name, e.g. ``build_token_method("opefo", opefo_sides="increase_only")``."""
    return get_token_method_class(name)(**settings)


def options_are_fields(args: Any) -> bool:
    """Whether the OPEFO options are fields of ``args``'s class (an ``OPEFOConfig``: a fix is an argument, also of
    opefo-train) rather than attributes ``OPEFOTrainer`` gave a ``GRPOConfig`` (a fix is an attribute to set)."""
    return dataclasses.is_dataclass(args) and "method" in {f.name for f in dataclasses.fields(args)}
