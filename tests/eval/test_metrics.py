"""opefo_trl.eval.metrics: per-problem rows and benchmark metrics from hand-written samples."""

import numpy as np
import pytest

from opefo_trl.data.rewards import extract_answer
from opefo_trl.eval import Problem, average_over_benchmarks, compute_benchmark_metrics, score_problem
from opefo_trl.eval.pass_at_k import pass_at_k


def test_score_problem_and_metrics_from_hand_written_samples():
    rows = [
        score_problem(Problem(0, "q0", "42"), [r"\boxed{42}", "Answer: 42", "Answer: 41", "nothing"]),  # c = 2
        score_problem(Problem(1, "q1", r"\frac{1}{2}"), ["Answer: 0.3", "Answer: 0.3", r"\boxed{1/2}", "x"]),  # c = 1
        score_problem(Problem(2, "q2", "7"), ["Answer: 6"] * 4),  # c = 0
        score_problem(Problem(3, "q3", r"\frac{"), [r"\boxed{1}"] * 4),  # unparseable gold
    ]
    assert [row["c"] for row in rows] == [2, 1, 0, None]
    assert rows[0]["answers"] == ["42", "42", "41", None]
    assert (rows[0]["majority_answer"], rows[0]["majority_correct"]) == ("42", True)
    assert (rows[1]["majority_answer"], rows[1]["majority_correct"]) == (extract_answer("Answer: 0.3"), False)
    assert rows[3]["scorable"] is False

    metrics = compute_benchmark_metrics(rows, [1, 2, 4])
    assert metrics["num_problems"] == 4 and metrics["num_unscorable_problems"] == 1 and metrics["n"] == 4
    assert metrics["avg@n"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert metrics["maj@n"] == pytest.approx(1 / 3)
    for k in (1, 2, 4):
        expected = np.mean([pass_at_k(4, 2, k), pass_at_k(4, 1, k), pass_at_k(4, 0, k)])
        assert metrics[f"pass@{k}"] == pytest.approx(expected)
    assert metrics["pass@1"] == pytest.approx(metrics["avg@n"])
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        compute_benchmark_metrics(rows, [8])


def test_average_is_over_benchmarks_that_all_have_the_metric():
    average = average_over_benchmarks(
        {"a": {"avg@n": 0.2, "pass@4": 0.5, "n": 4}, "b": {"avg@n": 0.6, "n": 1}},
    )
    assert average == {"avg@n": pytest.approx(0.4)}


def test_a_gold_answer_that_fails_to_parse_makes_the_problem_unscorable_not_wrong(monkeypatch):
    from opefo_trl.data import rewards

    def broken_gold(gold_text):
        raise rewards.VerificationFailure("math-verify parsing timed out after 10 s")

    monkeypatch.setattr(rewards, "_parse_gold", broken_gold)
    row = score_problem(Problem(0, "1+1?", "2"), [r"\boxed{2}", r"\boxed{3}"])
    assert row["scorable"] is False and row["c"] is None
    assert row["num_verification_failures"] == 2
