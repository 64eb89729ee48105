"""Token-level methods: how each method of the paper's comparison weights or penalises a batch's tokens.

Pure torch, no TRL import: a method only sees tensors (``TokenBatch``) and what the trainer offers its hooks
(``MethodContext``); ``opefo_trl.trainer`` is the only glue. One method is one file of this package, its class
registered by name; the protocol is in ``base`` (its docstring lists the hooks). Every list of methods (the
``method`` option's help and choices, ``OPEFOConfig``'s fields, ``opefo-train --help``, the README's methods table,
the demo's runs) is made from the registry.

Add a method by subclassing ``TokenMethod`` and decorating it with ``@register_token_method("name")`` (CONTRIBUTING.md
has the checklist). A built-in method is such a file here, imported below.

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
from collections.abc import Iterable

from opefo_trl.methods.base import (
    SINGLE_PROCESS,
    TOKEN_METHODS,
    MethodContext,
    RolloutWeights,
    StepChange,
    TokenBatch,
    TokenMethod,
    TokenTerms,
    build_token_method,
    decide_rollout_weights,
    get_token_method_class,
    off_policy_reasons,
    register_token_method,
    setting,
)

# The built-in methods, registered in this order (the order of the methods table and of OPEFOConfig's bases).
# isort: off
from opefo_trl.methods.grpo import GRPO
from opefo_trl.methods.opefo import OPEFO
from opefo_trl.methods.opefo_regime import REGIME_GUARD
from opefo_trl.methods.par import PAR
from opefo_trl.methods.clip_cov import ClipCov, covariance_scores
from opefo_trl.methods.kl_cov import KLCov
from opefo_trl.methods.steer import STEER
from opefo_trl.methods.stare import STARE
from opefo_trl.methods.ce_gppo import CEGPPO
# isort: on

#: ``OPEFOConfig``'s default ``method``, first in the methods table.
DEFAULT_METHOD = "opefo"
#: The built-in methods, in registration order.
BUILTIN_METHODS: tuple[type[TokenMethod], ...] = tuple(TOKEN_METHODS.values())


def settings_classes(methods: Iterable[type[TokenMethod]]) -> tuple[type, ...]:
    """The settings dataclasses of ``methods`` that have options, in order: what a config class inherits to have
    their options as fields (``OPEFOConfig`` those of ``BUILTIN_METHODS``, ``opefo_trl.trainer.config.config_class``
    those of any method)."""
    return tuple(dict.fromkeys(m.Settings for m in methods if dataclasses.fields(m.Settings)))


def method_choices(methods: Iterable[type[TokenMethod]] | None = None) -> str:
    """The methods and what each does, for help texts: ``'opefo' (entropy-flow balancing, the default), ...``.

    >>> method_choices([PAR])
    "'par' (positive-advantage reweighting)"
    """
    methods = _ordered(TOKEN_METHODS.values() if methods is None else methods)
    return ", ".join(f"{m.name!r}" + (f" ({m.summary})" if m.summary else "") for m in methods)


def _ordered(methods: Iterable[type[TokenMethod]]) -> list[type[TokenMethod]]:
    return sorted(methods, key=lambda m: m.name != DEFAULT_METHOD)  # stable: registry order, the default first


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
    lines = ["| method | configuration |", "|---|---|"]
    for method in _ordered(TOKEN_METHODS.values()) if methods is None else methods:
        defaults = _defaults(method.Settings)
        rows = vars(method).get("table_rows") or (
            (method.__name__, f'`method="{method.name}"`' + (" ({defaults})" if defaults else "")),
        )
        lines += [f"| {what} | {how.replace('{defaults}', defaults)} |" for what, how in rows]
    return "\n".join(lines)


__all__ = [
    "BUILTIN_METHODS",
    "CEGPPO",
    "DEFAULT_METHOD",
    "GRPO",
    "OPEFO",
    "PAR",
    "REGIME_GUARD",
    "STARE",
    "STEER",
    "SINGLE_PROCESS",
    "TOKEN_METHODS",
    "ClipCov",
    "KLCov",
    "MethodContext",
    "RolloutWeights",
    "StepChange",
    "TokenBatch",
    "TokenMethod",
    "TokenTerms",
    "build_token_method",
    "covariance_scores",
    "decide_rollout_weights",
    "get_token_method_class",
    "method_choices",
    "methods_table",
    "off_policy_reasons",
    "register_token_method",
    "setting",
    "settings_classes",
]
