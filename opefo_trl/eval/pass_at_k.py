r"""Sampling-based accuracy estimators: unbiased pass@k, avg@n and majority vote (numpy only, no TRL).

With ``n`` samples of a problem of which ``c`` are correct, the unbiased estimator of pass@k (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k),

the probability that a random k-subset of the n samples holds at least one correct sample. It is computed in the
numerically stable product form ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials), and is 1 when
``n - c < k``. avg@n (mean accuracy over the n samples) is pass@1. Benchmark scores average over problems.

Example:
    >>> from opefo_trl.eval.pass_at_k import pass_at_k, mean_pass_at_k, avg_at_n, majority_vote
    >>> round(pass_at_k(n=4, c=1, k=2), 6)   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    >>> mean_pass_at_k([4, 4], [1, 0], k=2)
    0.25
    >>> avg_at_n([4, 2], [1, 2])             # (1/4 + 2/2) / 2
    0.625
    >>> majority_vote(["1/2", "3", "1/2", None], [True, False, True, False])
    ('1/2', True)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def _whole(value, name: str) -> int:
    """``value`` as an int; a fractional value (an accuracy passed for a count, say) is an error, not truncated."""
    if isinstance(value, bool) or float(value) != int(value):
        raise ValueError(f"{name} must be a whole number of samples, got {value!r}.")
    return int(value)


def _check_counts(n: int, c: int) -> None:
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample per problem, got n={n}.")
    if not 0 <= c <= n:
        raise ValueError(f"The number of correct samples must be between 0 and n={n}, got c={c}.")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct.

    Raises:
        ValueError: if ``k > n`` (pass@k needs at least k samples: sample more, or lower k), ``k < 1``, or ``c`` is
            not in ``[0, n]``.

    Example:
        >>> pass_at_k(10, 0, 5), pass_at_k(10, 10, 5), pass_at_k(10, 6, 5)
        (0.0, 1.0, 1.0)
        >>> round(pass_at_k(10, 1, 1), 6)
        0.1
    """
    n, c, k = _whole(n, "n"), _whole(c, "c"), _whole(k, "k")
    _check_counts(n, c)
    if k < 1:
        raise ValueError(f"k must be at least 1, got k={k}.")
    if k > n:
        raise ValueError(
            f"pass@{k} needs at least {k} samples per problem, but only n={n} were drawn: raise n or lower k."
        )
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> float:
    """pass@k averaged over problems (``num_samples[i]`` samples of problem i, ``num_correct[i]`` correct).

    Raises:
        ValueError: on mismatched lengths, no problems, or any problem with fewer than ``k`` samples.
    """
    samples, correct = _as_counts(num_samples, num_correct)
    return float(np.mean([pass_at_k(n, c, k) for n, c in zip(samples, correct, strict=True)]))


def avg_at_n(num_samples: Sequence[int], num_correct: Sequence[int]) -> float:
    """Mean over problems of the fraction of correct samples (avg@n, an unbiased estimate of pass@1)."""
    samples, correct = _as_counts(num_samples, num_correct)
    for n, c in zip(samples, correct, strict=True):
        _check_counts(int(n), int(c))
    return float(np.mean(correct / samples))


def _as_counts(num_samples, num_correct) -> tuple[np.ndarray, np.ndarray]:
    num_samples, num_correct = np.asarray(num_samples), np.asarray(num_correct)
    for name, values in (("num_samples", num_samples), ("num_correct", num_correct)):
        if values.size and not np.array_equal(values, np.round(values)):
            raise ValueError(f"{name} must hold whole numbers of samples (counts, not accuracies), got {values[:5]}.")
    num_samples, num_correct = num_samples.astype(np.int64), num_correct.astype(np.int64)
    if num_samples.shape != num_correct.shape or num_samples.ndim != 1:
        raise ValueError(
            f"num_samples and num_correct must be 1-D and of equal length, got shapes {num_samples.shape} and "
            f"{num_correct.shape}."
        )
    if num_samples.size == 0:
        raise ValueError("No problems to average over.")
    return num_samples, num_correct


def majority_vote(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> tuple[Hashable | None, bool]:
    """The most frequent extracted answer of one problem and whether it is correct.

    ``None`` answers (nothing extracted) do not vote; ties go to the answer seen first. With no answer at all the
    vote is ``(None, False)``. Answers should be canonical (see :func:`opefo_trl.data.rewards.extract_answer`) so that
    ``0.5`` and ``\\frac{1}{2}`` count as one answer; the vote is correct if any sample with that answer is.

    Example:
        >>> majority_vote(["4", "5", "5", "4"], [True, False, False, True])  # tie: first seen wins
        ('4', True)
        >>> majority_vote([None, None], [False, False])
        (None, False)
    """
    if len(answers) != len(correct):
        raise ValueError(f"Got {len(answers)} answers but {len(correct)} correctness flags.")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None, False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return winner, any(bool(ok) for a, ok in zip(answers, correct, strict=True) if a == winner)
