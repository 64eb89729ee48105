"""The small-model recipe recipes/smollm2-135m-instruct/opefo.yaml, as written except for the model folder (the local
SmolLM2-135M-Instruct instead of the hub id) and a one-step run: `opefo-train` from the repository root, offline, on the
recipe's own word problems, with its worked_example prompt, 40-token completions, strict reward and lambda* logged."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opefo_trl.cli.recipe_files import load_recipe

pytestmark = pytest.mark.real_model

REPO = Path(__file__).parents[2]
RECIPE = REPO / "recipes" / "smollm2-135m-instruct" / "opefo.yaml"


def test_small_model_recipe_trains_one_step_on_the_real_model(real_model_path, tmp_path):
    recipe = load_recipe(RECIPE)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "opefo_trl.cli.train", "--config", str(RECIPE), "--model_name_or_path",
         real_model_path, "--output_dir", str(out), "--max_steps", "1", "--save_strategy", "no"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    with open(out / "metrics.jsonl") as f:
        (step,) = [m for m in map(json.loads, f) if "loss" in m]
    assert math.isfinite(step["loss"]) and step["learning_rate"] == pytest.approx(recipe["learning_rate"])
    # 8 prompts x 4 completions of at most 40 tokens, scored by the strict math reward.
    assert step["completions/max_length"] <= recipe["max_completion_length"] == 40
    assert step["num_tokens"] > 0 and 0 <= step["reward"] <= 1
    assert "rewards/math_accuracy_reward/not_final" in step
    # The worked_example prompt gives the first step something to learn (under qwen_math_boxed every reward was 0).
    assert recipe["prompt_template"] == "worked_example"
    assert step["reward"] > 0 and step["frac_reward_zero_std"] < 1
    assert -1 <= step["entropy_flow/lambda"] <= 1 and math.isfinite(step["entropy"])
    flows = step["entropy_flow/increase"] + step["entropy_flow/decrease"]
    assert abs(step["opefo/weighted_net"]) <= 1e-5 * flows + 1e-12
    print({k: step[k] for k in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "entropy_flow/lambda")})
