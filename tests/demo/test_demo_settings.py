"""The demo's settings: task defaults, --quick, the method list and the checks made before any work."""

import pytest

from opefo_trl.demo import METHOD_NAMES, TASKS, DemoSettings, demo_methods


def test_task_defaults_and_quick_budget():
    default, summed = DemoSettings(), DemoSettings(task="sum")
    assert default.task == "digit_sum" and default.seeds == [0, 1, 2] and default.numerics == ["threads1"]
    for settings in (default, summed):
        for name, value in TASKS[settings.task].defaults.items():
            assert getattr(settings, name) == value
    assert DemoSettings(steps=7).steps == 7  # an explicit value wins over the task's
    quick = DemoSettings(quick=True)
    assert quick.seeds == [0] and quick.methods == default.methods
    assert quick.steps == default.steps // 3 and quick.warm_start_steps == default.warm_start_steps // 2
    # with --quick, values given explicitly are kept
    explicit = DemoSettings(quick=True, seeds=[0, 1, 2], steps=30, warm_start_steps=50)
    assert (explicit.seeds, explicit.steps, explicit.warm_start_steps) == ([0, 1, 2], 30, 50)


def test_methods_of_make_demo_and_behind_the_flag():
    assert DemoSettings().methods == ["grpo", "opefo", "opefo_param_step", "entropy_reg"]
    assert set(METHOD_NAMES) >= {"opefo_param", "opefo_full", "clip_cov", "par", "steer", "stare", "stare_start"}
    methods = demo_methods(DemoSettings().entropy_coef)
    assert methods["entropy_reg"].config == {"method": "grpo", "entropy_coef": 1e-3}  # the literature's default
    assert methods["opefo_param_step"].config == {
        "method": "opefo",
        "entropy_flow_estimate": "param",
        "opefo_balance": "step",
    }
    assert methods["opefo_param"].config == {"method": "opefo", "entropy_flow_estimate": "param"}
    assert [methods[m].flow_estimate for m in ("grpo", "opefo", "opefo_param_step")] == ["opefo", "opefo", "param"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(methods=["grpo", "nope"]), "Unknown method"),
        (dict(methods=[]), "No methods"),
        (dict(seeds=[0, 0]), "duplicates"),
        (dict(numerics=["threads1", "threads1"]), "duplicates"),
        (dict(numerics=["threads3"]), "Unknown numerics"),
        (dict(numerics=[]), "No numerics"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(num_generations=1), "num_generations must be >= 2"),
        (dict(task="product"), "Unknown task"),
        (dict(prompts_per_step=25), "exceeds the 24 training prompts"),  # 30 targets, 6 held out
        (dict(pass_at_k=[1, 128]), "pass@128 needs at least 128 samples"),
        (dict(pass_at_k=[0, 4]), "whole numbers >= 1"),
        (dict(pass_at_k_samples=-1), "pass_at_k_samples must be >= 0"),
        (dict(workers=0), "workers must be >= 1"),
        (dict(learning_rate=-1.0), r"learning_rate must be > 0, got -1.0"),
        (dict(warm_start_learning_rate=0.0), r"warm_start_learning_rate must be > 0, got 0.0"),
        (dict(learning_rate=float("nan")), r"learning_rate must be a finite number, got nan"),
        (dict(temperature=float("inf")), r"temperature must be a finite number, got inf"),
        (dict(entropy_coef=-1e-3), r"entropy_coef must be >= 0, got -0.001"),
    ],
)
def test_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        DemoSettings(**overrides)


def test_no_evaluation_needs_no_k():
    assert DemoSettings(pass_at_k_samples=0, pass_at_k=[128]).pass_at_k_samples == 0


def test_the_pretrained_task_takes_the_recipes_rollouts_and_refuses_model_settings():
    settings = DemoSettings(task="word_problems")
    assert (settings.prompts_per_step, settings.num_generations, settings.max_completion_length) == (8, 4, 40)
    assert (settings.temperature, settings.learning_rate, settings.warmup_steps) == (0.7, 5e-6, 0)
    assert (settings.pass_at_k_samples, settings.pass_at_k) == (16, [1, 4, 16])
    # the synthetic tasks keep the demo's own defaults
    assert (DemoSettings().temperature, DemoSettings().num_generations, DemoSettings().pass_at_k) == (
        1.0,
        8,
        [1, 4, 16, 64],
    )
    with pytest.raises(ValueError, match=r"trains the pretrained model as it is .* cannot take \{'hidden_size': 64\}"):
        DemoSettings(task="word_problems", hidden_size=64)
    with pytest.raises(ValueError, match="cannot take {'warm_start_steps': 10}"):
        DemoSettings(task="word_problems", warm_start_steps=10)
