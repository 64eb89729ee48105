"""Token-level methods: how each method of the paper's comparison weights or penalises a batch's tokens.

Pure torch, no TRL import. The trainer (``opefo_trl.trainer``) is the only glue; a method only sees tensors.

A method is one class, registered by name with ``@register_token_method("name")``; everything about it is in it:

- ``Settings``: a dataclass nested in the class whose fields are the method's options, each declared once with its
  default and its ``help``, its own ranges checked in ``__post_init__``. ``OPEFOConfig`` inherits the settings of
  every built-in method, so they are options of every TRL parser and recipe; the method is built from the config by
  keyword (``from_config``).
- ``check_config(args)``: what the method cannot run with in the rest of the configuration (TRL's options, the
  entropy-flow settings), refused, or warned about, when the config is built, before any model loads.
- ``table_rows``: its rows of the methods table (:func:`methods_table`, printed by ``python -m opefo_trl.methods``
  and copied into the README).
- ``rollout_weights(batch, reduce_sum)``: once per rollout batch, before the first backward, on the whole local
  rollout batch. Returns detached (B, T) weights multiplied into the advantages (OPEFO: lambda* needs every token
  of the optimizer step). ``reduce_sum`` sums a tensor over data-parallel ranks.
- ``micro_batch_terms(batch, logps, reduce_sum)``: on every micro-batch inside the loss, with the current
  log-probs ``logps`` still attached to the graph. Returns ``TokenTerms``: weights for the advantages and/or an
  extra per-token loss term (aggregated by the trainer exactly like the policy loss).
- ``on_optimizer_step(reduce_sum)``: once per optimizer step, after the last micro-batch (controllers, metrics).

All but the registration are optional.

Because every weight is >= 0, scaling the per-token advantage by it is exactly the reweighted loss for every TRL
loss type, clipping included, and TRL's normalisation, KL term, entropy bonus and vLLM correction stay untouched.

Add a method by subclassing ``TokenMethod`` and decorating it with ``@register_token_method("name")``
(CONTRIBUTING.md has the checklist). A built-in method is such a class in this module, nothing else.

Example:
    >>> import torch
    >>> par = build_token_method("par", par_coef=0.5)
    >>> batch = TokenBatch(logps=torch.zeros(2, 3), entropies=torch.ones(2, 3),
    ...                    advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]), factor=torch.ones(2, 3))
    >>> par.micro_batch_terms(batch, batch.logps).weights[:, 0].tolist()
    [0.5, 1.0]
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .entropy_flow import BALANCES, SIDES, FlowStats, check_choice, flow_stats, token_weights, weight_signs
from .param_flow import solve_step_balance

ReduceSum = Callable[[torch.Tensor], torch.Tensor]
#: ``OPEFOConfig``'s default ``method``, first in the methods table.
DEFAULT_METHOD = "opefo"
#: The start of every regime-guard warning (docs/algorithm.md, "The regime guard").
REGIME_GUARD = "OPEFO regime guard: "


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def setting(default, help: str):
    """A settings field: its default and the ``help`` text TRL's parsers print (``--help``, recipes)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TokenBatch:
    """Detached per-token quantities of a (micro- or rollout) batch, all (B, T).

    ``logps``/``entropies`` are those of the current policy at the training temperature; ``advantages`` are the
    GRPO advantages broadcast per token (before this method's weights); ``factor`` is the per-token factor of the
    update TRL's loss applies to A_t grad log pi_t (loss and tool masks, loss normalisation, vLLM importance weights,
    off-policy and entropy masks; 0 for a token that is not in the loss). ``flow`` is d_t, the first-order entropy
    change of each token's update with the configured estimate (see ``entropy_flow``), when the method needs it.
    ``old_logps`` are the behaviour policy's when TRL tracks them (off-policy or vLLM correction), else None (strict
    on-policy: the ratio is 1). ``step_change`` (the `param` estimate, for methods with ``needs_step_model``) maps
    lambda to the first-order change of the mean token entropy that the real next optimizer step makes when the
    tokens are weighted 1 + lambda * ``weight_signs`` (``param_flow.StepModel``; the same on every rank).
    """

    logps: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    factor: torch.Tensor
    flow: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    step_change: Callable[[float], float] | None = None

    @property
    def in_loss(self) -> torch.Tensor:
        """Boolean (B, T): the tokens the loss acts on (factor > 0); windows and counts are taken over these."""
        return self.factor > 0


