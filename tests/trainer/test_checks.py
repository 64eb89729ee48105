"""opefo_trl.trainer.checks, alone and through OPEFOTrainer (the Python API): settings that would fail at the first
step, reward functions that raise or return non-numbers, infinities or NaN, and GRPOTrainer's optional
`reward_funcs`."""

import asyncio
import inspect
import os
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from opefo_trl import OPEFOConfig, OPEFOTrainer
from opefo_trl.trainer.checks import RewardCheck, RewardFunctionError, check_training_values, reward_problem


def _settings(**overrides):
    return SimpleNamespace(**{"learning_rate": 1e-6, "max_completion_length": 8, "temperature": 1.0, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learning_rate": -1.0}, "learning_rate=-1.0: the learning rate must be >= 0"),
        ({"max_completion_length": 0}, "max_completion_length=0: completions need at least 1 token"),
        ({"temperature": 0.0}, "temperature=0.0: GRPO samples completions"),
        ({"loss_type": "dr_grpo", "max_completion_length": None}, "loss_type='dr_grpo' with max_completion_length="),
        # Any number option that is not finite, found without a list of names.
        ({"learning_rate": float("inf")}, "learning_rate=inf: must be a finite number .every number option is"),
        ({"temperature": float("nan")}, "temperature=nan: must be a finite number"),
        ({"beta": float("-inf")}, "beta=-inf: must be a finite number"),
        ({"reward_weights": [1.0, float("nan")]}, r"reward_weights=\[1.0, nan\]: must be a finite number"),
    ],
)
def test_values_that_fail_at_the_first_step_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_training_values(_settings(**overrides))
    check_training_values(_settings(learning_rate=0.0, max_completion_length=1, temperature=0.1))  # the edges pass
    check_training_values(_settings(loss_type="dapo", max_completion_length=None))


@pytest.mark.parametrize(
    "rewards, message",
    [
        ([1.0, "0.5", 0.0], "returned '0.5' (a str) for completion 1 of 3 (1 such value(s) in this batch)"),
        ([[1.0], [0.0], [1.0]], "returned [1.0] (a list) for completion 0 of 3 (3 such value(s)"),
        (0.5, "returned 0.5 (a float); it must return a list of 3 numbers"),
        ("1 0 1", "returned '1 0 1' (a str); it must return a list of 3 numbers"),
        ([1.0, 0.0], "returned 2 rewards for 3 completions"),
        ([1.0, float("-inf"), float("inf")], "returned -inf for 2 of 3 completions (first: completion 1)"),
        ([1.0, float("nan"), float("nan")], "returned nan for 2 of 3 completions (first: completion 1); a non-finite"),
        ({"a": 1.0}, "returned {'a': 1.0} (a dict); it must return a list of 3 numbers"),
    ],
)
def test_bad_reward_outputs_are_described_with_the_first_bad_value(rewards, message):
    assert message in reward_problem("my_reward", rewards, 3)


@pytest.mark.parametrize(
    "rewards, message",
    [
        ([1.0, 1e300, 0.0], "returned 1e+300 for 1 of 3 completions (first: completion 1); TRL holds rewards in"),
        ([1.0, 10**400, 0.0], "returned an integer of 401 digits for 1 of 3 completions (first: completion 1); a non-"),
    ],
)
def test_rewards_too_large_for_the_standard_deviation_are_refused(rewards, message):
    assert message in reward_problem("my_reward", rewards, 3)


@pytest.mark.numerics
@pytest.mark.parametrize("group", [2, 8, 64])
def test_the_largest_reward_keeps_trls_group_statistics_finite(group):
    """At the bound, a group of rewards has a finite float32 mean and standard deviation as TRL computes them, equal
    to the float64 ones to float32's precision (error estimate: ``group`` additions, each rounded with relative error
    <= 2**-24, so <= group * 2**-24 relative); four times the bound overflows the group's mean to inf."""
    from opefo_trl.trainer.checks import largest_reward

    bound = largest_reward(group)
    assert reward_problem("r", [bound] * group, group) is None
    assert "overflow to inf" in reward_problem("r", [bound * 1.01] * group, group)
    for values in ([bound] * group, [bound * (i % 2) for i in range(group)], [(-1) ** i * bound for i in range(group)]):
        rewards32, rewards64 = torch.tensor(values, dtype=torch.float32), torch.tensor(values, dtype=torch.float64)
        for statistic in (torch.mean, torch.std):
            value32, value64 = float(statistic(rewards32)), float(statistic(rewards64))
            assert value32 == pytest.approx(value64, rel=group * 2**-24, abs=bound * group * 2**-24)
    assert torch.isinf(torch.tensor([4 * bound] * group, dtype=torch.float32).mean())


