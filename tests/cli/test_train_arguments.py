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
    with pytest.raises(ValueError, match="Unknown reward function 'accuracy': use one of 'math_accuracy_reward', "):
        resolve_reward_funcs(["accuracy"])


def test_trls_reward_names_are_trls_functions_and_the_overlong_one_is_built_as_trl_grpo_builds_it():
    import trl.rewards

    accuracy, think, overlong = resolve_reward_funcs(
        ["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
    )
    assert accuracy is trl.rewards.accuracy_reward and think is trl.rewards.think_format_reward
    # trl grpo's (1280, 256): no penalty up to 1280 - 256 tokens, -1 at 1280.
    assert overlong([[1] * 1024, [1] * 1152, [1] * 1280]) == pytest.approx([0.0, -0.5, -1.0])


def test_trls_script_arguments_are_the_base_and_what_opefo_train_cannot_do_is_refused():
    from trl import ScriptArguments

    args = TrainScriptArguments(dataset_train_split="validation")
    assert isinstance(args, ScriptArguments) and args.dataset_train_split == "validation"
    with pytest.raises(ValueError, match="dataset_streaming=true: opefo-train reads the whole training set first"):
        TrainScriptArguments(dataset_streaming=True)
    with pytest.raises(ValueError, match="ignore_bias_buffers=true is TRL's DDP fix"):
        TrainScriptArguments(ignore_bias_buffers=True)


def test_the_math_reward_mode_builds_the_reward_and_is_refused_without_it():
    assert TrainScriptArguments().math_reward_mode == "equivalent"
    assert TrainScriptArguments(math_reward_mode="strict").math_reward_mode == "strict"
    (equivalent,) = resolve_reward_funcs(["math_accuracy_reward"])
    (strict,) = resolve_reward_funcs(["math_accuracy_reward"], "strict")
    restated = ["The answer is 6 + 3."]
    assert equivalent(restated, solution=["9"]) == [1.0] and strict(restated, solution=["9"]) == [0.0]
    assert strict.__name__ == "math_accuracy_reward"
    with pytest.raises(ValueError, match="math_reward_mode='final' is not a mode of the math reward"):
        TrainScriptArguments(math_reward_mode="final")
    with pytest.raises(ValueError) as raised:
        TrainScriptArguments(math_reward_mode="strict", reward_funcs=["accuracy_reward"])
    assert str(raised.value) == (
        "math_reward_mode='strict' sets how 'math_accuracy_reward' scores, but reward_funcs (['accuracy_reward']) "
        "does not name it; add 'math_accuracy_reward' to reward_funcs or leave math_reward_mode at 'equivalent'."
    )
