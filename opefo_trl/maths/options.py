"""What the methods' options share: a settings field with its help, and the test of strict on-policy training.

Pure Python, in the lowest layer, so that the options of `method="opefo"` declared outside `opefo_trl.methods` (the
step balance's, `opefo_trl.experimental.opefo_step`) need nothing of that package (`opefo_trl.methods.base` gives
both to the methods).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default, help: str):
    """A settings field: its default and the ``help`` text TRL's parsers print (``--help``, recipes)."""
    return field(default=default, metadata={"help": help})


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
