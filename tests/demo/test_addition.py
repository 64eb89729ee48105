"""The addition task ("Solve t = ? + ?"): prompts, parsing and the exact reward the demo trains on."""

import pytest

from opefo_trl.demo.addition import (
    build_sum_dataset,
    correct_sum_reward,
    default_targets,
    is_correct_sum,
    parse_sum,
    sample_warm_start_examples,
    sum_prompt,
)


def test_dataset_rows_are_conversational_prompts_with_targets():
    ds = build_sum_dataset(targets=[7, 12])
    assert ds.column_names == ["prompt", "target"]
    assert ds[1]["target"] == 12
    assert ds[1]["prompt"] == [{"role": "user", "content": "Solve 12 = ? + ?"}]
    assert len(build_sum_dataset()) == len(default_targets())


@pytest.mark.parametrize(
    "text, target, expected",
    [
        ("3 + 4", 7, 1.0),
        ("4 + 3", 7, 1.0),
        ("  10+2 \n", 12, 1.0),  # whitespace is tolerated
        ("0 + 7", 7, 0.0),  # addends must be positive
        ("3 + 5", 7, 0.0),  # wrong sum
        ("7", 7, 0.0),  # not a sum
        ("3 + 2 + 2", 7, 0.0),  # three addends
        ("3 + 4 = 7", 7, 0.0),  # trailing text: not exactly "a + b"
        ("x 3 + 4", 7, 0.0),
        ("-3 + 10", 7, 0.0),
        ("", 7, 0.0),
    ],
)
def test_reward_is_exact(text, target, expected):
    assert correct_sum_reward([text], target=[target]) == [expected]


def test_reward_accepts_trl_conversational_completions_and_checks_each_row_against_its_target():
    completions = [[{"role": "assistant", "content": "5 + 6"}], [{"role": "assistant", "content": "5 + 6"}]]
    assert correct_sum_reward(completions, target=[11, 12]) == [1.0, 0.0]


def test_reward_refuses_mismatched_or_missing_targets():
    with pytest.raises(ValueError, match="2 completions but 1 targets"):
        correct_sum_reward(["1 + 1", "1 + 2"], target=[2])
    with pytest.raises(ValueError, match="`target` column"):
        correct_sum_reward(["1 + 1"], target=None)
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        correct_sum_reward([42], target=[2])


def test_parse_sum():
    assert parse_sum("12 + 5") == (12, 5)
    assert parse_sum("12 plus 5") is None
    assert is_correct_sum("12 + 5", 17) and not is_correct_sum("12 + 5", 18)


def test_targets_are_validated():
    with pytest.raises(ValueError, match="targets >= 2"):
        build_sum_dataset(targets=[1, 5])
    with pytest.raises(ValueError, match="empty"):
        build_sum_dataset(targets=[])
    with pytest.raises(ValueError, match="max_target"):
        default_targets(10, 5)
    assert sum_prompt(9)[0]["content"] == "Solve 9 = ? + ?"


def test_warm_start_examples_mix_correct_and_wrong_answers_at_the_requested_rate():
    examples = sample_warm_start_examples(4000, targets=range(6, 26), wrong_fraction=0.3, seed=0)
    for e in examples:
        assert e.correct == is_correct_sum(e.answer, e.target)
        a, b = parse_sum(e.answer)
        assert a >= 1 and b >= 1 and 1 <= a <= e.target - 1
        assert abs(a + b - e.target) <= 3
    wrong = sum(not e.correct for e in examples) / len(examples)
    assert abs(wrong - 0.3) < 0.03
    # the first addend covers every correct answer of a target: the warm-start policy has real entropy
    firsts = {parse_sum(e.answer)[0] for e in examples if e.target == 10}
    assert firsts == set(range(1, 10))
    assert sample_warm_start_examples(50, seed=3) == sample_warm_start_examples(50, seed=3)


def test_warm_start_examples_validate_arguments():
    with pytest.raises(ValueError, match="wrong_fraction"):
        sample_warm_start_examples(10, wrong_fraction=1.5)
    with pytest.raises(ValueError, match="max_error"):
        sample_warm_start_examples(10, max_error=0)