@dataclass
class TokenTerms:
    """What a method contributes to one micro-batch's loss: advantage weights and/or an extra per-token loss."""

    weights: torch.Tensor | None = None
    extra_loss: torch.Tensor | None = None


@dataclass
class NoSettings:
    """A method without options."""


class TokenMethod:
    """Base class: plain GRPO (weights 1, no extra term). Subclasses override the hooks they need.

    Build with the settings' fields as keywords (``PAR(par_coef=0.5)``) or from a config (``PAR.from_config(args)``).
    """

    name: ClassVar[str] = "grpo"
    Settings: ClassVar[type] = NoSettings
    #: Needs statistics over the whole rollout batch before the first backward (one update per rollout batch).
    needs_rollout_pass: ClassVar[bool] = False
    #: This class's own rows of the methods table (``methods_table``): (what, how to configure it); ``{defaults}``
    #: in the second is replaced by the settings' defaults. Read from the class itself, never inherited.
    table_rows: ClassVar[tuple[tuple[str, str], ...]] = (
        ("GRPO, 8 updates per rollout", '`method="grpo"`, `steps_per_generation=8 * gradient_accumulation_steps`'),
        ("strict on-policy GRPO", '`method="grpo"`'),
        ("Entropy-Reg", '`method="grpo"`, `entropy_coef=1e-3` or `use_adaptive_entropy=True` (TRL\'s own)'),
        ("Clip-higher", '`method="grpo"`, `epsilon_high=0.28` (TRL\'s own; active only off-policy)'),
    )

    def __init__(self, settings=None, **values) -> None:
        if settings is not None and values:
            raise TypeError("Pass either a settings object or its fields as keywords, not both.")
        if settings is not None and not isinstance(settings, self.Settings):
            raise TypeError(
                f"{type(self).__name__} takes a {_class_name(self.Settings)} or its fields as keywords, got "
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
                f"{_class_name(cls.Settings)}): pass`."
            )
        return cls.Settings(**{name: getattr(config, name) for name in names})

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Refuse (ValueError naming the options and a fix), or warn about, what this method cannot run with in the
        rest of a configuration; called when the config is built, after the settings' own checks.

        ``args`` is an ``OPEFOConfig`` or a ``GRPOConfig`` given the OPEFO options by ``OPEFOTrainer``: every option
        is an attribute. Plain GRPO needs nothing beyond TRL's own checks.
        """

    @classmethod
    def from_config(cls, config) -> TokenMethod:
        """Build from a config object; subclasses that also read TRL options (e.g. epsilon) override this."""
        return cls(cls.settings_from(config))

    @property
    def needs_step_model(self) -> bool:
        """Whether ``rollout_weights`` needs ``TokenBatch.step_change`` (the trainer then computes it)."""
        return False

    def weight_signs(self, batch: TokenBatch) -> torch.Tensor | None:
        """s_t when the rollout weights are 1 + lambda * s_t for a scalar lambda (what ``step_change`` takes), else
        None."""
        return None

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

    def regime_warning(self) -> str | None:
        """A message for the user, once, when the method runs far outside the regime it was designed for."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _class_name(cls: type) -> str:
    """How code names a class: ``OPEFO.Settings`` for a nested one, without a function's ``<locals>`` prefix."""
    return cls.__qualname__.rsplit("<locals>.", 1)[-1]


TOKEN_METHODS: dict[str, type[TokenMethod]] = {}


def register_token_method(name: str):
    """Class decorator adding a ``TokenMethod`` to the registry under ``name``."""

    def register(cls: type[TokenMethod]) -> type[TokenMethod]:
        if name in TOKEN_METHODS:
            raise ValueError(f"A token method named {name!r} is already registered ({TOKEN_METHODS[name].__name__}).")
        if "on_policy_only" in vars(cls):  # the flag of earlier releases: refusing it beats ignoring it
            raise TypeError(
                f"{cls.__name__}.on_policy_only is no longer read: refuse off-policy configurations in "
                "`check_config(args)` instead (`off_policy_reasons(args)` says why one is off-policy; "
                "OPEFO.check_config is an example)."
            )
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


register_token_method("grpo")(TokenMethod)