def test_good_reward_outputs_pass():
    for rewards in ([1, 0.5, None], (True, False, None), np.array([0.0, 1.0, 2.0]), torch.tensor([1.0, 0, 2])):
        assert reward_problem("r", rewards, 3) is None
    assert reward_problem("r", [np.float32(1), np.int64(0), torch.tensor(0.5)], 3) is None
    check = RewardCheck()
    (generator_reward,) = check.wrap([lambda completions, **kwargs: (1.0 for _ in completions)], ["generator"])
    assert generator_reward(completions="abc") == [1.0, 1.0, 1.0] and check.error is None  # read once, passed on


def test_a_dict_or_nan_from_a_checked_function_is_reported_as_it_was_returned():
    """A dict is named as a dict (not "returned None"); NaN rewards stop the run (they would train at loss 0)."""
    for returned, message in (
        ({"accuracy": 1.0, "format": 0.0}, "returned {'accuracy': 1.0, 'format': 0.0} (a dict); it must return a list"),
        (np.array([1.0, np.nan]), "returned nan for 1 of 2 completions (first: completion 1)"),
    ):
        check = RewardCheck()
        (wrapped,) = check.wrap([lambda completions, returned=returned, **kwargs: returned], ["scores"])
        assert wrapped(completions=["x", "y"]) == [0.0, 0.0]
        with pytest.raises(RewardFunctionError, match=re.escape(f"Reward function 'scores' {message}")):
            check.raise_if_failed()


def test_a_failing_function_is_named_and_later_ones_are_not_called():
    calls = []

    def raises(completions, **kwargs):
        return {"a": 1}["missing"]

    def later(completions, **kwargs):
        calls.append(1)
        return [1.0] * len(completions)

    check = RewardCheck()
    first, second = check.wrap([raises, later], ["raises", "later"])
    assert first(completions=["x", "y"]) == [0.0, 0.0] and second(completions=["x", "y"]) == [0.0, 0.0]
    assert calls == []
    with pytest.raises(RewardFunctionError) as error:
        check.raise_if_failed()
    assert str(error.value).startswith("Reward function 'raises' raised KeyError: 'missing' at ")
    assert "test_checks.py" in str(error.value) and isinstance(error.value.__cause__, KeyError)


def test_async_functions_and_reward_models_and_other_processes():
    async def async_strings(completions, **kwargs):
        return ["1"] * len(completions)

    model = torch.nn.Linear(1, 1)
    check = RewardCheck()
    wrapped, kept = check.wrap([async_strings, model], ["async_strings", "model"])
    assert kept is model and asyncio.iscoroutinefunction(wrapped)
    assert asyncio.run(wrapped(completions=["a", "b"])) == [0.0, 0.0]
    with pytest.raises(RewardFunctionError, match="'async_strings' returned '1' \\(a str\\)"):
        check.raise_if_failed()
    fine = RewardCheck()
    fine.raise_if_failed(0)
    with pytest.raises(RewardFunctionError, match="failed on 1 other process"):
        fine.raise_if_failed(1)


