"""opefo_trl.cli.train_arguments: opefo-train's own options and the reward functions they name. Through the command
line: tests/cli/test_train.py (test_bad_options_fail_before_model_loading)."""

import pytest

from opefo_trl.cli.train_arguments import TrainScriptArguments, resolve_reward_funcs


def test_single_values_become_lists_and_out_of_range_values_are_refused_by_name():
    args = TrainScriptArguments(reward_funcs="math_accuracy_reward", dataset_files="problems.jsonl")
    assert args.reward_funcs == ["math_accuracy_reward"] and args.dataset_files == ["problems.jsonl"]
    for values, message in (
        (dict(metrics_jsonl="all"), "metrics_jsonl must be one of ('main_process', 'every_process', 'off'), got 'all'"),
        (dict(max_train_samples=0), "max_train_samples must be at least 1, got 0."),
        (dict(probe_prompts=-1), "probe_prompts must be >= 0 (0: no probe), got -1."),
        (dict(context_length=1), "context_length must be a positive number of tokens, got 1."),
        (dict(reward_funcs=[]), "reward_funcs is empty: give at least one, e.g. 'math_accuracy_reward'."),
    ):
        with pytest.raises(ValueError) as raised:
            TrainScriptArguments(**values)
        assert str(raised.value).rstrip(".") == message.rstrip(".")


def test_reward_functions_by_dotted_path_and_the_one_that_fails_is_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def length(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (length,) = resolve_reward_funcs(["my_rewards.length"])
    assert length(["a", "b"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"Module 'my_rewards' has no callable 'missing' \(reward function"):
        resolve_reward_funcs(["my_rewards.length", "my_rewards.missing"])
    with pytest.raises(ValueError, match="Unknown reward function 'accuracy': use 'math_accuracy_reward' or a dotted"):
        resolve_reward_funcs(["accuracy"])
