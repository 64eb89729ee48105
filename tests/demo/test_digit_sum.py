"""The digit-sum task: prompts, the graded reward, default targets and the warm-start sampler's statistics."""

import collections
import doctest

import pytest

from opefo_trl.demo import digit_sum
from opefo_trl.demo.digit_sum import (
    DEFAULT_TOLERANCE,
    DIGIT_RANKING,
    answer_digits,
    build_digit_sum_dataset,
    default_targets,
    digit_sum_prompt,
    digit_sum_reward,
    digit_sum_score,
    digit_weights,
    sample_warm_start_examples,
)


def test_doctests():
    assert doctest.testmod(digit_sum).failed == 0


def test_dataset_rows_carry_the_prompt_and_every_column_the_reward_reads():
    ds = build_digit_sum_dataset(targets=[100, 110], num_digits=24, tolerance=5.0)
    assert ds.column_names == ["prompt", "target", "num_digits", "tolerance"]
    assert len(ds) == 2
    assert ds[1] == {
        "prompt": [{"role": "user", "content": "Write 24 digits that add up to 110"}],
        "target": 110,
        "num_digits": 24,
        "tolerance": 5.0,
    }
    assert ds[0]["prompt"] == digit_sum_prompt(100, 24)
    assert build_digit_sum_dataset()["target"] == default_targets()


@pytest.mark.parametrize(
    "text, target, expected",
    [
        ("5555", 20, 1.0),
        ("9110", 11, 1.0),
        ("5556", 20, 0.9),  # one off: loses 1 / tolerance
        ("5553", 20, 0.8),
        ("9999", 20, 0.0),  # 16 off: floored at 0
        ("0000", 10, 0.0),  # exactly `tolerance` off
        (" 5555\n", 20, 1.0),  # whitespace is ignored
        ("55 55", 20, 1.0),
        ("5a55", 15, 1.0),  # a stray token costs its missing digit (here nothing: the sum is still right) ...
        ("5a55", 20, 0.5),  # ... or the error of the missing digit
        ("-555", 15, 1.0),  # signs are not digits
        ("55555", 25, 0.0),  # more digits than asked for
        ("", 0, 1.0),
        ("", 5, 0.5),
    ],
)
def test_score_is_graded_by_the_digit_sum_and_ignores_other_characters(text, target, expected):
    assert digit_sum_score(text, target, num_digits=4, tolerance=10.0) == pytest.approx(expected)
    assert digit_sum_reward([text], target=[target], num_digits=[4], tolerance=[10.0]) == [pytest.approx(expected)]


def test_reward_uses_each_rows_target_length_and_tolerance_and_accepts_chat_completions():
    completions = ["1234", [{"role": "assistant", "content": "1234"}], "123456", "1234"]
    rewards = digit_sum_reward(
        completions, target=[10, 12, 21, 12], num_digits=[4, 4, 6, 4], tolerance=[10.0, 10.0, 10.0, 4.0]
    )
    assert rewards == [1.0, pytest.approx(0.8), 1.0, pytest.approx(0.5)]


def test_reward_runs_on_trl_batches_built_from_the_dataset():
    ds = build_digit_sum_dataset(targets=[30, 31], num_digits=6)
    batch = ds[:2]
    rewards = digit_sum_reward(
        ["555555", "555555"], target=batch["target"], num_digits=batch["num_digits"], tolerance=batch["tolerance"]
    )
    assert rewards == [1.0, pytest.approx(1 - 1 / DEFAULT_TOLERANCE)]
    # without a tolerance column the default applies
    assert digit_sum_reward(["555555"], target=[31], num_digits=[6]) == [pytest.approx(1 - 1 / DEFAULT_TOLERANCE)]


def test_reward_refuses_missing_or_mismatched_columns():
    with pytest.raises(ValueError, match=r"column\(s\) \['target'\]"):
        digit_sum_reward(["1234"], num_digits=[4])
    with pytest.raises(ValueError, match=r"column\(s\) \['target', 'num_digits'\]"):
        digit_sum_reward(["1234"])
    with pytest.raises(ValueError, match="2 completions but 1 values of `target`"):
        digit_sum_reward(["1234", "1234"], target=[10], num_digits=[4, 4])
    with pytest.raises(ValueError, match="2 completions but 1 values of `tolerance`"):
        digit_sum_reward(["1234", "1234"], target=[10, 10], num_digits=[4, 4], tolerance=[1.0])
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        digit_sum_reward(["1234"], target=[10], num_digits=[4], tolerance=[0.0])
    with pytest.raises(ValueError, match="num_digits must be a positive whole number"):
        digit_sum_reward(["1234"], target=[10], num_digits=[0])
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        digit_sum_reward([1234], target=[10], num_digits=[4])


