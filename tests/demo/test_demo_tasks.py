"""The demo's tasks: the explicit train / held-out split, and that held-out targets never reach training."""

import pytest

from opefo_trl.data.word_problems import word_problems
from opefo_trl.demo.tasks import TASKS, held_out_split


def test_held_out_split_is_every_fifth_target():
    train, held_out = held_out_split(range(99, 129))
    assert held_out == [101, 106, 111, 116, 121, 126]
    assert sorted(train + held_out) == list(range(99, 129)) and not set(train) & set(held_out)
    with pytest.raises(ValueError, match="Cannot hold out"):
        held_out_split([1, 2])


@pytest.mark.parametrize("name", list(TASKS))
def test_held_out_targets_never_reach_training(name):
    task = TASKS[name]
    held_out = set(task.held_out_targets)
    assert held_out and len(task.train_targets) >= task.defaults["prompts_per_step"]
    assert set(task.train_dataset()["target"]) == set(task.train_targets)
    if task.pretrained_model is not None:  # no warm start
        with pytest.raises(ValueError, match="starts from the pretrained model"):
            task.warm_start_answers(300, task.train_targets, 0)
        return
    warm = task.warm_start_answers(300, task.train_targets, 0)
    assert {target for target, _ in warm} == set(task.train_targets)
    # each warm-start answer is an exact answer of its target
    assert all(task.exact_answer(answer, target) is not None for target, answer in warm)


def test_exact_answers():
    digit_sum, addition = TASKS["digit_sum"], TASKS["sum"]
    answer = "9" * 11 + "1" + "0" * 12  # 24 digits adding up to 100
    assert digit_sum.exact_answer(answer, 100) == tuple(map(int, answer))
    assert digit_sum.exact_answer(answer, 101) is None
    assert digit_sum.exact_answer(answer[:-1], 100) is None  # 23 digits: not an answer of the task
    assert digit_sum.exact_answer(answer + "0", 100) is None  # 25 digits
    assert digit_sum.exact_answer(answer[:-1] + "x0", 100) == tuple(map(int, answer))  # other characters ignored
    assert addition.exact_answer(" 3 + 5", 8) == (3, 5) and addition.exact_answer("3 + 4", 8) is None


def test_word_problems_are_the_recipes_with_a_worked_example_and_the_strict_reward():
    task = TASKS["word_problems"]
    assert len(task.train_targets) == 64 and task.held_out_targets == list(range(2, 80, 5))
    first = word_problems(1)[0]  # recipes/smollm2-135m-instruct/word_problems.jsonl's first problem
    prompt = task.prompt(0)
    assert [m["role"] for m in prompt] == ["user", "assistant", "user"] and prompt[-1]["content"] == first.question
    assert prompt[1]["content"].endswith("Answer: 5")
    row = task.train_dataset()[0]
    assert (row["target"], row["solution"]) == (0, "10") and row["prompt"] == prompt
    assert task.reward([[{"role": "assistant", "content": "5 + 5 = 10\nAnswer: 10"}]], solution=["10"]) == [1.0]
    assert task.exact_answer("5 + 5 = 10\nAnswer: 10", 0) == 10
    assert task.exact_answer("Answer: 5 + 5", 0) is None  # the strict reward: arithmetic left undone is not paid
    assert task.exact_answer("Answer: 11", 0) is None