def test_a_checked_function_takes_the_arguments_its_function_takes():
    """TRL's reward of an environment that owns it takes only `environments=`, and is called so directly: the checked
    function has its name and signature, counts the rewards by what it is given, and raises what it cannot count."""

    def get_reward(environments, **kwargs):
        return list(environments)

    async def get_reward_async(environments, **kwargs):  # an environment's async `get_reward`
        return [1.0 for _ in environments]

    def by_position(completions):
        return completions

    check = RewardCheck()
    funcs = [get_reward, get_reward_async, by_position]
    env_reward, async_env_reward, positional = check.wrap(funcs, ["ScoredEnvironment", "AsyncEnv", "by_position"])
    for checked, func in zip((env_reward, async_env_reward, positional), funcs, strict=True):
        assert checked.__name__ == func.__name__ and inspect.signature(checked) == inspect.signature(func)
    assert env_reward(environments=[1.0, None]) == [1.0, None] and check.error is None
    assert asyncio.run(async_env_reward(environments=["env"])) == [1.0] and check.error is None
    assert env_reward(environments=[1.0, 2.0, "3"]) == [0.0, 0.0, 0.0]
    with pytest.raises(RewardFunctionError, match="'ScoredEnvironment' returned '3' \\(a str\\) for completion 2 of 3"):
        check.raise_if_failed()
    check.start()
    assert positional([1.0, None]) == [1.0, None]
    with pytest.raises(RewardFunctionError, match="'by_position' returned inf for 1 of 2 completions"):
        positional([float("inf"), 0.0])  # no zeros to give without the number of completions: raised at once


# ----------------------------------------------------------------------------------------------------------------------
# Through OPEFOTrainer
# ----------------------------------------------------------------------------------------------------------------------


def _config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="steps",
        save_steps=1,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return OPEFOConfig(**settings)


def string_reward(completions, **kwargs):
    return ["1.0" for _ in completions]


def raising_reward(completions, **kwargs):
    raise RuntimeError("grader unreachable")


def infinite_reward(completions, **kwargs):
    return [float("inf")] + [0.0] * (len(completions) - 1)


def nan_reward(completions, **kwargs):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]


@pytest.mark.parametrize(
    "reward, message",
    [
        (string_reward, "Reward function 'string_reward' returned '1.0' (a str) for completion 0 of 4"),
        (raising_reward, "Reward function 'raising_reward' raised RuntimeError: grader unreachable at "),
        (infinite_reward, "Reward function 'infinite_reward' returned inf for 1 of 4 completions (first: completion"),
        (nan_reward, "Reward function 'nan_reward' returned nan for 2 of 4 completions (first: completion 1)"),
    ],
)
def test_the_python_api_refuses_a_bad_reward_at_its_first_call(
    reward, message, tiny_model_path, tiny_dataset, length_reward, tmp_path, snapshot
):
    args = _config(tmp_path)
    trainer = OPEFOTrainer(tiny_model_path, [length_reward, reward], args=args, train_dataset=tiny_dataset)
    before = snapshot(tmp_path)
    with pytest.raises(RewardFunctionError) as error:
        trainer.train()
    assert message in str(error.value)
    assert trainer.state.global_step == 0 and snapshot(tmp_path) == before  # no step, no checkpoint, no file
    assert trainer.reward_funcs[1].__wrapped__ is reward and trainer.reward_funcs[1].__name__ == reward.__name__


def test_a_checked_async_reward_function_is_still_run_by_trl_as_async(tiny_model_path, tiny_dataset, tmp_path):
    """TRL runs async reward functions concurrently (`is_async_callable`); the checked one must stay async."""
    calls = []

    async def async_reward(completions, **kwargs):
        calls.append(len(completions))
        return [1.0] * len(completions)

    trainer = OPEFOTrainer(
        tiny_model_path,
        async_reward,
        args=_config(tmp_path, max_steps=1, save_strategy="no"),
        train_dataset=tiny_dataset,
    )
    trainer.train()
    assert calls == [4] and trainer.reward_func_names == ["async_reward"]
    assert trainer.state.log_history[0]["rewards/async_reward/mean"] == 1.0


def test_the_python_api_refuses_settings_that_fail_at_the_first_step(tiny_model_path, length_reward, tmp_path):
    with pytest.raises(ValueError, match="temperature=0.0: GRPO samples completions"):
        OPEFOTrainer(tiny_model_path, length_reward, args=_config(tmp_path, temperature=0.0))
    assert os.listdir(tmp_path) == []


class CountingEnvironment:
    """Owns the reward (TRL's `environment_factory`): 1 for the first rollout it is reset for, 0 afterwards."""

    def __init__(self):
        self.resets = 0

    def reset(self, **kwargs):
        self.resets += 1

    def get_reward(self):
        return float(self.resets == 1)


