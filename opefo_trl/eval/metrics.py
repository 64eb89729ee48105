"""Scoring sampled completions and summarising them: per-problem rows, avg@n, maj@n, pass@k, averages, a table."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opefo_trl.data.reward_modes import DEFAULT_MATH_REWARD_MODE

from .benchmarks import Problem
from .pass_at_k import avg_at_n, majority_vote, mean_pass_at_k

logger = logging.getLogger(__name__)


def score_problem(
    problem: Problem, completions: Sequence[str], math_reward_mode: str = DEFAULT_MATH_REWARD_MODE
) -> dict[str, Any]:
    """Score one problem's completions: a per-problem row with extracted answers, scores, n, c and the vote, as
    ``math_accuracy_reward`` scores them in ``math_reward_mode`` (:mod:`opefo_trl.data.reward_modes`).

    Returns a row with ``scorable=False`` (and no correctness) when the gold answer cannot be parsed.

    Example:
        >>> row = score_problem(Problem(0, "1+1?", "2"), [r"\\boxed{2}", "Answer: 3", r"\\boxed{2}"])
        >>> row["n"], row["c"], row["answers"], row["majority_answer"], row["majority_correct"]
        (3, 2, ['2', '3', '2'], '2', True)
    """
    from opefo_trl.data.rewards import FAILED, verify_completion

    results = [verify_completion(text, problem.gold, math_reward_mode) for text in completions]
    scorable = all(r.gold_scorable for r in results)  # an unreadable gold answer is not 0 correct
    correct = [r.score == 1.0 for r in results]
    answers = [r.answer for r in results]
    majority_answer, majority_correct = majority_vote(answers, correct)
    return {
        "problem_id": problem.problem_id,
        "question": problem.question,
        "gold": problem.gold,
        "scorable": scorable,
        "n": len(results),
        "c": sum(correct) if scorable else None,
        "answers": answers,
        "scores": [r.score for r in results],
        "statuses": [r.status for r in results],
        "num_verification_failures": sum(r.status == FAILED for r in results),
        "majority_answer": majority_answer,
        "majority_correct": majority_correct if scorable else None,
    }


def compute_benchmark_metrics(rows: Sequence[dict], k_values: Sequence[int]) -> dict[str, Any]:
    """Benchmark metrics from per-problem rows (as :func:`score_problem` returns them).

    ``avg@n`` averages c/n over scorable problems, ``maj@n`` the majority-vote correctness, ``pass@k`` the unbiased
    estimator; unscorable problems are counted, not scored.

    Raises:
        ValueError: a ``k`` larger than some problem's ``n``.

    Example:
        >>> rows = [{"n": 4, "c": 1, "scorable": True, "majority_correct": False, "num_verification_failures": 0},
        ...         {"n": 4, "c": 4, "scorable": True, "majority_correct": True, "num_verification_failures": 0}]
        >>> m = compute_benchmark_metrics(rows, [1, 2])
        >>> m["avg@n"], m["maj@n"], round(m["pass@2"], 4)
        (0.625, 0.5, 0.75)
    """
    scored = [row for row in rows if row["scorable"]]
    metrics: dict[str, Any] = {
        "num_problems": len(rows),
        "num_unscorable_problems": len(rows) - len(scored),
        "n": max((row["n"] for row in rows), default=0),
        "num_verification_failures": sum(row["num_verification_failures"] for row in rows),
    }
    if not scored:
        logger.warning("No problem could be scored (all gold answers unparseable).")
        return metrics
    num_samples, num_correct = [row["n"] for row in scored], [row["c"] for row in scored]
    metrics["avg@n"] = avg_at_n(num_samples, num_correct)
    metrics["maj@n"] = sum(bool(row["majority_correct"]) for row in scored) / len(scored)
    for k in k_values:
        metrics[f"pass@{k}"] = mean_pass_at_k(num_samples, num_correct, k)
    return metrics


AVERAGED_METRICS_PREFIXES = ("avg@n", "maj@n", "pass@")


def average_over_benchmarks(metrics_by_benchmark: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Mean of every score metric that all benchmarks have (the paper's "average" column)."""
    if not metrics_by_benchmark:
        return {}
    names = [
        key
        for key in next(iter(metrics_by_benchmark.values()))
        if key.startswith(AVERAGED_METRICS_PREFIXES) and all(key in m for m in metrics_by_benchmark.values())
    ]
    return {key: sum(m[key] for m in metrics_by_benchmark.values()) / len(metrics_by_benchmark) for key in names}


def format_markdown_table(metrics_by_benchmark: dict[str, dict[str, Any]], average: dict[str, float]) -> str:
    """A markdown table: one row per benchmark plus ``average``; scores in percent.

    Example:
        >>> print(format_markdown_table({"b": {"num_problems": 2, "n": 4, "avg@n": 0.5, "maj@n": 1.0, "pass@1": 0.5}},
        ...                             {"avg@n": 0.5, "maj@n": 1.0, "pass@1": 0.5}))
        | benchmark | problems | n | avg@n | maj@n | pass@1 |
        |---|---|---|---|---|---|
        | b | 2 | 4 | 50.0 | 100.0 | 50.0 |
        | average |  |  | 50.0 | 100.0 | 50.0 |
    """
    score_columns = ["avg@n", "maj@n"]
    ks = sorted(
        {int(key[5:]) for m in metrics_by_benchmark.values() for key in m if key.startswith("pass@")},
    )
    score_columns += [f"pass@{k}" for k in ks]
    header = ["benchmark", "problems", "n"] + score_columns
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(metrics, key):
        return f"{100 * metrics[key]:.1f}" if key in metrics else "-"

    for name, metrics in metrics_by_benchmark.items():
        row = [name, str(metrics.get("num_problems", "")), str(metrics.get("n", ""))]
        lines.append("| " + " | ".join(row + [cell(metrics, key) for key in score_columns]) + " |")
    if len(metrics_by_benchmark) > 0:
        lines.append("| " + " | ".join(["average", "", ""] + [cell(average, key) for key in score_columns]) + " |")
    return "\n".join(lines)
