"""Unbiased pass@k against brute-force enumeration, avg@n, majority vote."""

import itertools

import numpy as np
import pytest

from opefo_trl.eval.pass_at_k import avg_at_n, majority_vote, mean_pass_at_k, pass_at_k


def _brute_force_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_over_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_edge_cases():
    assert pass_at_k(16, 0, 8) == 0.0  # c = 0
    assert pass_at_k(16, 16, 8) == 1.0  # c = n
    assert pass_at_k(16, 1, 16) == 1.0  # k = n with one correct
    assert pass_at_k(16, 0, 16) == 0.0  # k = n with none correct
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 = c / n


def test_large_n_is_stable():
    # C(1024, 512) overflows float64; the product form does not.
    value = pass_at_k(1024, 1, 512)
    assert value == pytest.approx(0.5)
    assert 0.0 <= pass_at_k(1024, 3, 64) <= 1.0


def test_k_greater_than_n_is_an_error():
    with pytest.raises(ValueError, match=r"pass@8 needs at least 8 samples per problem, but only n=4"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError, match="at least 8 samples"):
        mean_pass_at_k([8, 4], [1, 1], k=8)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1)])
def test_invalid_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_means_over_problems():
    num_samples, num_correct = [4, 4, 4], [0, 2, 4]
    assert mean_pass_at_k(num_samples, num_correct, 1) == pytest.approx(np.mean([0, 0.5, 1]))
    assert mean_pass_at_k(num_samples, num_correct, 2) == pytest.approx(np.mean([0, 1 - 1 / 6, 1]))
    assert avg_at_n(num_samples, num_correct) == pytest.approx(0.5)
    assert avg_at_n([1, 2], [1, 1]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="equal length"):
        avg_at_n([1, 2], [1])
    with pytest.raises(ValueError, match="No problems"):
        mean_pass_at_k([], [], 1)


def test_majority_vote():
    assert majority_vote(["3", "5", "5"], [True, False, False]) == ("5", False)
    assert majority_vote(["3", None, None, "3", "5"], [True, False, False, True, False]) == ("3", True)
    assert majority_vote(["5", "3", "3", "5"], [False, True, True, False]) == ("5", False)  # tie -> first seen
    assert majority_vote([None, None], [False, False]) == (None, False)
    with pytest.raises(ValueError, match="2 answers but 1"):
        majority_vote(["1", "2"], [True])


def test_fractional_counts_are_rejected_not_truncated():
    from opefo_trl.eval.pass_at_k import mean_pass_at_k, pass_at_k

    with pytest.raises(ValueError, match="whole number"):
        pass_at_k(4.9, 1, 4)
    with pytest.raises(ValueError, match="counts, not accuracies"):
        mean_pass_at_k([4, 4], [0.5, 0.75], 1)