#: ChatML that also renders tool calls and tool messages, which TRL requires of a tokenizer with environments.
TOOL_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>{{ call['function']['name'] }} "
    "{{ call['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reward_funcs_is_optional_as_in_grpo_trainer(tiny_model_path, tiny_dataset, tmp_path):
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    args = _config(tmp_path, max_steps=1, save_strategy="no")
    for trainer_class in (GRPOTrainer, OPEFOTrainer):  # the same error, raised by TRL
        with pytest.raises(ValueError, match="No reward source provided. Pass `reward_funcs`, or an"):
            trainer_class(tiny_model_path, args=args, train_dataset=tiny_dataset)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = TOOL_CHATML
    trainer = OPEFOTrainer(
        tiny_model_path,
        args=args,
        train_dataset=tiny_dataset,
        processing_class=tokenizer,
        environment_factory=CountingEnvironment,
    )
    trainer.train()
    assert trainer.reward_func_names == ["CountingEnvironment"]
    assert any("rewards/CountingEnvironment/mean" in row for row in trainer.state.log_history)


class ScoredEnvironment:
    """Owns its reward (TRL's `get_reward`), with a tool."""

    def reset(self, **kwargs): ...

    def act(self, x: int) -> int:
        """
        Act.

        Args:
            x: A value.

        Returns:
            The value.
        """
        return x

    def get_reward(self) -> float:
        return 1.0


class PlainEnvironment:
    """No `get_reward`: its rollouts are scored by `reward_funcs` alone."""

    def reset(self, **kwargs): ...

    def play(self, x: int) -> int:
        """
        Play.

        Args:
            x: A value.

        Returns:
            The value.
        """
        return x