def test_dataset_and_sampler_refuse_unusable_settings():
    with pytest.raises(ValueError, match="`targets` is empty"):
        build_digit_sum_dataset(targets=[])
    with pytest.raises(ValueError, match=r"Targets \[37\] cannot be the sum of 4 digits; use 0..36"):
        build_digit_sum_dataset(targets=[10, 37], num_digits=4)
    with pytest.raises(ValueError, match="num_digits must be a positive whole number"):
        build_digit_sum_dataset(num_digits=2.5)
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        build_digit_sum_dataset(tolerance=-1.0)
    with pytest.raises(ValueError, match="skew must be >= 0"):
        sample_warm_start_examples(4, skew=-0.5)
    with pytest.raises(ValueError, match="num_examples must be >= 0"):
        sample_warm_start_examples(-1)


def test_answer_digits():
    assert answer_digits("0123456789") == list(range(10))
    assert answer_digits(" 1 2\t3,x") == [1, 2, 3]
    assert answer_digits("１２") == []  # full-width digits are not ASCII digits


def test_digit_weights_follow_the_ranking():
    weights = digit_weights(1.0)
    assert sum(weights) == pytest.approx(1.0)
    assert sorted(range(10), key=weights.__getitem__, reverse=True) == list(DIGIT_RANKING)
    assert weights[DIGIT_RANKING[0]] / weights[DIGIT_RANKING[1]] == pytest.approx(2.0)
    assert digit_weights(0.0) == [pytest.approx(0.1)] * 10


def test_default_targets_are_centred_on_the_warm_starts_expected_sum():
    for num_digits in (8, 24):
        targets = default_targets(num_digits)
        weights = digit_weights()
        mean_sum = num_digits * sum(d * w for d, w in enumerate(weights))
        assert targets == list(range(targets[0], targets[-1] + 1))
        assert abs((targets[0] + targets[-1]) / 2 - mean_sum) <= 1.0
    # enough distinct prompts for 16 prompts per step (TRL draws distinct rows within a step)
    assert len(default_targets(24)) >= 16


def test_warm_start_answers_are_correct_and_cover_the_targets():
    examples = sample_warm_start_examples(400, targets=[100, 110, 120], num_digits=24, seed=3)
    assert {e.target for e in examples} == {100, 110, 120}
    for e in examples:
        assert len(e.answer) == 24
        assert digit_sum_score(e.answer, e.target, 24) == 1.0
    assert sample_warm_start_examples(5, seed=3) == sample_warm_start_examples(5, seed=3)
    assert sample_warm_start_examples(5, seed=3) != sample_warm_start_examples(5, seed=4)


def test_warm_start_digits_follow_the_skewed_distribution_at_the_expected_sum():
    # Conditioning independent digits on their expected sum barely changes their marginal distribution, so the
    # warm-start data teaches the skewed digit frequencies.
    num_digits = 24
    weights = digit_weights()
    target = round(num_digits * sum(d * w for d, w in enumerate(weights)))
    examples = sample_warm_start_examples(1500, targets=[target], num_digits=num_digits, seed=0)
    counts = collections.Counter(c for e in examples for c in e.answer)
    total = sum(counts.values())
    for d in range(10):
        assert counts[str(d)] / total == pytest.approx(weights[d], abs=0.015)


def test_conditioned_sampler_is_exact():
    # Two digits adding up to 9: P(d, 9 - d) is proportional to w[d] * w[9 - d].
    weights = digit_weights(1.0)
    examples = sample_warm_start_examples(20000, targets=[9], num_digits=2, skew=1.0, seed=0)
    counts = collections.Counter(e.answer for e in examples)
    norm = sum(weights[d] * weights[9 - d] for d in range(10))
    for d in range(10):
        expected = weights[d] * weights[9 - d] / norm
        assert counts[f"{d}{9 - d}"] / len(examples) == pytest.approx(expected, abs=0.012)
    assert sum(counts.values()) == len(examples)