def off_policy_reasons(args: Any) -> list[str]:
    """Why a configuration uses a rollout batch for more than one optimizer step (empty when strictly on-policy).

    >>> from types import SimpleNamespace
    >>> off_policy_reasons(SimpleNamespace(num_iterations=2, steps_per_generation=4, gradient_accumulation_steps=4))
    ['num_iterations=2 (several updates per rollout batch)']
    """
    reasons = []
    if args.num_iterations > 1:
        reasons.append(f"num_iterations={args.num_iterations} (several updates per rollout batch)")
    if args.steps_per_generation != args.gradient_accumulation_steps:
        reasons.append(
            f"steps_per_generation={args.steps_per_generation} != gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} (a rollout batch is not exactly one optimizer step)"
        )
    return reasons


def _options_are_fields(args: Any) -> bool:
    """Whether the OPEFO options are fields of ``args``'s class (an ``OPEFOConfig``: a fix is an argument, also of
    opefo-train) rather than attributes ``OPEFOTrainer`` gave a ``GRPOConfig`` (a fix is an attribute to set)."""
    return dataclasses.is_dataclass(args) and "method" in {f.name for f in dataclasses.fields(args)}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def covariance_scores(batch: TokenBatch) -> torch.Tensor:
    """cov_t = (A_t - mean A)(log pi_t - mean log pi), means over the micro-batch's tokens in the loss (detached)."""
    mask = batch.in_loss.float()
    adv = batch.advantages.float()
    logps = batch.logps.float()
    return (adv - _masked_mean(adv, mask)) * (logps - _masked_mean(logps, mask))


# --------------------------------------------------------------------------------------------------------------------
# OPEFO (docs/algorithm.md section 3)
# --------------------------------------------------------------------------------------------------------------------


def _flow(batch: TokenBatch) -> torch.Tensor:
    """The batch's entropy flow d_t, which OPEFO needs."""
    if batch.flow is None:
        raise ValueError("OPEFO needs the batch's entropy flow (TokenBatch.flow).")
    return batch.flow