def format_reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.mark.parametrize("method", ["grpo", pytest.param(None, id="default")])
def test_an_environment_owned_reward_is_called_as_trl_gives_it(method, tiny_model_path, tiny_dataset, tmp_path):
    """TRL's test_environment_owned_reward_mixed_environments, then a step: `trainer.reward_funcs[-1]` is TRL's
    reward of the environments that own it, with its name and signature, and called with `environments=` only."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = qwen2_5_chat_template  # one TRL parses tool calls of (the environments have tools)
    names = ["scored", "scored2", "plain"]
    dataset = tiny_dataset.add_column("environment", [names[i % 3] for i in range(len(tiny_dataset))])
    method_setting = {} if method is None else {"method": method}
    trainer = OPEFOTrainer(
        tiny_model_path,
        format_reward,
        args=_config(tmp_path, max_steps=1, save_strategy="no", **method_setting),
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment, "plain": PlainEnvironment},
    )
    assert trainer.reward_func_names == ["format_reward", "ScoredEnvironment"]
    env_reward = trainer.reward_funcs[-1]
    assert env_reward(environments=[ScoredEnvironment(), PlainEnvironment()]) == [1.0, None]
    assert (
        env_reward.__name__ == "get_reward" and next(iter(inspect.signature(env_reward).parameters)) == "environments"
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.state.log_history[0]["rewards/ScoredEnvironment/mean"] == 1.0  # its rollouts only


def test_args_none_names_the_output_dir_as_grpo_trainer_does(tiny_model_path, length_reward, monkeypatch):
    import trl.trainer.grpo_trainer

    import opefo_trl.trainer.trainer

    class Named(Exception):
        pass

    def record(output_dir=None, **kwargs):  # stands for the config class: the default config's output_dir
        raise Named(output_dir)

    monkeypatch.setattr(trl.trainer.grpo_trainer, "GRPOConfig", record)
    monkeypatch.setattr(opefo_trl.trainer.trainer, "OPEFOConfig", record)
    names = []
    for trainer_class in (trl.GRPOTrainer, OPEFOTrainer):
        with pytest.raises(Named) as named:
            trainer_class(tiny_model_path, length_reward)
        names.append(str(named.value))
    assert names == ["model-GRPO", "model-GRPO"]  # the tiny model's folder is called `model`


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"vllm_enable_sleep_mode": True},
            r"vllm_enable_sleep_mode=True needs a CUDA GPU .* set vllm_enable_sleep_mode=False",
        ),
        (
            {"vllm_mode": "server"},
            r"vllm_mode='server' sends the weights to the server over NCCL, which needs a CUDA GPU on the trainer's "
            r"side \(use_cpu=True\); use vllm_mode='colocate', or train on a GPU",
        ),
    ],
)
def test_vllm_options_that_need_a_gpu_are_refused_before_loading(overrides, message, length_reward, tmp_path):
    """Sleep mode and server mode's weight transfer fail inside vLLM / TRL on a CPU machine; refused up front, before
    the model (here one that does not exist) is looked at."""
    args = OPEFOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, use_cpu=True, report_to="none", **overrides)
    with pytest.raises(ValueError, match=message):
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=args)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "report_to, error, message",
    [
        ("wandbb", ValueError, r"report_to names 'wandbb' \(did you mean 'wandb'\?\), which transformers does not log"),
        (["tensorboard", "dvclive"], ImportError, r"report_to names 'dvclive' \(DVCLiveCallback requires dvclive "),
        (False, ValueError, r"report_to=\[False\] holds False, which is not a tracker's name"),
    ],
)
def test_a_report_to_the_trainer_cannot_log_to_is_refused_before_loading(
    report_to, error, message, length_reward, tmp_path, monkeypatch
):
    """Issue 53: transformers refuses these only once the trainer is built, after the model loaded (here one that
    does not exist); a tracker transformers lists as installed is not built."""
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["tensorboard"])
    args = OPEFOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=report_to)
    with pytest.raises(error, match=message):
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=args)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "num_prompts, overrides",
    [
        (16, dict(per_device_train_batch_size=8, num_generations=4, max_steps=-1, num_train_epochs=1)),
        (
            16,
            dict(
                per_device_train_batch_size=4,
                num_generations=2,
                gradient_accumulation_steps=2,
                max_steps=-1,
                num_train_epochs=1.5,
            ),
        ),  # fmt: skip
        (
            13,
            dict(
                per_device_train_batch_size=4,
                num_generations=2,
                steps_per_generation=4,
                gradient_accumulation_steps=3,
                num_iterations=2,
                max_steps=-1,
                num_train_epochs=2,
                method="grpo",
            ),
        ),  # fmt: skip
        (16, dict(per_device_train_batch_size=4, num_generations=2, max_steps=5)),
        (3, dict(per_device_train_batch_size=8, num_generations=2, max_steps=5)),  # one generation batch takes 4
        (16, dict(per_device_train_batch_size=8, num_generations=4, max_steps=-1, num_train_epochs=0)),
    ],
)
def test_planned_steps_are_the_steps_trls_data_loader_and_transformers_train(
    num_prompts, overrides, tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """The count the refusals of 0-step runs and finished resumes use, against the trainer's own: transformers' step
    count over TRL's data loader (which yields nothing at all when the data fills no generation batch)."""
    from trainer_setup import make_config, make_trainer

    from opefo_trl.trainer.checks import planned_steps

    args = make_config(tmp_path, **overrides)
    trainer = make_trainer(tiny_model_path, tiny_dataset.select(range(num_prompts)), length_reward, args)
    loader = trainer.get_train_dataloader()
    expected = 0 if len(loader) == 0 else trainer.set_initial_training_values(args, loader)[-1]
    assert planned_steps(num_prompts, args) == expected


#: TRL's `test_prepare_input_called_with_correct_data`: 8 micro-batches a rollout, 3 a step.
TRLS_OFF_POLICY = dict(num_iterations=2, steps_per_generation=4, gradient_accumulation_steps=3)


def _save_settings(**overrides):
    settings = {"save_strategy": "steps", "save_steps": 500, "max_steps": -1, "num_train_epochs": 3.0}
    return SimpleNamespace(**{**settings, **TRLS_OFF_POLICY, **overrides})


