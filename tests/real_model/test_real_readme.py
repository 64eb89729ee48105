"""The README's CPU example on the real model (its first screen), run as it is written there but for its length:
``max_steps=10`` becomes ``max_steps=2`` (the one change; the block must hold that text once). SmolLM2-135M-Instruct
from ``opefo_trl.real_model``, the recipe's word problems under the ``worked_example`` prompt, the strict reward."""

import math

import pytest
from readme_blocks import REAL_MODEL_CPU_MARKER, readme_block

pytestmark = pytest.mark.real_model

AS_WRITTEN, STEPS = "max_steps=10,", 2


def test_the_readme_real_model_cpu_example_trains_and_is_paid(real_model_path, tmp_path, monkeypatch, capsys):
    code = readme_block(REAL_MODEL_CPU_MARKER)
    assert code.count(AS_WRITTEN) == 1, f"the README's real-model CPU example must set {AS_WRITTEN!r} once"
    monkeypatch.chdir(tmp_path)  # the example writes its run under ./
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {}
    exec(
        compile(code.replace(AS_WRITTEN, f"max_steps={STEPS},"), "README.md (real-model CPU example)", "exec"),
        namespace,
    )
    trainer = namespace["trainer"]
    assert trainer.state.global_step == STEPS and trainer.model.name_or_path == real_model_path
    steps = [log for log in trainer.state.log_history if "reward" in log]
    assert len(steps) == STEPS
    for step in steps:
        # 8 prompts x 4 completions of at most 40 tokens, scored by the strict math reward, lambda* balancing the flows.
        assert math.isfinite(step["loss"]) and 0 <= step["reward"] <= 1 and step["completions/max_length"] <= 40
        assert "rewards/math_accuracy_reward/not_final" in step
        assert -1 <= step["entropy_flow/lambda"] <= 1
        flows = step["entropy_flow/increase"] + step["entropy_flow/decrease"]
        assert abs(step["opefo/weighted_net"]) <= 1e-5 * flows + 1e-12
    # The prompt pays the untrained model now and then: a gradient (under qwen_math_boxed every reward was 0).
    assert steps[0]["reward"] > 0 and min(step["frac_reward_zero_std"] for step in steps) < 1
    rewards = [round(step["reward"], 3) for step in steps]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"reward per step: {rewards}"