@register_token_method("opefo")
class OPEFO(TokenMethod):
    """On-Policy Entropy Flow Optimization: rescale S+ / S- by 1 +/- lambda* so the batch's net entropy flow is 0.

    The flow d_t comes with the batch (the trainer computes it with ``entropy_flow_estimate``) and every sum is
    weighted by the batch's ``factor``, so lambda* balances the update the loss really applies. With
    ``opefo_balance="step"`` lambda is instead the root of ``TokenBatch.step_change`` on [-1, 1]: the real next
    optimizer step then leaves the mean token entropy unchanged to first order.
    """

    @dataclass
    class Settings:
        """Options of ``method="opefo"``."""

        opefo_lambda: float | None = setting(
            None, "Fixed lambda in [-1, 1] instead of the balancing lambda* (the paper's static-lambda ablation)."
        )
        opefo_sides: str = setting(
            "both", "Which set OPEFO rescales: 'both', 'increase_only' (S+) or 'decrease_only' (S-) (paper ablations)."
        )
        opefo_balance: str = setting(
            "batch",
            "What lambda balances. 'batch' (the paper's): the reweighted batch's own first-order entropy flow sums to "
            "0. 'step' (this library's): the first-order entropy change of the real next AdamW step is 0 (its moments, "
            "bias correction, eps, weight decay and the gradient clip included), lambda found by a 1-D root search; "
            "needs entropy_flow_estimate='param' with entropy_flow_preconditioner='adam'.",
        )
        opefo_lambda_warn: float = setting(
            0.1,
            "Warn once when |lambda*| averaged over the last 20 optimizer steps exceeds this: the paper's lambda* is "
            "~1e-3, and a large one means the entropy flow is far from balanced, so OPEFO's reweighting is no longer a "
            "small correction.",
        )

        def __post_init__(self):
            check_choice("opefo_sides", self.opefo_sides, SIDES)
            check_choice("opefo_balance", self.opefo_balance, BALANCES)
            if self.opefo_balance == "step" and self.opefo_lambda is not None:
                raise ValueError(
                    "opefo_balance='step' chooses lambda every step, which a fixed opefo_lambda overrides. Remove one."
                )
            if self.opefo_balance == "step" and self.opefo_sides != "both":
                raise ValueError(
                    "opefo_balance='step' solves for lambda with both sets rescaled, so "
                    f"opefo_sides={self.opefo_sides!r} would not balance the step. Use opefo_sides='both', or "
                    "opefo_balance='batch' for the paper's ablation."
                )
            if self.opefo_lambda is not None and not -1.0 <= self.opefo_lambda <= 1.0:
                raise ValueError(
                    "opefo_lambda must lie in [-1, 1] (token weights 1 +/- lambda must stay >= 0); "
                    f"got {self.opefo_lambda}."
                )
            if not self.opefo_lambda_warn > 0:
                raise ValueError(f"opefo_lambda_warn must be > 0; got {self.opefo_lambda_warn}.")

    settings: Settings
    needs_rollout_pass = True
    table_rows = (
        (
            "OPEFO (default)",
            '`method="opefo"`; `entropy_flow_estimate` in `opefo` (default), `onaction`, `sign`, `full`, `param`',
        ),
        ("OPEFO ablations", '`opefo_lambda=0.001` (static λ), `opefo_sides="increase_only"` / `"decrease_only"`'),
        (
            "OPEFO, whole AdamW step balanced (ours)",
            '`entropy_flow_estimate="param"`, `opefo_balance="step"`: λ also offsets what Adam\'s momentum carries',
        ),
    )
    #: Optimizer steps over which the regime guard averages |lambda*|.
    REGIME_WINDOW = 20
    #: The regime guard also warns once when a rollout's mean token entropy exceeds this multiple of the first
    #: rollout's: on the demo's digit-sum task healthy OPEFO runs peaked at 1.14x their start, and a run on its way to
    #: a uniform policy (reward 0) crossed 1.2x two steps before it died, with |lambda*| averaging only 0.04.
    ENTROPY_RISE_WARN = 1.2

    def __init__(self, settings: Settings | None = None, *, flow_estimate: str = "opefo", **values) -> None:
        super().__init__(settings, **values)
        self.flow_estimate = flow_estimate  # for the regime guard's advice
        self._recent_lambdas: deque[float] = deque(maxlen=self.REGIME_WINDOW)
        self._rollout_metrics: dict[str, float] = {}
        self._first_entropy: float | None = None
        self._pending_warnings: list[str] = []
        self._warned: set[str] = set()
        self._warned_one_sided = False
        self._warned_unbalanced = False

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Strictly on-policy unless ``allow_off_policy``; the step balance needs the `param` estimate with the Adam
        preconditioner, no KL term or entropy bonus, and one optimizer step per rollout batch."""
        step = args.opefo_balance == "step"
        if step and (args.entropy_flow_estimate != "param" or args.entropy_flow_preconditioner != "adam"):
            raise ValueError(
                "opefo_balance='step' offsets what Adam's momentum carries into the step, which only the 'param' "
                f"estimate with the 'adam' preconditioner measures; got entropy_flow_estimate="
                f"{args.entropy_flow_estimate!r}, entropy_flow_preconditioner={args.entropy_flow_preconditioner!r}. "
                "Set entropy_flow_estimate='param' and entropy_flow_preconditioner='adam', or opefo_balance='batch'."
            )
        if step and (args.beta != 0 or args.entropy_coef != 0):
            raise ValueError(
                f"opefo_balance='step' zeroes the first-order entropy change of the policy-gradient step, but the "
                f"loss also has a KL term (beta={args.beta}) or an entropy bonus (entropy_coef={args.entropy_coef}) "
                "whose gradients move the entropy outside the balance. Set beta=0 and entropy_coef=0 (the paper's "
                "setup), or use opefo_balance='batch'."
            )
        reasons = off_policy_reasons(args)
        if reasons and step:
            raise ValueError(
                f"opefo_balance='step' offsets the momentum of the one optimizer step its rollout batch is used for, "
                f"but this configuration has {' and '.join(reasons)}; allow_off_policy does not extend to it. Set "
                "num_iterations=1 and leave steps_per_generation unset, or use opefo_balance='batch'."
            )
        if reasons and not args.allow_off_policy:
            if _options_are_fields(args):  # refused while it is built (also by opefo-train): the fix is an argument
                grpo_fix = "`OPEFOConfig(..., method='grpo')` (opefo-train: --method grpo)"
                off_policy_fix = "`OPEFOConfig(..., allow_off_policy=True)` (opefo-train: --allow_off_policy true)"
            else:  # given the OPEFO options by OPEFOTrainer, which keeps the attributes set on the object
                grpo_fix = f'set `args.method = "grpo"` on this {type(args).__name__} before passing it'
                off_policy_fix = "set `args.allow_off_policy = True` on it"
            raise ValueError(
                f"method={args.method!r} is strictly on-policy: lambda* is computed over one rollout batch and applied "
                f"in exactly one optimizer step, but this configuration has {' and '.join(reasons)}. Fix: set "
                "num_iterations=1 and leave steps_per_generation unset (it then equals gradient_accumulation_steps); "
                f"or, for plain GRPO, {grpo_fix}; or, to run {args.method} off-policy deliberately, {off_policy_fix}."
            )

    @classmethod
    def from_config(cls, config) -> OPEFO:
        return cls(cls.settings_from(config), flow_estimate=config.entropy_flow_estimate)

    @property
    def needs_step_model(self) -> bool:
        return self.settings.opefo_balance == "step"

    def weight_signs(self, batch: TokenBatch) -> torch.Tensor:
        return weight_signs(_flow(batch), self.settings.opefo_sides)

    def rollout_weights(self, batch: TokenBatch, reduce_sum: ReduceSum = _identity) -> torch.Tensor:
        flow = _flow(batch)
        stats = FlowStats.from_tensor(reduce_sum(flow_stats(flow, batch.factor).to_tensor()))
        self._warn_if_one_sided(stats)
        metrics = {"opefo/lambda": float(stats.lambda_star)}
        if self.settings.opefo_lambda is not None:
            lam = float(self.settings.opefo_lambda)
        elif self.needs_step_model:
            if batch.step_change is None:
                raise ValueError("opefo_balance='step' needs the step model (TokenBatch.step_change).")
            balance = solve_step_balance(batch.step_change)
            lam = balance.lam
            metrics.update({"opefo/step_change": balance.residual, "opefo/step_change_unweighted": balance.unweighted})
            if not balance.bracketed and not self._warned_unbalanced:
                self._warned_unbalanced = True
                warnings.warn(
                    "opefo_balance='step': no lambda in [-1, 1] zeroes the first-order entropy change of this step "
                    f"(without reweighting {balance.unweighted:.3g}; at lambda={lam:g} still {balance.residual:.3g}): "
                    "reweighting this batch's sets cannot offset what the optimizer's moments carry. lambda is set to "
                    "the end point with the smaller change (warned once; opefo/step_change logs what remains).",
                    stacklevel=2,
                )
        else:
            lam = float(stats.lambda_star)
        weights = token_weights(flow, lam, self.settings.opefo_sides)
        weighted = FlowStats.from_tensor(reduce_sum(flow_stats(flow * weights, batch.factor).to_tensor()))
        self._recent_lambdas.append(abs(float(stats.lambda_star)))
        in_loss = batch.in_loss.double()
        entropy = reduce_sum(torch.stack([(batch.entropies.double() * in_loss).sum(), in_loss.sum()]))
        self._watch_regime(float(entropy[0] / entropy[1].clamp(min=1)))
        self._rollout_metrics = {**metrics, "opefo/lambda_applied": lam, "opefo/weighted_net": float(weighted.net)}
        return weights

    def _warn_if_one_sided(self, stats: FlowStats) -> None:
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
            "moves entropy the same way (e.g. a batch of mostly EOS or forced tokens). Warned once; opefo/lambda logs "
            "lambda* every step.",
            stacklevel=2,
        )

    def on_optimizer_step(self, reduce_sum: ReduceSum = _identity) -> None:
        # Logged on every optimizer step, also when one rollout batch serves several (off-policy opt-in).
        self.metrics = dict(self._rollout_metrics)

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

    def _watch_regime(self, entropy: float) -> None:
        """Queue each of the guard's two warnings once: |lambda*| large on average, or entropy far above its start."""
        if self._first_entropy is None:
            self._first_entropy = entropy
        window = len(self._recent_lambdas)
        mean = sum(self._recent_lambdas) / max(window, 1)
        if "lambda" not in self._warned and window == self.REGIME_WINDOW and mean > self.settings.opefo_lambda_warn:
            self._warned.add("lambda")
            self._pending_warnings.append(
                f"{REGIME_GUARD}|lambda*| averaged over the last {self.REGIME_WINDOW} optimizer steps is {mean:.3g} "
                f"(> opefo_lambda_warn={self.settings.opefo_lambda_warn:g}); in the OPEFO paper lambda* stays around "
                f"2.5e-4..1.75e-3, while balancing these batches takes token weights of 1 +/- {mean:.2f}, which can "
                f"fight the learning signal instead of gently correcting it. {self._advice()} docs/algorithm.md ('The "
                "regime') explains when OPEFO applies."
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


# --------------------------------------------------------------------------------------------------------------------
# Positive-Advantage Reweighting (docs/algorithm.md section 5)
# --------------------------------------------------------------------------------------------------------------------


@register_token_method("par")
class PAR(TokenMethod):
    """Positive-Advantage Reweighting: tokens with A_t > 0 are weighted by c in [0, 1], the rest by 1.

    With ``par_coef=None`` an entropy-guided controller sets c once per optimizer step from the global mean token
    entropy H of that step (over the tokens in the loss): c <- clip(c - step, 0, 1) if H < target, else
    clip(c + step, 0, 1).
    """

    @dataclass
    class Settings:
        """Options of ``method="par"``."""

        par_coef: float | None = setting(
            None, "PAR: constant weight in [0, 1] of positive-advantage tokens; None for the entropy-guided controller."
        )
        par_coef_init: float = setting(0.0, "PAR controller: initial coefficient in [0, 1].")
        par_entropy_target: float = setting(0.2, "PAR controller: target mean token entropy of an optimizer step.")
        par_coef_step: float = setting(0.05, "PAR controller: change of the coefficient per optimizer step.")

        def __post_init__(self):
            for name in ("par_coef", "par_coef_init"):
                value = getattr(self, name)
                if value is not None and not 0.0 <= value <= 1.0:
                    raise ValueError(f"{name} must lie in [0, 1]; got {value}.")
            if not self.par_coef_step > 0:
                raise ValueError(f"par_coef_step must be > 0; got {self.par_coef_step}.")

    settings: Settings
    table_rows = (("PAR", '`method="par"` (entropy-guided coefficient, state saved in checkpoints) or `par_coef=c`'),)

    def __init__(self, settings: Settings | None = None, **values) -> None:
        super().__init__(settings, **values)
        self.adaptive = self.settings.par_coef is None
        self.coef = self.settings.par_coef_init if self.settings.par_coef is None else self.settings.par_coef
        self._entropy_sums: torch.Tensor | None = None  # this step's sum of H over tokens in the loss, and count

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        in_loss = batch.in_loss.float()
        sums = torch.stack([(batch.entropies.float() * in_loss).sum(), in_loss.sum()]).double()
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
            delta = (
                -self.settings.par_coef_step
                if entropy < self.settings.par_entropy_target
                else self.settings.par_coef_step
            )
            self.coef = min(1.0, max(0.0, self.coef + delta))

    def state_dict(self) -> dict:
        return {"coef": self.coef, "adaptive": self.adaptive}

    def load_state_dict(self, state: dict) -> None:
        # Only the controller's coefficient is state; a constant par_coef is configuration and the new run's wins.
        if self.adaptive and state.get("adaptive", True):
            self.coef = float(state["coef"])


# --------------------------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (docs/algorithm.md section 6)
# --------------------------------------------------------------------------------------------------------------------


def _count(fraction: float, n_valid: torch.Tensor) -> int:
    return max(1, int(fraction * int(n_valid)))


@register_token_method("clip_cov")
class ClipCov(TokenMethod):
    """Clip-Cov: drop the gradient of a few random tokens whose covariance score lies in (lb, ub).

    ``max(1, int(ratio * n))`` tokens (n: tokens in the loss) are picked uniformly among the tokens in the loss that
    PPO's clip has not already removed, with lb < cov_t < ub (all of them if fewer qualify); their loss weight is 0.
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
    table_rows = (("Clip-Cov", '`method="clip_cov"` ({defaults})'),)

    def __init__(
        self, settings: Settings | None = None, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2, **values
    ) -> None:
        super().__init__(settings, **values)
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high

    @classmethod
    def from_config(cls, config) -> ClipCov:
        # TRL leaves epsilon_high None to mean "same as epsilon".
        epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
        return cls(cls.settings_from(config), epsilon_low=config.epsilon, epsilon_high=epsilon_high)

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
            count = _count(self.settings.clip_cov_ratio, in_loss.sum())
            keep = index[torch.randperm(index.numel(), device=index.device)[:count]]
            chosen.view(-1)[keep] = True
        return chosen

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        dropped = self.select(batch)
        counts = reduce_sum(torch.stack([dropped.sum(), batch.in_loss.sum()]).double())
        self.metrics = {"clip_cov/dropped_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(weights=(~dropped).float())


#: An epsilon this large makes TRL's clip range [1 - eps, 1 + eps] contain every ratio: no clipping.
KL_COV_NO_CLIP = 1e9


@register_token_method("kl_cov")
class KLCov(TokenMethod):
    """KL-Cov: add ``coef * |log r_t|`` to the loss of the top-k tokens by covariance score.

    k = max(1, int(ratio * n)). Under strict on-policy training log r = 0 and |x| has zero gradient at 0, so KL-Cov
    is plain GRPO there; the published baselines take 8 updates per rollout batch.
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
    table_rows = (("KL-Cov", '`method="kl_cov"` ({defaults}; inert on-policy, warned)'),)

    @classmethod
    def check_config(cls, args: Any) -> None:
        """Runs anywhere; warns where it cannot be the published KL-Cov (on-policy: inert; PPO's clip: kept)."""
        if not off_policy_reasons(args):
            warnings.warn(
                "method='kl_cov' in a strict on-policy configuration is inert: log r = 0 (up to sampler noise with "
                "vLLM), so the |log r| penalty has no gradient and training is plain GRPO. The published KL-Cov "
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
        k = min(_count(self.settings.kl_cov_ratio, in_loss.sum()), int(in_loss.sum()))
        chosen = torch.zeros_like(in_loss)
        if k > 0:
            chosen.view(-1)[cov.topk(k).indices] = True
        return chosen

    def micro_batch_terms(self, batch, logps, reduce_sum=_identity) -> TokenTerms:
        chosen = self.select(batch)
        old = batch.logps if batch.old_logps is None else batch.old_logps
        penalty = self.settings.kl_cov_coef * (logps - old).abs() * chosen
        counts = reduce_sum(torch.stack([chosen.sum(), batch.in_loss.sum()]).double())
        self.metrics = {"kl_cov/penalised_frac": float(counts[0] / counts[1].clamp(min=1))}
        return TokenTerms(extra_loss=penalty)


#: The built-in methods, in registration order: every class registered above.
BUILTIN_METHODS: tuple[type[TokenMethod], ...] = tuple(TOKEN_METHODS.values())
#: The settings dataclasses of the built-in methods that have options (``OPEFOConfig`` inherits them).
BUILTIN_METHOD_SETTINGS: tuple[type, ...] = tuple(m.Settings for m in BUILTIN_METHODS if dataclasses.fields(m.Settings))
# The settings' names of earlier releases.
OPEFOSettings = OPEFO.Settings
PARSettings = PAR.Settings
ClipCovSettings = ClipCov.Settings
KLCovSettings = KLCov.Settings


def _defaults(settings: type) -> str:
    values = ((f.name, f.default) for f in dataclasses.fields(settings))
    return ", ".join(
        f"`{name}={value:g}`" if isinstance(value, float) else f"`{name}={value!r}`" for name, value in values
    )


def methods_table(methods: Iterable[type[TokenMethod]] | None = None) -> str:
    """The methods table (markdown): every row of each method's ``table_rows``; a method without rows of its own gets
    one naming it and its settings' defaults. Default: every registered method, ``DEFAULT_METHOD`` first.

    >>> print(methods_table([PAR]))
    | method | configuration |
    |---|---|
    | PAR | `method="par"` (entropy-guided coefficient, state saved in checkpoints) or `par_coef=c` |
    """
    if methods is None:
        methods = sorted(TOKEN_METHODS.values(), key=lambda m: m.name != DEFAULT_METHOD)  # stable: registry order
    lines = ["| method | configuration |", "|---|---|"]
    for method in methods:
        defaults = _defaults(method.Settings)
        rows = vars(method).get("table_rows") or (
            (method.__name__, f'`method="{method.name}"`' + (" ({defaults})" if defaults else "")),
        )
        lines += [f"| {what} | {how.replace('{defaults}', defaults)} |" for what, how in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # the README's methods table
    print(methods_table())
