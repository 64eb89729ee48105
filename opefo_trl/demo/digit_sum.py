"""A verifiable task whose GRPO entropy flow is balanced as in the paper: "Write 24 digits that add up to 110".

The answer should be ``num_digits`` decimal digits. Its score is ``1 - |sum of its digits - target| / tolerance``,
floored at 0 (1.0 for an exact sum; with the default tolerance of 30, 0.9 for a sum 3 off); characters other than
digits are ignored, and an answer with more than ``num_digits`` digits scores 0. Many answers are correct, and
reward cannot tell them apart.

Why GRPO on this task is in the entropy-flow regime of the OPEFO paper (lambda* = net / gross first-order entropy
flow of a batch of a few hundredths, not ~0.7 as on the two-addend task of ``opefo_trl.demo.addition``), while its
token entropy still falls:

* the reward rests on an aggregate of many low-stakes tokens: each of the 24 digits moves the sum a little, and no
  single token decides the score. A narrower digit distribution misses the target by less, so GRPO keeps sharpening
  the policy and the entropy falls, but whether one completion beats another depends mostly on which digits it drew,
  hardly on how likely they were; so the tokens of a batch move entropy up and down in nearly equal measure;
* a stray token costs only the digit it replaces instead of zeroing the answer. A rare token that voids the whole
  answer is decisive: it is unlikely and strongly punished, which is an entropy-decreasing flow on its own (with a
  strict "exactly 24 digits" rule such tokens alone put |lambda*| at 0.05-0.1 early in training);
* the warm-start digit distribution is skewed by a fixed ranking unrelated to the digits' values
  (``DIGIT_RANKING``), so the policy starts broad (about 2.2 nats per digit) and uneven, with likely and unlikely
  digits on both sides of the mean.

Generation should stop after ``num_digits`` tokens (``max_completion_length = num_digits``: every digit is one token
of the arithmetic tokenizer of ``opefo_trl.testing``), so the model never has to count digits to end its answer.

Example:
    >>> from opefo_trl.demo.digit_sum import build_digit_sum_dataset, digit_sum_reward
    >>> ds = build_digit_sum_dataset(targets=[10, 12], num_digits=4)
    >>> ds[0]["prompt"]
    [{'role': 'user', 'content': 'Write 4 digits that add up to 10'}]
    >>> digit_sum_reward(["1234", "1243", "1 2 3 9", "12345"], target=[10, 10, 10, 10], num_digits=[4, 4, 4, 4])
    [1.0, 1.0, 0.8333333333333334, 0.0]
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from opefo_trl.data.prompts import completion_to_text

PROMPT_TEMPLATE = "Write {num_digits} digits that add up to {target}"
DEFAULT_NUM_DIGITS = 24
DEFAULT_TOLERANCE = 30.0
#: Popularity rank of each digit in the warm start (7 most likely, 6 least): unrelated to the digits' values, so that
#: likely and unlikely digits lie on both sides of the mean.
DIGIT_RANKING = (7, 2, 9, 4, 0, 5, 1, 8, 3, 6)
#: Exponent of the warm start's Zipf-like skew: the digit of rank r (0-based) has weight 1 / (r + 1) ** skew.
DEFAULT_SKEW = 0.5

_DIGITS_RE = re.compile(r"[0-9]")


def digit_weights(skew: float = DEFAULT_SKEW) -> list[float]:
    """Normalised warm-start probability of each digit 0..9 (index = digit), skewed by ``DIGIT_RANKING``.

    >>> w = digit_weights(1.0)
    >>> round(sum(w), 6), max(range(10), key=w.__getitem__), min(range(10), key=w.__getitem__)
    (1.0, 7, 6)
    """
    if not skew >= 0:
        raise ValueError(f"skew must be >= 0 (0 = uniform digits), got {skew}.")
    raw = [1.0 / (DIGIT_RANKING.index(d) + 1) ** skew for d in range(10)]
    total = sum(raw)
    return [w / total for w in raw]


def _check_num_digits(num_digits: int) -> int:
    if int(num_digits) != num_digits or num_digits < 1:
        raise ValueError(f"num_digits must be a positive whole number, got {num_digits!r}.")
    return int(num_digits)


def _check_targets(targets: Sequence[int], num_digits: int) -> list[int]:
    targets = [int(t) for t in targets]
    if not targets:
        raise ValueError("`targets` is empty: give at least one target sum (see default_targets()).")
    impossible = [t for t in targets if not 0 <= t <= 9 * num_digits]
    if impossible:
        raise ValueError(f"Targets {impossible} cannot be the sum of {num_digits} digits; use 0..{9 * num_digits}.")
    return targets


def default_targets(num_digits: int = DEFAULT_NUM_DIGITS, skew: float = DEFAULT_SKEW) -> list[int]:
    """Every whole target within one standard deviation of the warm start's expected digit sum.

    The warm start's digit sum has mean ``num_digits * m`` and standard deviation ``sqrt(num_digits) * s`` (``m``,
    ``s``: mean and standard deviation of one digit under ``digit_weights(skew)``), so these targets are all reachable
    by the warm-started policy without a large shift of its digit distribution.

    >>> default_targets(24)[0], default_targets(24)[-1], len(default_targets(24))
    (99, 128, 30)
    """
    num_digits = _check_num_digits(num_digits)
    weights = digit_weights(skew)
    mean = sum(d * w for d, w in enumerate(weights))
    std = sum((d - mean) ** 2 * w for d, w in enumerate(weights)) ** 0.5
    centre, spread = num_digits * mean, num_digits**0.5 * std
    low, high = max(0, round(centre - spread)), min(9 * num_digits, round(centre + spread))
    return list(range(low, high + 1))


def digit_sum_prompt(target: int, num_digits: int = DEFAULT_NUM_DIGITS) -> list[dict[str, str]]:
    """The conversational prompt (one user message) of one task instance."""
    return [{"role": "user", "content": PROMPT_TEMPLATE.format(num_digits=int(num_digits), target=int(target))}]


def build_digit_sum_dataset(
    targets: Sequence[int] | None = None,
    num_digits: int = DEFAULT_NUM_DIGITS,
    tolerance: float = DEFAULT_TOLERANCE,
):
    """A ``datasets.Dataset`` with TRL's conversational ``prompt`` column and the columns the reward reads.

    One row per target (``targets`` defaults to ``default_targets(num_digits)``), with columns ``prompt``, ``target``,
    ``num_digits`` and ``tolerance``: TRL passes the extra columns to ``digit_sum_reward`` as keyword arguments.
    Give at least as many targets as prompts per step: TRL's sampler draws distinct rows within a step.
    """
    from datasets import Dataset

    num_digits = _check_num_digits(num_digits)
    targets = _check_targets(default_targets(num_digits) if targets is None else targets, num_digits)
    _check_tolerance(tolerance)
    return Dataset.from_list(
        [
            {"prompt": digit_sum_prompt(t, num_digits), "target": t, "num_digits": num_digits, "tolerance": tolerance}
            for t in targets
        ]
    )


def _check_tolerance(tolerance: float) -> float:
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0 (the sum error at which the score reaches 0), got {tolerance!r}.")
    return float(tolerance)


def answer_digits(text: str) -> list[int]:
    """The ASCII digits of ``text`` in order; every other character (spaces, stray symbols) is ignored.

    >>> answer_digits(" 09 1x2 "), answer_digits("no digits")
    ([0, 9, 1, 2], [])
    """
    return [int(c) for c in _DIGITS_RE.findall(text)]


def digit_sum_score(text: str, target: int, num_digits: int, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """``max(0, 1 - |sum of the answer's digits - target| / tolerance)``; 0.0 for more than ``num_digits`` digits.

    Characters other than digits are ignored, so a stray token costs what its missing digit costs (the sum is off by
    that digit), not the whole answer: the score stays graded by the sum alone.

    >>> digit_sum_score("5555", 20, 4, tolerance=10), digit_sum_score("5556", 20, 4, tolerance=10)
    (1.0, 0.9)
    >>> digit_sum_score("55 5x", 20, 4, tolerance=10), digit_sum_score("9999", 20, 4, tolerance=10)
    (0.5, 0.0)
    >>> digit_sum_score("55555", 25, 4)
    0.0
    """
    digits = answer_digits(text)
    if len(digits) > num_digits:
        return 0.0
    return max(0.0, 1.0 - abs(sum(digits) - int(target)) / tolerance)


def digit_sum_reward(completions: Sequence, target=None, num_digits=None, tolerance=None, **kwargs) -> list[float]:
    """TRL reward function: ``digit_sum_score`` of each completion against its row's ``target``.

    ``target`` and ``num_digits`` come from the dataset columns of those names (``build_digit_sum_dataset``), and
    ``tolerance`` from its column when present (else ``DEFAULT_TOLERANCE``). A missing or mismatched column raises
    instead of silently scoring 0.
    """
    missing = [name for name, value in (("target", target), ("num_digits", num_digits)) if value is None]
    if missing:
        raise ValueError(
            f"digit_sum_reward needs the dataset column(s) {missing}; build the data with build_digit_sum_dataset()."
        )
    if tolerance is None:
        tolerance = [DEFAULT_TOLERANCE] * len(completions)
    for name, column in (("target", target), ("num_digits", num_digits), ("tolerance", tolerance)):
        if len(column) != len(completions):
            raise ValueError(
                f"Got {len(completions)} completions but {len(column)} values of `{name}`; they must match one to one."
            )
    return [
        digit_sum_score(completion_to_text(c), t, _check_num_digits(k), _check_tolerance(tol))
        for c, t, k, tol in zip(completions, target, num_digits, tolerance, strict=True)
    ]


@dataclass(frozen=True)
class DigitSumExample:
    """One supervised warm-start example: the prompt's target and an answer whose digits add up to it."""

    target: int
    answer: str


class _ConditionedDigitSampler:
    """Exact sampling of digits drawn independently from ``weights``, conditioned on their sum.

    ``ways[j][s]`` is the probability that j independent digits add up to s; drawing the digits one by one with
    probability proportional to ``weights[d] * ways[remaining digits][remaining sum - d]`` gives exactly the
    conditional distribution (no rejection, so even unlikely targets cost nothing).
    """

    def __init__(self, num_digits: int, weights: Sequence[float]):
        self.num_digits, self.weights = num_digits, list(weights)
        ways = [[1.0] + [0.0] * (9 * num_digits)]
        for _ in range(num_digits):
            previous = ways[-1]
            ways.append(
                [
                    sum(w * previous[s - d] for d, w in enumerate(self.weights) if s >= d)
                    for s in range(9 * num_digits + 1)
                ]
            )
        self.ways = ways

    def sample(self, target: int, rng: random.Random) -> list[int]:
        digits, remaining = [], target
        for left in range(self.num_digits, 0, -1):
            options = [d for d in range(10) if 0 <= remaining - d <= 9 * (left - 1)]
            chances = [self.weights[d] * self.ways[left - 1][remaining - d] for d in options]
            digit = rng.choices(options, weights=chances)[0]
            digits.append(digit)
            remaining -= digit
        return digits


def sample_warm_start_examples(
    num_examples: int,
    targets: Sequence[int] | None = None,
    num_digits: int = DEFAULT_NUM_DIGITS,
    skew: float = DEFAULT_SKEW,
    seed: int = 0,
) -> list[DigitSumExample]:
    """Supervised warm-start examples: correct answers whose digits follow the skewed ``digit_weights(skew)``.

    Each example picks a target uniformly from ``targets`` (default ``default_targets(num_digits, skew)``) and draws
    ``num_digits`` independent digits from ``digit_weights(skew)`` conditioned on adding up to it, so a model fitted to
    them starts RL with a broad, uneven digit distribution and a roughly right digit sum.

    >>> ex = sample_warm_start_examples(3, targets=[30], num_digits=6, seed=1)
    >>> [(e.target, len(e.answer), sum(map(int, e.answer))) for e in ex]
    [(30, 6, 30), (30, 6, 30), (30, 6, 30)]
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}.")
    num_digits = _check_num_digits(num_digits)
    targets = _check_targets(default_targets(num_digits, skew) if targets is None else targets, num_digits)
    sampler = _ConditionedDigitSampler(num_digits, digit_weights(skew))
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        target = rng.choice(targets)
        examples.append(DigitSumExample(target, "".join(map(str, sampler.sample(target, rng)))))
    return examples
