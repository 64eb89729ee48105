"""The demo's tasks: the explicit train / held-out split, and that held-out targets never reach training."""

import pytest

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