@pytest.mark.parametrize(
    "overrides, steps_per_epoch, saves",
    [
        (dict(), 6, []),  # TRL's test: 3 epochs of 6 steps, no checkpoint before the last
        (dict(max_steps=16), None, []),  # the data not known yet: checked when it is
        (dict(max_steps=16, save_steps=8), 100, []),  # steps 8 and 16 end the 1st and 3rd rollouts
        (dict(max_steps=16, save_steps=4), 100, [4, 12]),
        (dict(save_steps=6), 6, []),  # every epoch ends on a rollout boundary
        # 4 rollouts an epoch (32 micro-batches): 11 steps, ending rollouts at steps 8 and 11, 19 and 22, 30 and 33
        (dict(save_steps=8), 11, [16, 24, 32]),
        (dict(save_steps=0.25), 11, [9, 18, 27]),  # a fraction of the run's 33 steps: every 9
        (dict(save_steps=4, save_strategy="epoch"), 10, []),
    ],
)
def test_the_checkpoints_between_the_updates_of_a_rollout_are_those_the_run_saves(overrides, steps_per_epoch, saves):
    from opefo_trl.trainer.checks import mid_rollout_saves

    assert mid_rollout_saves(_save_settings(**overrides), steps_per_epoch) == saves


def test_a_checkpoint_between_the_updates_of_a_rollout_warns_under_grpo_and_is_refused_by_a_weighting_method():
    """Issue 53: save_steps was refused under every method whenever it was not a multiple of the rollout's steps,
    even where no checkpoint was saved before the run's end (TRL's own test, max_steps 16 < save_steps 500); its
    message said "8 optimizer steps on each rollout batch" where the 8 steps span 3 rollouts."""
    from opefo_trl.trainer.checks import check_save_steps

    schedule = (
        "TRL samples a rollout every 8 micro-batches (steps_per_generation 4 x num_iterations 2) and an optimizer "
        "step takes 3 (gradient_accumulation_steps), so a rollout spans 8/3 optimizer steps and ends where a step ends "
        "only every 8 steps (3 rollouts). TRL keeps the rollout in memory, not in the checkpoint"
    )
    for method in ("grpo", "kl_cov"):  # nothing saved between the updates of a rollout: neither says anything
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_save_steps(_save_settings(max_steps=16, method=method), 100)
    args = _save_settings(max_steps=16, save_steps=4, method="grpo")
    with pytest.warns(UserWarning) as caught:
        check_save_steps(args, 100)
    assert [str(w.message) for w in caught] == [
        f"save_steps=4 saves checkpoints between the updates of one rollout (at steps 4, 12): {schedule}, so a resume "
        "from one of them samples a new rollout and trains the rest of that rollout's updates on other completions "
        "than this run does (as GRPOTrainer's resume does). With a save_steps that is a multiple of 8 (e.g. 8) every "
        "checkpoint is at a rollout boundary."
    ]
    with pytest.raises(ValueError) as raised:
        check_save_steps(_save_settings(max_steps=16, save_steps=4, method="kl_cov"), 100)
    assert str(raised.value) == (
        f"save_steps=4 saves checkpoints between the updates of one rollout (at steps 4, 12): {schedule}, and "
        "method='kl_cov' cannot resume from such a checkpoint (its token weights come from the rollout); give a "
        "save_steps that is a multiple of 8 (e.g. 8)."
    )
    # Over epochs of 11 steps, no multiple of 8 keeps clear of the rollouts (they restart at each epoch's end).
    with pytest.raises(ValueError, match=re.escape("(at steps 16, 24, 32)")) as raised:
        check_save_steps(_save_settings(save_steps=8, method="kl_cov"), 11)
    assert str(raised.value).endswith("give save_strategy='epoch' (every epoch ends on a rollout boundary).")


