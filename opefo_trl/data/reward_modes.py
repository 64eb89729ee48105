r"""The ``math_reward_mode`` option of ``opefo-train`` and ``opefo-eval``: which answers the math-verify reward pays.

Declared here once (default, help, validation) and used by both commands' option dataclasses and by
:mod:`opefo_trl.data.rewards`; this module needs no math-verify, so options parse without the ``math`` extra.

- ``equivalent`` (default): any final answer that math-verify finds equal to the gold answer is paid, an expression
  included: "The answer is 6 + 3." scores 1.0 against 9.
- ``strict``: only a final number, or an expression with no arithmetic left undone, is paid. An answer that still
  holds a computation on numbers (``6 + 3``, ``3 \times 9``, ``2^{10}``, ``54/2``, ``3 * 9 = 27``) scores 0 unless
  the gold answer is written the same way; so does restating the question's arithmetic as the answer. A completion
  that is nothing but a number or expression (``27``, ``$\frac{1}{2}$``) is read as its answer.

Example:
    >>> check_math_reward_mode("strict")
    >>> check_math_reward_mode("final")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: math_reward_mode='final' is not a mode of the math reward; give 'equivalent' (...) or 'strict' (...).
"""

from dataclasses import field
from typing import Any, Literal, get_args

MathRewardMode = Literal["equivalent", "strict"]
MATH_REWARD_MODES: tuple[str, ...] = get_args(MathRewardMode)
DEFAULT_MATH_REWARD_MODE = "equivalent"
STRICT = "strict"

MATH_REWARD_MODE_HELP = (
    "Which answers math_accuracy_reward (and opefo-eval's scoring) pays: 'equivalent' any final answer math-verify "
    "finds equal to the gold, an expression included ('The answer is 6 + 3.' against 9 scores 1); 'strict' only a "
    "final number or an expression with no arithmetic on numbers left undone: '6 + 3', '3 * 9 = 27' or '2^{10}' "
    "against 9, 27 or 1024 score 0 (unless the gold is written that way), and a completion that is only a number "
    "('27') is read as its answer."
)


def math_reward_mode_field() -> Any:
    """The dataclass field of ``math_reward_mode`` (default and help), for each command's options."""
    return field(default=DEFAULT_MATH_REWARD_MODE, metadata={"help": MATH_REWARD_MODE_HELP})


def check_math_reward_mode(mode: str) -> None:
    """Refuse a ``math_reward_mode`` that is not one of :data:`MATH_REWARD_MODES`, saying what each mode does."""
    if mode not in MATH_REWARD_MODES:
        raise ValueError(
            f"math_reward_mode={mode!r} is not a mode of the math reward; give 'equivalent' (pay any answer "
            "math-verify finds equal to the gold) or 'strict' (pay only a final number or expression, never a "
            "restated computation such as '6 + 3')."
        )
