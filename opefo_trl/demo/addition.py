"""A synthetic verifiable task with several correct answers per prompt, generated locally (no hub, no data files).

The task: *"Solve 17 = ? + ?"*, i.e. write 17 as a sum of two positive whole numbers. Any ``a + b`` with
``a, b >= 1`` and ``a + b == 17`` is correct, so a prompt with target ``t`` has ``t - 1`` correct answers. A policy
that has learned the task can keep spreading its probability over many correct answers (high token entropy on the
first addend) or collapse onto one of them: reward cannot tell the two apart, which is exactly the situation in
which on-policy RL's entropy collapse shows up (docs/algorithm.md section 7, "The regime").

The verifier is plain Python: the completion must be exactly ``"<a> + <b>"`` (surrounding whitespace allowed),
with both addends positive integers that sum to the target; anything else scores 0.

Example:
    >>> from opefo_trl.demo.addition import build_sum_dataset, correct_sum_reward
    >>> ds = build_sum_dataset(targets=[5, 6])
    >>> ds[0]["prompt"]
    [{'role': 'user', 'content': 'Solve 5 = ? + ?'}]
    >>> correct_sum_reward(["2 + 3", "4 + 4", "five"], target=[5, 5, 5])
    [1.0, 0.0, 0.0]
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opefo_trl.data.prompts import completion_to_text

PROMPT_TEMPLATE = "Solve {target} = ? + ?"
DEFAULT_MIN_TARGET = 6
DEFAULT_MAX_TARGET = 25

_SUM_RE = re.compile(r"(\d+)\s*\+\s*(\d+)")


def sum_prompt(target: int) -> list[dict[str, str]]:
    """The conversational prompt (one user message) asking to write ``target`` as a sum of two positive numbers.

    The prompt is short on purpose (about 11 tokens with the tiny arithmetic tokenizer): the demo's CPU budget is
    dominated by sequence length.
    """
    return [{"role": "user", "content": PROMPT_TEMPLATE.format(target=int(target))}]


def _check_targets(targets: Sequence[int]) -> list[int]:
    targets = [int(t) for t in targets]
    if not targets:
        raise ValueError("`targets` is empty: give at least one target number (e.g. range(6, 26)).")
    too_small = [t for t in targets if t < 2]
    if too_small:
        raise ValueError(f"Targets {too_small} cannot be written as a sum of two positive numbers; use targets >= 2.")
    return targets


def default_targets(min_target: int = DEFAULT_MIN_TARGET, max_target: int = DEFAULT_MAX_TARGET) -> list[int]:
    """``list(range(min_target, max_target + 1))`` after checking the range is usable."""
    if max_target < min_target:
        raise ValueError(f"max_target ({max_target}) must be >= min_target ({min_target}).")
    return _check_targets(range(min_target, max_target + 1))


def build_sum_dataset(targets: Sequence[int] | None = None):
    """A ``datasets.Dataset`` with TRL's conversational ``prompt`` column and the ``target`` the reward checks.

    One row per target; ``targets`` defaults to ``default_targets()`` (6..25, i.e. 5 to 24 correct answers each).
    """
    from datasets import Dataset

    targets = _check_targets(default_targets() if targets is None else targets)
    return Dataset.from_list([{"prompt": sum_prompt(t), "target": t} for t in targets])


def parse_sum(text: str) -> tuple[int, int] | None:
    """``(a, b)`` if ``text`` is exactly ``"<a> + <b>"`` (whitespace around the parts allowed), else ``None``.

    >>> parse_sum(" 12 + 5 "), parse_sum("12+5"), parse_sum("12 + 5 + 1"), parse_sum("x = 12 + 5")
    ((12, 5), (12, 5), None, None)
    """
    match = _SUM_RE.fullmatch(text.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def is_correct_sum(text: str, target: int) -> bool:
    """Whether ``text`` writes ``target`` as ``a + b`` with positive integers ``a`` and ``b``."""
    parsed = parse_sum(text)
    return parsed is not None and min(parsed) >= 1 and sum(parsed) == int(target)


def correct_sum_reward(completions: Sequence, target: Sequence[int], **kwargs) -> list[float]:
    """TRL reward function: 1.0 for a correct ``a + b`` decomposition of the row's ``target``, else 0.0.

    ``target`` comes from the dataset column of that name (TRL passes extra columns as keyword arguments).
    A missing or mismatched ``target`` column raises instead of silently scoring 0.
    """
    if target is None:
        raise ValueError("correct_sum_reward needs the dataset's `target` column; build data with build_sum_dataset().")
    if len(target) != len(completions):
        raise ValueError(f"Got {len(completions)} completions but {len(target)} targets; they must match one to one.")
    return [float(is_correct_sum(completion_to_text(c), t)) for c, t in zip(completions, target, strict=True)]


@dataclass(frozen=True)
class SumExample:
    """One supervised warm-start example: the prompt's target and the answer text (correct or not)."""

    target: int
    answer: str
    correct: bool


def sample_warm_start_examples(
    num_examples: int,
    targets: Iterable[int] | None = None,
    wrong_fraction: float = 0.5,
    max_error: int = 3,
    seed: int = 0,
) -> list[SumExample]:
    """Supervised examples for a warm start that leaves the policy neither hopeless nor solved.

    The first addend ``a`` is uniform over ``1..t-1`` (every correct answer equally likely: high entropy), and with
    probability ``wrong_fraction`` the second addend is off by ``1..max_error`` (kept positive), so that a model
    fitted to these examples answers correctly only part of the time.

    >>> ex = sample_warm_start_examples(4, targets=[10], wrong_fraction=0.0, seed=1)
    >>> all(e.correct and is_correct_sum(e.answer, 10) for e in ex)
    True
    """
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ValueError(f"wrong_fraction must be in [0, 1], got {wrong_fraction}.")
    if max_error < 1:
        raise ValueError(f"max_error must be >= 1, got {max_error}.")
    targets = _check_targets(default_targets() if targets is None else list(targets))
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        t = rng.choice(targets)
        a = rng.randint(1, t - 1)
        b = t - a
        if rng.random() < wrong_fraction:
            errors = [e for e in range(-max_error, max_error + 1) if e != 0 and b + e >= 1]
            b += rng.choice(errors)
        examples.append(SumExample(target=t, answer=f"{a} + {b}", correct=(a + b == t)))
    return examples