def test_trls_own_off_policy_configuration_trains_under_method_grpo(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """Issue 53: TRL's `test_prepare_input_called_with_correct_data` (num_iterations 2, steps_per_generation 4,
    accumulation 3, TRL's save_steps 500) was refused at construction under method="grpo". It builds with no
    warning and trains its epoch: 2 rollouts of 8 micro-batches, each trained on num_iterations times."""
    from unittest import mock

    from trainer_setup import make_config, make_trainer
    from trl import GRPOTrainer

    args = make_config(
        tmp_path,
        method="grpo",
        per_device_train_batch_size=6,
        num_generations=4,
        max_steps=-1,
        num_train_epochs=1,
        save_strategy="steps",
        save_steps=500,
        shuffle_dataset=False,
        **TRLS_OFF_POLICY,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="save_steps=")
        trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with mock.patch.object(GRPOTrainer, "training_step", wraps=trainer.training_step) as training_step:
        trainer.train()
    assert training_step.call_count == 16 and trainer.state.global_step == 6  # 16 prompts: 2 generation batches of 6
    batches = [call.args[1] for call in training_step.call_args_list]  # the generation batch each step is given
    assert batches[:8] == [batches[0]] * 8 and batches[8:] == [batches[8]] * 8 and batches[0] != batches[8]
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def _audit_config(tmp_path, **overrides):
    return OPEFOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", **overrides)


def test_an_option_the_factor_refuses_set_after_the_config_was_built_is_refused_by_the_trainer(length_reward, tmp_path):
    """Audit: importance_sampling_level='sequence' set on a built config reached training; only the one-time loss
    guard could stop it, and it let |lambda| < 0.013 through."""
    args = _audit_config(tmp_path)
    args.importance_sampling_level = "sequence"
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' is not modelled by OPEFOTrainer"):
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=args)  # refused before the model is looked at
    args.importance_sampling_level, args.delta = "token", 0.5
    with pytest.raises(
        ValueError, match="delta=0.5 is not modelled by OPEFOTrainer: TRL's two-sided clip caps the ratio"
    ):
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=args)
    assert os.listdir(tmp_path) == []


def test_neftune_is_refused_by_a_weighting_method_and_switches_the_diagnostics_off_under_grpo(tmp_path):
    """Audit: NEFTune's noise changes TRL's update (the step balance's written gradient 0.88 off), unsaid."""
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=5.0 is not modelled by OPEFOTrainer: NEFTune adds"):
        _audit_config(tmp_path, neftune_noise_alpha=5.0)
    with pytest.warns(
        UserWarning,
        match=r"neftune_noise_alpha=5.0 is not modelled by OPEFOTrainer: NEFTune .* switched off for this run",
    ) as caught:
        args = _audit_config(tmp_path, method="grpo", neftune_noise_alpha=5.0)
    assert len([w for w in caught if "NEFTune" in str(w.message)]) == 1 and args.entropy_flow_diagnostics is False


@pytest.fixture
def dropout_model_path(tiny_model_path, tmp_path):
    """The tiny model with attention dropout 0.1 in its config."""
    import json
    import shutil

    path = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    return str(path)


def test_dropout_in_training_is_refused_by_a_weighting_method_before_loading(
    dropout_model_path, length_reward, tmp_path, monkeypatch
):
    """Audit: with dropout TRL's training pass is not the scoring pass (the step balance's gradient 0.31 off)."""
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(ValueError, match=r"dropout in training \(attention_dropout=0.1; disable_dropout=False\) is"):
        OPEFOTrainer(dropout_model_path, length_reward, args=_audit_config(tmp_path))
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.05, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"dropout in training \(lora_dropout=0.05; disable_dropout=False\)"):
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=_audit_config(tmp_path), peft_config=lora)
    # disable_dropout zeroes LoRA's dropout modules: taken (then the bogus model fails to load, past the checks).
    monkeypatch.undo()
    with pytest.raises(OSError):
        args = _audit_config(tmp_path, disable_dropout=True)
        OPEFOTrainer("no-such-org/no-such-model", length_reward, args=args, peft_config=lora)


def test_dropout_under_plain_grpo_switches_the_diagnostics_off_with_one_warning(
    dropout_model_path, length_reward, tmp_path
):
    small = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4)
    args = _audit_config(tmp_path, method="grpo", **small)
    with pytest.warns(UserWarning, match=r"dropout in training \(attention_dropout=0.1.* switched off for this run"):
        trainer = OPEFOTrainer(dropout_model_path, length_reward, args=args, train_dataset=_prompts())
    assert trainer.args.entropy_flow_diagnostics is False


def _prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["What is 1 + 1?", "What is 2 + 2?"]})
